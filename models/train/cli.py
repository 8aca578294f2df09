"""`python -m models.train target|draft`: train and export the tiny Kimi-architecture pair.

  python -m models.train target --out DIR   # tokenizer + target -> DIR/target, DIR/heldout_prompts.jsonl
  python -m models.train draft  --out DIR   # draft on DIR/target -> DIR/draft; accept length on held-out prompts

Both write their report into DIR/manifest.json (seed, steps, threads, Python version, corpus digest, held-out
loss and perplexity, accept lengths, weights hashes and every shipped file's sha256). The shipped pair
(models/data/tiny_pair) is `--out models/data/tiny_pair` with the defaults.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

__all__ = ["main", "BPE_TOKENS", "VOCAB", "tokenize_corpus", "file_hashes", "update_manifest"]

BPE_TOKENS = 3840          # BPE ranks (bytes + merges); the 256 Kimi special ids follow
VOCAB = BPE_TOKENS + 256
PROMPTS_FILE = "heldout_prompts.jsonl"


def tokenize_corpus(tok, corpus) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token streams: each file's ids, files in sorted order."""
    def stream(files):
        ids: list[int] = []
        for _, text in files:
            ids.extend(tok.encode(text))
        return torch.tensor(ids, dtype=torch.long)
    return stream(corpus.train), stream(corpus.heldout)


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file of the pair (relative path -> hex), manifest excluded."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def update_manifest(root: Path, section: str, data: dict[str, Any]) -> None:
    m_path = root / "manifest.json"
    m = json.loads(m_path.read_text()) if m_path.exists() else {}
    m[section] = data
    m["files"] = file_hashes(root)
    m_path.write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")


def _env(threads: int) -> dict[str, Any]:
    return {"python": platform.python_version(), "torch": torch.__version__, "threads": threads}


