"""The MLP's down GEMM fed by split-K gate|up partial sums (kernel `gemm_bf16_swiglu`).

At decode sizes the gate|up GEMM (N2 = 2I weight rows, K = hidden) has too few output tiles to
keep every CU streaming weights (at 8-way tensor parallelism I = 256: 32 tiles of 16 rows for
304 CUs). Split along K it fills the GPU, but then no program holds a complete gate or up sum for
the SiLU(gate)*up epilogue. This kernel takes the partial sums [S, M, 2I] f32 (gate columns then
up columns), adds them in split order in f32, rounds gate and up to bf16 (what an unsplit GEMM
stores), applies SiLU(gate)*up rounded to bf16 (ops.gemm.gemm_bf16_silu_mul's epilogue) and
multiplies that into the down projection [N, I]: the epilogue and the down GEMM in one launch,
so the split costs no launch.

`gemm_bf16_swiglu_combine` (kernel `gemm_bf16_swiglu_combine`) is the same GEMM for a MoE layer's
shared expert with the end of the layer in its epilogue (`ops.moe.combine_add`'s work for the
program's columns): the top-k routed partial rows summed in k order (ids outside [0, E) count 0),
+ the shared output rounded to bf16 (what gemm_bf16_swiglu stores), rounded to bf16, added into the
residual stream in place, and the new residual returned as f32 rows for the next layer's
`gemm_bf16_rmsnorm`. The bits of gemm_bf16_swiglu + combine_add, one launch fewer.

`gemm_bf16_swiglu_rank` (kernel `gemm_bf16_swiglu_rank`) is its counterpart at world size > 1, where
a MoE layer ends in a rank's share of the layer output (`ops.moe.combine_rank`'s work: the top-k
routed partial rows summed in k order + the shared output, rounded to bf16), the all-reduce payload:
the bits of gemm_bf16_swiglu + combine_rank, one launch fewer per MoE layer.
"""
from __future__ import annotations

import torch

import kdsl as kd
from ops._common import check_backend, check_tensor, config_for, invariant_config
from ops.gemm import BK_DOMAIN, BN_DOMAIN, MMA_ROWS, NORM_BM_DOMAIN, _mma_rows, gemm_bf16_ref, splitk_sum_ref

EXAMPLE = {"S": 4, "M": 1, "N2": 512, "I": 256, "N": 7168}
N_TILES_DOMAIN = (1, 2, 4)


def _split_rows(part, rows, cols):
    """ops.gemm.splitk_rows (part[0] + ... + part[S-1] in split order, f32, rounded to bf16) with the
    static split count unrolled, so the ISA (and the tuner) sees every split's loads and adds."""
    def add(s, acc):
        return acc + kd.sum(part[s, rows, cols], axis=s)

    S = kd.dim("S")
    total = kd.fold(kd.tiles(start=1, stop=S, block=1, label="s", unroll=True), part[0, rows, cols], add)
    return total.to(kd.bf16).to(kd.f32)


def _swiglu_tiles(part, w):
    """The program's grid, tiles and f32 accumulators of bf16(silu(gate) * up) @ w^T (shared by both
    kernels, so the combine variant keeps gemm_bf16_swiglu's bits): (m, mm, small, column spans, accs)."""
    bn = kd.tunable("BLOCK_N", BN_DOMAIN, 64)
    tiles_n = kd.tunable("N_TILES", N_TILES_DOMAIN, 1, "BLOCK_N tiles per program, each its own dot of the "
                         "program's one A tile: the prologue is shared, a tile's bits are not changed (launch-only)")
    m, nt = kd.grid(kd.tile("M", "BLOCK_M", domain=NORM_BM_DOMAIN, default=16), kd.tile("N", bn * tiles_n))
    ns = [kd.span(nt.start + j * bn, bn, kd.dim("N"), "N") for j in range(tiles_n)]
    I = kd.dim("I")
    small = m.size < MMA_ROWS
    mm, place = _mma_rows(m) if small else (m, 0)

    def body(k, *accs):
        a = (kd.silu(_split_rows(part, m, k)) * _split_rows(part, m, k + I)).to(kd.bf16)
        a = kd.pad(a, m, mm, offset=place) if small else a
        return tuple(acc + kd.dot(a, w[n, k]) for acc, n in zip(accs, ns))

    ks = kd.tiles("I", block="BLOCK_K", domain=BK_DOMAIN, default=64)
    accs = kd.fold(ks, tuple(kd.zeros((mm, n), kd.f32) for n in ns), body)
    return m, mm, small, ns, (accs if isinstance(accs, tuple) else (accs,))


