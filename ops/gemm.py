"""The GEMM family: y[M, N] = x[M, K] @ w[N, K]^T for every weight format Kimi-K2.5 ships.

Weights are [N, K], K-contiguous (the checkpoint layout). Kernels:
- gemm_bf16        bf16 x bf16, f32 accumulate                                   -> bf16
- gemm_fp8         fp8 act (per-token scale) x fp8 weight (per-channel), f32 acc  -> bf16
- gemm_w8a8        int8 act (per-token) x int8 weight (per-channel), i32 acc      -> bf16
- gemm_w4a8        int8 act (per-token) x int4 Quark *reorder* weight (per-channel), i32 acc (Kimi W4A8)
- gemm_w4a8_order  the same with Quark sequential ("order") packing
- gemm_w4a8_i32acc the W4A8 main loop storing the raw i32 accumulator (tests it exactly)
- gemm_bf16_silu_mul  bf16 gate|up GEMM over stacked [2I, K] weights, SiLU(gate)*up epilogue -> bf16 [M, I]
- gemm_bf16_splitk    bf16 x bf16 split along K: f32 partial sums [S, M, N], no atomics (MLA's q_a|kv_a GEMM,
                      whose two consumers add the splits in order and round to bf16)
- gemm_bf16_rmsnorm   bf16 GEMM over RMSNorm(x) * norm weight, the norm in a prologue (MLA's q_b over raw q_a
                      rows), x given as split-K partials [S, M, K] f32 (S = 1: one plain f32 row); it
                      writes its own split-K partials [P, M, N] f32 (P = its SPLIT_K: q_b's small N at TP8)
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
    (67 vs 70 VALU, 20 vs 29 LDS ops). W4A16 keeps "shift" (bfe adds spills at BLOCK_K=128).
    "swar" unpacks four nibbles per word operation (kdsl `load(..., unpack="swar")`). Exact either way:
    the tuner tries each for every bucket's best tile (ProblemModel.launch_keys)."""
    return kd.tunable("INT4_UNPACK", ("shift", "bfe", "swar"), default)


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


SPLIT_K_DOMAIN = tuple(range(1, 9))
SPLIT_K_SEARCH = (1, 2, 4, 8)  # what the tuner tries; any count in the domain is a valid launch
SPLIT_K_DEFAULT = 4


@kd.kernel(name="gemm_bf16_splitk", example={"S": SPLIT_K_DEFAULT, "M": 1, "N": 2112, "K": 7168})
def gemm_bf16_splitk_kernel(x: kd.In["M", "K", kd.bf16], w: kd.In["N", "K", kd.bf16],
                            part: kd.Out["S", "M", "N", kd.f32]):
    """Split-K bf16 GEMM: part[s] = x[:, Ks] @ w[:, Ks]^T in f32 over the K range of split s,
    Ks = [s * KS, min(K, (s + 1) * KS)), KS = cdiv(cdiv(K, S), BLOCK_K) * BLOCK_K; no atomics, a
    consumer adds the S partials in split order. At decode sizes a GEMM with a small N (MLA's
    q_a|kv_a, N=2112) has too few (M, N) tiles to fill the CUs; S splits give S times the programs
    at the same tile. SPLIT_K is the op's split count (it allocates part [SPLIT_K, M, N]); the kernel
    splits by part's S dim, so any S is a correct decomposition."""
    kd.tunable("SPLIT_K", SPLIT_K_DOMAIN, SPLIT_K_DEFAULT, "splits along K (the S dim of part): more programs",
               search=SPLIT_K_SEARCH)
    m, n, s = kd.grid(kd.tile("M", "BLOCK_M", domain=BM_DOMAIN, default=16),
                      kd.tile("N", "BLOCK_N", domain=BN_DOMAIN, default=16), kd.each("S"))
    bk = kd.tunable("BLOCK_K", BK_DOMAIN, 64)
    K = kd.dim("K")
    ks = kd.cdiv(kd.cdiv(K, kd.dim("S")), bk) * bk
    k0 = s * ks
    k1 = kd.minimum(K, k0 + ks)
    span = kd.tiles(start=k0, stop=k1, block="BLOCK_K", domain=BK_DOMAIN, default=64, label="K")
    part[s, m, n] = kd.fold(span, kd.zeros((m, n), kd.f32), lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))


