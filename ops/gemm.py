"""The GEMM family: y[M, N] = x[M, K] @ w[N, K]^T for every weight format Kimi-K2.5 ships.

Weights are [N, K], K-contiguous (the checkpoint layout). Kernels:
- gemm_bf16        bf16 x bf16, f32 accumulate                                   -> bf16
- gemm_fp8         fp8 act (per-token scale) x fp8 weight (per-channel), f32 acc  -> bf16
- gemm_w8a8        int8 act (per-token) x int8 weight (per-channel), i32 acc      -> bf16
- gemm_w4a8        int8 act (per-token) x int4 Quark *reorder* weight (per-channel), i32 acc (Kimi W4A8)
- gemm_w4a8_order  the same with Quark sequential ("order") packing
- gemm_w4a8_i32acc the W4A8 main loop storing the raw i32 accumulator (tests it exactly)
- gemm_bf16_silu_mul  bf16 gate|up GEMM over stacked [2I, K] weights, SiLU(gate)*up epilogue -> bf16 [M, I]
- gemm_bf16_rmsnorm   bf16 GEMM over RMSNorm(x) * norm weight, the norm in a prologue (MLA's q_b over raw q_a rows)
- gemm_w4a16       bf16 act x int4 compressed-tensors weight, bf16 group-32 scales [N, K/32]
The int paths accumulate exactly in int32 and apply `acc * x_scale[m] * w_scale[n]` in f32 once.

Tile sizes are tunables: BLOCK_M in (1, 2, 4) takes the VALU multiply-and-sum dot (decode rows),
16+ the matrix cores (MFMA / wgmma); the tuner picks per M bucket. The kernel default is
BLOCK_M=16 so the reports show the matrix path.
"""
from __future__ import annotations

from typing import Any

import torch

import kdsl as kd
from autotune import lookup_config
from ops import quant as Q
from ops._common import check_tensor, invariant_config
from ops.packing import unpack_int4

GROUP = 32  # compressed-tensors int4 group along K
BM_DOMAIN = (1, 2, 4, 16, 32, 64, 128)
BN_DOMAIN = (16, 32, 64, 128, 256)
BK_DOMAIN = (32, 64, 128, 256)
EXAMPLE = {"M": 1, "N": 4096, "K": 7168}


def _tiles() -> tuple[Any, Any]:
    return kd.grid(kd.tile("M", "BLOCK_M", domain=BM_DOMAIN, default=16),
                   kd.tile("N", "BLOCK_N", domain=BN_DOMAIN, default=64))


def _k(default: int = 128) -> kd.tiles:
    return kd.tiles("K", block="BLOCK_K", domain=BK_DOMAIN, default=default)


def _unpack(default: str = "bfe") -> str:
    """How packed int4 weights are unpacked (a kdsl lowering choice, tuned like a tile size).

    Measured on the gfx942 ISA at the Kimi shape (M=1, N=4096, K=7168): with the MFMA tile
    (16, 64, 128) "bfe" cuts main-loop LDS ops 61 -> 13 and VGPRs 90 -> 56 (gfx950: 50 -> 12,
    sm90: 136 -> 14); with the VALU decode tile (1, 16, 256) "shift" is slightly leaner
    (67 vs 70 VALU, 20 vs 29 LDS ops). W4A16 keeps "shift" (bfe adds spills at BLOCK_K=128)."""
    return kd.tunable("INT4_UNPACK", ("shift", "bfe"), default)


def _int_acc(x, w, m, n):
    if w.is_int4:
        how = _unpack()
        return kd.fold(_k(), kd.zeros((m, n), kd.i32),
                       lambda k, acc: acc + kd.dot(x[m, k], w.load(n, k, unpack=how)))
    return kd.fold(_k(), kd.zeros((m, n), kd.i32), lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))


