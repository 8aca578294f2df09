"""`python -m models.bench_spec`: acceptance sweep of speculative decoding over a prompt file.

Runs every (steps, topk, draft tokens) configuration of the sweep (the cartesian product; chain
configurations take draft tokens = steps + 1, tree ones skip sizes their depth and width cannot fill) on
the same prompts, greedy, and reports per configuration:
- accept length (tokens committed per verify step, bonus included; max steps + 1),
- per-position acceptance, unconditional (fraction of verify steps whose j-th draft was accepted) and
  conditional (given the (j-1)-th was),
- the histogram of accepted drafts per step, target forwards per token, decode tokens/s (spec and plain),
- vLLM's raw counters: drafts (verify steps), draft tokens (tokens proposed), accepted tokens, accepted per
  position; so `accepted / draft_tokens` is vLLM's acceptance rate and `1 + accepted / drafts` its mean
  acceptance length,
- lossless: the greedy spec output equals plain greedy decoding token for token.
Defaults: the shipped trained pair (models/data/tiny_pair) and its held-out prompts.

Prompt files: JSONL, one prompt per line as {"prompt": "..."} (or {"text": ...}, or a bare JSON string).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["main", "run_config", "load_prompts", "sweep_configs", "counters"]


def load_prompts(path: Path) -> list[str]:
    from models.train import read_prompts

    return read_prompts(Path(path))


def run_config(target: Path, draft: Path, prompts: Sequence[str], steps: int, topk: int, draft_tokens: Optional[int],
               max_new_tokens: int, backend: str = "torch") -> dict[str, Any]:
    """One configuration through the engine's public entry point (models.generate's argument parser and
    run): the only place this module touches the engine, so an engine API change stays here."""
    from models import generate

    argv = ["--target", str(target), "--draft", str(draft), "--steps", str(steps), "--topk", str(topk),
            "--max-new-tokens", str(max_new_tokens), "--backend", backend]
    if draft_tokens is not None:
        argv += ["--draft-tokens", str(draft_tokens)]
    for p in prompts:
        argv += ["--prompt", p]
    return generate.run(generate.parse_args(argv))


def counters(r: dict[str, Any], steps: int) -> dict[str, Any]:
    """vLLM-style raw counters and conditional acceptance from a run's histogram and per-position rates."""
    hist = list(r["accept_histogram"])
    drafts = sum(hist)
    accepted = sum(i * n for i, n in enumerate(hist))
    per = list(r["per_position_acceptance"])
    per_pos = [round(x * drafts) for x in per]
    cond = [(per_pos[j] / per_pos[j - 1] if j and per_pos[j - 1] else (per[0] if not j else 0.0))
            for j in range(len(per))]
    spec_tokens = r["draft_tokens"] - 1
    return {"drafts": drafts, "draft_tokens": drafts * spec_tokens, "accepted_tokens": accepted,
            "accepted_per_position": per_pos, "conditional_acceptance": cond,
            "acceptance_rate_vllm": accepted / (drafts * spec_tokens) if drafts else 0.0,
            "mean_acceptance_length_vllm": 1 + accepted / drafts if drafts else 0.0}


def sweep_configs(steps: Sequence[int], topk: Sequence[int], draft_tokens: Optional[Sequence[int]]
                  ) -> list[tuple[int, int, Optional[int]]]:
    """Valid (steps, topk, draft tokens) triples in sweep order, duplicates dropped."""
    out: list[tuple[int, int, Optional[int]]] = []
    for s, k in itertools.product(steps, topk):
        if k == 1:
            cands: Sequence[Optional[int]] = [s + 1]
        else:
            most = 1 + k + (s - 1) * k * k
            cands = [d for d in draft_tokens if 2 <= d <= most] if draft_tokens else [None]
        for d in cands:
            if (s, k, d) not in out:
                out.append((s, k, d))
    return out


