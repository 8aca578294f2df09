"""Training of the tiny Kimi-architecture target and its EAGLE-3 draft (`python -m models.train`).

target: a byte-pair tokenizer learnt on the Python standard library's sources, then the Kimi-K2.5
        text model (MLA, MoE with sigmoid routing, dense layer 0, YaRN) trained on them; exported as
        a Kimi-layout checkpoint with compressed-tensors INT4 experts.
draft:  the EAGLE-3 draft trained on the target's aux hidden states and distribution over the target's
        own greedy continuations, with the training-time test (k unrolled steps); exported BF16.
Modules: corpus (text and split), bpe (tokenizer), nets (trainable modules), export (checkpoint
formats), loop (training and evaluation), cli (the command line).
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["PAIR_DIR", "PROMPTS_FILE", "shipped_pair", "shipped_prompts", "read_prompts"]

PAIR_DIR = Path(__file__).resolve().parent.parent / "data" / "tiny_pair"
PROMPTS_FILE = "heldout_prompts.jsonl"


def shipped_pair() -> tuple[Path, Path]:
    """(target dir, draft dir) of the trained pair shipped with the package (models/data/tiny_pair)."""
    t, d = PAIR_DIR / "target", PAIR_DIR / "draft"
    for p in (t, d):
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"the shipped pair is missing {p / 'config.json'} (package data not installed?)")
    return t, d


def read_prompts(path: Path) -> list[str]:
    """Prompts of a JSONL file: one object per line with a "prompt" (or "text") string, or a bare string."""
    out = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                v = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: not JSON ({e.msg})") from None
            if isinstance(v, dict):
                v = v.get("prompt", v.get("text"))
            if not isinstance(v, str) or not v:
                raise ValueError(f"{path}:{ln}: expected a non-empty string or an object with a \"prompt\" string")
            out.append(v)
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def shipped_prompts() -> list[str]:
    """The held-out prompts shipped with the trained pair (never seen in training)."""
    return read_prompts(PAIR_DIR / PROMPTS_FILE)