@kd.kernel(name="gemm_bf16", example=EXAMPLE)
def gemm_bf16_kernel(x: kd.In["M", "K", kd.bf16], w: kd.In["N", "K", kd.bf16], out: kd.Out["M", "N", kd.bf16]):
    """bf16 GEMM with an f32 accumulator."""
    m, n = _tiles()
    acc = kd.fold(_k(64), kd.zeros((m, n), kd.f32), lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))
    out[m, n] = acc


@kd.kernel(name="gemm_fp8", example=EXAMPLE)
def gemm_fp8_kernel(x: kd.In["M", "K", kd.fp8], xs: kd.In["M", kd.f32], w: kd.In["N", "K", kd.fp8],
             ws: kd.In["N", kd.f32], out: kd.Out["M", "N", kd.bf16]):
    """Arch-native fp8 (PTPC): per-token activation scale x per-channel weight scale."""
    m, n = _tiles()
    acc = kd.fold(_k(), kd.zeros((m, n), kd.f32), lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))
    out[m, n] = acc * xs[m] * ws[n]


@kd.kernel(name="gemm_w8a8", example=EXAMPLE)
def gemm_w8a8_kernel(x: kd.In["M", "K", kd.i8], xs: kd.In["M", kd.f32], w: kd.In["N", "K", kd.i8],
              ws: kd.In["N", kd.f32], out: kd.Out["M", "N", kd.bf16]):
    """int8 x int8, exact i32 accumulator, per-token x per-channel scales."""
    m, n = _tiles()
    out[m, n] = _int_acc(x, w, m, n) * xs[m] * ws[n]


@kd.kernel(name="gemm_w4a8", example=EXAMPLE)
def gemm_w4a8_kernel(x: kd.In["M", "K", kd.i8], xs: kd.In["M", kd.f32], w: kd.In["N", "K", kd.int4("quark_reorder")],
              ws: kd.In["N", kd.f32], out: kd.Out["M", "N", kd.bf16]):
    """int8 activations x Quark reorder-packed int4 weights (the amd/Kimi-K2.5-W4A8 layout)."""
    m, n = _tiles()
    out[m, n] = _int_acc(x, w, m, n) * xs[m] * ws[n]


@kd.kernel(name="gemm_w4a8_order", example=EXAMPLE)
def gemm_w4a8_order_kernel(x: kd.In["M", "K", kd.i8], xs: kd.In["M", kd.f32], w: kd.In["N", "K", kd.int4("quark_order")],
                    ws: kd.In["N", kd.f32], out: kd.Out["M", "N", kd.bf16]):
    """int8 activations x Quark sequentially packed int4 weights."""
    m, n = _tiles()
    out[m, n] = _int_acc(x, w, m, n) * xs[m] * ws[n]


@kd.kernel(name="gemm_w4a8_i32acc", example=EXAMPLE)
def gemm_w4a8_i32acc_kernel(x: kd.In["M", "K", kd.i8], w: kd.In["N", "K", kd.int4("quark_reorder")],
                     acc_out: kd.Out["M", "N", kd.i32]):
    """The W4A8 main loop with the raw i32 accumulator stored (lets tests check it exactly)."""
    m, n = _tiles()
    acc_out[m, n] = _int_acc(x, w, m, n)


def _w4a16_block_k_rule() -> None:
    bk = kd.tunable("BLOCK_K", (16, *BK_DOMAIN), 64)  # 16 is a legal tile elsewhere, not here
    kd.require(bk % GROUP == 0, f"BLOCK_K must be a multiple of the quant group {GROUP}", "BLOCK_K")