def splitk_rows(part, rows, cols, row_mask=None):
    """part[0] + part[1] + ... + part[S-1] at (rows, cols) in split order (f32), rounded to bf16 as
    a plain GEMM stores its output, returned in f32: what a consumer of gemm_bf16_splitk reads in
    place of the bf16 GEMM output (S = 1: that row itself). `row_mask`: loads only where it holds."""
    first = part.load(0, rows, cols, mask=row_mask)

    def add(s, acc):
        return acc + kd.sum(part.load(s, rows, cols, mask=row_mask), axis=s)

    total = kd.fold(kd.tiles(start=1, stop=kd.dim("S"), block=1, label="s"), first, add)
    return total.to(kd.bf16).to(kd.f32)


NORM_K_DOMAIN = (64, 128, 256, 512, 1024, 2048, 4096)
NORM_BM_DOMAIN = (1, 2, 4, 8, 16)  # one 16-row matrix dot per tile: BLOCK_M only launches
MMA_ROWS = 16  # the fewest rows of a matrix dot (MFMA / wgmma)


def _mma_rows(m, dim: str = "M"):
    """The matrix dot's 16-row tile for a grid tile `m` under 16 rows: the aligned 16 rows that hold
    `m` ([m16, m16 + 16), m16 = m.start rounded down to 16), rows past M or m masked off, and m's
    place in them (m.start - m16, for kd.pad). A row meets the dot at position row mod 16 whatever
    BLOCK_M is, so BLOCK_M only launches: a row's bits do not depend on it (the interpreter's f32
    matmul can give a row different bits at a different position). The rows before m.start belong to
    other programs: the store masks them (`m.start <= mm`). `dim`: the kernel's name of the row dim."""
    m16 = m.start // MMA_ROWS * MMA_ROWS
    mm = kd.span(m16, MMA_ROWS, kd.minimum(kd.dim(dim), m.start + m.size), dim + "p")
    return mm, m.start - m16


def _tile_squares(x, m):
    """sum(xr * xr) over K of the rows of a tile of 16+ rows, all rows in one 2-D reduction per
    NORM_K tile (the per-row walk of `_row_squares` would let Triton redo the A tile's elementwise
    work in every warp of the unpadded dot: 4x the VALU)."""
    nk = kd.tiles("K", block="NORM_K", domain=NORM_K_DOMAIN, default=256, label="kn")

    def squares(k, s):
        v = splitk_rows(x, m, k)
        return s + kd.sum(v * v, axis=k)

    return kd.fold(nk, kd.zeros((m,), kd.f32), squares)


def _row_squares(x, m):
    """sum(xr * xr) over K of each real row of the tile `m` (rows past M are 0), one row at a time:
    a row's sum runs over 1-D NORM_K tiles, so its order depends on NORM_K and num_warps only,
    never on BLOCK_M (a tile's rows do not share one reduction layout), and rows past M cost
    nothing."""
    nk = kd.tiles("K", block="NORM_K", domain=NORM_K_DOMAIN, default=256, label="kn")

    def row(r, ss):
        def squares(k, acc):
            v = splitk_rows(x, r, k)
            return acc + kd.sum(v * v, axis=k)

        total = kd.fold(nk, kd.zeros((), kd.f32), squares)
        return kd.where(m == r, total, ss)

    return kd.fold(kd.indices(kd.minimum(kd.dim("M"), m.start + m.size), start=m.start, label="row"),
                   kd.zeros((m,), kd.f32), row)


NORM_SPLIT_SEARCH = (1, 2, 3, 4, 8)  # output K splits the tuner tries for gemm_bf16_rmsnorm


