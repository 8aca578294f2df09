"""Tokenizers for the generate script: a checkpoint's tiktoken BPE (Kimi-K2 / K2.5), or byte-level.

Kimi checkpoints ship `tiktoken.model` (one `base64(token bytes) rank` line per BPE token),
`tokenizer_config.json` and their own `tokenization_kimi.py`. The format facts this module follows:
- the BPE ranks are the ids 0..n-1 (n = number of lines, 163584 for Kimi);
- a block of 256 reserved special ids follows, n .. n+255; `added_tokens_decoder` in
  tokenizer_config.json names some of them ({"163584": {"content": "[BOS]"}, ...}), the others are
  `<|reserved_token_{id}|>`;
- the split pattern (below) keeps runs of Han characters together, splits cased words with an
  optional English contraction, digits in groups of up to three, punctuation runs, newlines, spaces;
- special tokens written in the text are encoded as their ids (Kimi's default);
- `bos_token` / `eos_token` in tokenizer_config.json name the bos/eos tokens ("[BOS]", "[EOS]").
A checkpoint without `tiktoken.model` (the tiny embedded default) gets the byte-level tokenizer.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Sequence, Union

__all__ = ["Tokenizer", "ByteTokenizer", "TiktokenTokenizer", "TokenizerError", "load_tokenizer",
           "generation_eos_ids", "KIMI_PATTERN", "NUM_RESERVED_SPECIAL"]

NUM_RESERVED_SPECIAL = 256         # Kimi: special ids n .. n+255 after the n BPE ranks

_LETTERS_NO_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_NO_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",                                                                       # Han runs
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_NO_HAN_UPPER}*{_LETTERS_NO_HAN_LOWER}+{_CONTRACTION}",  # Word, word
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_NO_HAN_UPPER}+{_LETTERS_NO_HAN_LOWER}*{_CONTRACTION}",  # WORD
    r"\p{N}{1,3}",                                                                       # digits by 3
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",                                                        # punctuation
    r"\s*[\r\n]+",                                                                       # newlines
    r"\s+(?!\S)",                                                                        # trailing spaces
    r"\s+",
])
_MAX_CHARS = 400_000               # tiktoken's encoder is only safe on pieces up to this size ...
_MAX_RUN = 25_000                  # ... and on runs of (non-)whitespace up to this length


class TokenizerError(ValueError):
    """A tokenizer file is missing, malformed, or does not fit the model's vocabulary."""


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    eos_id: Optional[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes <-> ids 0..255; larger ids (specials of the tiny vocab) print as <id>."""

    kind = "byte"
    eos_id: Optional[int] = None

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise TokenizerError(f"byte-level tokenizer needs a vocab of >= 256 ids, the model has {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return _decode_runs(ids, lambda i: bytes([i]) if 0 <= i < 256 else None)


def _decode_runs(ids: Sequence[int], piece) -> str:
    """Join the byte pieces of known ids (UTF-8, errors replaced, so a split character never raises);
    ids without a piece print as <id>."""
    out, buf = [], bytearray()
    for i in ids:
        b = piece(int(i))
        if b is None:
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            out.append(f"<{int(i)}>")
        else:
            buf += b
    out.append(buf.decode("utf-8", errors="replace"))
    return "".join(out)


def read_bpe_ranks(path: Union[str, Path]) -> dict[bytes, int]:
    """Parse a tiktoken.model file, with the file and line named in every error."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    seen: set[int] = set()
    with open(path, "rb") as f:
        for ln, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise TokenizerError(f"{path}:{ln}: expected 'base64-token rank', got {raw[:60]!r}")
            try:
                tok = base64.b64decode(parts[0], validate=True)
                rank = int(parts[1])
            except (binascii.Error, ValueError) as e:
                raise TokenizerError(f"{path}:{ln}: bad token or rank in {raw[:60]!r} ({e})") from None
            if tok in ranks or rank in seen or rank < 0:
                raise TokenizerError(f"{path}:{ln}: duplicate token or rank (or negative rank) in {raw[:60]!r}")
            ranks[tok] = rank
            seen.add(rank)
    if not ranks:
        raise TokenizerError(f"{path}: no BPE ranks")
    if seen != set(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be 0..{len(ranks) - 1} without gaps")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: not byte-level: {len(missing)} single bytes have no rank (e.g. {missing[0]})")
    return ranks


def _token_name(v: Any) -> Optional[str]:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class TiktokenTokenizer:
    """Kimi-style tiktoken BPE: ranks from tiktoken.model, 256 reserved special ids after them."""

    kind = "tiktoken"

    def __init__(self, model_file: Union[str, Path], config: Optional[dict[str, Any]] = None,
                 pattern: str = KIMI_PATTERN):
        import tiktoken

        ranks = read_bpe_ranks(model_file)
        n = len(ranks)
        config = config or {}
        named: dict[int, str] = {}
        for k, v in (config.get("added_tokens_decoder") or {}).items():
            name = _token_name(v)
            try:
                i = int(k)
            except ValueError:
                raise TokenizerError(f"tokenizer_config.json: added_tokens_decoder key {k!r} is not an id") from None
            if name is None:
                raise TokenizerError(f"tokenizer_config.json: added token {k} has no 'content'")
            if i < n:
                raise TokenizerError(f"tokenizer_config.json: added token {name!r} has id {i}, inside the {n} BPE "
                                     f"ranks of {model_file} (special ids start at {n})")
            named[i] = name
        top = max([n + NUM_RESERVED_SPECIAL - 1, *named])
        self.special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, top + 1)}
        if len(self.special) != top + 1 - n:
            raise TokenizerError("tokenizer_config.json: two added tokens share one name")
        self.id_to_special = {i: s for s, i in self.special.items()}
        self.num_base = n
        self.vocab_size = top + 1
        self._enc = tiktoken.Encoding(name=Path(model_file).name, pat_str=pattern, mergeable_ranks=ranks,
                                      special_tokens=self.special)
        self.bos_id = self._named_id(config, "bos_token")
        self.eos_id = self._named_id(config, "eos_token")

    def _named_id(self, config: dict[str, Any], key: str) -> Optional[int]:
        name = _token_name(config.get(key))
        if name is None:
            return None
        if name not in self.special:
            raise TokenizerError(f"tokenizer_config.json: {key} {name!r} is not a special token")
        return self.special[name]

    def encode(self, text: str) -> list[int]:
        """Text -> ids; special tokens written in the text become their ids."""
        out: list[int] = []
        for piece in _pieces(text):
            out.extend(self._enc.encode(piece, allowed_special="all"))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """ids -> text: bytes of BPE tokens joined then UTF-8 decoded (errors replaced), specials by
        name, ids beyond the vocabulary as <id>."""
        def piece(i: int) -> Optional[bytes]:
            if 0 <= i < self.num_base:
                return self._enc.decode_single_token_bytes(i)
            s = self.id_to_special.get(i)
            return None if s is None else s.encode("utf-8")
        return _decode_runs(ids, piece)


