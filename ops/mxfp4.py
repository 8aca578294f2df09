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

Scale rule of the dynamic quantizer (SCALE_RULE, named after Quark's `scale_calculation_mode`):
"even" (default; the formula of vLLM's MXFP4 emulation and AMD's aiter `dynamic_mxfp4_quant`) rounds
the group's absmax half-up to E2M1's one mantissa bit (bits + 0x200000, keep sign and exponent), then
s = floor(log2(amax)) - 2, clamped to [-127, 127]. UNCONFIRMED: that this is exactly Quark's own
`even_round` (recalled, not read). "floor" is the OCP spec's rule: s = floor(log2(absmax)) - 2
(emax of E2M1 = 2), no rounding. Values are scaled by 2^-s (exact) and rounded to the E2M1 grid to
nearest, ties to the even code, saturating at +-6; the sign of values rounding to 0 is kept
(-0 = code 8). A NaN input becomes a signed zero code and an inf/NaN absmax gives s = 127
(UNCONFIRMED: what Quark writes for non-finite groups; never produced from finite activations).

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
SCALE_RULES = ("even", "floor")  # Quark scale_calculation_mode names
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


def mx_scale_exp_ref(amax: torch.Tensor, rule: str = "even") -> torch.Tensor:
    """Unbiased E8M0 exponent s (int32, in [-127, 127]) of groups with absmax `amax` (f32 >= 0)."""
    if rule not in SCALE_RULES:
        raise ValueError(f"scale rule must be one of {SCALE_RULES}, got {rule!r}")
    bits = amax.float().view(torch.int32)
    if rule == "even":
        bits = (bits + 0x200000) & 0x7F800000
    e = (bits >> 23) & 255
    return torch.where(e == 255, torch.full_like(e, 127), torch.clamp(e - 129, min=-127))


def quant_mxfp4_ref(x: torch.Tensor, rule: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
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
    rule = kd.tunable("SCALE_RULE", SCALE_RULES, "even", "E8M0 rule: Quark's even (rounded absmax) or the OCP floor",
                      search=False)
    j = kd.arange(GROUP // 2, label="j")
    col = g * GROUP + j * 2
    lo = x.load(m, col).to(kd.f32)
    hi = x.load(m, col + 1).to(kd.f32)
    amax = kd.maximum(kd.max(kd.abs(lo), axis=j), kd.max(kd.abs(hi), axis=j))
    bits = amax.bitcast(kd.i32)
    if rule == "even":
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


@kd.kernel(example={"M": 1, "K": KIMI["H"], "ONE": 1})
def quant_fp8_static_bf16(x: kd.In["M", "K", kd.bf16], x_scale: kd.In["ONE", kd.f32], q: kd.Out["M", "K", kd.bf16]):
    """The e4m3fn values of `quant_fp8_static`, widened to bf16 (exact): the fp8 activations of the
    W4A8 scheme on targets whose native fp8 is not OCP (gfx942), fed to the bf16 x e2m1 kernels."""
    m, k = kd.grid(kd.each("M"), kd.tile("K", "BLOCK_K", domain=(256, 512, 1024), default=512))
    y = kd.minimum(kd.maximum(x[m, k].to(kd.f32) / x_scale[0], -FP8_MAX), FP8_MAX)
    q[m, k] = y.to(kd.fp8e4m3fn).to(kd.f32)


# ----------------------------------------------------------------------------------------------
# torch-facing ops

ACTS = ("mxfp4", "fp8", "bf16")


def mx_path(target: kd.Target | None = None) -> str:
    """"native": the MX operands go to `tl.dot_scaled` as they are (gfx950's scaled MFMA, the
    interpreter's exact emulation, NVIDIA's upcast); "upcast": the arch has no OCP fp8 (gfx942), so
    fp8 activations are widened to bf16 (exact) for the bf16 x e2m1 kernels; e2m1 x e2m1 still runs
    through `tl.dot_scaled`, which Triton lowers to bf16 MFMA there."""
    t = target or kd.current_target()
    return "upcast" if t.name.startswith("gfx94") else "native"


def _check_mx(name: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if t.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 ({what}), got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {what} of shape {list(shape)}, got {tuple(t.shape)}")


def _check_x(op: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] % GROUP:
        raise ValueError(f"{op}: x must be bf16 [M, K] with K a multiple of {GROUP}, got {x.dtype} {tuple(x.shape)}")


def quantize_mxfp4(x: torch.Tensor, backend: str = "triton", config: dict | None = None,
                   rule: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [M, K] -> (packed uint8 [M, K/2], E8M0 scales uint8 [M, K/32]), dynamic per 32."""
    _check_x("quantize_mxfp4", x)
    _check_backend(backend)
    if rule not in SCALE_RULES:
        raise ValueError(f"quantize_mxfp4: rule must be one of {SCALE_RULES}, got {rule!r}")
    if backend == "torch":
        return quant_mxfp4_ref(x, rule)
    M, K = x.shape
    q = torch.empty(M, K // 2, dtype=torch.uint8, device=x.device)
    s = torch.empty(M, K // GROUP, dtype=torch.uint8, device=x.device)
    cfg = dict(config_for(quant_mxfp4, {"K": K}, M, config))
    cfg["SCALE_RULE"] = rule
    quant_mxfp4(x.contiguous(), q, s, config=cfg)
    return q, s


def _quant_fp8(x: torch.Tensor, scale: torch.Tensor, path: str) -> torch.Tensor:
    """Static per-tensor fp8 activations: e4m3fn ("native") or their values as bf16 ("upcast")."""
    M, K = x.shape
    if path == "native":
        q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
        quant_fp8_static(x, scale, q, config=config_for(quant_fp8_static, {"K": K}, M, None))
    else:
        q = torch.empty(M, K, dtype=torch.bfloat16, device=x.device)
        quant_fp8_static_bf16(x, scale, q, config=config_for(quant_fp8_static_bf16, {"K": K}, M, None))
    return q


def gemm_mxfp4_w4a4(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, backend: str = "triton",
                    config: dict | None = None) -> torch.Tensor:
    """y = MXFP4(x) @ W^T -> bf16 [M, N]: x bf16 [M, K] quantized per 32 (Quark rule), W MXFP4."""
    _check_x("gemm_mxfp4_w4a4", x)
    M, K = x.shape
    N = w.shape[0]
    _check_mx("gemm_mxfp4_w4a4: w", w, (N, K // 2), "packed fp4")
    _check_mx("gemm_mxfp4_w4a4: w_scale", w_scale, (N, K // GROUP), "E8M0 per 32")
    xq, xs = quantize_mxfp4(x, backend)
    if backend == "torch":
        return gemm_mxfp4_ref(xq, xs, w, w_scale).to(torch.bfloat16)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    gemm_mxfp4(xq, xs, w, w_scale, out, config=config_for(gemm_mxfp4, {"N": N, "K": K}, M, config))
    return out


@dataclass
class MXFP4Weights:
    """Routed experts in MXFP4 (the fused-MoE layout of ops.moe with fp4 bytes and E8M0 scales):
    w13 uint8 [E, 2I, H/2] (gate rows then up rows), s13 uint8 [E, 2I, H/32]; w2 uint8 [E, H, I/2],
    s2 uint8 [E, H, I/32]. act: "mxfp4" (W4A4, dynamic per 32), "fp8" (W4A8: static per-tensor
    scales a13_scale / a2_scale, f32 [1]) or "bf16" (no activation quantization)."""
    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    act: str = "mxfp4"
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None
    act_rule: str = "even"  # the E8M0 rule of the dynamic activation quantization (SCALE_RULES)
    fmt: str = field(default="mxfp4", init=False)

    def dims(self) -> tuple[int, int, int]:
        """(E, H, I) from the tensors, validating every shape and dtype."""
        if self.act not in ACTS:
            raise ValueError(f"MXFP4Weights: act must be one of {ACTS}, got {self.act!r}")
        if self.act_rule not in SCALE_RULES:
            raise ValueError(f"MXFP4Weights: act_rule must be one of {SCALE_RULES}, got {self.act_rule!r}")
        if self.w13.dim() != 3 or self.w2.dim() != 3:
            raise ValueError(f"MXFP4Weights: w13 and w2 must be 3-D, got {tuple(self.w13.shape)} and {tuple(self.w2.shape)}")
        E, N2, H2 = self.w13.shape
        if N2 % 2:
            raise ValueError(f"MXFP4Weights: w13 rows must be 2*I (gate then up), got {N2}")
        I, H = N2 // 2, H2 * 2
        for name, kk in (("hidden size H", H), ("intermediate size I", I)):
            if kk % GROUP:
                raise ValueError(f"MXFP4Weights: {name}={kk} must be a multiple of {GROUP}")
        _check_mx("MXFP4Weights.w13", self.w13, (E, N2, H // 2), "packed fp4")
        _check_mx("MXFP4Weights.s13", self.s13, (E, N2, H // GROUP), "E8M0 per 32")
        _check_mx("MXFP4Weights.w2", self.w2, (E, H, I // 2), "packed fp4")
        _check_mx("MXFP4Weights.s2", self.s2, (E, H, I // GROUP), "E8M0 per 32")
        if self.act == "fp8":
            for name, t in (("a13_scale", self.a13_scale), ("a2_scale", self.a2_scale)):
                if t is None or t.numel() != 1 or t.dtype != torch.float32:
                    raise ValueError(f"MXFP4Weights(act=fp8): {name} must be an f32 tensor of one element")
        return E, H, I

    def dequant(self, which: str) -> torch.Tensor:
        """Exact f32 experts [E, N, K] ("13" or "2")."""
        return dequant_mxfp4_ref(self.w13, self.s13) if which == "13" else dequant_mxfp4_ref(self.w2, self.s2)


def _act_ref(h: torch.Tensor, act: str, scale: torch.Tensor | None, rule: str = "even"
             ) -> tuple[torch.Tensor, float | torch.Tensor]:
    """The activation values the dot sees (f32) and the factor applied after it."""
    if act == "mxfp4":
        q, s = quant_mxfp4_ref(h, rule)
        return dequant_mxfp4_ref(q, s), 1.0
    if act == "fp8":
        return quant_fp8_static_ref(h, scale).float(), scale.float().reshape(())
    return h.float(), 1.0


def experts_ref(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w: MXFP4Weights) -> torch.Tensor:
    """Torch reference of the MXFP4 routed experts (same quantizations and roundings as the
    kernels; dots in f64): f32 [M, H]."""
    E, H, I = w.dims()
    M = ids.shape[0]
    out = torch.zeros(M, H, dtype=torch.float64, device=x.device)
    w13, w2 = w.dequant("13"), w.dequant("2")
    a, fa = _act_ref(x.to(torch.bfloat16), w.act, w.a13_scale, w.act_rule)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = (a[tok].double() @ w13[e].double().t()).float()
        h = (torch.nn.functional.silu(gu[:, :I] * fa) * (gu[:, I:] * fa)).to(torch.bfloat16)
        a2, f2 = _act_ref(h, w.act, w.a2_scale, w.act_rule)
        y = (a2.double() @ w2[e].double().t()).float() * f2
        out.index_add_(0, tok, (y * wts[tok, slot][:, None]).double())
    return out.float()


STAGE1 = {"mxfp4": moe_stage1_mxfp4, "fp8": moe_stage1_mxfp4_fp8, "bf16": moe_stage1_mxfp4_bf16a}
STAGE2 = {"mxfp4": moe_stage2_mxfp4, "fp8": moe_stage2_mxfp4_fp8, "bf16": moe_stage2_mxfp4_bf16a}


def stage_kernels(act: str, path: str = "native") -> tuple[kd.Kernel, kd.Kernel]:
    """The (stage 1, stage 2) kernels an activation scheme runs on a path (`mx_path`)."""
    if act == "fp8" and path == "upcast":
        return STAGE1["bf16"], STAGE2["bf16"]
    return STAGE1[act], STAGE2[act]


def fused_experts(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w: MXFP4Weights,
                  backend: str = "triton", config: dict | None = None, check_ids: bool = True) -> torch.Tensor:
    """MXFP4 routed-expert output f32 [M, H] = sum_k wts[m,k] * expert_{ids[m,k]}(x[m]) (the
    interface of ops.moe.fused_experts). config: "stage1"/"stage2" kernel configs (BLOCK_M of
    stage 1 is used by both) and "path" ("native" | "upcast", default `mx_path()`)."""
    _check_backend(backend)
    E, H, I = w.dims()
    M = x.shape[0]
    if x.dim() != 2 or x.shape[1] != H:
        raise ValueError(f"fused_experts(mxfp4): hidden must be [M, H={H}], got {tuple(x.shape)}")
    if ids.shape != wts.shape or ids.dim() != 2 or ids.shape[0] != M:
        raise ValueError(f"fused_experts(mxfp4): ids and weights must both be [M={M}, top_k], "
                         f"got {tuple(ids.shape)} and {tuple(wts.shape)}")
    top_k = ids.shape[1]
    if top_k > E:
        raise ValueError(f"fused_experts(mxfp4): top_k={top_k} exceeds the number of experts {E}")
    if check_ids and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
        raise ValueError(f"fused_experts(mxfp4): expert ids out of range [0, {E}): got [{int(ids.min())}, {int(ids.max())}]")
    if backend == "torch":
        return experts_ref(x, ids, wts, w)
    path = (config or {}).get("path") or mx_path()
    if path not in ("native", "upcast"):
        raise ValueError(f"fused_experts(mxfp4): config path must be 'native' or 'upcast', got {path!r}")
    k1, k2 = stage_kernels(w.act, path)
    prob = {"E": E, "K": H, "H": H, "I": I, "TOPK": top_k}
    c1 = dict((config or {}).get("stage1") or config_for(k1, prob, M, None))
    c2 = dict((config or {}).get("stage2") or config_for(k2, prob, M, None))
    c1["BLOCK_M"] = c2["BLOCK_M"] = c1.get("BLOCK_M", 16)  # both stages walk the same aligned blocks
    sorted_ids, bexp = moe_align(ids, E, c1["BLOCK_M"], check=False)
    S, T = sorted_ids.numel(), M * top_k
    inter = torch.zeros(S, I, dtype=torch.bfloat16, device=x.device)  # padding rows stay finite
    xb = x.to(torch.bfloat16).contiguous()
    one = torch.ones(1, dtype=torch.float32, device=x.device)
    if w.act == "mxfp4":
        xq, xs = quantize_mxfp4(xb, rule=w.act_rule)
        k1(xq, xs, w.w13, w.s13, sorted_ids, bexp, inter, top_k, config=c1)
        a2 = quantize_mxfp4(inter, rule=w.act_rule)
    elif w.act == "fp8":
        k1(_quant_fp8(xb, w.a13_scale, path), w.a13_scale, w.w13, w.s13, sorted_ids, bexp, inter, top_k, config=c1)
        a2 = (_quant_fp8(inter, w.a2_scale, path), w.a2_scale)
    else:
        k1(xb, one, w.w13, w.s13, sorted_ids, bexp, inter, top_k, config=c1)
        a2 = (inter, one)
    atomic = c2.get("REDUCE", "atomic") == "atomic"
    out = torch.zeros(M if atomic else 0, H, dtype=torch.float32, device=x.device)
    part = torch.empty(0 if atomic else T, H, dtype=torch.float32, device=x.device)
    k2(*a2, w.w2, w.s2, sorted_ids, bexp, wts.reshape(-1).float().contiguous(), out, part, top_k, config=c2)
    if atomic:
        return out
    res = torch.empty(M, H, dtype=torch.float32, device=x.device)
    moe_sum(part, res, top_k)
    return res


def fused_moe(hidden: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, experts: MXFP4Weights,
              shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              cfg: MoEConfig | None = None, backend: str = "triton", config: dict | None = None) -> torch.Tensor:
    """One MoE layer with MXFP4 experts: bf16 [M, H] -> bf16 [M, H] (routing and the shared expert
    as in ops.moe.fused_moe; the router weight is bf16, an MXFP4 router dequantized exactly)."""
    cfg = cfg or MoEConfig()
    _check_backend(backend)
    E, H, I = experts.dims()
    if hidden.dim() != 2 or hidden.shape[1] != H:
        raise ValueError(f"fused_moe(mxfp4): hidden must be [M, H={H}], got {tuple(hidden.shape)}")
    if tuple(router_w.shape) != (E, H):
        raise ValueError(f"fused_moe(mxfp4): router weight must be [E={E}, H={H}], got {tuple(router_w.shape)}")
    ids, wts = route(hidden, router_w, bias, cfg.top_k, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                     cfg.routed_scaling_factor, backend=backend, config=config)
    y = fused_experts(hidden, ids, wts, experts, backend=backend, config=config, check_ids=False)
    s = shared_expert_ref(hidden, shared)
    return (y if s is None else y + s).to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# model-layer glue: one entry point for every expert format

def experts_weights(stacked: dict):
    """`models.loader.stack_experts(...)` output -> the weight object the fused-MoE ops take:
    MXFP4Weights for fmt "mxfp4", else ops.moe.MoEWeights."""
    from ops.moe import MoEWeights

    d = dict(stacked)
    if d.get("fmt") == "mxfp4":
        d.pop("fmt")
        return MXFP4Weights(**d)
    return MoEWeights(**d)


def fused_experts_any(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w, backend: str = "triton",
                      config: dict | None = None, check_ids: bool = True) -> torch.Tensor:
    """ops.moe.fused_experts for MoEWeights, this module's for MXFP4Weights (same signature)."""
    if isinstance(w, MXFP4Weights):
        return fused_experts(x, ids, wts, w, backend=backend, config=config, check_ids=check_ids)
    from ops.moe import fused_experts as moe_fused_experts

    return moe_fused_experts(x, ids, wts, w, backend=backend, config=config, check_ids=check_ids)


@kd.kernel(example={"N": 4096, "K": KIMI["H"], "KG": KIMI["H"] // GROUP}, checks=GEMM_CHECKS)
def dequant_mxfp4(w: kd.In["N", "K", kd.fp4_e2m1], ws: kd.In["N", "KG", kd.e8m0], out: kd.Out["N", "K", kd.f32]):
    """MXFP4 -> f32 (exact; E8M0 0xFF gives NaN): the dequantizing path's decode, and the check
    that the kernels decode every code and every scale as the OCP reference does."""
    n, k = kd.grid(kd.tile("N", "BLOCK_N", domain=(16, 32, 64), default=16),
                   kd.tile("K", "BLOCK_K", domain=(64, 128, 256), default=128))
    out[n, k] = kd.mx_decode(w[n, k], ws[n, kd.mx_groups(k, kd.dim("KG"))])


KERNELS = KERNELS + (quant_fp8_static_bf16, dequant_mxfp4)
