"""Problem models of the MXFP4 kernels (ops.mxfp4), registered with `autotune.problems.register` when
ops.problems is imported (autotune does that on first use).

MXFP4 bytes per element: 0.5 (two E2M1 codes per byte) + 1/32 (one E8M0 byte per 32 values).
The fused-MoE stages share ops.moe's keys and derived block dims (E, K|H, I, TOPK; blocks from M),
plus the one-element per-tensor scale operand (ONE) of the fp8 / bf16-activation variants.
Matrix peak: "fp8" (gfx950's scaled MFMA f8f6f4 runs e2m1 at least at the fp8 rate; the MI355X
MXFP4 peak is higher, so the compute term is conservative).
"""
from __future__ import annotations

from typing import Any, Callable

from autotune.problems import Problem, ProblemModel, register
from ops.problems import _moe_stage1_derived, _moe_stage2_derived, experts_touched

MX_BYTES = 0.5 + 1.0 / 32.0  # per value: the fp4 code and its share of the E8M0 scale
ACT_BYTES = {"mxfp4": MX_BYTES, "fp8": 1.0, "bf16a": 2.0}


def _stage(stage: int, act: str) -> tuple[Callable[[Problem, int], float], Callable[[Problem, int], float]]:
    """(bytes, flops) of an MXFP4 MoE stage: the touched experts' codes and scales, the activations
    in their scheme's bytes, the bf16 intermediate (stage 1) or routing weights + f32 output (stage 2)."""
    ab = ACT_BYTES[act]

    def dims(p: Problem) -> tuple[int, int]:
        return (2 * p["I"], p["K"]) if stage == 1 else (p["H"], p["I"])

    def nbytes(p: Problem, m: int) -> float:
        n, k = dims(p)
        t = m * p["TOPK"]
        w = experts_touched(p, m) * n * k * MX_BYTES
        if stage == 1:
            return w + m * k * ab + t * p["I"] * 2
        return w + t * k * ab + 4 * t + m * n * 4

    def flops(p: Problem, m: int) -> float:
        n, k = dims(p)
        return 2.0 * m * p["TOPK"] * n * k

    return nbytes, flops


def _with_one(derived: Callable[[Problem, int, dict[str, Any]], Problem]) -> Callable[[Problem, int, dict[str, Any]], Problem]:
    return lambda p, m, c: {**derived(p, m, c), "ONE": 1}


def _gemm_bytes(ab: float) -> Callable[[Problem, int], float]:
    return lambda p, m: p["N"] * p["K"] * MX_BYTES + m * p["K"] * ab + m * p["N"] * 2


MX_MODELS: list[ProblemModel] = []
for _act, _sfx in (("mxfp4", ""), ("fp8", "_fp8"), ("bf16a", "_bf16a")):
    _b1, _f1 = _stage(1, _act)
    _b2, _f2 = _stage(2, _act)
    MX_MODELS += [
        ProblemModel(f"moe_stage1_mxfp4{_sfx}", ("E", "K", "I", "TOPK"), peak_dtype="fp8", bytes_fn=_b1,
                     flops_fn=_f1, derived=_with_one(_moe_stage1_derived)),
        ProblemModel(f"moe_stage2_mxfp4{_sfx}", ("E", "H", "I", "TOPK"), peak_dtype="fp8", bytes_fn=_b2,
                     flops_fn=_f2, derived=_with_one(_moe_stage2_derived), loop_dim="I"),
    ]
MX_MODELS += [
    ProblemModel("gemm_mxfp4", ("N", "K"), peak_dtype="fp8", bytes_fn=_gemm_bytes(MX_BYTES),
                 flops_fn=lambda p, m: 2.0 * m * p["N"] * p["K"], derived=lambda p, m, c: {"KG": p["K"] // 32}),
    ProblemModel("gemm_mxfp4_bf16a", ("N", "K"), peak_dtype="bf16", bytes_fn=_gemm_bytes(2.0),
                 flops_fn=lambda p, m: 2.0 * m * p["N"] * p["K"], derived=lambda p, m, c: {"KG": p["K"] // 32}),
    # one program per (row, group tile): no main loop
    ProblemModel("quant_mxfp4", ("K",), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=lambda p, m: m * p["K"] * (2 + MX_BYTES), flops_fn=lambda p, m: 12.0 * m * p["K"],
                 derived=lambda p, m, c: {"KH": p["K"] // 2, "KG": p["K"] // 32}),
]

register(*MX_MODELS)