@kd.kernel(name="gemm_bf16_rmsnorm", example={"S": 1, "P": 1, "M": 1, "N": 12288, "K": 1536})
def gemm_bf16_rmsnorm_kernel(x: kd.In["S", "M", "K", kd.f32], xw: kd.In["K", kd.bf16], w: kd.In["N", "K", kd.bf16],
                             part: kd.Out["P", "M", "N", kd.f32], eps: kd.Scalar[kd.f32]):
    """part[p] = bf16(rmsnorm(xr) * xw)[:, Kp] @ w[:, Kp]^T in f32 over the K range Kp of output split
    p (the ranges of gemm_bf16_splitk; P = 1: the whole GEMM), xr = bf16(x[0] + ... + x[S-1]) the
    row of split-K partials (gemm_bf16_splitk; S = 1 an f32 row): the split sum and the norm in a
    prologue, so neither the q_a rows nor the normed rows leave the program (MLA's q_b GEMM reads
    the q_a columns of the q_a|kv_a partials in place). A consumer adds the P partials in split order
    and rounds to bf16 (splitk_rows): at a small N (q_b at TP8: 1536 columns, 96 16-column tiles)
    P splits give P times the programs, each with 1/P of the weight stream and of the A tiles'
    LDS traffic. Each program sums each of its real rows' squares over all of K in f32 (the norm
    needs the whole row whatever its split), one row at a time (1-D NORM_K-wide tiles: at
    NORM_K >= K one reduction, the order of ops.mla_fused.mla_prep_qkv), then scales each A tile by
    rstd * xw and rounds it to bf16 before the dot, the expressions and rounding of that kernel's
    q_c. That elementwise work runs over the BLOCK_M rows of the tile only: a tile under 16 rows
    sums its squares a row at a time (ROW_SQUARES=1) and kd.pad places it at its own rows of the
    aligned 16 of the matrix dot (zeros around it), so a row's bits do not depend on BLOCK_M (1 to
    16: a launch-only key, each M bucket takes its own), nor a column's on BLOCK_N (the 16-row dot is
    one matrix instruction at every BLOCK_N: launch-only too); a 16-row tile may instead sum in one
    2-D reduction per NORM_K tile (ROW_SQUARES=0: less VALU at prefill, other bits). SPLIT_K is the op's
    split count (it allocates part [SPLIT_K, M, N]); the kernel splits by part's P dim."""
    kd.tunable("SPLIT_K", SPLIT_K_DOMAIN, 1, "output splits along K (the P dim of part): more programs",
               search=NORM_SPLIT_SEARCH)
    m, n, p = kd.grid(kd.tile("M", "BLOCK_M", domain=NORM_BM_DOMAIN, default=16),
                      kd.tile("N", "BLOCK_N", domain=BN_DOMAIN, default=64), kd.each("P"))
    by_row = kd.tunable("ROW_SQUARES", (0, 1), 1, "sum the squares a row at a time (any BLOCK_M) or in one "
                        "2-D reduction per NORM_K tile (BLOCK_M=16 only): a numerics key, BLOCK_M is not")
    small = m.size < MMA_ROWS
    kd.require(by_row or not small, "BLOCK_M under 16 sums its squares a row at a time (ROW_SQUARES=1)",
               "ROW_SQUARES")
    mm, place = _mma_rows(m) if small else (m, 0)
    rstd = kd.rsqrt((_row_squares(x, m) if by_row else _tile_squares(x, m)) / kd.dim("K") + eps)

    output_split_gemm(part, w, m, n, p, mm, place,
                      lambda k: (splitk_rows(x, m, k) * rstd * xw[k].to(kd.f32)).to(kd.bf16))


def output_split_gemm(part, w, m, n, p, mm, place, a_tile):
    """part[p, m, n] = sum over the K range of output split p (gemm_bf16_splitk's ranges) of
    a_tile(k) @ w[n, k]^T in f32: the main loop of the GEMMs that build their bf16 A tiles in a
    prologue (gemm_bf16_rmsnorm, ops.gemm_addnorm). A tile of fewer than 16 rows (`mm`, `place`:
    _mma_rows) sits at its own rows of the aligned 16 of the matrix dot; only m's rows are stored."""
    small = m.size < MMA_ROWS

    def body(k, acc):
        a = a_tile(k)
        return acc + kd.dot(kd.pad(a, m, mm, offset=place) if small else a, w[n, k])

    bk = kd.tunable("BLOCK_K", BK_DOMAIN, 64)
    K = kd.dim("K")
    ks = kd.cdiv(kd.cdiv(K, kd.dim("P")), bk) * bk
    k0 = p * ks
    span = kd.tiles(start=k0, stop=kd.minimum(K, k0 + ks), block="BLOCK_K", domain=BK_DOMAIN, default=64, label="K")
    acc = kd.fold(span, kd.zeros((mm, n), kd.f32), body)
    if small:
        kd.store(part, (p, mm, n), acc, mask=m.start <= mm)
    else:
        part[p, mm, n] = acc


