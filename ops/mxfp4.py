"""MXFP4 (OCP microscaling FP4) kernels and their torch references: GEMM, fused-MoE stages, and the
dynamic activation quantizer, for AMD's `Kimi-K2.5-MXFP4` layout (REFERENCE §8).

The format (OCP MX v1.0): FP4 E2M1 values, codes 0..15 = +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} (bit 3 the
sign), two per uint8 along the input dim (element 2i in the low nibble); one E8M0 scale byte per 32
inputs, value 2^(e-127), 0xFF = NaN. A weight [N, K] is `w` uint8 [N, K/2] + `w_scale` uint8
[N, K/32]; W[n, k] = e2m1(code[n, k]) * 2^(s[n, k//32] - 127).

Activation schemes (vLLM's Quark schemes):
- W4A4 (`QuarkW4A4MXFP4`): activations quantized dynamically to MXFP4 per 32 (`quant_mxfp4`);
  the dot multiplies e2m1 x e2m1 with both scales (gfx950: `v_mfma_scale_f32_16x16x128_f8f6f4`).
- W4A8 (`QuarkW4A8_MXFP4_FP8`): activations OCP fp8 e4m3 with a *static per-tensor* scale from the
  checkpoint (`input_scale`), x_fp8 = clamp(x / s, +-448); e4m3 x e2m1 dot, times s in the epilogue.
- bf16 x e2m1 (`*_bf16a` kernels): no activation quantization; the dequantizing path.

Scale rule of the dynamic quantizer (SCALE_RULE): "quark" (default) is the rule of Quark's exporter
and AMD's kernels (aiter `dynamic_mxfp4_quant`, vLLM's emulation): round the group's absmax up at
the 0.75 mantissa point (bits + 0x200000, keep the exponent), then s = floor(log2(amax)) - 2,
clamped to [-127, 127]. "ocp" is the spec's rule without that rounding: s = floor(log2(absmax)) - 2
(emax of E2M1 = 2). Values are scaled by 2^-s (exact) and rounded to the E2M1 grid to nearest, ties
to the even code, saturating at +-6; the sign of values rounding to 0 is kept (-0 = code 8). A NaN
input becomes a signed zero code and an inf/NaN absmax gives s = 127 (UNCONFIRMED: what Quark writes
for non-finite groups; never produced from finite activations).

Paths, chosen by `mx_path(target)`: "native" where `tl.dot_scaled` runs the MX operands directly
(gfx950: scaled MFMA; the CPU interpreter: exact f32 emulation); "dequant" elsewhere (gfx942 has no MX
MFMA and no OCP fp8): W4A4 still runs the e2m1 x e2m1 kernels (Triton upcasts them to bf16 MFMA,
exact: every e2m1 x 2^k value fits bf16), W4A8-FP8 feeds the fp8 values as bf16 (exact) to the
bf16 x e2m1 kernels with the same per-tensor scale. Both paths give the same numbers up to f32
summation order.

Facts marked UNCONFIRMED: whether routers (`mlp.gate`) are MXFP4 in AMD's checkpoint (a model card
says so; our loader dequantizes an MXFP4 router to bf16 exactly, so routing sees the same weights).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kdsl as kd
from ops._common import config_for
from ops.moe import (KIMI, N_BLOCKS, MoEConfig, _block_rows, _check_backend, _s1_grid, _s2_epilogue, _s2_grid,
                     moe_align, moe_sum, route, shared_expert_ref)

GROUP = kd.MX_GROUP  # values per E8M0 scale
E2M1_MAX = 6.0
FP8_MAX = 448.0  # OCP e4m3fn
E8M0_NAN = 0xFF
SCALE_RULES = ("quark", "ocp")
MX_K_BLOCKS = (64, 128, 256)  # the scaled MFMA is 16x16x128: K tiles of 128+ feed it whole
G_BLOCKS = (1, 2, 4, 8, 16, 32)  # scale groups per program of the quantizer

# e2m1 code -> value (bit 3 = sign; -0.0 for code 8)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ----------------------------------------------------------------------------------------------
# torch reference of the OCP MX format

def e2m1_to_f32(codes: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1 codes (uint8 0..15) -> f32, exact."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.long() & 15]


def e8m0_to_f32(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> f32 2^(e-127) (byte 0 = 2^-127, a subnormal; 0xFF = NaN), exact, by bits."""
    e = s.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    out = bits.view(torch.float32)
    return torch.where(e == E8M0_NAN, torch.full_like(out, float("nan")), out)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes uint8 [..., K] (element 2i from the low nibble)."""
    lo, hi = packed & 15, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., K] (K even) -> uint8 [..., K/2] (element 2i in the low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def dequant_mxfp4_ref(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The f32 values [..., K] of an MXFP4 tensor (packed [..., K/2], scales [..., K/32]), exact."""
    v = e2m1_to_f32(unpack_fp4(packed))
    K = v.shape[-1]
    if scale.shape[-1] * GROUP != K:
        raise ValueError(f"dequant_mxfp4: {scale.shape[-1]} scales for {K} values (one per {GROUP})")
    return v * e8m0_to_f32(scale).repeat_interleave(GROUP, dim=-1)


