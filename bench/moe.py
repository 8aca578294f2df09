"""MoE layer suite at the Kimi-K2.5 shape (E=384, top-8, hidden 7168, expert intermediate 2048):
measured on a GPU, static on a CPU.

    python -m bench.moe                          # GPU: measured vs a torch path; CPU: static, gfx942 + gfx950
    python -m bench.moe --static --arch gfx942 --m 1 4 16 64 --fmt w4a8 w4a16
    python -m bench.moe --static --arch gfx950 --m 1 4 --fmt w4a8 mxfp4   # MXFP4 (W4A4): static only
    python -m bench.moe --json /tmp/moe.json

The figure that matters is the bandwidth over the bytes of the experts a step actually touches
(M tokens x top-8 hit about E(1 - (1 - 8/E)^M) distinct experts; only their weights are read):
the MoE layer at decode is a weight stream, so time / (touched bytes / HBM peak) says how far it is
from the floor. The M=4 / M=1 time ratio is the cost of verifying 4 tokens instead of decoding 1.

GPU mode times `ops.moe.fused_moe` (routing + align + both stages, configs from the tuned files)
against a torch path in the same run, interleaved: torch routing, then per touched expert the
weights dequantized to bf16 and two bf16 matmuls (torch has no int4 GEMM). CPU mode sums the
static predictions (`autotune.search.predict_config`: AOT report + cost model, tuned config) of
the modelled launches; the tiny single-program launches (route, align) are listed, not modelled.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ops.problems import experts_touched

from .report import write_json

KIMI_MOE = {"E": 384, "H": 7168, "I": 2048, "TOPK": 8}
M_VALUES = (1, 4, 16, 64)
FORMATS = ("w4a8", "w4a16")
STATIC_ARCHES = ("gfx942", "gfx950")
NOT_MODELLED = ("moe_route", "moe_align_blocks", "moe_align_scatter")


def weight_bytes(fmt: str, shape: dict[str, int], experts: float) -> float:
    """Bytes of `experts` experts' weights and scales (gate+up and down) plus the router weight."""
    E, H, I = shape["E"], shape["H"], shape["I"]
    per = 3 * I * H  # gate, up, down
    if fmt == "w4a8":
        b = per / 2 + (2 * I + H) * 4
    elif fmt == "w4a16":
        b = per / 2 + per / 32 * 2
    elif fmt == "mxfp4":
        b = per / 2 + per / 32       # E2M1 codes and one E8M0 byte per 32
    else:
        b = per * 2
    return experts * b + E * H * 2


def launches(fmt: str, shape: dict[str, int], m: int, arch: str | None = None) -> list[tuple[Any, dict[str, int], int]]:
    """(kernel, problem, M) of every modelled launch of one `fused_moe` call on `arch`, in order
    (W4A8: the stages of the stage2_quant mode fused_experts picks there)."""
    from ops import moe
    from ops.quant import quant_per_token_int8

    from autotune.problems import full_dims

    E, H, I, K = shape["E"], shape["H"], shape["I"], shape["TOPK"]
    if fmt == "mxfp4":              # W4A4: the MXFP4 quantizer and stages (bench.mxfp4's rows), on gfx950
        from bench.mxfp4 import launches as mx_launches

        return [(moe.moe_gate_gemm, {"E": E, "H": H}, m)] + mx_launches("mxfp4", shape, m)
    sq = moe.stage2_quant_mode(None, E, H, I, K, m, arch) if fmt == "w4a8" else None
    s1, s2 = moe.W4A8_STAGES[sq] if sq else (moe.STAGE1[fmt], moe.STAGE2[fmt])
    p1, p2 = {"E": E, "K": H, "I": I, "TOPK": K}, {"E": E, "H": H, "I": I, "TOPK": K}
    out: list[tuple[Any, dict[str, int], int]] = [(moe.moe_gate_gemm, {"E": E, "H": H}, m)]
    if fmt == "w4a8":
        out.append((quant_per_token_int8, {"K": H}, m))
    out.append((s1, p1, m))
    if sq == "separate":
        rows = full_dims(s1, p1, m, moe._stage_configs({"stage2_quant": sq}, fmt, E, H, I, K, m)[0])["S"]
        out.append((quant_per_token_int8, {"K": I}, rows))
    out.append((s2, p2, m))
    return out


