"""`python -m kdsl`: list kernels, show their generated Triton, assembly, or resource report."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import KdslError


def parse_kv(s: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in (s or "").split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise SystemExit(f"kdsl: --problem takes NAME=INT pairs separated by commas, got {part!r}")
        k, v = part.split("=", 1)
        try:
            out[k.strip()] = int(v)
        except ValueError:
            raise SystemExit(f"kdsl: --problem value for {k.strip()!r} must be an integer, got {v!r}") from None
    return out


def parse_config(s: str | None) -> dict:
    if not s:
        return {}
    try:
        cfg = json.loads(s)
    except json.JSONDecodeError as e:
        raise SystemExit(f"kdsl: --config must be a JSON object: {e}") from None
    if not isinstance(cfg, dict):
        raise SystemExit("kdsl: --config must be a JSON object like '{\"BLOCK_N\": 64}'")
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdsl", description=__doc__)
    ap.add_argument("--module", "-m", action="append", default=[],
                    help="extra kernel file or module to import (repeatable); the installed ops are always loaded")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="print one kernel name per line")
    sh = sub.add_parser("show", help="print a kernel's generated Triton, its assembly or its resource report")
    sh.add_argument("kernel")
    sh.add_argument("--arch", default="gfx942", help="gfx942 | gfx950 | sm90 | interpret (default gfx942)")
    sh.add_argument("--emit", choices=("triton", "asm", "ttgir", "llir", "report"), default="report")
    sh.add_argument("--config", help="tile config as JSON, e.g. '{\"BLOCK_N\": 64, \"num_warps\": 4}'; "
                                     "default: the kernel's defaults")
    sh.add_argument("--problem", help="dims as NAME=INT,... (default: the kernel's Kimi-K2.5 example shape)")
    sh.add_argument("--json", action="store_true", help="with --emit report: one JSON object")
    sh.add_argument("--strict", action="store_true", help="with --emit report: spills make ok false")
    args = ap.parse_args(argv)

    from . import aot
    from .registry import discover, get_kernel
    from .targets import get_target

    try:
        if args.cmd == "list":
            for name in sorted(discover(args.module)):
                print(name)
            return 0
        k = get_kernel(args.kernel, args.module)
        try:
            target = get_target(args.arch)
        except ValueError as e:
            raise SystemExit(f"kdsl: {e}") from None
        cfg, problem = parse_config(args.config), parse_kv(args.problem)
        from .kernel import problem_dims

        full = {**k.example, **problem}  # sizes the operands: 64-bit offsets where a span reaches 2^31
        if args.emit == "triton":
            static = {d: v for d, v in full.items() if d in k.static}
            print(k.source(cfg, target, static, dims=full), end="")
            return 0
        if target.backend == "interpret":
            raise SystemExit("kdsl: the interpret target has no assembly or report; use --arch gfx942|gfx950|sm90")
        if args.emit in ("asm", "ttgir", "llir"):
            stage = None if args.emit == "asm" else args.emit
            with problem_dims(full):
                print(aot.asm(k, target, cfg, problem, stage))
            return 0
        with problem_dims(full):
            r = aot.report(k, target, cfg, problem, strict=args.strict)
        print(json.dumps(r.to_dict(), indent=None if args.json else 2) if args.json else r.text())
        return 0 if r.ok else 1
    except KdslError as e:
        print(f"kdsl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