@kd.kernel(name="gemm_bf16_swiglu", static=("S",), example=EXAMPLE,
           checks=[("N2", lambda d: d["N2"] == 2 * d["I"], "part must be [S, M, 2*I] (gate columns then up)")])
def gemm_bf16_swiglu_kernel(part: kd.In["S", "M", "N2", kd.f32], w: kd.In["N", "I", kd.bf16],
                            out: kd.Out["M", "N", kd.bf16]):
    """out = bf16(silu(gate) * up) @ w^T with gate | up = the split-K rows of `part` as
    ops.gemm.splitk_rows reads them (added in split order, rounded to bf16; S static): the partials are
    re-added per A tile, so a program reads S x 2 x its rows' K tile (L2-resident after the first
    N tile has read them). That elementwise prologue (the kernel's cost at decode sizes) runs over the
    BLOCK_M rows of the tile only: a tile under 16 rows (no padding rows at M=2) is placed by kd.pad
    at its own rows of the aligned 16 of the matrix dot (zeros around it, ops.gemm._mma_rows), so a
    row's bits do not depend on BLOCK_M (1 to 16: a launch-only key, each M bucket takes its own).
    The prologue is redone by every program along N: a program may cover N_TILES tiles of BLOCK_N
    columns, each its own BLOCK_N dot of its one A tile (same bits, launch-only), so decode takes
    narrow tiles (many programs) and prefill shares the prologue among several."""
    m, mm, small, ns, accs = _swiglu_tiles(part, w)
    for acc, n in zip(accs, ns):
        if small:
            kd.store(out, (mm, n), acc, mask=m.start <= mm)
        else:
            out[mm, n] = acc


COMBINE_EXAMPLE = {"S": 4, "M": 1, "N2": 4096, "I": 2048, "N": 7168, "P": 8, "TOPK": 8, "E": 384}


def _rank_sum(acc, m, mm, small, n, partial, ids):
    """ops.moe.moe_combine_rank over the tile (mm, n) with the shared output `acc` (f32, rounded to
    bf16 first: what gemm_bf16_swiglu stores and the combines read): the top-k partial rows in k order
    (a row whose id is outside [0, E) counts 0 and is never read) + shared, f32, and the mask of the
    program's own rows (None for a 16-row tile or more). A tile under 16 rows spans the aligned 16
    (`_mma_rows`): the rows before m.start belong to other programs, so every load and store of them
    is masked."""
    K = kd.static("TOPK")
    own = (m.start <= mm) if small else None
    tot = None
    for j in range(K):
        e = ids[mm * K + j]
        ok = (e >= 0) & (e < kd.static("E"))
        v = partial.load(mm * K + j, n, mask=ok if own is None else ok & own)
        tot = v if tot is None else tot + v
    return tot + acc.to(kd.bf16).to(kd.f32), own


def _combine_into(acc, m, mm, small, n, partial, ids, res, rows):
    """ops.moe.moe_combine_add over the tile (mm, n): `_rank_sum` -> bf16, + residual -> bf16, stored
    in place and as f32 rows."""
    tot, own = _rank_sum(acc, m, mm, small, n, partial, ids)
    old = res[mm, n] if own is None else res.load(mm, n, mask=own)
    r = (tot.to(kd.bf16).to(kd.f32) + old.to(kd.f32)).to(kd.bf16)
    if own is None:
        res[mm, n] = r
        rows[mm, n] = r.to(kd.f32)
    else:
        kd.store(res, (mm, n), r, mask=own)
        kd.store(rows, (mm, n), r.to(kd.f32), mask=own)


@kd.kernel(name="gemm_bf16_swiglu_combine", static=("S", "TOPK", "E"), example=COMBINE_EXAMPLE,
           checks=[("N2", lambda d: d["N2"] == 2 * d["I"], "part must be [S, M, 2*I] (gate columns then up)"),
                   ("P", lambda d: d["P"] == d["M"] * d["TOPK"], "partial and ids must hold M*TOPK rows")])
