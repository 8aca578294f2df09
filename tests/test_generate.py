"""`python -m models.generate`: embedded default, --json keys, lossless, clear errors for bad flags/paths."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from models import generate as G


@pytest.fixture()
def cache_home(tmp_path_factory, monkeypatch):
    d = tmp_path_factory.getbasetemp() / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(d))
    n = torch.get_num_threads()
    yield d
    torch.set_num_threads(n)


def test_json_default_is_lossless(cache_home, capsys):
    rc = G.main(["--json", "--max-new-tokens", "6", "--batch", "3", "--steps", "2"])
    out = capsys.readouterr()
    assert rc == 0
    r = json.loads(out.out)
    for key in ("lossless", "accept_length", "acceptance_rate", "per_position_acceptance", "target_forwards_per_token",
                "tokens_per_s_spec", "tokens_per_s_plain", "outputs"):
        assert key in r
    assert r["lossless"] is True and len(r["outputs"]) == 3 and len(r["per_position_acceptance"]) == 2
    assert 1.0 <= r["accept_length"] <= 3.0
    assert all(len(o["spec_ids"]) == 6 for o in r["outputs"])
    assert (cache_home / "kdsl" / "fixtures" / "kimi-k25-seed0" / "config.json").exists()
    assert "spec (torch)" in out.err           # the progress bar goes to stderr


def test_report_and_prompt_flag(cache_home, capsys):
    assert G.main(["--max-new-tokens", "4", "--prompt", "hello", "--prompt", "wörld"]) == 0
    out = capsys.readouterr().out
    assert "lossless (spec == plain greedy): true" in out and "accept length" in out and "'wörld'" in out


@pytest.mark.parametrize("argv,msg", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--top-p", "1.5"], "--top-p must be in"),
    (["--backend", "cuda"], "invalid choice"),
    (["--target", "/nonexistent"], "--target and --draft go together"),
    (["--target", "/nonexistent", "--draft", "/nonexistent2"], "no such directory"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", ","], "--prompt-ids must hold at least one id"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    (["--device", "cpu", "--graphs", "on"], "--graphs on needs a cuda device"),
    (["--graphs", "maybe"], "invalid choice"),
] + ([(["--device", "cuda"], "no GPU is visible")] if not torch.cuda.is_available() else []))
def test_bad_flags(cache_home, capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        G.main(argv)
    err = capsys.readouterr().err + str(e.value)
    assert msg in err


@pytest.mark.parametrize("argv,msg", [(["--topk", "2", "--draft-tokens", "30"], "--draft-tokens must be in"),
                                      (["--draft-tokens", "9"], "--draft-tokens must be steps + 1"),
                                      (["--backend", "triton", "--topk", "2", "--draft-tokens", "9"],
                                       "--draft-tokens must be <= 8 on the triton backend")])
def test_inconsistent_flags(cache_home, capsys, argv, msg):
    assert G.main(argv) == 2
    assert msg in capsys.readouterr().err


def test_target_dir_without_config(cache_home, tmp_path, capsys):
    with pytest.raises(SystemExit, match="no config.json"):
        G.main(["--target", str(tmp_path), "--draft", str(tmp_path)])


def test_byte_tokenizer_roundtrip(cache_home, capsys):
    tok = G.ByteTokenizer(512)
    s = "héllo, wörld"
    assert tok.decode(tok.encode(s)) == s
    assert tok.decode([104, 300, 105]) == "h<300>i"
    assert G.main(["--json", "--max-new-tokens", "2", "--batch", "1"]) == 0   # the embedded default
    assert json.loads(capsys.readouterr().out)["tokenizer"] == "byte"


def test_module_entry_point(cache_home):
    """The README command itself (subprocess), on the torch backend."""
    p = subprocess.run([sys.executable, "-m", "models.generate", "--json", "--max-new-tokens", "4", "--batch", "2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["lossless"] is True


def test_sampled_run(cache_home, capsys):
    assert G.main(["--json", "--temperature", "0.8", "--top-p", "0.9", "--max-new-tokens", "5", "--batch", "2",
                   "--seed", "3"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["lossless"] is None and all(len(o["spec_ids"]) == 5 for o in r["outputs"])


def test_tree_run(cache_home, capsys):
    assert G.main(["--json", "--topk", "2", "--steps", "3", "--draft-tokens", "6", "--max-new-tokens", "6",
                   "--batch", "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["lossless"] is True and r["topk"] == 2 and r["draft_tokens"] == 6


def test_sampled_tree_run(cache_home, capsys):
    assert G.main(["--json", "--topk", "3", "--temperature", "0.7", "--top-p", "0.9", "--max-new-tokens", "5",
                   "--batch", "2", "--seed", "5"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["lossless"] is None and r["topk"] == 3 and all(len(o["spec_ids"]) == 5 for o in r["outputs"])


def test_checkpoint_tokenizer(tmp_path, capsys):
    """A target with tiktoken.model + tokenizer_config.json (fixture writer, vocab 640: 128 merges):
    generate encodes with it (special tokens in the prompt become their ids), decodes with it, stops at
    the config's eos; a corrupted tiktoken.model is a clear error."""
    from models.fixtures import write_fixture
    from models.tokenizer import load_tokenizer

    t, d = tmp_path / "t", tmp_path / "d"
    write_fixture("kimi-k25", t, seed=5, tokenizer=True, vocab=640)
    write_fixture("eagle3", d, seed=6, vocab=640)
    tok = load_tokenizer(t, 640)
    prompt = "The quick brown fox<|im_end|>"
    n = torch.get_num_threads()
    try:
        assert G.main(["--json", "--target", str(t), "--draft", str(d), "--max-new-tokens", "4",
                       "--prompt", prompt]) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["tokenizer"] == "tiktoken" and r["lossless"] is True
        o = r["outputs"][0]
        assert o["prompt_ids"] == tok.encode(prompt) and tok.special["<|im_end|>"] in o["prompt_ids"]
        assert len(o["prompt_ids"]) < len(prompt.encode())
        assert o["spec_text"] == tok.decode(o["spec_ids"])
        assert r["eos_ids"] == [640 - 11]                  # config.json's eos (no generation_config.json)
        with open(t / "tiktoken.model", "a") as f:
            f.write("not-a-token-line\n")
        assert G.main(["--target", str(t), "--draft", str(d), "--max-new-tokens", "2"]) == 2
        assert "tiktoken.model:385: expected 'base64-token rank'" in capsys.readouterr().err
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("tkind,dkind", [("kimi-k25-w4a8", "eagle3-fp8"), ("kimi-k25-bf16", "eagle3-int4")])
def test_other_checkpoint_formats(tmp_path, capsys, tkind, dkind):
    """--target/--draft with the other fixture formats (Quark W4A8 experts, bf16, FP8 / INT4 drafts)."""
    from models.fixtures import write_fixture

    write_fixture(tkind, tmp_path / "t", seed=3)
    write_fixture(dkind, tmp_path / "d", seed=4)
    n = torch.get_num_threads()
    try:
        assert G.main(["--json", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"),
                       "--max-new-tokens", "5", "--batch", "2"]) == 0
    finally:
        torch.set_num_threads(n)
    assert json.loads(capsys.readouterr().out)["lossless"] is True


def test_prompt_ids_and_device(cache_home, capsys):
    """--prompt-ids gives prompts as token ids (after the --prompt texts); --device cpu is reported,
    graphs are off there; an id outside the vocab is one line naming the flag."""
    assert G.main(["--json", "--max-new-tokens", "3", "--prompt", "hi", "--prompt-ids", "1,2,300",
                   "--prompt-ids", "7", "--device", "cpu"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["device"] == "cpu" and r["graphs"] == "off" and r["lossless"] is True
    assert [o["prompt_ids"] for o in r["outputs"]][1:] == [[1, 2, 300], [7]]
    assert r["outputs"][1]["prompt"] == "ids:1,2,300"
    assert G.main(["--prompt-ids", "1,99999", "--max-new-tokens", "2"]) == 2
    assert "--prompt-ids: token id 99999 outside the vocab" in capsys.readouterr().err