def e2m1_round_ref(q: torch.Tensor) -> torch.Tensor:
    """f32 -> nearest E2M1 code, ties to the even code, saturating at +-6; the sign bit is kept
    (values rounding to 0 give +-0); NaN gives a signed zero code."""
    a = q.float().abs()
    mag = sum((a > t).to(torch.int32) if strict else (a >= t).to(torch.int32)
              for t, strict in ((0.25, True), (0.75, False), (1.25, True), (1.75, False),
                                (2.5, True), (3.5, False), (5.0, True)))
    sign = (q.float().view(torch.int32) >> 31) & 1
    return (mag | (sign << 3)).to(torch.uint8)


def mx_scale_exp_ref(amax: torch.Tensor, rule: str = "quark") -> torch.Tensor:
    """Unbiased E8M0 exponent s (int32, in [-127, 127]) of groups with absmax `amax` (f32 >= 0)."""
    if rule not in SCALE_RULES:
        raise ValueError(f"scale rule must be one of {SCALE_RULES}, got {rule!r}")
    bits = amax.float().view(torch.int32)
    if rule == "quark":
        bits = (bits + 0x200000) & 0x7F800000
    e = (bits >> 23) & 255
    return torch.where(e == 255, torch.full_like(e, 127), torch.clamp(e - 129, min=-127))


def quant_mxfp4_ref(x: torch.Tensor, rule: str = "quark") -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic MXFP4 quantization per 32 along the last dim: (packed uint8 [..., K/2], scales
    uint8 [..., K/32]) (module docstring: scale rule, rounding, saturation)."""
    K = x.shape[-1]
    if K % GROUP:
        raise ValueError(f"quant_mxfp4: the last dim ({K}) must be a multiple of {GROUP}")
    xg = x.float().reshape(*x.shape[:-1], K // GROUP, GROUP)
    s = mx_scale_exp_ref(xg.abs().amax(-1), rule)
    qbits = torch.where(s == 127, torch.full_like(s, 0x00400000), (127 - s) << 23)
    q = xg * qbits.view(torch.float32)[..., None]
    codes = e2m1_round_ref(q).reshape(*x.shape)
    return pack_fp4(codes), (s + 127).to(torch.uint8)


def quant_fp8_static_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x -> OCP e4m3fn with a per-tensor scale: clamp(x / s, +-448), round to nearest even."""
    return (x.float() / scale.float().reshape(())).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def gemm_mxfp4_ref(x: torch.Tensor, x_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor
                   ) -> torch.Tensor:
    """f32 [M, N] = A @ W^T in f64 then f32: A = the MXFP4 activations (x_scale given), or x's own
    values (bf16 / fp8) when x_scale is None; W = the MXFP4 weight."""
    a = dequant_mxfp4_ref(x, x_scale) if x_scale is not None else x.float()
    return (a.double() @ dequant_mxfp4_ref(w, w_scale).double().t()).float()


# ----------------------------------------------------------------------------------------------
# kernels: quantizers

def _e2m1_code(q):
    """f32 tile -> E2M1 code (i32), the comparison ladder of `e2m1_round_ref`."""
    a = kd.abs(q)
    mag = ((a > 0.25).to(kd.i32) + (a >= 0.75).to(kd.i32) + (a > 1.25).to(kd.i32) + (a >= 1.75).to(kd.i32)
           + (a > 2.5).to(kd.i32) + (a >= 3.5).to(kd.i32) + (a > 5.0).to(kd.i32))
    sign = (q.bitcast(kd.i32) >> 31) & 1
    return mag | (sign << 3)