_RUN = re.compile(r"\s+|\S+")


def _pieces(text: str) -> Iterator[str]:
    """Cut text so no piece exceeds _MAX_CHARS and no (non-)whitespace run exceeds _MAX_RUN; the cuts
    only fall inside over-long runs, so ordinary text is encoded in one piece."""
    start, size = 0, 0
    for m in _RUN.finditer(text):
        a, b = m.span()
        while b - a > _MAX_RUN:                      # an over-long run: cut it
            if a > start:
                yield text[start:a]
            yield text[a:a + _MAX_RUN]
            a = start = a + _MAX_RUN
            size = 0
        if size + (b - a) > _MAX_CHARS and a > start:
            yield text[start:a]
            start, size = a, 0
        size += b - a
    if start < len(text) or not text:
        yield text[start:]


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    if not path.exists():
        return None
    if not path.is_file():
        raise TokenizerError(f"{path}: not a regular file")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e.strerror or e})") from None
    if not isinstance(d, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return d


def load_tokenizer(checkpoint: Union[str, Path], vocab_size: int) -> Tokenizer:
    """The checkpoint's tiktoken tokenizer when it ships `tiktoken.model`, else byte-level."""
    root = Path(checkpoint)
    model = root / "tiktoken.model"
    if not model.exists():
        return ByteTokenizer(vocab_size)
    if not model.is_file():
        raise TokenizerError(f"{model}: not a regular file")
    tok = TiktokenTokenizer(model, _read_json(root / "tokenizer_config.json"))
    if tok.vocab_size > vocab_size:
        raise TokenizerError(f"{model}: the tokenizer has {tok.vocab_size} ids ({tok.num_base} BPE + specials), "
                             f"more than the model's vocab_size {vocab_size}")
    return tok


def _ids(v: Any) -> Optional[frozenset[int]]:
    if v is None:
        return None
    vals = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
        raise TokenizerError(f"eos_token_id must be an int or a list of ints, got {v!r}")
    return frozenset(vals)


def generation_eos_ids(checkpoint: Union[str, Path], tokenizer: Optional[Tokenizer] = None) -> frozenset[int]:
    """Ids that end generation: generation_config.json's eos_token_id (what the model was tuned to
    stop on, e.g. a chat turn end), else config.json's (top level or text_config), else the
    tokenizer's eos_token."""
    root = Path(checkpoint)
    gen = _read_json(root / "generation_config.json") or {}
    ids = _ids(gen.get("eos_token_id"))
    if ids is None:
        cfg = _read_json(root / "config.json") or {}
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        ids = _ids(text.get("eos_token_id", cfg.get("eos_token_id")))
    if ids is None and tokenizer is not None and tokenizer.eos_id is not None:
        ids = frozenset([tokenizer.eos_id])
    return ids or frozenset()
