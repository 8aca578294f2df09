"""The training text: the Python standard library's own sources (every fresh machine has them).

Files: the top-level `*.py` modules of `sysconfig.get_paths()['stdlib']`, sorted by name (no
site-packages, no sub-packages, so the list does not depend on what else is installed). Split by file
name: a file is held out when crc32(name) % HELDOUT_MOD == 0, so the split does not move when a
Python version adds or drops a module. `corpus_digest` names the exact bytes a run trained on.
"""
from __future__ import annotations

import hashlib
import random
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["HELDOUT_MOD", "Corpus", "load_corpus", "heldout_prompts"]

HELDOUT_MOD = 16


@dataclass
class Corpus:
    root: Path
    train: list[tuple[str, str]]        # (file name, text), sorted by name
    heldout: list[tuple[str, str]]

    def digest(self) -> str:
        """sha256 over (split, name, text) of every file: what a training run saw."""
        h = hashlib.sha256()
        for split, files in (("train", self.train), ("heldout", self.heldout)):
            for name, text in files:
                h.update(f"{split}\0{name}\0{len(text)}\0".encode())
                h.update(text.encode("utf-8"))
        return h.hexdigest()


def is_heldout(name: str) -> bool:
    return zlib.crc32(name.encode()) % HELDOUT_MOD == 0


def load_corpus(root: Optional[Path] = None, limit_files: Optional[int] = None) -> Corpus:
    """Read the sorted stdlib module sources (undecodable files skipped), split train / held-out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no *.py files under {root} (the training text is the stdlib's sources)")
    train, held = [], []
    for p in files[:limit_files] if limit_files else files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (held if is_heldout(p.name) else train).append((p.name, text))
    if not train or not held:
        raise ValueError(f"{root}: {len(train)} training and {len(held)} held-out files; both splits need one "
                         "(raise --limit-files)")
    return Corpus(root, train, held)


def heldout_prompts(corpus: Corpus, count: int = 32, lines: int = 4, seed: int = 0) -> list[str]:
    """Code prompts from held-out files: a `def` line and the lines after it (`lines` in all, ending
    with a newline), at most four per file, picked with a seeded generator."""
    rng = random.Random(seed)
    cands: list[list[str]] = []
    for _, text in corpus.heldout:
        ls = text.splitlines(keepends=True)
        starts = [i for i, ln in enumerate(ls) if ln.lstrip().startswith("def ") and i + lines <= len(ls)]
        rng.shuffle(starts)
        for i in sorted(starts[:4]):
            block = ls[i:i + lines]
            if all(b.strip() for b in block) and sum(map(len, block)) < 500:
                cands.append(block)
    rng.shuffle(cands)
    return ["".join(b) for b in cands[:count]]