KERNELS = (gemm_bf16_kernel, gemm_fp8_kernel, gemm_w8a8_kernel, gemm_w4a8_kernel, gemm_w4a8_order_kernel,
           gemm_w4a8_i32acc_kernel, gemm_w4a16_kernel, gemm_bf16_silu_mul_kernel, gemm_bf16_splitk_kernel,
           gemm_bf16_rmsnorm_kernel)
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


def splitk_sum_ref(part: torch.Tensor) -> torch.Tensor:
    """bf16(part[0] + part[1] + ... + part[S-1]) with the f32 adds in split order: the row a consumer
    of split-K partials reads (`splitk_rows` in the kernels)."""
    acc = part[0].float()
    for s in range(1, part.shape[0]):
        acc = acc + part[s].float()
    return acc.to(torch.bfloat16)


def splitk_bounds(K: int, splits: int, block_k: int) -> list[tuple[int, int]]:
    """The K range of each split of gemm_bf16_splitk: KS = cdiv(cdiv(K, S), BLOCK_K) * BLOCK_K, split
    s covers [s * KS, min(K, (s + 1) * KS)) (empty past K)."""
    ks = -(-(-(-K // splits)) // block_k) * block_k
    return [(min(K, s * ks), min(K, (s + 1) * ks)) for s in range(splits)]


def gemm_bf16_splitk_ref(x: torch.Tensor, w: torch.Tensor, splits: int, block_k: int) -> torch.Tensor:
    """The f32 partials [S, M, N] of gemm_bf16_splitk, each computed in float64 and rounded once."""
    parts = [x[:, a:b].double() @ w[:, a:b].double().T for a, b in splitk_bounds(x.shape[1], splits, block_k)]
    return torch.stack(parts).float()


def splitk_config(M: int, N: int, K: int, config: dict | None = None) -> dict:
    """gemm_bf16_splitk's batch-invariant config at (N, K): the split count and tiles of the M=1
    entry at every M (a row's bits never depend on the batch), launch keys from M's bucket."""
    return invariant_config(gemm_bf16_splitk_kernel, {"N": N, "K": K}, M, config)


def gemm_bf16_splitk(x: torch.Tensor, w: torch.Tensor, backend: str = "triton",
                     config: dict | None = None) -> torch.Tensor:
    """bf16 x [M, K] @ w [N, K]^T as split-K partial sums: f32 [S, M, N], S the tuned SPLIT_K (the
    same at every M). `splitk_sum_ref` (or a consumer: gemm_bf16_rmsnorm, ops.mla_fused.q_absorb_append)
    adds them in split order and rounds to bf16. The torch backend computes the same splits."""
    name = "gemm_bf16_splitk"
    _backend(name, backend)
    M, N, K = _dims(name, x, w)
    check_tensor(name, "x", x, 2, (torch.bfloat16,))
    check_tensor(name, "w", w, 2, (torch.bfloat16,))
    config = splitk_config(M, N, K, config)
    splits = int(config.get("SPLIT_K", SPLIT_K_DEFAULT))
    if splits not in SPLIT_K_DOMAIN:
        raise ValueError(f"{name}: SPLIT_K must be one of {SPLIT_K_DOMAIN}, got {splits!r}")
    if backend == "torch":
        return gemm_bf16_splitk_ref(x, w, splits, int(config.get("BLOCK_K", 64))).to(x.device)
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    if M:
        gemm_bf16_splitk_kernel(x, w, part, config=config)
    return part


def _partials(op: str, x: torch.Tensor) -> torch.Tensor:
    """x as split-K partials [S, M, K] f32 (any strides with a contiguous last dim): a bf16 [M, K]
    row block is taken as one split (an f32 copy, exact)."""
    check_tensor(op, "x", x, None, last_contiguous=True)
    if x.dim() == 2:
        check_tensor(op, "x", x, 2, (torch.bfloat16,))
        return x.float().unsqueeze(0)
    if x.dim() != 3 or x.dtype != torch.float32:
        raise TypeError(f"{op}: x must be bfloat16 [M, K] or float32 split-K partials [S, M, K], got "
                        f"{str(x.dtype).replace('torch.', '')} {tuple(x.shape)}")
    if x.shape[0] < 1:
        raise ValueError(f"{op}: x partials need at least one split, got {tuple(x.shape)}")
    return x


def gemm_bf16_rmsnorm_ref(x: torch.Tensor, x_norm_w: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """gemm_bf16_ref over rmsnorm_ref(x, x_norm_w) (the normed rows rounded to bf16 first); x bf16
    [M, K] or f32 split-K partials [S, M, K] (their `splitk_sum_ref`)."""
    return gemm_bf16_ref(_rmsnorm_rows_ref(x, x_norm_w, eps), w)


def _rmsnorm_rows_ref(x: torch.Tensor, x_norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    from ops.norm import rmsnorm_ref

    return rmsnorm_ref(splitk_sum_ref(x) if x.dim() == 3 else x, x_norm_w, eps)


def rmsnorm_config(M: int, N: int, K: int, config: dict | None = None, invariant: bool = True) -> dict:
    """gemm_bf16_rmsnorm's config at (N, K): batch-invariant (`invariant`: the split count, the squares'
    order and the K tile of the M=1 entry at every M, launch keys from M's bucket) or M's own entry."""
    problem = {"N": N, "K": K}
    if invariant:
        return invariant_config(gemm_bf16_rmsnorm_kernel, problem, M, config)
    if config is not None:
        return dict(config)
    return lookup_config(gemm_bf16_rmsnorm_kernel, kd.current_target().name, problem, max(M, 1))


def gemm_bf16_rmsnorm(x: torch.Tensor, x_norm_w: torch.Tensor, w: torch.Tensor, eps: float, backend: str = "triton",
                      config: dict | None = None, invariant: bool = True, partials: bool = False) -> torch.Tensor:
    """bf16(rmsnorm(xr) * x_norm_w) [M, K] @ w [N, K]^T in one launch: the norm of each row (f32, over
    all K) in the GEMM's prologue. x is bf16 [M, K] (xr = x) or the f32 split-K partials [S, M, K] of
    gemm_bf16_splitk (xr = their bf16-rounded sum in split order); either may be a strided view (any
    strides, last dim contiguous), e.g. the q_a columns of the q_a|kv_a output. The kernel writes f32
    partials over the tuned SPLIT_K ranges of K (`splitk_bounds`); `partials=True` returns them
    ([SPLIT_K, M, N], for a consumer that adds them in split order: ops.mla_fused.q_absorb_append),
    else their bf16-rounded sum [M, N] (`splitk_sum_ref`: torch adds when SPLIT_K > 1). The torch
    backend computes the same splits in float64 (`partials=True`) or the whole GEMM. `invariant`
    (default): the M=1 tiles at every M, as `gemm_bf16`."""
    import math

    name = "gemm_bf16_rmsnorm"
    _backend(name, backend)
    xp = _partials(name, x)
    check_tensor(name, "w", w, 2, (torch.bfloat16,), x.device, last_contiguous=True)
    S, M, K = xp.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"{name}: K mismatch: x rows are K={K} wide but w is {tuple(w.shape)}")
    if N < 1 or K < 1:
        raise ValueError(f"{name}: N and K must be positive, got x {tuple(x.shape)}, w {tuple(w.shape)}")
    check_tensor(name, "x_norm_w", x_norm_w, 1, (torch.bfloat16,), x.device, contiguous=True)
    if x_norm_w.shape[0] != K:
        raise ValueError(f"{name}: x_norm_w must be [K={K}], got {tuple(x_norm_w.shape)}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{name}: eps must be a finite number >= 0, got {eps!r}")
    if backend == "torch" and not partials:
        return gemm_bf16_rmsnorm_ref(xp, x_norm_w, w, eps)
    config = rmsnorm_config(M, N, K, config, invariant)
    splits = int(config.get("SPLIT_K", 1))
    if splits not in SPLIT_K_DOMAIN:
        raise ValueError(f"{name}: SPLIT_K must be one of {SPLIT_K_DOMAIN}, got {splits!r}")
    if backend == "torch":
        return gemm_bf16_splitk_ref(_rmsnorm_rows_ref(xp, x_norm_w, eps), w, splits,
                                    int(config.get("BLOCK_K", 64))).to(x.device)
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    if M:
        gemm_bf16_rmsnorm_kernel(xp, x_norm_w, w, part, float(eps), config=config)
    return part if partials else splitk_sum_ref(part)