@dataclass
class StaticRow:
    fmt: str
    arch: str
    M: int
    predicted_us: float
    floor_us: float
    roofline_fraction: float
    experts_touched: float
    touched_bytes: float
    kernels: list[dict[str, Any]] = field(default_factory=list)
    ratio_vs_m1: float = float("nan")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def static_row(fmt: str, arch: str, m: int, shape: dict[str, int] = KIMI_MOE) -> StaticRow:
    """Sum of the static predictions of the layer's modelled launches at M=m on `arch`."""
    from autotune.search import predict_config
    from kdsl.targets import get_target

    target = get_target(arch)
    kernels = []
    for k, prob, mm in launches(fmt, shape, m, target.name):
        fig = predict_config(k, target, prob, mm)
        kernels.append({"kernel": k.name, "m": mm, "predicted_us": fig["predicted_us"], "floor_us": fig["floor_us"],
                        "config": fig["config"], "resources": fig["resources"], "penalty": fig.get("penalty", "")})
    total = sum(k["predicted_us"] for k in kernels)
    touched = experts_touched(shape, m)
    nbytes = weight_bytes(fmt, shape, touched)
    floor = nbytes / (target.hbm_gbps * 1e3)
    return StaticRow(fmt, target.name, m, total, floor, min(1.0, floor / total) if total > 0 else float("nan"),
                     touched, nbytes, kernels)


def with_ratios(rows: list[Any], key: str) -> list[Any]:
    """Fill ratio_vs_m1 = time(M) / time(M=1) of the same format and arch (NaN without an M=1 row)."""
    base = {(r.fmt, r.arch): getattr(r, key) for r in rows if r.M == 1}
    for r in rows:
        b = base.get((r.fmt, r.arch))
        r.ratio_vs_m1 = getattr(r, key) / b if b else float("nan")
    return rows


def static_table(rows: list[StaticRow]) -> str:
    head = (f"{'fmt':<6} {'arch':<6} {'M':>4} {'experts':>7} {'MB read':>8} {'pred us':>8} {'floor us':>8} "
            f"{'roof':>5} {'xM=1':>5}  per launch (us)")
    lines = [head, "-" * len(head)]
    for r in rows:
        per = " ".join(f"{k['kernel'].replace('moe_', '')}={k['predicted_us']:.1f}" for k in r.kernels)
        lines.append(f"{r.fmt:<6} {r.arch:<6} {r.M:>4} {r.experts_touched:>7.1f} {r.touched_bytes / 1e6:>8.1f} "
                     f"{r.predicted_us:>8.1f} {r.floor_us:>8.1f} {r.roofline_fraction:>5.2f} {r.ratio_vs_m1:>5.2f}  {per}")
    lines.append("static figures (compile-only, no run): pred = sum of the cost model's predictions of the modelled "
                 f"launches (not modelled: {', '.join(NOT_MODELLED)}, launch overheads); floor = touched experts' "
                 "weights + router weight / HBM bandwidth; roof = floor / pred")
    return "\n".join(lines)


# -- GPU: measured ----------------------------------------------------------------------------------