def gemm_bf16_swiglu_combine_kernel(part: kd.In["S", "M", "N2", kd.f32], w: kd.In["N", "I", kd.bf16],
                                    partial: kd.In["P", "N", kd.f32], ids: kd.In["P", kd.i32],
                                    res: kd.InOut["M", "N", kd.bf16], rows: kd.Out["M", "N", kd.f32],
                                    TOPK: kd.Dim, E: kd.Dim):
    """gemm_bf16_swiglu's program (the same prologue, tiles and dots: the same shared-expert bits)
    ending a MoE layer: with y = the tile of bf16(silu(gate) * up) @ w^T rounded to bf16,
    res <- bf16(bf16(sum_k partial[m*TOPK + k] (ids in [0, E)) + y) + res), rows = res as f32: the
    adds and roundings of ops.moe.moe_combine_add, whose launch it saves."""
    m, mm, small, ns, accs = _swiglu_tiles(part, w)
    for acc, n in zip(accs, ns):
        _combine_into(acc, m, mm, small, n, partial, ids, res, rows)


@kd.kernel(name="gemm_bf16_swiglu_rank", static=("S", "TOPK", "E"), example=COMBINE_EXAMPLE,
           checks=[("N2", lambda d: d["N2"] == 2 * d["I"], "part must be [S, M, 2*I] (gate columns then up)"),
                   ("P", lambda d: d["P"] == d["M"] * d["TOPK"], "partial and ids must hold M*TOPK rows")])
def gemm_bf16_swiglu_rank_kernel(part: kd.In["S", "M", "N2", kd.f32], w: kd.In["N", "I", kd.bf16],
                                 partial: kd.In["P", "N", kd.f32], ids: kd.In["P", kd.i32],
                                 out: kd.Out["M", "N", kd.bf16], TOPK: kd.Dim, E: kd.Dim):
    """gemm_bf16_swiglu's program ending a MoE layer at world size > 1: with y = the tile of
    bf16(silu(gate) * up) @ w^T rounded to bf16, out = bf16(sum_k partial[m*TOPK + k] (ids in
    [0, E)) + y), the rank's share before the all-reduce: the adds and rounding of
    ops.moe.moe_combine_rank, whose launch it saves."""
    m, mm, small, ns, accs = _swiglu_tiles(part, w)
    for acc, n in zip(accs, ns):
        tot, own = _rank_sum(acc, m, mm, small, n, partial, ids)
        if own is None:
            out[mm, n] = tot.to(kd.bf16)
        else:
            kd.store(out, (mm, n), tot.to(kd.bf16), mask=own)


KERNELS = (gemm_bf16_swiglu_kernel, gemm_bf16_swiglu_combine_kernel, gemm_bf16_swiglu_rank_kernel)


def swiglu_of_partials_ref(part: torch.Tensor) -> torch.Tensor:
    """bf16 [M, I]: silu(gate) * up in f32 -> bf16, gate | up = splitk_sum_ref(part) (bf16)."""
    g, u = splitk_sum_ref(part).float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(torch.bfloat16)


def gemm_bf16_swiglu_ref(part: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """gemm_bf16_ref over swiglu_of_partials_ref(part)."""
    return gemm_bf16_ref(swiglu_of_partials_ref(part), w)


def gemm_bf16_swiglu(part: torch.Tensor, w: torch.Tensor, backend: str = "triton", config: dict | None = None,
                     invariant: bool = True) -> torch.Tensor:
    """part [S, M, 2I] f32 (split-K partial sums of an MLP's gate|up GEMM, gate columns first; any
    strides), w [N, I] bf16 (the down projection) -> bf16 [M, N] in one launch. Tuned files are
    keyed by N, I and S (the split count is static: the sum unrolls). `invariant` (default): the M=1 tiles at every M, as `gemm_bf16`."""
    name = "gemm_bf16_swiglu"
    check_backend(name, backend)
    check_tensor(name, "part", part, 3, (torch.float32,))
    check_tensor(name, "w", w, 2, (torch.bfloat16,), part.device)
    S, M, N2 = part.shape
    N, I = w.shape
    if N2 != 2 * I:
        raise ValueError(f"{name}: part must be [S, M, 2*I] with I = w.shape[1] = {I}, got {tuple(part.shape)}")
    if S < 1:
        raise ValueError(f"{name}: part needs at least one split, got {tuple(part.shape)}")
    if backend == "torch":
        return gemm_bf16_swiglu_ref(part, w)
    problem = {"N": N, "I": I, "S": S}
    config = _config(gemm_bf16_swiglu_kernel, problem, M, config, invariant)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=part.device)
    if M:
        gemm_bf16_swiglu_kernel(part, w, out, config=config)
    return out


