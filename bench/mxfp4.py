"""MXFP4 MoE rows next to W4A8 at the MI355X deployment shapes (REFERENCE §8: TP4 and TP8 of Kimi-K2.5's
routed experts, tensor-parallel: expert intermediate 2048 / TP), static figures from the cost model.

    python -m bench.mxfp4                         # gfx950, TP4 + TP8, M 1 4 16 64
    python -m bench.mxfp4 --arch gfx950 gfx942 --tp 8 --m 1 4 --json /tmp/mx.json

A row sums the static predictions (`autotune.search.predict_config`: AOT report + cost model, tuned
config when one is committed) of the modelled launches of one MoE layer's routed experts:
- mxfp4 (W4A4): quant_mxfp4 (x) -> moe_stage1_mxfp4 -> quant_mxfp4 (intermediate) -> moe_stage2_mxfp4
- w4a8:         quant_per_token_int8 (x) -> moe_stage1_w4a8 -> quant_per_token_int8 -> moe_stage2_w4a8_pq
(the router GEMM, routing and align are the same launches in both and left out). On gfx942 the MXFP4
stages run Triton's bf16 upcast of `tl.dot_scaled` (no MX MFMA there).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from ops.problems import experts_touched

from .report import write_json

KIMI = {"E": 384, "H": 7168, "I": 2048, "TOPK": 8}
TPS = (4, 8)
M_VALUES = (1, 4, 16, 64)
FORMATS = ("mxfp4", "w4a8")


def tp_shape(tp: int) -> dict[str, int]:
    """Kimi's routed experts at tensor parallel `tp`: the intermediate split tp ways."""
    if KIMI["I"] % tp or (KIMI["I"] // tp) % 32:
        raise ValueError(f"--tp {tp}: 2048 / tp must be a multiple of 32")
    return {**KIMI, "I": KIMI["I"] // tp}


def launches(fmt: str, shape: dict[str, int], m: int, arch: str = "gfx950") -> list[tuple[Any, dict[str, int], int]]:
    """(kernel, problem, M) of the modelled expert launches of one layer, in order."""
    from autotune.problems import full_dims
    from ops import moe
    from ops import mxfp4 as mx
    from ops.quant import quant_per_token_int8

    E, H, I, K = shape["E"], shape["H"], shape["I"], shape["TOPK"]
    p1, p2 = {"E": E, "K": H, "I": I, "TOPK": K}, {"E": E, "H": H, "I": I, "TOPK": K}
    if fmt == "mxfp4":
        s1, s2, q = mx.moe_stage1_mxfp4, mx.moe_stage2_mxfp4, mx.quant_mxfp4
    else:
        s1, s2, q = moe.moe_stage1_w4a8, moe.moe_stage2_w4a8_pq, quant_per_token_int8
    import warnings

    from autotune.store import lookup_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c1 = dict(lookup_config(s1, arch, p1, m))
    rows = full_dims(s1, p1, m, {"BLOCK_M": 16, **c1})["S"]  # the padded rows the second quantizer sees
    return [(q, {"K": H}, m), (s1, p1, m), (q, {"K": I}, rows), (s2, p2, m)]


@dataclass
class Row:
    fmt: str
    arch: str
    tp: int
    M: int
    predicted_us: float
    stage1_us: float
    floor_us: float
    experts_touched: float
    kernels: list[dict[str, Any]] = field(default_factory=list)


def weight_bytes(fmt: str, shape: dict[str, int], experts: float) -> float:
    per = 3 * shape["I"] * shape["H"]
    b = per * (0.5 + 1 / 32) if fmt == "mxfp4" else per / 2 + (2 * shape["I"] + shape["H"]) * 4
    return experts * b


def static_row(fmt: str, arch: str, tp: int, m: int) -> Row:
    from autotune.search import predict_config
    from kdsl.targets import get_target

    target = get_target(arch)
    shape = tp_shape(tp)
    ks = []
    for k, prob, mm in launches(fmt, shape, m, target.name):
        fig = predict_config(k, target, prob, mm)
        ks.append({"kernel": k.name, "m": mm, "predicted_us": fig["predicted_us"], "floor_us": fig["floor_us"],
                   "config": fig["config"]})
    touched = experts_touched(shape, m)
    return Row(fmt, target.name, tp, m, sum(k["predicted_us"] for k in ks), ks[1]["predicted_us"],
               weight_bytes(fmt, shape, touched) / (target.hbm_gbps * 1e3), touched, ks)


def table(rows: list[Row]) -> str:
    head = f"{'fmt':<6} {'arch':<6} {'TP':>2} {'M':>4} {'experts':>7} {'stage1 us':>9} {'layer us':>8} {'floor us':>8}  per launch (us)"
    out = [head, "-" * len(head)]
    for r in rows:
        per = " ".join(f"{k['kernel']}={k['predicted_us']:.2f}" for k in r.kernels)
        out.append(f"{r.fmt:<6} {r.arch:<6} {r.tp:>2} {r.M:>4} {r.experts_touched:>7.1f} {r.stage1_us:>9.2f} "
                   f"{r.predicted_us:>8.2f} {r.floor_us:>8.2f}  {per}")
    out.append("static (compile-only): layer = quant + stage 1 + quant + stage 2 predictions; floor = the touched "
               "experts' weights and scales / HBM bandwidth")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mxfp4", description=__doc__.split("\n")[0])
    p.add_argument("--arch", nargs="+", default=["gfx950"], help="gfx950 | gfx942 (default gfx950)")
    p.add_argument("--tp", nargs="+", type=int, default=list(TPS), help="tensor-parallel sizes (default 4 8)")
    p.add_argument("--m", nargs="+", type=int, default=list(M_VALUES), help="tokens per step (default 1 4 16 64)")
    p.add_argument("--fmt", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--json", default=None, help="where to write the JSON (default .benchmarks/mxfp4_static.json)")
    a = p.parse_args(argv)
    for arch in a.arch:
        if arch not in ("gfx942", "gfx950"):
            print(f"bench.mxfp4: --arch: unknown arch {arch!r} (gfx942 | gfx950)", file=sys.stderr)
            return 2
    if any(m < 1 for m in a.m):
        print("bench.mxfp4: --m values must be >= 1", file=sys.stderr)
        return 2
    for tp in a.tp:
        try:
            tp_shape(tp)
        except ValueError as e:
            print(f"bench.mxfp4: {e}", file=sys.stderr)
            return 2
    rows = [static_row(f, arch, tp, m) for arch in a.arch for tp in a.tp for f in a.fmt for m in a.m]
    print(table(rows))
    write_json(a.json, "mxfp4_static.json", {"rows": [asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