QUANT_EXAMPLE = {"M": 1, "K": KIMI["H"], "KH": KIMI["H"] // 2, "KG": KIMI["H"] // GROUP}
QUANT_CHECKS = [("KH", lambda d: d["KH"] * 2 == d["K"], "q must be uint8 [M, K/2] (two fp4 per byte)"),
                ("KG", lambda d: d["KG"] * GROUP == d["K"], "scale must be [M, K/32] (one E8M0 per 32)")]


@kd.kernel(example=QUANT_EXAMPLE, checks=QUANT_CHECKS)
def quant_mxfp4(x: kd.In["M", "K", kd.bf16], q: kd.Out["M", "KH", kd.u8], scale: kd.Out["M", "KG", kd.e8m0]):
    """Dynamic MXFP4 per 32 (module docstring): E8M0 scale from the group's absmax, e2m1 codes
    rounded to nearest even with saturation, packed two per byte."""
    m, g = kd.grid(kd.each("M"), kd.tile("KG", "BLOCK_G", domain=G_BLOCKS, default=8))
    rule = kd.tunable("SCALE_RULE", SCALE_RULES, "quark", "E8M0 rule: Quark's rounded absmax or the OCP floor",
                      search=False)
    j = kd.arange(GROUP // 2, label="j")
    col = g * GROUP + j * 2
    lo = x.load(m, col).to(kd.f32)
    hi = x.load(m, col + 1).to(kd.f32)
    amax = kd.maximum(kd.max(kd.abs(lo), axis=j), kd.max(kd.abs(hi), axis=j))
    bits = amax.bitcast(kd.i32)
    if rule == "quark":
        bits = (bits + 0x200000) & 0x7F800000
    e = (bits >> 23) & 255
    s = kd.where(e == 255, 127, kd.maximum(e - 129, -127))
    qs = kd.where(s == 127, 0x00400000, (127 - s) << 23).bitcast(kd.f32)
    byte = _e2m1_code(lo * qs) | (_e2m1_code(hi * qs) << 4)
    q.store(m, g * (GROUP // 2) + j, value=byte.to(kd.u8))
    scale.store(m, g, value=(s + 127).to(kd.e8m0))


@kd.kernel(example={"M": 1, "K": KIMI["H"], "ONE": 1})
def quant_fp8_static(x: kd.In["M", "K", kd.bf16], x_scale: kd.In["ONE", kd.f32],
                     q: kd.Out["M", "K", kd.fp8e4m3fn]):
    """x -> OCP e4m3fn with a static per-tensor scale: clamp(x / s, +-448), nearest even."""
    m, k = kd.grid(kd.each("M"), kd.tile("K", "BLOCK_K", domain=(256, 512, 1024), default=512))
    y = x[m, k].to(kd.f32) / x_scale[0]
    q[m, k] = kd.minimum(kd.maximum(y, -FP8_MAX), FP8_MAX)


# ----------------------------------------------------------------------------------------------
# kernels: GEMM

def _mx_k(dim: str, default: int = 128) -> kd.tiles:
    return kd.tiles(dim, block="BLOCK_K", domain=MX_K_BLOCKS, default=default)


GEMM_EXAMPLE = {"M": 1, "N": 4096, "K": KIMI["H"], "KG": KIMI["H"] // GROUP}
GEMM_CHECKS = [("KG", lambda d: d["KG"] * GROUP == d["K"], "scales must be [rows, K/32] (one E8M0 per 32)")]


def _gemm_grid():
    return kd.grid(kd.tile("M", "BLOCK_M", domain=(16, 32, 64, 128), default=16),
                   kd.tile("N", "BLOCK_N", domain=(16, 32, 64, 128, 256), default=64))


@kd.kernel(example=GEMM_EXAMPLE, checks=GEMM_CHECKS)
def gemm_mxfp4(x: kd.In["M", "K", kd.fp4_e2m1], xs: kd.In["M", "KG", kd.e8m0],
               w: kd.In["N", "K", kd.fp4_e2m1], ws: kd.In["N", "KG", kd.e8m0], out: kd.Out["M", "N", kd.bf16]):
    """W4A4 MXFP4 GEMM: e2m1 x e2m1 with per-32 E8M0 scales on both sides, f32 accumulate -> bf16."""
    m, n = _gemm_grid()
    KG = kd.dim("KG")

    def body(k, acc):
        g = kd.mx_groups(k, KG)
        return kd.dot_scaled(x[m, k], xs[m, g], w[n, k], ws[n, g], acc=acc)

    out[m, n] = kd.fold(_mx_k("K"), kd.zeros((m, n), kd.f32), body)


@kd.kernel(example=GEMM_EXAMPLE, checks=GEMM_CHECKS)
def gemm_mxfp4_bf16a(x: kd.In["M", "K", kd.bf16], w: kd.In["N", "K", kd.fp4_e2m1], ws: kd.In["N", "KG", kd.e8m0],
                     out: kd.Out["M", "N", kd.bf16]):
    """bf16 activations x MXFP4 weight (no activation quantization), f32 accumulate -> bf16."""
    m, n = _gemm_grid()
    KG = kd.dim("KG")

    def body(k, acc):
        return kd.dot_scaled(x[m, k], None, w[n, k], ws[n, kd.mx_groups(k, KG)], acc=acc)

    out[m, n] = kd.fold(_mx_k("K"), kd.zeros((m, n), kd.f32), body)


# ----------------------------------------------------------------------------------------------
# kernels: fused-MoE stages (the align / route / sum pieces are ops.moe's)

S1_EXAMPLE = {"M": 1, "K": KIMI["H"], "KG": KIMI["H"] // GROUP, "I": KIMI["I"], "N2": 2 * KIMI["I"],
              "E": KIMI["E"], "TOPK": 8, "S": 16 * 9, "NB": 9, "ONE": 1}
S1_CHECKS = [("N2", lambda d: d["N2"] == 2 * d["I"], "w13 rows (N2) must be 2*I (gate rows then up rows)"),
             ("KG", lambda d: d["KG"] * GROUP == d["K"], "scales must be [.., K/32] (one E8M0 per 32)")]
S2_EXAMPLE = {"M": 1, "I": KIMI["I"], "IG": KIMI["I"] // GROUP, "H": KIMI["H"], "E": KIMI["E"], "TOPK": 8, "T": 8,
              "S": 16 * 9, "NB": 9, "MO": 1, "P": 8, "ONE": 1}
S2_CHECKS = [("IG", lambda d: d["IG"] * GROUP == d["I"], "scales must be [.., I/32] (one E8M0 per 32)")]


def _s1_main(a_of, w13, s13, e, n, tid):
    """Stage-1 main loop: gate and up f32 accumulators; `a_of(k, g)` gives the A tile and its scales."""
    I, KG = kd.dim("I"), kd.dim("KG")

    def body(k, ag, au):
        g = kd.mx_groups(k, KG)
        a, a_s = a_of(k, g)
        return (kd.dot_scaled(a, a_s, w13[e, n, k], s13[e, n, g], acc=ag),
                kd.dot_scaled(a, a_s, w13[e, n + I, k], s13[e, n + I, g], acc=au))

    z = kd.zeros((tid, n), kd.f32)
    return kd.fold(_mx_k("K"), (z, z), body)


def _s1_setup(sorted_ids, block_expert, TOPK):
    b, n = _s1_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("M") * TOPK
    return n, e, rows, tid, valid, tid // TOPK


@kd.kernel(static=("TOPK",), checks=S1_CHECKS, example=S1_EXAMPLE)
def moe_stage1_mxfp4(x: kd.In["M", "K", kd.fp4_e2m1], xs: kd.In["M", "KG", kd.e8m0],
                     w13: kd.In["E", "N2", "K", kd.fp4_e2m1], s13: kd.In["E", "N2", "KG", kd.e8m0],
                     sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32],
                     inter: kd.Out["S", "I", kd.bf16], TOPK: kd.Dim):
    """W4A4 gate+up: MXFP4 activations x MXFP4 experts (scaled dot), SiLU(gate)*up -> bf16."""
    n, e, rows, tid, valid, tok = _s1_setup(sorted_ids, block_expert, TOPK)
    ag, au = _s1_main(lambda k, g: (x.load(tok, k, mask=valid), xs.load(tok, g, mask=valid)), w13, s13, e, n, tid)
    inter.store(rows, n, value=kd.silu(ag) * au, mask=valid)


@kd.kernel(static=("TOPK",), checks=S1_CHECKS, example=S1_EXAMPLE)
def moe_stage1_mxfp4_fp8(x: kd.In["M", "K", kd.fp8e4m3fn], x_scale: kd.In["ONE", kd.f32],
                         w13: kd.In["E", "N2", "K", kd.fp4_e2m1], s13: kd.In["E", "N2", "KG", kd.e8m0],
                         sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32],
                         inter: kd.Out["S", "I", kd.bf16], TOPK: kd.Dim):
    """W4A8 gate+up: OCP e4m3 activations (static per-tensor scale) x MXFP4 experts, SiLU(gate)*up."""
    n, e, rows, tid, valid, tok = _s1_setup(sorted_ids, block_expert, TOPK)
    ag, au = _s1_main(lambda k, g: (x.load(tok, k, mask=valid), None), w13, s13, e, n, tid)
    s = x_scale[0]
    inter.store(rows, n, value=kd.silu(ag * s) * (au * s), mask=valid)


@kd.kernel(static=("TOPK",), checks=S1_CHECKS, example=S1_EXAMPLE)
def moe_stage1_mxfp4_bf16a(x: kd.In["M", "K", kd.bf16], x_scale: kd.In["ONE", kd.f32],
                           w13: kd.In["E", "N2", "K", kd.fp4_e2m1], s13: kd.In["E", "N2", "KG", kd.e8m0],
                           sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32],
                           inter: kd.Out["S", "I", kd.bf16], TOPK: kd.Dim):
    """bf16 activations x MXFP4 experts (the dequantizing path; x_scale = 1, or the per-tensor fp8
    scale when x holds fp8 values widened to bf16), SiLU(gate)*up -> bf16."""
    n, e, rows, tid, valid, tok = _s1_setup(sorted_ids, block_expert, TOPK)
    ag, au = _s1_main(lambda k, g: (x.load(tok, k, mask=valid), None), w13, s13, e, n, tid)
    s = x_scale[0]
    inter.store(rows, n, value=kd.silu(ag * s) * (au * s), mask=valid)


def _s2_main(a_of, w2, s2, e, n, rows):
    IG = kd.dim("IG")

    def body(k, acc):
        g = kd.mx_groups(k, IG)
        a, a_s = a_of(k, g)
        return kd.dot_scaled(a, a_s, w2[e, n, k], s2[e, n, g], acc=acc)

    return kd.fold(_mx_k("I"), kd.zeros((rows, n), kd.f32), body)


@kd.kernel(static=("TOPK",), checks=S2_CHECKS, example=S2_EXAMPLE)
def moe_stage2_mxfp4(inter: kd.In["S", "I", kd.fp4_e2m1], inter_s: kd.In["S", "IG", kd.e8m0],
                     w2: kd.In["E", "H", "I", kd.fp4_e2m1], s2: kd.In["E", "H", "IG", kd.e8m0],
                     sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32], topk_w: kd.In["T", kd.f32],
                     out: kd.InOut["MO", "H", kd.f32], partial: kd.Out["P", "H", kd.f32], TOPK: kd.Dim):
    """W4A4 down: the MXFP4-quantized intermediate x MXFP4 experts, routing weight, top-k sum."""
    b, n = _s2_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("T")
    acc = _s2_main(lambda k, g: (inter.load(rows, k, mask=valid), inter_s.load(rows, g, mask=valid)), w2, s2, e, n, rows)
    _s2_epilogue(acc, tid, valid, n, topk_w, out, partial)


@kd.kernel(static=("TOPK",), checks=S2_CHECKS, example=S2_EXAMPLE)
def moe_stage2_mxfp4_fp8(inter: kd.In["S", "I", kd.fp8e4m3fn], inter_scale: kd.In["ONE", kd.f32],
                         w2: kd.In["E", "H", "I", kd.fp4_e2m1], s2: kd.In["E", "H", "IG", kd.e8m0],
                         sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32], topk_w: kd.In["T", kd.f32],
                         out: kd.InOut["MO", "H", kd.f32], partial: kd.Out["P", "H", kd.f32], TOPK: kd.Dim):
    """W4A8 down: the e4m3 intermediate (static per-tensor scale) x MXFP4 experts, weight, top-k sum."""
    b, n = _s2_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("T")
    acc = _s2_main(lambda k, g: (inter.load(rows, k, mask=valid), None), w2, s2, e, n, rows)
    _s2_epilogue(acc * inter_scale[0], tid, valid, n, topk_w, out, partial)


