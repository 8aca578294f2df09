"""Checkpoint tokenizers: Kimi-layout tiktoken BPE (synthetic tiktoken.model + tokenizer_config.json
written by models.fixtures.write_tokenizer), byte-level fallback, generation eos, clear errors."""
from __future__ import annotations

import base64
import json

import pytest

from models.fixtures import write_tokenizer
from models.tokenizer import (NUM_RESERVED_SPECIAL, ByteTokenizer, TiktokenTokenizer, TokenizerError,
                              generation_eos_ids, load_tokenizer, read_bpe_ranks)

V = 600                                  # 344 BPE ranks (256 bytes + 88 merges), then 256 special ids
NB = V - NUM_RESERVED_SPECIAL
NAMES = {NB: "[BOS]", NB + 1: "[EOS]", NB + 2: "<|im_end|>", V - 1: "[PAD]"}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def fib(n):\n    return n", "  two  spaces\n\nand\ttabs ",
         "héllo wörld, 你好世界, emoji 🙂🚀", "1234567 + 89 = 1234656", "'s 're CAPS Mixed", ""]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"), V, NAMES)


@pytest.fixture(scope="module")
def tok(tok_dir):
    t = load_tokenizer(tok_dir, V)
    assert isinstance(t, TiktokenTokenizer) and t.kind == "tiktoken"
    return t


def test_layout_and_special_ids(tok, tok_dir):
    assert tok.num_base == NB and tok.vocab_size == V
    assert (tok.bos_id, tok.eos_id) == (NB, NB + 1)
    assert tok.special["<|im_end|>"] == NB + 2 and tok.special["[PAD]"] == V - 1
    assert tok.special[f"<|reserved_token_{NB + 3}|>"] == NB + 3          # unnamed ids keep a reserved name
    assert len(tok.special) == NUM_RESERVED_SPECIAL
    assert len(read_bpe_ranks(tok_dir / "tiktoken.model")) == NB


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < NB for i in ids)                                   # no special from plain text
    assert tok.decode(ids) == text


def test_merges_are_used(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    assert len(ids) < 0.75 * len(text.encode())                            # learnt merges, not bytes
    assert any(i >= 256 for i in ids)


def test_special_tokens_in_text(tok):
    ids = tok.encode("hi<|im_end|>[EOS] [BOS]x")
    assert ids.count(NB + 2) == 1 and ids.count(NB + 1) == 1 and ids.count(NB) == 1
    assert tok.decode(ids) == "hi<|im_end|>[EOS] [BOS]x"
    assert tok.decode([NB + 7]) == f"<|reserved_token_{NB + 7}|>"
    assert tok.decode([104, V + 5, 105]) == f"h<{V + 5}>i"                  # beyond the vocab: <id>


def test_partial_utf8_decodes_with_replacement(tok):
    ids = tok.encode("é🙂")
    raw = b"".join(tok._enc.decode_single_token_bytes(i) for i in ids)
    assert raw == "é🙂".encode()
    cut = tok.encode("é")[:1] if len(tok.encode("é")) > 1 else [0xC3]      # first byte of a 2-byte char
    assert tok.decode(cut) == "\ufffd"
    assert tok.decode([0xF0, 0x9F]) == "\ufffd"                            # truncated emoji


def test_long_runs_roundtrip(tok):
    text = "a" * 60_000 + " " * 30_001 + "b"
    assert tok.decode(tok.encode(text)) == text


def _lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("bad,msg", [
    (["!!!notbase64 0"], ":1: bad token or rank"),
    ([base64.b64encode(b"a").decode()], ":1: expected 'base64-token rank'"),
    ([base64.b64encode(b"a").decode() + " x"], ":1: bad token or rank"),
    ([base64.b64encode(bytes([i])).decode() + f" {i}" for i in range(256)] + ["YQ== 256"], ":257: duplicate"),
    ([base64.b64encode(bytes([i])).decode() + f" {i + 1}" for i in range(256)], "without gaps"),
    ([base64.b64encode(bytes([i])).decode() + f" {i}" for i in range(200)], "not byte-level"),
    ([], "no BPE ranks"),
])
def test_malformed_tiktoken_model(tmp_path, bad, msg):
    p = _lines(tmp_path / "tiktoken.model", bad)
    with pytest.raises(TokenizerError, match=msg):
        load_tokenizer(tmp_path, 1 << 20)


def test_config_errors(tmp_path, tok_dir):
    (tmp_path / "tiktoken.model").write_bytes((tok_dir / "tiktoken.model").read_bytes())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    bad = dict(cfg, added_tokens_decoder={"5": {"content": "[X]"}})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(bad))
    with pytest.raises(TokenizerError, match="inside the 344 BPE ranks"):
        load_tokenizer(tmp_path, V)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(cfg, eos_token="<|nope|>")))
    with pytest.raises(TokenizerError, match="eos_token '<|nope|>' is not a special token"):
        load_tokenizer(tmp_path, V)
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        load_tokenizer(tmp_path, V)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="more than the model's vocab_size 512"):
        load_tokenizer(tmp_path, 512)
    assert load_tokenizer(tmp_path, V).eos_id == NB + 1


def test_byte_fallback(tmp_path):
    t = load_tokenizer(tmp_path, 512)
    assert isinstance(t, ByteTokenizer) and t.kind == "byte"
    assert t.decode(t.encode("héllo")) == "héllo" and t.decode([104, 300, 105]) == "h<300>i"
    assert t.decode([0xC3]) == "\ufffd"
    with pytest.raises(TokenizerError, match=">= 256"):
        ByteTokenizer(100)


def test_generation_eos_priority(tmp_path, tok_dir, tok):
    d = tmp_path
    assert generation_eos_ids(d, tok) == {NB + 1}                          # only the tokenizer knows
    (d / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 7}, "eos_token_id": 8}))
    assert generation_eos_ids(d, tok) == {7}                               # text_config first
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [NB + 2, NB + 1]}))
    assert generation_eos_ids(d, tok) == {NB + 2, NB + 1}                  # generation config wins
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerError, match="eos_token_id must be"):
        generation_eos_ids(d, tok)
    assert generation_eos_ids(tmp_path / "missing", None) == frozenset()


def test_tokenizer_files_must_be_regular_files(tmp_path):
    """A FIFO or directory in place of tiktoken.model / a JSON file is refused by name (never opened:
    a FIFO would block)."""
    import os

    from models.tokenizer import TokenizerError, generation_eos_ids, load_tokenizer

    os.mkfifo(tmp_path / "tiktoken.model")
    with pytest.raises(TokenizerError, match="tiktoken.model: not a regular file"):
        load_tokenizer(tmp_path, 1024)
    (tmp_path / "generation_config.json").mkdir()
    with pytest.raises(TokenizerError, match="generation_config.json: not a regular file"):
        generation_eos_ids(tmp_path)