def cmd_target(a: argparse.Namespace) -> int:
    from models.train.bpe import learn_merges, piece_counts, write_kimi_tokenizer
    from models.train.corpus import heldout_prompts, load_corpus
    from models.train.loop import TargetRun, train_target

    out = Path(a.out)
    tdir = out / "target"
    t0 = time.perf_counter()
    corpus = load_corpus(limit_files=a.limit_files)
    print(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out files from {corpus.root}")
    merges = learn_merges(piece_counts(t for _, t in corpus.train), a.bpe_tokens)
    n, _ = write_kimi_tokenizer(tdir, merges)
    vocab = n + 256
    tok = load_tokenizer_checked(tdir, vocab)
    train_ids, held_ids = tokenize_corpus(tok, corpus)
    print(f"tokenizer: {n} BPE ranks + 256 special ids ({time.perf_counter() - t0:.0f} s); "
          f"{train_ids.numel()} train / {held_ids.numel()} held-out tokens")
    run = TargetRun(seed=a.seed, steps=a.steps, batch=a.batch, seq=a.seq, lr=a.lr)
    rep = train_target(train_ids, held_ids, vocab, n, tdir, run)
    (tdir / "generation_config.json").write_text(json.dumps({"eos_token_id": n + 1, "bos_token_id": n}) + "\n")
    prompts = heldout_prompts(corpus)
    with open(out / PROMPTS_FILE, "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    data = {k: v for k, v in rep.items() if k not in ("net", "config")}
    data.update(_env(torch.get_num_threads()), seed=a.seed, batch=a.batch, seq=a.seq, lr=a.lr,
                corpus_digest=corpus.digest(), corpus_files=len(corpus.train) + len(corpus.heldout),
                train_tokens=int(train_ids.numel()), bpe_tokens=n, wall_s=time.perf_counter() - t0,
                cpu_s=time.process_time(),
                heldout_prompts=len(prompts))
    update_manifest(out, "target", data)
    print(f"wrote {tdir} and {out / PROMPTS_FILE} ({len(prompts)} prompts) in {time.perf_counter() - t0:.0f} s")
    return 0


def load_tokenizer_checked(tdir: Path, vocab: int):
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(tdir, vocab)
    if tok.kind != "tiktoken":
        raise FileNotFoundError(f"{tdir}: no tiktoken.model (the target's tokenizer)")
    return tok


def cmd_draft(a: argparse.Namespace) -> int:
    from models.config import DeepseekV3Config
    from models.loader import load_target
    from models.train.corpus import load_corpus
    from models.train.export import target_from_checkpoint
    from models.train.loop import DraftRun, train_draft

    out = Path(a.out)
    tdir = out / "target"
    if not (tdir / "config.json").exists():
        raise FileNotFoundError(f"--out {out}: no target checkpoint at {tdir} (run `python -m models.train target` "
                                "first)")
    t0 = time.perf_counter()
    ck = load_target(tdir)
    assert isinstance(ck.config, DeepseekV3Config)
    target = target_from_checkpoint(ck)
    tok = load_tokenizer_checked(tdir, ck.config.vocab_size)
    corpus = load_corpus(limit_files=a.limit_files)
    train_ids, held_ids = tokenize_corpus(tok, corpus)
    tcfg = json.loads((tdir / "config.json").read_text())
    run = DraftRun(seed=a.seed, steps=a.steps, batch=a.batch, sequences=a.sequences, lr=a.lr)
    rep = train_draft(target, train_ids, held_ids, tcfg, out / "draft", run)
    data = {k: v for k, v in rep.items() if k not in ("net", "config")}
    data.update(_env(torch.get_num_threads()), seed=a.seed, batch=a.batch, lr=a.lr, corpus_digest=corpus.digest())
    if not a.no_engine_eval and (out / PROMPTS_FILE).exists():
        from models.bench_spec import load_prompts, run_config

        prompts = load_prompts(out / PROMPTS_FILE)[: a.eval_prompts]
        r = run_config(tdir, out / "draft", prompts, steps=3, topk=1, draft_tokens=None,
                       max_new_tokens=a.eval_tokens)
        data["engine_chain3"] = {k: r[k] for k in ("accept_length", "per_position_acceptance",
                                                   "target_forwards_per_token", "lossless")}
        data["engine_chain3"]["prompts"] = len(prompts)
        print(f"engine (torch backend), chain k=3 on {len(prompts)} held-out prompts: accept length "
              f"{r['accept_length']:.3f}, target forwards/token {r['target_forwards_per_token']:.3f}, "
              f"lossless {r['lossless']}")
    data["wall_s"] = time.perf_counter() - t0
    data["cpu_s"] = time.process_time()
    update_manifest(out, "draft", data)
    print(f"wrote {out / 'draft'} in {time.perf_counter() - t0:.0f} s")
    return 0


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m models.train", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, helptext in (("target", "train the tokenizer and the target"), ("draft", "train the EAGLE-3 draft")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--out", default="tiny_pair", help="pair directory (target/, draft/, manifest.json)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--threads", type=int, default=1, help="torch CPU threads (results are bitwise "
                                                               "reproducible for a given thread count)")
        p.add_argument("--limit-files", type=int, default=None, help="use only the first N stdlib files (tests)")
        if name == "target":
            p.add_argument("--steps", type=int, default=240)
            p.add_argument("--batch", type=int, default=16)
            p.add_argument("--seq", type=int, default=256)
            p.add_argument("--lr", type=float, default=4e-3)
            p.add_argument("--bpe-tokens", type=int, default=BPE_TOKENS, help="BPE ranks (bytes + merges)")
        else:
            p.add_argument("--steps", type=int, default=400)
            p.add_argument("--batch", type=int, default=16)
            p.add_argument("--sequences", type=int, default=2048, help="target continuations to train on")
            p.add_argument("--lr", type=float, default=3e-3)
            p.add_argument("--eval-tokens", type=int, default=48, help="new tokens per prompt in the engine eval")
            p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts in the engine eval")
            p.add_argument("--no-engine-eval", action="store_true", help="skip the engine accept-length run")
    a = ap.parse_args(argv)
    for flag in ("steps", "batch", "threads", "limit_files", "seq", "sequences", "eval_tokens", "eval_prompts"):
        v = getattr(a, flag, None)
        if v is not None and v < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if getattr(a, "bpe_tokens", 512) < 256:
        ap.error(f"--bpe-tokens must be >= 256 (the bytes), got {a.bpe_tokens}")
    if a.lr <= 0:
        ap.error(f"--lr must be > 0, got {a.lr}")
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        return cmd_target(a) if a.cmd == "target" else cmd_draft(a)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