@kd.kernel(static=("TOPK",), checks=S2_CHECKS, example=S2_EXAMPLE)
def moe_stage2_mxfp4_bf16a(inter: kd.In["S", "I", kd.bf16], inter_scale: kd.In["ONE", kd.f32],
                           w2: kd.In["E", "H", "I", kd.fp4_e2m1], s2: kd.In["E", "H", "IG", kd.e8m0],
                           sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32],
                           topk_w: kd.In["T", kd.f32], out: kd.InOut["MO", "H", kd.f32],
                           partial: kd.Out["P", "H", kd.f32], TOPK: kd.Dim):
    """bf16 intermediate x MXFP4 experts (the dequantizing path), routing weight, top-k sum."""
    b, n = _s2_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("T")
    acc = _s2_main(lambda k, g: (inter.load(rows, k, mask=valid), None), w2, s2, e, n, rows)
    _s2_epilogue(acc * inter_scale[0], tid, valid, n, topk_w, out, partial)


KERNELS = (quant_mxfp4, quant_fp8_static, gemm_mxfp4, gemm_mxfp4_bf16a, moe_stage1_mxfp4, moe_stage1_mxfp4_fp8,
           moe_stage1_mxfp4_bf16a, moe_stage2_mxfp4, moe_stage2_mxfp4_fp8, moe_stage2_mxfp4_bf16a)
