"""`python -m kdsl`: list kernels, show their generated Triton, assembly, or resource report.

Every bad input (flag, kernel name, module file, config, problem dims) ends in one line on stderr
that names it, and exit status 2; no traceback.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, NoReturn

from .errors import KdslError, UsageError

# problem values: operand dims in [1, MAX_DIM], dim parameters in [0, MAX_DIM] (flags such as NORM=0),
# scalars any int64; MAX_DIM keeps every product of two dims inside int64 arithmetic's reach
MAX_DIM = 1 << 40


def parse_kv(s: str | None) -> dict[str, int]:
    """'M=16,N=256' -> {'M': 16, 'N': 256}; malformed pairs, empty or repeated names are errors."""
    out: dict[str, int] = {}
    for part in (s or "").split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise UsageError("--problem", f"takes NAME=INT pairs separated by commas, got {part!r}")
        k, v = (x.strip() for x in part.split("=", 1))
        if not k.isidentifier():
            raise UsageError("--problem", f"dim names must be identifiers, got {k!r}")
        if k in out:
            raise UsageError("--problem", f"gives dim {k!r} twice")
        try:
            out[k] = int(v)
        except ValueError:
            raise UsageError("--problem", f"value for {k!r} must be an integer, got {v!r}") from None
    return out


def check_problem(kernel: Any, problem: dict[str, int]) -> dict[str, int]:
    """Every name a dim, dim parameter or scalar of `kernel` (or in its example), every value in range."""
    sig = kernel.signature
    dim_params = set(sig.dim_params)
    operand_dims = set(sig.all_dims()) - dim_params
    known = operand_dims | dim_params | set(sig.scalars) | set(kernel.example)
    for k, v in problem.items():
        if k not in known:
            raise UsageError("--problem", f"names {k!r}, not a dim of this kernel (its dims: {', '.join(sorted(known))})",
                             kernel.name)
        if k in sig.scalars and k not in operand_dims and k not in dim_params:
            if not -(1 << 63) <= v < (1 << 63):
                raise UsageError("--problem", f"value {k}={v} is outside int64", kernel.name)
            continue
        lo = 0 if k in dim_params else 1
        if not lo <= v <= MAX_DIM:
            raise UsageError("--problem", f"value {k}={v} must be in [{lo}, 2**40]", kernel.name)
    return problem


def _finite(x: Any, path: str) -> None:
    if isinstance(x, float) and not math.isfinite(x):
        raise UsageError("--config", f"value {path} must be finite, got {x}")
    if isinstance(x, dict):
        for k, v in x.items():
            _finite(v, f"{path}.{k}" if path else str(k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _finite(v, f"{path}[{i}]")


def parse_config(s: str | None) -> dict:
    """--config JSON: an object of finite values (the kernel then checks names and domains)."""
    if not s:
        return {}
    try:
        cfg = json.loads(s)
    except (json.JSONDecodeError, RecursionError) as e:
        raise UsageError("--config", f"must be a JSON object: {e}") from None
    if not isinstance(cfg, dict):
        raise UsageError("--config", "must be a JSON object like '{\"BLOCK_N\": 64}'")
    _finite(cfg, "")
    return cfg


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line on stderr (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        print(f"kdsl: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _line(msg: str) -> str:
    msg = str(msg).strip()
    return msg.splitlines()[0] if msg else "error"


def _load(fn, modules: list[str], *a):
    """Kernel discovery and module import: a missing file, an import or syntax error in a module, or
    the registry's own refusal become one UsageError naming --module (or the kernel name)."""
    mods = ", ".join(modules) or "(the installed kernels)"
    try:
        return fn(*a)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            raise
        msg = _line(str(e.code)).removeprefix("kdsl: ")
        if "kernel file" in msg:
            raise UsageError("--module", f"{mods}: {msg}") from None
        raise UsageError("", msg) from None
    except KdslError:
        raise
    except SyntaxError as e:
        raise UsageError("--module", f"{mods}: {e.filename}:{e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - a user module may raise anything at import
        raise UsageError("--module", f"{mods}: importing failed: {type(e).__name__}: {_line(str(e))}") from None


def _run(args: argparse.Namespace) -> int:
    from . import aot
    from .registry import discover, get_kernel
    from .targets import get_target

    if args.cmd == "list":
        for name in sorted(_load(discover, args.module, args.module)):
            print(name)
        return 0
    k = _load(get_kernel, args.module, args.kernel, args.module)
    try:
        target = get_target(args.arch)
    except ValueError as e:
        raise UsageError("--arch", _line(str(e)).removeprefix("kdsl: ")) from None
    cfg, problem = parse_config(args.config), check_problem(k, parse_kv(args.problem))
    from .kernel import problem_dims

    full = {**k.example, **problem}  # sizes the operands: 64-bit offsets where a span reaches 2^31
    static = {d: v for d, v in full.items() if d in k.static}
    if args.emit == "triton":
        print(k.source(cfg, target, static, dims=full), end="")
        return 0
    if args.emit == "ir":
        from .irtools import kernel_ir

        print(kernel_ir(k, cfg, target, static), end="")
        return 0
    if target.backend == "interpret":
        raise UsageError("--arch", "interpret has no assembly or report; use --arch gfx942|gfx950|sm90")
    if args.emit in ("asm", "ttgir", "llir"):
        stage = None if args.emit == "asm" else args.emit
        with problem_dims(full):
            print(aot.asm(k, target, cfg, problem, stage))
        return 0
    with problem_dims(full):
        r = aot.report(k, target, cfg, problem, strict=args.strict)
    print(json.dumps(r.to_dict(), indent=None if args.json else 2) if args.json else r.text())
    return 0 if r.ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="python -m kdsl", description=__doc__.split("\n")[0])
    ap.add_argument("--module", "-m", action="append", default=[],
                    help="extra kernel file or module to import (repeatable); the installed ops are always loaded")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="print one kernel name per line")
    sh = sub.add_parser("show", help="print a kernel's generated Triton, its assembly or its resource report")
    sh.add_argument("kernel")
    sh.add_argument("--arch", default="gfx942", help="gfx942 | gfx950 | sm90 | interpret (default gfx942)")
    sh.add_argument("--emit", choices=("triton", "ir", "asm", "ttgir", "llir", "report"), default="report")
    sh.add_argument("--config", help="tile config as JSON, e.g. '{\"BLOCK_N\": 64, \"num_warps\": 4}'; "
                                     "default: the kernel's defaults")
    sh.add_argument("--problem", help="dims as NAME=INT,... (default: the kernel's Kimi-K2.5 example shape); "
                                      "operand dims in [1, 2**40]")
    sh.add_argument("--json", action="store_true", help="with --emit report: one JSON object")
    sh.add_argument("--strict", action="store_true", help="with --emit report: spills make ok false")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except KdslError as e:
        print(f"kdsl: error: {_line(str(e))}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OverflowError, OSError, MemoryError, RecursionError, RuntimeError) as e:
        # an input no check above foresaw: still one line, never a traceback
        print(f"kdsl: error: {type(e).__name__}: {_line(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