def _config(kernel, problem: dict, M: int, config: dict | None, invariant: bool) -> dict:
    """The launch's config: with `invariant` the M=1 entry's numerics keys at every M."""
    return invariant_config(kernel, problem, M, config) if invariant else config_for(kernel, problem, M, config)


def _check_shared(name: str, part: torch.Tensor, w: torch.Tensor, M: int, N: int, dev: torch.device
                  ) -> tuple[int, int]:
    """The shared expert's operands of a combine variant: part [S >= 1, M, 2I] f32, w [N, I] bf16.
    Returns (S, I)."""
    check_tensor(name, "part", part, 3, (torch.float32,), dev)
    check_tensor(name, "w", w, 2, (torch.bfloat16,), dev)
    S, MP, N2 = part.shape
    NW, I = w.shape
    if N2 != 2 * I or MP != M or NW != N:
        raise ValueError(f"{name}: needs part [S, M={M}, 2*I] and w [N={N}, I] with I = w.shape[1], got "
                         f"{tuple(part.shape)} and {tuple(w.shape)}")
    if S < 1:
        raise ValueError(f"{name}: part needs at least one split, got {tuple(part.shape)}")
    return S, I


def gemm_bf16_swiglu_combine(part: torch.Tensor, w: torch.Tensor, partial: torch.Tensor, ids: torch.Tensor,
                             res: torch.Tensor, n_experts: int, backend: str = "triton",
                             config: dict | None = None, invariant: bool = True) -> torch.Tensor:
    """`gemm_bf16_swiglu(part, w)` (a MoE layer's shared expert) and `ops.moe.combine_add(partial,
    ids, shared, res, n_experts)` in one launch, with their bits: routed partials [M*top_k, N] f32
    summed in k order + the shared output (bf16), added into `res` [M, N] bf16 IN PLACE; returns the
    new residual as f32 [M, N] (exact). Ids outside [0, n_experts) add nothing. No device read.
    Tuned files are keyed by N, I, S and TOPK; `invariant` (default): the M=1 numerics at every M."""
    from ops.moe import _check_combine, moe_combine_rank_ref

    name = "gemm_bf16_swiglu_combine"
    M, N = _check_combine(name, partial, ids, None, res, backend)
    S, I = _check_shared(name, part, w, M, N, res.device)
    if backend == "torch":
        shared = gemm_bf16_swiglu_ref(part, w)
        r = (moe_combine_rank_ref(partial, ids, shared, n_experts).float() + res.float()).to(torch.bfloat16)
        res.copy_(r)
        return r.float()
    K = ids.shape[1]
    problem = {"N": N, "I": I, "S": S, "TOPK": K}
    config = _config(gemm_bf16_swiglu_combine_kernel, problem, M, config, invariant)
    rows = torch.empty(M, N, dtype=torch.float32, device=res.device)
    if M:
        gemm_bf16_swiglu_combine_kernel(part, w, partial, ids.reshape(-1), res, rows, K, n_experts, config=config)
    return rows


def gemm_bf16_swiglu_rank(part: torch.Tensor, w: torch.Tensor, partial: torch.Tensor, ids: torch.Tensor,
                          n_experts: int, backend: str = "triton", config: dict | None = None,
                          invariant: bool = True) -> torch.Tensor:
    """`gemm_bf16_swiglu(part, w)` (a MoE layer's shared expert) and `ops.moe.combine_rank(partial,
    ids, shared, n_experts)` in one launch, with their bits: routed partials [M*top_k, N] f32 summed
    in k order + the shared output (bf16) -> bf16 [M, N], the rank's all-reduce payload. Ids outside
    [0, n_experts) add nothing. No device read. Tuned files are keyed by N, I, S and TOPK;
    `invariant` (default): the M=1 numerics at every M."""
    from ops.moe import _check_partials, moe_combine_rank_ref

    name = "gemm_bf16_swiglu_rank"
    M, N = _check_partials(name, partial, ids, backend)
    S, I = _check_shared(name, part, w, M, N, partial.device)
    if backend == "torch":
        return moe_combine_rank_ref(partial, ids, gemm_bf16_swiglu_ref(part, w), n_experts)
    K = ids.shape[1]
    problem = {"N": N, "I": I, "S": S, "TOPK": K}
    config = _config(gemm_bf16_swiglu_rank_kernel, problem, M, config, invariant)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=partial.device)
    if M:
        gemm_bf16_swiglu_rank_kernel(part, w, partial, ids.reshape(-1), out, K, n_experts, config=config)
    return out