def random_layer(fmt: str, shape: dict[str, int], device: str, seed: int = 0) -> dict[str, Any]:
    """Random MoE layer weights in `fmt` (never zeros): packed int4 as random words, scales around
    1/64 so the activations stay O(1)."""
    from ops.moe import GROUP, MoEWeights

    g = torch.Generator(device=device).manual_seed(seed)
    E, H, I = shape["E"], shape["H"], shape["I"]

    def words(*s):
        return torch.randint(-2 ** 31, 2 ** 31 - 1, s, generator=g, device=device, dtype=torch.int64).to(torch.int32)

    def scale(*s, dt=torch.float32):
        return ((torch.rand(s, generator=g, device=device) + 0.5) / 64).to(dt)

    if fmt == "w4a8":
        w = MoEWeights("w4a8", words(E, 2 * I, H // 8), words(E, H, I // 8), scale(E, 2 * I), scale(E, H))
    elif fmt == "w4a16":
        w = MoEWeights("w4a16", words(E, 2 * I, H // 8), words(E, H, I // 8),
                       scale(E, 2 * I, H // GROUP, dt=torch.bfloat16), scale(E, H, I // GROUP, dt=torch.bfloat16))
    else:
        w = MoEWeights("bf16", (torch.randn(E, 2 * I, H, generator=g, device=device) / 64).to(torch.bfloat16),
                       (torch.randn(E, H, I, generator=g, device=device) / 64).to(torch.bfloat16))
    router = (torch.randn(E, H, generator=g, device=device) / math.sqrt(H)).to(torch.bfloat16)
    bias = torch.randn(E, generator=g, device=device) * 1e-3
    return {"experts": w, "router": router, "bias": bias}


def torch_path(x: torch.Tensor, layer: dict[str, Any], top_k: int, scaling: float) -> torch.Tensor:
    """The layer as plain torch: reference routing, then per touched expert its weights
    dequantized to bf16 and bf16 matmuls (W4A8 with bf16 activations: torch has no int8 x int4)."""
    from ops.moe import GROUP, moe_route_ref
    from ops.packing import unpack_int4

    w = layer["experts"]
    ids, wts = moe_route_ref(x, layer["router"], layer["bias"], top_k, routed_scaling_factor=scaling)
    pack = "quark_reorder" if w.fmt == "w4a8" else "ct_reorder"
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    I = w.w2.shape[2] * (8 if w.fmt != "bf16" else 1)

    def deq(words, s, e):
        if w.fmt == "bf16":
            return words[e]
        q = unpack_int4(words[e], pack).to(torch.bfloat16)
        if w.fmt == "w4a16":
            return q * s[e].repeat_interleave(GROUP, dim=-1)
        return q * s[e].to(torch.bfloat16)[:, None]

    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = x[tok] @ deq(w.w13, w.s13, e).t()
        h = torch.nn.functional.silu(gu[:, :I].float()) * gu[:, I:].float()
        y = h.to(torch.bfloat16) @ deq(w.w2, w.s2, e).t()
        out.index_add_(0, tok, y.float() * wts[tok, slot][:, None])
    return out.to(torch.bfloat16)


def gpu_record(fmt: str, m: int, shape: dict[str, int] = KIMI_MOE, reps: int = 30, device: str = "cuda",
               layer: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time kdsl's fused_moe and the torch path at M=m, interleaved, on the current GPU.
    (`device="cpu"` exists only so a test can dry-run the record assembly with a stub timer.)"""
    from kdsl.targets import current_target
    from ops.moe import MoEConfig, fused_moe, moe_route_ref

    from . import timing

    target = current_target()
    layer = layer or random_layer(fmt, shape, device)
    cfg = MoEConfig(top_k=shape["TOPK"])
    x = torch.randn(m, shape["H"], device=device, generator=torch.Generator(device=device).manual_seed(m)
                    ).to(torch.bfloat16)
    run_kd = lambda: fused_moe(x, layer["router"], layer["bias"], layer["experts"], cfg=cfg)  # noqa: E731
    run_t = lambda: torch_path(x, layer, cfg.top_k, cfg.routed_scaling_factor)  # noqa: E731
    y_kd, y_t = run_kd().float(), run_t().float()
    err = float((y_kd - y_t).abs().max() / y_t.abs().max().clamp_min(1e-30))
    ids, _ = moe_route_ref(x, layer["router"], layer["bias"], cfg.top_k)
    touched = int(ids.unique().numel())
    nbytes = weight_bytes(fmt, shape, touched)
    t = timing.time_interleaved({"kdsl": run_kd, "torch": run_t}, reps=reps)
    us = t["kdsl"]
    return {"fmt": fmt, "M": m, "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
            "target": target.name, "kdsl_us": us, "torch_us": t["torch"], "speedup_vs_torch": t["torch"] / us,
            "experts_touched": touched, "touched_bytes": nbytes, "gbps": nbytes / (us * 1e3),
            "hbm_fraction": nbytes / (us * 1e3) / target.hbm_gbps, "max_rel_err_vs_torch": err,
            "torch_op": "torch routing + per-expert bf16 dequantize + bf16 matmuls"}


def gpu_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'fmt':<6} {'M':>4} {'experts':>7} {'kdsl us':>8} {'torch us':>8} {'x torch':>7} {'GB/s':>7} "
            f"{'%HBM':>5} {'xM=1':>5} {'relerr':>7}")
    lines = [head, "-" * len(head)]
    base = {r["fmt"]: r["kdsl_us"] for r in rows if r["M"] == 1}
    for r in rows:
        ratio = r["kdsl_us"] / base[r["fmt"]] if r["fmt"] in base else float("nan")
        r["ratio_vs_m1"] = ratio
        lines.append(f"{r['fmt']:<6} {r['M']:>4} {r['experts_touched']:>7} {r['kdsl_us']:>8.1f} {r['torch_us']:>8.1f} "
                     f"{r['speedup_vs_torch']:>7.2f} {r['gbps']:>7.0f} {100 * r['hbm_fraction']:>5.1f} {ratio:>5.2f} "
                     f"{r['max_rel_err_vs_torch']:>7.1e}")
    lines.append("measured with device events, median of interleaved repeats, L2 flushed; GB/s over the touched "
                 "experts' weights + router weight; x torch = torch time / kdsl time")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n")[0])
    p.add_argument("--arch", nargs="+", default=list(STATIC_ARCHES), help="static mode: arches (default gfx942 gfx950)")
    p.add_argument("--fmt", nargs="+", default=list(FORMATS), choices=["w4a8", "w4a16", "bf16", "mxfp4"],
                   help="expert weight formats (default w4a8 w4a16; mxfp4 (W4A4): static figures only)")
    p.add_argument("--m", nargs="+", type=int, default=list(M_VALUES), help="tokens per step (default 1 4 16 64)")
    p.add_argument("--static", action="store_true", help="static figures even when a GPU is present")
    p.add_argument("--json", default=None, help="where to write the JSON (default .benchmarks/moe_<mode>.json)")
    a = p.parse_args(argv)
    if any(m < 1 for m in a.m):
        p.error("--m values must be >= 1")
    t0 = time.time()
    if "mxfp4" in a.fmt and torch.cuda.is_available() and not a.static:
        p.error("--fmt mxfp4 has static figures only: add --static")
    if torch.cuda.is_available() and not a.static:
        rows = []
        for fmt in a.fmt:
            layer = random_layer(fmt, KIMI_MOE, "cuda")
            rows += [gpu_record(fmt, m, layer=layer) for m in a.m]
            del layer
            torch.cuda.empty_cache()
        print(gpu_table(rows))
        payload: dict[str, Any] = {"mode": "measured", "rows": rows}
    else:
        srows = with_ratios([static_row(f, arch, m) for f in a.fmt for arch in a.arch for m in a.m], "predicted_us")
        print(static_table(srows))
        payload = {"mode": "static", "note": "compile-only predictions; no kernel was run",
                   "rows": [r.to_dict() for r in srows]}
    path = write_json(a.json, f"moe_{payload['mode']}.json", payload)
    print(f"wrote {path} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
