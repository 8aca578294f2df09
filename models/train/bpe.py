"""Byte-level BPE learnt on a text, written in the Kimi `tiktoken.model` layout (models.tokenizer).

Pieces come from the Kimi split pattern (models.tokenizer.KIMI_PATTERN, the `regex` module's V1
set syntax), so every merge can fire under the real tokenizer. Merges: the most frequent adjacent pair
in turn (ties: the larger (left, right) bytes), counted incrementally with a lazy heap; a merge whose
bytes already are a token is applied without a new rank. Ranks 0..255 are the bytes, then the merges
in learnt order: exactly tiktoken's rank semantics.
"""
from __future__ import annotations

import base64
import heapq
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable, Union

__all__ = ["piece_counts", "learn_merges", "write_kimi_tokenizer", "SPECIAL_NAMES"]

# names of the first special ids (offset from the first special id n), as in Kimi's tokenizer_config
SPECIAL_NAMES = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 255: "[PAD]"}


def piece_counts(texts: Iterable[str]) -> Counter:
    """UTF-8 bytes of every pre-tokenizer piece of `texts`, counted."""
    import regex

    from models.tokenizer import KIMI_PATTERN

    pat = regex.compile(KIMI_PATTERN, flags=regex.V1)
    c: Counter = Counter()
    for t in texts:
        c.update(pat.findall(t))
    return Counter({k.encode("utf-8"): v for k, v in c.items()})


def learn_merges(counts: Counter, n_tokens: int) -> list[bytes]:
    """The first `n_tokens - 256` merged tokens (bytes), in rank order."""
    words = [[bytes([b]) for b in w] for w in sorted(counts)]
    freq = [counts[w] for w in sorted(counts)]
    pairs: Counter = Counter()
    where: dict[tuple[bytes, bytes], set[int]] = defaultdict(set)
    for i, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pairs[(a, b)] += freq[i]
            where[(a, b)].add(i)
    heap = [(-c, tuple(-x for x in a), tuple(-x for x in b), a, b) for (a, b), c in pairs.items()]
    heapq.heapify(heap)
    known = {bytes([i]) for i in range(256)}
    out: list[bytes] = []
    need = n_tokens - 256
    while len(out) < need:
        if not heap:
            raise ValueError(f"the text has room for {len(out)} merges, {need} asked")
        c, _, _, a, b = heapq.heappop(heap)
        if pairs.get((a, b), 0) != -c or c == 0:
            continue                                   # stale entry
        ab = a + b
        if ab not in known:
            known.add(ab)
            out.append(ab)
        touched: dict[tuple[bytes, bytes], int] = {}
        for i in sorted(where.pop((a, b), ())):
            w, f = words[i], freq[i]
            j, nw = 0, []
            changed = False
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    nw.append(ab)
                    j += 2
                    changed = True
                else:
                    nw.append(w[j])
                    j += 1
            if not changed:
                continue
            for x, y in zip(w, w[1:]):
                pairs[(x, y)] -= f
                touched[(x, y)] = 1
            for x, y in zip(nw, nw[1:]):
                pairs[(x, y)] += f
                where[(x, y)].add(i)
                touched[(x, y)] = 1
            words[i] = nw
        pairs.pop((a, b), None)
        for p in touched:
            cnt = pairs.get(p, 0)
            if cnt > 0:
                heapq.heappush(heap, (-cnt, tuple(-x for x in p[0]), tuple(-x for x in p[1]), p[0], p[1]))
            elif p in pairs:
                del pairs[p]
    return out


def write_kimi_tokenizer(out_dir: Union[str, Path], merges: list[bytes]) -> tuple[int, dict[int, str]]:
    """Write `tiktoken.model` (bytes + merges) and `tokenizer_config.json` (256 special ids after the
    ranks, the named ones in added_tokens_decoder); returns (number of BPE ranks n, {id: name})."""
    toks = [bytes([i]) for i in range(256)] + list(merges)
    n = len(toks)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "tiktoken.model", "w") as f:
        f.writelines(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(toks))
    names = {n + off: s for off, s in SPECIAL_NAMES.items()}
    cfg: dict[str, Any] = {
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, s in sorted(names.items())},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576,
    }
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    return n, names