def _ints(flag: str):
    def parse(v: str) -> list[int]:
        try:
            xs = [int(x) for x in v.replace(",", " ").split()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes integers (comma or space separated), got {v!r}") from None
        if not xs or any(x < 1 for x in xs):
            raise argparse.ArgumentTypeError(f"{flag} values must be >= 1, got {v!r}")
        return xs
    return parse


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m models.bench_spec", description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=Path, default=None,
                    help="JSONL prompt file (default: the shipped pair's held-out prompts)")
    ap.add_argument("--target", help="target checkpoint dir (default: the shipped trained pair)")
    ap.add_argument("--draft", help="EAGLE-3 draft checkpoint dir (default: the shipped trained pair)")
    ap.add_argument("--steps", type=_ints("--steps"), default=[3], help="draft steps to sweep, e.g. 1,2,3")
    ap.add_argument("--topk", type=_ints("--topk"), default=[1], help="draft top-k to sweep (1 = chain)")
    ap.add_argument("--draft-tokens", type=_ints("--draft-tokens"), default=None,
                    help="tree sizes incl. the root to sweep (chain: always steps + 1)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    ap.add_argument("--backend", choices=("torch", "triton"), default="torch")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    if a.max_new_tokens < 1:
        ap.error(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.limit is not None and a.limit < 1:
        ap.error(f"--limit must be >= 1, got {a.limit}")
    if (a.target is None) != (a.draft is None):
        ap.error("--target and --draft go together (or give neither for the shipped pair)")
    for flag, p in (("--target", a.target), ("--draft", a.draft)):
        if p is not None and not (Path(p) / "config.json").exists():
            ap.error(f"{flag} {p}: not a checkpoint directory (no config.json)")
    if a.prompts is not None and not a.prompts.is_file():
        ap.error(f"--prompts {a.prompts}: no such file")
    return a


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("steps", "topk", "tokens", "accept len", "fwd/token", "per-position", "conditional", "histogram",
            "tok/s spec", "tok/s plain", "drafts", "accepted", "lossless")
    body = [(str(r["steps"]), str(r["topk"]), str(r["draft_tokens"]), f"{r['accept_length']:.3f}",
             f"{r['target_forwards_per_token']:.3f}", " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]),
             " ".join(f"{x:.2f}" for x in r["conditional_acceptance"]), " ".join(map(str, r["accept_histogram"])),
             f"{r['tokens_per_s_spec']:.1f}", f"{r['tokens_per_s_plain']:.1f}", str(r["drafts"]),
             f"{r['accepted_tokens']}/{r['draft_tokens_proposed']}", str(r["lossless"]).lower()) for r in rows]
    w = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    fmt = lambda x: "  ".join(f"{c:>{w[i]}}" for i, c in enumerate(x))  # noqa: E731
    return "\n".join([fmt(head), "-" * (sum(w) + 2 * len(w) - 2), *map(fmt, body)])


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    from models.train import PAIR_DIR, PROMPTS_FILE, shipped_pair

    try:
        tdir, ddir = (Path(a.target), Path(a.draft)) if a.target else shipped_pair()
        prompts = load_prompts(a.prompts or PAIR_DIR / PROMPTS_FILE)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = prompts[: a.limit] if a.limit else prompts
    rows = []
    for s, k, d in sweep_configs(a.steps, a.topk, a.draft_tokens):
        try:
            r = run_config(tdir, ddir, prompts, s, k, d, a.max_new_tokens, a.backend)
        except (ValueError, KeyError, NotImplementedError) as e:
            print(f"error: steps {s} topk {k} draft tokens {d}: {e}", file=sys.stderr)
            return 2
        c = counters(r, s)
        rows.append({"steps": s, "topk": k, "draft_tokens": r["draft_tokens"], "accept_length": r["accept_length"],
                     "per_position_acceptance": r["per_position_acceptance"],
                     "conditional_acceptance": c["conditional_acceptance"], "accept_histogram": r["accept_histogram"],
                     "target_forwards_per_token": r["target_forwards_per_token"],
                     "tokens_per_s_spec": r["tokens_per_s_spec"], "tokens_per_s_plain": r["tokens_per_s_plain"],
                     "drafts": c["drafts"], "draft_tokens_proposed": c["draft_tokens"],
                     "accepted_tokens": c["accepted_tokens"], "accepted_per_position": c["accepted_per_position"],
                     "acceptance_rate_vllm": c["acceptance_rate_vllm"],
                     "mean_acceptance_length_vllm": c["mean_acceptance_length_vllm"], "lossless": r["lossless"]})
    meta = {"target": str(tdir), "draft": str(ddir), "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
            "backend": a.backend}
    if a.json:
        print(json.dumps({**meta, "configs": rows}))
    else:
        print(f"target {tdir}\ndraft  {ddir}\n{len(prompts)} prompts, {a.max_new_tokens} new tokens each, greedy, "
              f"backend {a.backend}\n")
        print(_table(rows))
    return 0 if all(r["lossless"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