@kd.kernel(name="gemm_w4a16", example={**EXAMPLE, "G": EXAMPLE["K"] // GROUP},
           checks=[("K", lambda d: d["K"] % GROUP == 0, f"K must be a multiple of the quant group {GROUP}"),
                   ("G", lambda d: d["G"] * GROUP == d["K"], f"w_scale must be [N, K/{GROUP}]")])
def gemm_w4a16_kernel(x: kd.In["M", "K", kd.bf16], w: kd.In["N", "K", kd.int4("ct")],
               wsc: kd.In["N", "G", kd.bf16], out: kd.Out["M", "N", kd.bf16]):
    """bf16 activations x compressed-tensors int4 (group 32, bf16 scales): dequantize to bf16 in
    registers, then a bf16 dot with an f32 accumulator."""
    _w4a16_block_k_rule()
    m, n = _tiles()
    how = _unpack("shift")

    def body(k, acc):
        wd = (w.load(n, k, unpack=how).to(kd.f32) * wsc[n, k // GROUP].to(kd.f32)).to(kd.bf16)
        return acc + kd.dot(x[m, k], wd)

    out[m, n] = kd.fold(_k(64), kd.zeros((m, n), kd.f32), body)


@kd.kernel(name="gemm_bf16_silu_mul", example={"M": 1, "N2": 4096, "I": 2048, "K": 7168},
           checks=[("N2", lambda d: d["N2"] == 2 * d["I"], "w13 must be [2*I, K] (gate rows then up rows)")])
def gemm_bf16_silu_mul_kernel(x: kd.In["M", "K", kd.bf16], w13: kd.In["N2", "K", kd.bf16],
                              out: kd.Out["M", "I", kd.bf16]):
    """The MLP's gate|up GEMM with SiLU(gate)*up in the epilogue: one launch instead of gemm_bf16
    over [2I, K] plus silu_mul, and the [M, 2I] product never leaves registers. Gate and up are
    rounded to bf16 before the epilogue, as the two-launch path stores them, so both paths agree
    bit for bit at the same tile config. W_ROWS 1 puts the weight rows on the dot's M side."""
    # BLOCK_N 8: each program streams 2 x BLOCK_N weight rows, so at decode sizes (grids below one
    # program per CU) an 8-wide tile gives the same rows per program as gemm_bf16 at 16
    m, n = kd.grid(kd.tile("M", "BLOCK_M", domain=BM_DOMAIN, default=16),
                   kd.tile("I", "BLOCK_N", domain=(8, *BN_DOMAIN), default=64))
    I = kd.dim("I")
    wr = kd.tunable("W_ROWS", (0, 1), 0, "1: acc(n, m) = dot(w, x), warps split N; 0: acc(m, n) = dot(x, w)")

    def dot(a, b):
        return kd.dot(b, a) if wr else kd.dot(a, b)

    def body(k, ag, au):
        a = x[m, k]
        return ag + dot(a, w13[n, k]), au + dot(a, w13[n + I, k])

    z = kd.zeros((n, m) if wr else (m, n), kd.f32)
    ag, au = kd.fold(_k(64), (z, z), body)
    out[m, n] = kd.silu(ag.to(kd.bf16).to(kd.f32)) * au.to(kd.bf16).to(kd.f32)


NORM_K_DOMAIN = (64, 128, 256, 512, 1024, 2048, 4096)


@kd.kernel(name="gemm_bf16_rmsnorm", example={"M": 1, "N": 12288, "K": 1536})
def gemm_bf16_rmsnorm_kernel(x: kd.In["M", "K", kd.bf16], xw: kd.In["K", kd.bf16], w: kd.In["N", "K", kd.bf16],
                             out: kd.Out["M", "N", kd.bf16], eps: kd.Scalar[kd.f32]):
    """out = bf16(rmsnorm(x) * xw) @ w^T: the norm in a prologue, so the normed rows never leave the
    program (MLA's q_b GEMM reads the raw q_a rows of the q_a|kv_a output in place). Each program
    sums its rows' squares over K in f32 (NORM_K-wide tiles: at NORM_K >= K one reduction, the
    order of ops.mla_fused.mla_prep_qkv), then scales each A tile by rstd * xw and rounds it to bf16
    before the dot, the expressions and rounding of that kernel's q_c."""
    m, n = _tiles()
    nk = kd.tiles("K", block="NORM_K", domain=NORM_K_DOMAIN, default=256, label="kn")

    def squares(k, s):
        v = x[m, k].to(kd.f32)
        return s + kd.sum(v * v, axis=k)

    ss = kd.fold(nk, kd.zeros((m,), kd.f32), squares)
    rstd = kd.rsqrt(ss / kd.dim("K") + eps)

    def body(k, acc):
        a = (x[m, k].to(kd.f32) * rstd * xw[k].to(kd.f32)).to(kd.bf16)
        return acc + kd.dot(a, w[n, k])

    out[m, n] = kd.fold(_k(64), kd.zeros((m, n), kd.f32), body)


KERNELS = (gemm_bf16_kernel, gemm_fp8_kernel, gemm_w8a8_kernel, gemm_w4a8_kernel, gemm_w4a8_order_kernel,
           gemm_w4a8_i32acc_kernel, gemm_w4a16_kernel, gemm_bf16_silu_mul_kernel, gemm_bf16_rmsnorm_kernel)
W4A8_KERNELS = {"quark_reorder": gemm_w4a8_kernel, "quark_order": gemm_w4a8_order_kernel}


# ----------------------------------------------------------------------------------------------
# torch references (float64: the int paths are exact there, floats have one rounding at the end)

def gemm_bf16_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).to(torch.bfloat16)


def gemm_scaled_ref(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """acc[m, n] = sum_k xq wq (exact in float64 for int8/int4/fp8 operands) * xs[m] * ws[n] -> bf16."""
    acc = xq.double() @ wq.double().T
    return (acc * xs.double()[:, None] * ws.double()[None, :]).to(torch.bfloat16)


def gemm_w4a8_ref(xq: torch.Tensor, xs: torch.Tensor, w_packed: torch.Tensor, ws: torch.Tensor,
                  pack: str = "quark_reorder") -> torch.Tensor:
    return gemm_scaled_ref(xq, xs, unpack_int4(w_packed, pack), ws)


def dequant_w4a16_ref(w_packed: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The bf16 weight the W4A16 kernel multiplies: bf16(q * scale[n, k // 32])."""
    q = unpack_int4(w_packed, "ct").float()
    return (q * w_scale.float().repeat_interleave(GROUP, dim=-1)).to(torch.bfloat16)


def gemm_w4a16_ref(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    return gemm_bf16_ref(x, dequant_w4a16_ref(w_packed, w_scale))


# ----------------------------------------------------------------------------------------------
# torch-facing functions

def _backend(name: str, backend: str) -> None:
    if backend not in ("triton", "torch"):
        raise ValueError(f"{name}: backend must be 'triton' or 'torch', got {backend!r}")


def _dims(name: str, x: torch.Tensor, w: torch.Tensor, k_per_w: int = 1) -> tuple[int, int, int]:
    """Shapes, devices and layout of x [M, K] and w [N, K/k_per_w] (no data read)."""
    check_tensor(name, "x", x, 2, last_contiguous=True)
    check_tensor(name, "w", w, 2, device=x.device, last_contiguous=True)
    M, K = x.shape
    N, Kw = w.shape
    if Kw * k_per_w != K:
        raise ValueError(f"{name}: K mismatch: x is [M={M}, K={K}] but w is {tuple(w.shape)}"
                         + (f" (packed, {k_per_w} per word)" if k_per_w > 1 else ""))
    if N < 1 or K < 1:
        raise ValueError(f"{name}: N and K must be positive, got x {tuple(x.shape)}, w {tuple(w.shape)}")
    return M, N, K


def _scales(name: str, xs: torch.Tensor, ws: torch.Tensor, M: int, N: int, device: torch.device) -> None:
    check_tensor(name, "x_scale", xs, 1, (torch.float32,), device, contiguous=True)
    check_tensor(name, "w_scale", ws, 1, (torch.float32,), device, contiguous=True)
    if xs.shape[0] != M or ws.shape[0] != N:
        raise ValueError(f"{name}: scales must be x_scale [M={M}] and w_scale [N={N}], got "
                         f"{tuple(xs.shape)} and {tuple(ws.shape)}")


def _run(kernel: kd.Kernel, args: tuple, M: int, N: int, K: int, config: dict | None, device,
         invariant: bool = True) -> torch.Tensor:
    """Launch with the tuned config of this M (or, `invariant` with a float accumulator (bf16, fp8,
    W4A16), the M=1 tiles for every M: a row's result then does not depend on the batch; the
    integer kernels are exact at any tile and keep their per-bucket configs). M=0 launches nothing."""
    if invariant:
        config = invariant_config(kernel, {"N": N, "K": K}, M, config)
    elif config is None:
        config = lookup_config(kernel, kd.current_target().name, {"N": N, "K": K}, max(M, 1))
    out = torch.empty(M, N, dtype=torch.bfloat16, device=device)
    if M:
        kernel(*args, out, config=config)
    return out


def gemm_bf16(x: torch.Tensor, w: torch.Tensor, backend: str = "triton", config: dict | None = None,
              invariant: bool = True) -> torch.Tensor:
    """bf16 x [M, K] @ w [N, K]^T -> bf16 [M, N] (f32 accumulate). `invariant` (default): the same
    tiles at every M, so a row does not depend on the batch."""
    _backend("gemm_bf16", backend)
    M, N, K = _dims("gemm_bf16", x, w)
    check_tensor("gemm_bf16", "x", x, 2, (torch.bfloat16,))
    check_tensor("gemm_bf16", "w", w, 2, (torch.bfloat16,))
    if backend == "torch":
        return (x.float() @ w.float().T).to(torch.bfloat16)
    return _run(gemm_bf16_kernel, (x, w), M, N, K, config, x.device, invariant)


def gemm_scaled(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, backend: str = "triton",
                config: dict | None = None, invariant: bool = True) -> torch.Tensor:
    """Pre-quantized int8 x int8 or fp8 x fp8 GEMM with per-token xs [M] and per-channel ws [N] scales."""
    name = "gemm_w8a8" if xq.dtype == torch.int8 else "gemm_fp8"
    _backend(name, backend)
    M, N, K = _dims(name, xq, w)
    if xq.dtype != w.dtype:
        raise TypeError(f"{name}: x and w must have one dtype, got {xq.dtype} and {w.dtype}")
    _scales(name, xs, ws, M, N, xq.device)
    if backend == "torch":
        return gemm_scaled_ref(xq, xs, w, ws)
    return _run(gemm_w8a8_kernel if xq.dtype == torch.int8 else gemm_fp8_kernel, (xq, xs, w, ws), M, N, K, config,
                xq.device, invariant)


def gemm_w4a8(xq: torch.Tensor, xs: torch.Tensor, w_packed: torch.Tensor, ws: torch.Tensor,
               pack: str = "quark_reorder", backend: str = "triton", config: dict | None = None,
               invariant: bool = True) -> torch.Tensor:
    """int8 x [M, K] (per-token xs) @ int4 w [N, K/8 int32] (per-channel ws) -> bf16 [M, N]."""
    _backend("gemm_w4a8", backend)
    if pack not in W4A8_KERNELS:
        raise ValueError(f"gemm_w4a8: pack must be one of {sorted(W4A8_KERNELS)}, got {pack!r}")
    M, N, K = _dims("gemm_w4a8", xq, w_packed, 8)
    check_tensor("gemm_w4a8", "x", xq, 2, (torch.int8,))
    check_tensor("gemm_w4a8", "w", w_packed, 2, (torch.int32,))
    _scales("gemm_w4a8", xs, ws, M, N, xq.device)
    if backend == "torch":
        return gemm_w4a8_ref(xq, xs, w_packed, ws, pack)
    return _run(W4A8_KERNELS[pack], (xq, xs, w_packed, ws), M, N, K, config, xq.device, invariant)


def linear_w4a8(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, pack: str = "quark_reorder",
                backend: str = "triton", config: dict | None = None, invariant: bool = True) -> torch.Tensor:
    """bf16 x [M, K] -> per-token int8 quantization -> W4A8 GEMM -> bf16 [M, N] (the Kimi W4A8 linear).
    `w_scale` [N] f32 is the per-channel scale (fold a per-tensor scale into it)."""
    xq, xs = Q.quantize_int8(x, backend=backend)
    return gemm_w4a8(xq, xs, w_packed, w_scale.float(), pack, backend, config, invariant)


def linear_w8a8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, backend: str = "triton",
                config: dict | None = None, invariant: bool = True) -> torch.Tensor:
    """bf16 x -> per-token int8 -> int8 x int8 GEMM with per-channel w_scale -> bf16."""
    xq, xs = Q.quantize_int8(x, backend=backend)
    return gemm_scaled(xq, xs, w, w_scale.float(), backend, config, invariant)


def linear_fp8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, backend: str = "triton",
               config: dict | None = None, invariant: bool = True) -> torch.Tensor:
    """bf16 x -> per-token fp8 (native flavour) -> fp8 GEMM with per-channel w_scale -> bf16.
    `w` must already be in the native flavour (gfx942: e4m3fnuz, scale doubled; see REFERENCE §3)."""
    xq, xs = Q.quantize_fp8(x, backend=backend)
    if xq.dtype != w.dtype:
        raise TypeError(f"linear_fp8: weight is {w.dtype} but this target computes in {xq.dtype}: convert it first")
    return gemm_scaled(xq, xs, w, w_scale.float(), backend, config, invariant)


def gemm_w4a16(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, backend: str = "triton",
                config: dict | None = None, invariant: bool = True) -> torch.Tensor:
    """bf16 x [M, K] @ compressed-tensors int4 w [N, K/8 int32] with bf16 scales [N, K/32] -> bf16 [M, N]."""
    _backend("gemm_w4a16", backend)
    M, N, K = _dims("gemm_w4a16", x, w_packed, 8)
    check_tensor("gemm_w4a16", "x", x, 2, (torch.bfloat16,))
    check_tensor("gemm_w4a16", "w", w_packed, 2, (torch.int32,))
    check_tensor("gemm_w4a16", "w_scale", w_scale, 2, (torch.bfloat16,), x.device, last_contiguous=True)
    if K % GROUP:
        raise ValueError(f"gemm_w4a16: K={K} must be a multiple of the quant group {GROUP}")
    if tuple(w_scale.shape) != (N, K // GROUP):
        raise ValueError(f"gemm_w4a16: w_scale must be [N, K/{GROUP}] = {(N, K // GROUP)}, got {tuple(w_scale.shape)}")
    if backend == "torch":
        return (x.float() @ dequant_w4a16_ref(w_packed, w_scale).float().T).to(torch.bfloat16)
    return _run(gemm_w4a16_kernel, (x, w_packed, w_scale), M, N, K, config, x.device, invariant)


linear_w4a16 = gemm_w4a16


def gemm_w8a8(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, backend: str = "triton",
              config: dict | None = None, invariant: bool = True) -> torch.Tensor:
    """int8 xq [M, K] (per-token xs) @ int8 w [N, K] (per-channel ws) -> bf16 [M, N]."""
    if xq.dtype != torch.int8:
        raise TypeError(f"gemm_w8a8: x must be int8, got {xq.dtype}")
    return gemm_scaled(xq, xs, w, ws, backend, config, invariant)


def gemm_fp8(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, backend: str = "triton",
             config: dict | None = None, invariant: bool = True) -> torch.Tensor:
    """fp8 xq [M, K] (per-token xs) @ fp8 w [N, K] (per-channel ws) -> bf16 [M, N], native flavour."""
    if not xq.dtype.is_floating_point or xq.element_size() != 1:
        raise TypeError(f"gemm_fp8: x must be an fp8 tensor, got {xq.dtype}")
    return gemm_scaled(xq, xs, w, ws, backend, config, invariant)


def gemm_bf16_silu_mul_ref(x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    """silu(bf16(x @ gate^T)) * bf16(x @ up^T) in f32 -> bf16, gate = w13[:I], up = w13[I:]."""
    gu = gemm_bf16_ref(x, w13).float()
    g, u = gu.chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(torch.bfloat16)


def gemm_bf16_silu_mul(x: torch.Tensor, w13: torch.Tensor, backend: str = "triton",
                       config: dict | None = None, invariant: bool = True) -> torch.Tensor:
    """bf16 x [M, K], w13 [2I, K] (gate rows then up rows) -> silu(x gate^T) * (x up^T), bf16 [M, I],
    in one launch (tuned files are keyed by N2=2I and K). `invariant` (default): the M=1 tiles at
    every M, as `gemm_bf16`."""
    _backend("gemm_bf16_silu_mul", backend)
    M, N2, K = _dims("gemm_bf16_silu_mul", x, w13)
    check_tensor("gemm_bf16_silu_mul", "x", x, 2, (torch.bfloat16,))
    check_tensor("gemm_bf16_silu_mul", "w13", w13, 2, (torch.bfloat16,))
    if N2 % 2:
        raise ValueError(f"gemm_bf16_silu_mul: w13 rows must be 2*I (gate then up), got {N2}")
    if backend == "torch":
        return gemm_bf16_silu_mul_ref(x, w13)
    problem = {"N2": N2, "K": K}
    if invariant:
        config = invariant_config(gemm_bf16_silu_mul_kernel, problem, M, config)
    elif config is None:
        config = lookup_config(gemm_bf16_silu_mul_kernel, kd.current_target().name, problem, max(M, 1))
    out = torch.empty(M, N2 // 2, dtype=torch.bfloat16, device=x.device)
    if M:
        gemm_bf16_silu_mul_kernel(x, w13, out, config=config)
    return out


def gemm_bf16_rmsnorm_ref(x: torch.Tensor, x_norm_w: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """gemm_bf16_ref over rmsnorm_ref(x, x_norm_w) (the normed rows rounded to bf16 first)."""
    from ops.norm import rmsnorm_ref

    return gemm_bf16_ref(rmsnorm_ref(x, x_norm_w, eps), w)


def gemm_bf16_rmsnorm(x: torch.Tensor, x_norm_w: torch.Tensor, w: torch.Tensor, eps: float, backend: str = "triton",
                      config: dict | None = None, invariant: bool = True) -> torch.Tensor:
    """bf16(rmsnorm(x) * x_norm_w) [M, K] @ w [N, K]^T -> bf16 [M, N] in one launch: the norm of
    each row (f32, over all K) in the GEMM's prologue. x may be a strided view (any row stride, last
    dim contiguous), e.g. the q_a columns of the q_a|kv_a GEMM output. `invariant` (default): the
    M=1 tiles at every M, as `gemm_bf16`."""
    import math

    name = "gemm_bf16_rmsnorm"
    _backend(name, backend)
    M, N, K = _dims(name, x, w)
    check_tensor(name, "x", x, 2, (torch.bfloat16,))
    check_tensor(name, "w", w, 2, (torch.bfloat16,))
    check_tensor(name, "x_norm_w", x_norm_w, 1, (torch.bfloat16,), x.device, contiguous=True)
    if x_norm_w.shape[0] != K:
        raise ValueError(f"{name}: x_norm_w must be [K={K}], got {tuple(x_norm_w.shape)}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{name}: eps must be a finite number >= 0, got {eps!r}")
    if backend == "torch":
        return gemm_bf16_rmsnorm_ref(x, x_norm_w, w, eps)
    problem = {"N": N, "K": K}
    if invariant:
        config = invariant_config(gemm_bf16_rmsnorm_kernel, problem, M, config)
    elif config is None:
        config = lookup_config(gemm_bf16_rmsnorm_kernel, kd.current_target().name, problem, max(M, 1))
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if M:
        gemm_bf16_rmsnorm_kernel(x, x_norm_w, w, out, float(eps), config=config)
    return out
