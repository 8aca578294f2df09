"""A GEMM with the residual add and the RMSNorm before it in its prologue.

At world size > 1 a layer starts from the all-reduced output of the layer before (`x`, bf16 rows:
the sum of the ranks) and the residual stream `res`. The two-launch chain is ops.norm.rmsnorm_add
(res_out = bf16(x + res), y = bf16(rmsnorm(res_out) * w)) then the q_a|kv_a GEMM on y
(gemm_bf16_splitk). `gemm_bf16_addnorm` runs it as one launch: every program sums and normalizes
its rows in its prologue (as ops.gemm.gemm_bf16_rmsnorm does for world size 1's f32 rows, the
rows re-read from L2) and the programs of the first column tile store res_out over their K range.
One launch and one graph gap fewer per layer; the same expressions and roundings as the chain
(`res_out` bit for bit; with NORM_K >= K the sum of squares is the chain's single reduction, so on
the interpreter the output bits equal the chain's too). res_out must not alias `res`: every program
reads the whole row of `res` while the first column's programs write res_out.
`gemm_bf16_addnorm_y` does the same for the MoE half's first GEMM (the shared expert's gate|up and
the router, after the attention's all-reduce) and also stores the normed rows y (rmsnorm_add's
`out`), the routed experts' input; `gemm_bf16_addnorm_yq` (W4A8 experts) also their per-token int8
quant (rmsnorm_add_quant's). At world size 1 the MoE half starts from o_proj's split-K f32 partials:
`gemm_bf16_addnorm_splitk_y` / `_splitk_yq` read those (rmsnorm_add(_quant)_splitk's residual sum).
Which path the model takes: `addnorm_pays` (one answer per deployment, from the tuned files).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

import kdsl as kd
from ops._common import check_tensor, invariant_config
from ops.gemm import (BN_DOMAIN, MMA_ROWS, NORM_BM_DOMAIN, NORM_K_DOMAIN, NORM_SPLIT_SEARCH, SPLIT_K_DOMAIN, _backend,
                      _mma_rows, _partials, gemm_bf16_rmsnorm, output_split_gemm, splitk_sum_ref)
from ops.norm import _partials_residual_sum, _residual_sum


def _residual_squares(x, res, m, rsum):
    """sum(r * r) over K of each real row of the tile `m`, r = rsum(x, res, rows, cols) the residual
    sum (rows past M are 0), one row at a time over 1-D NORM_K tiles: the order depends on NORM_K and
    num_warps only, never on BLOCK_M (ops.gemm._row_squares, reading the residual sum)."""
    nk = kd.tiles("K", block="NORM_K", domain=NORM_K_DOMAIN, default=256, label="kn")

    def row(r, ss):
        def squares(k, acc):
            v = rsum(x, res, r, k).to(kd.f32)
            return acc + kd.sum(v * v, axis=k)

        return kd.where(m == r, kd.fold(nk, kd.zeros((), kd.f32), squares), ss)

    return kd.fold(kd.indices(kd.minimum(kd.dim("M"), m.start + m.size), start=m.start, label="row"),
                   kd.zeros((m,), kd.f32), row)


def _row_absmax(x, res, xw, m, rstd, stop, rsum):
    """max |r * rstd * xw| (f32, before the bf16 rounding: rmsnorm_add_quant's statistic) of the rows
    [m.start, stop) of the tile `m`, one row at a time over NORM_K tiles (0 for the other rows):
    stop = m.start in the programs that quantize nothing, which then run no iteration."""
    nk = kd.tiles("K", block="NORM_K", domain=NORM_K_DOMAIN, default=256, label="kq")

    def row(r, amax):
        inv = kd.sum(kd.where(m == r, rstd, 0.0), axis=m)     # row r's rstd (the other entries are 0)

        def most(k, acc):
            v = rsum(x, res, r, k).to(kd.f32) * inv * xw[k].to(kd.f32)
            return kd.maximum(acc, kd.max(kd.abs(v), axis=k))

        return kd.where(m == r, kd.fold(nk, kd.zeros((), kd.f32), most), amax)

    return kd.fold(kd.indices(stop, start=m.start, label="qrow"), kd.zeros((m,), kd.f32), row)


def _addnorm_gemm(x, res, xw, w, part, res_out, eps, y=None, q=None, scale=None, rsum=_residual_sum):
    """The kernels' body: part[p] = bf16(rmsnorm(r) * xw)[:, Kp] @ w[:, Kp]^T in f32 over the K range
    Kp of output split p (gemm_bf16_splitk's ranges), r = bf16(x + res) (`rsum`: x bf16 rows, or
    _partials_residual_sum: x split-K partials, bf16(bf16(their sum) + res)); res_out = r (and y = the
    normed bf16 rows; q, scale = their per-token int8 quant), stored by the programs of the first
    column tile for their K range (masked stores in the main loop). Each program sums its real
    rows' squares over all of K (a row at a time: BLOCK_M is a launch-only key, rows sit at their
    own place of the aligned 16 of the matrix dot), then scales each A tile by rstd * xw and rounds
    it to bf16 before the dot: rmsnorm_add's expressions. With q, the first column's programs also
    take each row's absmax in a second pass over the row (rmsnorm_add_quant's scale, absmax/127,
    and RNE codes; the other programs run no iteration of it)."""
    kd.tunable("SPLIT_K", SPLIT_K_DOMAIN, 1, "output splits along K (the P dim of part): more programs",
               search=NORM_SPLIT_SEARCH)
    m, n, p = kd.grid(kd.tile("M", "BLOCK_M", domain=NORM_BM_DOMAIN, default=16),
                      kd.tile("N", "BLOCK_N", domain=BN_DOMAIN, default=64), kd.each("P"))
    small = m.size < MMA_ROWS
    mm, place = _mma_rows(m) if small else (m, 0)
    rstd = kd.rsqrt(_residual_squares(x, res, m, rsum) / kd.dim("K") + eps)
    first = n.start < 1
    if q is not None:
        from ops.quant import MIN_ABSMAX, _round_rne

        rows_end = kd.minimum(kd.dim("M"), m.start + m.size)
        vmax = _row_absmax(x, res, xw, m, rstd, kd.where(first, rows_end, m.start), rsum)
        # max |bf16(v)| == bf16(max |v|) (RNE is monotone and symmetric), as ops.norm._norm_quant
        sq = kd.maximum(vmax.to(kd.bf16).to(kd.f32), MIN_ABSMAX) / 127.0
        kd.store(scale, (m,), sq, mask=first & (p < 1))

    def a_tile(k):
        r = rsum(x, res, m, k)
        kd.store(res_out, (m, k), r, mask=first)
        a = (r.to(kd.f32) * rstd * xw[k].to(kd.f32)).to(kd.bf16)
        if y is not None:
            kd.store(y, (m, k), a, mask=first)
        if q is not None:
            code = _round_rne(kd.minimum(kd.maximum(a.to(kd.f32) / sq, -127.0), 127.0)).to(kd.i32).to(kd.i8)
            kd.store(q, (m, k), code, mask=first)
        return a

    output_split_gemm(part, w, m, n, p, mm, place, a_tile)


@kd.kernel(name="gemm_bf16_addnorm", example={"P": 1, "M": 1, "N": 2112, "K": 7168})
def gemm_bf16_addnorm_kernel(x: kd.In["M", "K", kd.bf16], res: kd.In["M", "K", kd.bf16], xw: kd.In["K", kd.bf16],
                             w: kd.In["N", "K", kd.bf16], part: kd.Out["P", "M", "N", kd.f32],
                             res_out: kd.Out["M", "K", kd.bf16], eps: kd.Scalar[kd.f32]):
    """A layer's first GEMM (q_a|kv_a) over bf16(rmsnorm(x + res) * xw), the new residual stored
    (`_addnorm_gemm`)."""
    _addnorm_gemm(x, res, xw, w, part, res_out, eps)


@kd.kernel(name="gemm_bf16_addnorm_y", example={"P": 1, "M": 1, "N": 896, "K": 7168})
def gemm_bf16_addnorm_y_kernel(x: kd.In["M", "K", kd.bf16], res: kd.In["M", "K", kd.bf16], xw: kd.In["K", kd.bf16],
                               w: kd.In["N", "K", kd.bf16], part: kd.Out["P", "M", "N", kd.f32],
                               res_out: kd.Out["M", "K", kd.bf16], y: kd.Out["M", "K", kd.bf16],
                               eps: kd.Scalar[kd.f32]):
    """The MoE half's first GEMM (the shared expert's gate|up and the router) over the post-attention
    norm, storing the new residual and the normed rows y (the routed experts' input) too
    (`_addnorm_gemm`)."""
    _addnorm_gemm(x, res, xw, w, part, res_out, eps, y)


@kd.kernel(name="gemm_bf16_addnorm_yq", example={"P": 1, "M": 1, "N": 896, "K": 7168})
def gemm_bf16_addnorm_yq_kernel(x: kd.In["M", "K", kd.bf16], res: kd.In["M", "K", kd.bf16],
                                xw: kd.In["K", kd.bf16], w: kd.In["N", "K", kd.bf16],
                                part: kd.Out["P", "M", "N", kd.f32], res_out: kd.Out["M", "K", kd.bf16],
                                y: kd.Out["M", "K", kd.bf16], q: kd.Out["M", "K", kd.i8],
                                scale: kd.Out["M", kd.f32], eps: kd.Scalar[kd.f32]):
    """gemm_bf16_addnorm_y for W4A8 experts: the normed rows' per-token int8 quant (q, scale: what
    rmsnorm_add_quant stores, stage 1's input) stored by the first column tile's programs too
    (`_addnorm_gemm`)."""
    _addnorm_gemm(x, res, xw, w, part, res_out, eps, y, q, scale)


@kd.kernel(name="gemm_bf16_addnorm_splitk_y", example={"S": 4, "P": 1, "M": 1, "N": 4480, "K": 7168})
def gemm_bf16_addnorm_splitk_y_kernel(x: kd.In["S", "M", "K", kd.f32], res: kd.In["M", "K", kd.bf16],
                                      xw: kd.In["K", kd.bf16], w: kd.In["N", "K", kd.bf16],
                                      part: kd.Out["P", "M", "N", kd.f32], res_out: kd.Out["M", "K", kd.bf16],
                                      y: kd.Out["M", "K", kd.bf16], eps: kd.Scalar[kd.f32]):
    """gemm_bf16_addnorm_y at world size 1: x is o_proj's split-K partials (rmsnorm_add_splitk's
    residual sum, bf16(bf16(sum_s x[s]) + res))."""
    _addnorm_gemm(x, res, xw, w, part, res_out, eps, y, rsum=_partials_residual_sum)


@kd.kernel(name="gemm_bf16_addnorm_splitk_yq", example={"S": 4, "P": 1, "M": 1, "N": 4480, "K": 7168})
def gemm_bf16_addnorm_splitk_yq_kernel(x: kd.In["S", "M", "K", kd.f32], res: kd.In["M", "K", kd.bf16],
                                       xw: kd.In["K", kd.bf16], w: kd.In["N", "K", kd.bf16],
                                       part: kd.Out["P", "M", "N", kd.f32], res_out: kd.Out["M", "K", kd.bf16],
                                       y: kd.Out["M", "K", kd.bf16], q: kd.Out["M", "K", kd.i8],
                                       scale: kd.Out["M", kd.f32], eps: kd.Scalar[kd.f32]):
    """gemm_bf16_addnorm_yq at world size 1 (rmsnorm_add_quant_splitk's outputs)."""
    _addnorm_gemm(x, res, xw, w, part, res_out, eps, y, q, scale, rsum=_partials_residual_sum)


def residual_sum_ref(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """bf16(x + res), one f32 add rounded once (ops.norm.rmsnorm_add's res_out)."""
    return (x.float() + res.float()).to(torch.bfloat16)


def gemm_bf16_addnorm(x: torch.Tensor, res: torch.Tensor, x_norm_w: torch.Tensor, w: torch.Tensor, eps: float,
                      backend: str = "triton", config: dict | None = None, invariant: bool = True,
                      partials: bool = False, res_out: torch.Tensor | None = None, normed: bool = False,
                      quant: bool = False) -> tuple[torch.Tensor, ...]:
    """(bf16(rmsnorm(r) * x_norm_w) @ w^T, r) with r = bf16(x + res), in one launch: x, res bf16
    [M, K] (any row stride, contiguous last dim), w [N, K]; or x the f32 split-K partials [S, M, K]
    of o_proj at world size 1 (r = bf16(bf16(their sum in split order) + res), rmsnorm_add_splitk's;
    `normed` or `quant` only: the _splitk_ kernels). The GEMM is written as f32 partials over
    the tuned SPLIT_K ranges of K; `partials=True` returns them ([SPLIT_K, M, N], for consumers that
    add them in split order, as gemm_bf16_rmsnorm's), else their bf16 sum [M, N]. `res_out`: where r
    goes (bf16 [M, K], contiguous, not overlapping `res`; default a new tensor). The torch backend
    computes r, then gemm_bf16_rmsnorm's torch path on it. `invariant` (default): the M=1 entry's
    numerics keys at every M. `normed` (gemm_bf16_addnorm_y): also returns the normed rows
    bf16(rmsnorm(r) * x_norm_w) [M, K] (rmsnorm_add's `out`), a third element; `quant`
    (gemm_bf16_addnorm_yq) also their per-token int8 quant (int8 [M, K], f32 scale [M]: what
    rms_norm_quant returns), fourth and fifth."""
    name = "gemm_bf16_addnorm"
    _backend(name, backend)
    splitk = x.dim() == 3
    if splitk:
        x = _partials(name, x)
        if not (normed or quant):
            raise ValueError(f"{name}: split-K partials in need normed=True or quant=True (world size 1's "
                             "q_a|kv_a GEMM is gemm_bf16_rmsnorm)")
    else:
        check_tensor(name, "x", x, 2, (torch.bfloat16,), last_contiguous=True)
    check_tensor(name, "res", res, 2, (torch.bfloat16,), x.device, last_contiguous=True)
    check_tensor(name, "w", w, 2, (torch.bfloat16,), x.device, last_contiguous=True)
    check_tensor(name, "x_norm_w", x_norm_w, 1, (torch.bfloat16,), x.device, contiguous=True)
    M, K = x.shape[-2:]
    N = w.shape[0]
    if res.shape != x.shape[-2:]:
        raise ValueError(f"{name}: res must have x's rows' shape {tuple(x.shape[-2:])}, got {tuple(res.shape)}")
    if w.shape[1] != K or N < 1 or K < 1:
        raise ValueError(f"{name}: w must be [N >= 1, K={K}] with K >= 1, got {tuple(w.shape)}")
    if x_norm_w.shape[0] != K:
        raise ValueError(f"{name}: x_norm_w must be [K={K}], got {tuple(x_norm_w.shape)}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{name}: eps must be a finite number >= 0, got {eps!r}")
    if res_out is None:
        res_out = torch.empty(M, K, dtype=torch.bfloat16, device=x.device)
    else:
        check_tensor(name, "res_out", res_out, 2, (torch.bfloat16,), x.device, contiguous=True)
        if res_out.shape != res.shape:
            raise ValueError(f"{name}: res_out must be [M={M}, K={K}], got {tuple(res_out.shape)}")
        if M and _overlaps(res_out, res):
            raise ValueError(f"{name}: res_out must not overlap res (every program reads the whole residual row)")
    kern = kernel_for(normed, quant, splitk)
    config = addnorm_config(M, N, K, config, invariant, kern, x.shape[0] if splitk else 0)
    if backend == "torch":
        from ops.norm import rms_norm_quant_ref, rmsnorm_ref

        res_out.copy_(residual_sum_ref(splitk_sum_ref(x) if splitk else x, res))
        gemm = gemm_bf16_rmsnorm(res_out, x_norm_w, w, eps, backend="torch", config=config, partials=partials)
        if quant:
            q, sc, yq, _ = rms_norm_quant_ref(res_out, x_norm_w, eps)
            return gemm, res_out, yq, q, sc
        return (gemm, res_out, rmsnorm_ref(res_out, x_norm_w, eps)) if normed else (gemm, res_out)
    splits = int(config.get("SPLIT_K", 1))
    if splits not in SPLIT_K_DOMAIN:
        raise ValueError(f"{name}: SPLIT_K must be one of {SPLIT_K_DOMAIN}, got {splits!r}")
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    extra: tuple[torch.Tensor, ...] = ()
    if normed or quant:
        extra = (torch.empty(M, K, dtype=torch.bfloat16, device=x.device),)
    if quant:
        extra += (torch.empty(M, K, dtype=torch.int8, device=x.device),
                  torch.empty(M, dtype=torch.float32, device=x.device))
    if M:
        kern(x, res, x_norm_w, w, part, res_out, *extra, float(eps), config=config)
    return (part if partials else splitk_sum_ref(part), res_out, *extra)


def kernel_for(normed: bool = False, quant: bool = False, splitk: bool = False) -> Any:
    """gemm_bf16_addnorm, its _y (normed rows out) or _yq (and their int8 quant) variant; `splitk`:
    the _splitk_y / _splitk_yq kernels (x as split-K partials)."""
    if splitk:
        return KERNELS[4 if quant else 3]
    return KERNELS[2 if quant else int(bool(normed))]


def addnorm_config(M: int, N: int, K: int, config: dict | None = None, invariant: bool = True,
                   kernel: Any = None, splits: int = 0) -> dict[str, Any]:
    """The config of `kernel` (default gemm_bf16_addnorm) at (N, K) (and S = `splits` partials in:
    the _splitk_ kernels): the M=1 entry's numerics keys at every M (`invariant`), launch keys from
    M's bucket; or M's own entry."""
    kernel = kernel or gemm_bf16_addnorm_kernel
    problem = {"N": N, "K": K, **({"S": splits} if splits else {})}
    if invariant or config is not None:
        return invariant_config(kernel, problem, M, config)
    from autotune import lookup_config

    return lookup_config(kernel, kd.current_target().name, problem, max(M, 1))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the [M, K] row blocks a and b share an address (meta tensors have none)."""
    if a.device.type == "meta" or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    sa, sb = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    ea = sa + ((a.shape[0] - 1) * a.stride(0) + a.shape[1]) * a.element_size()
    eb = sb + ((b.shape[0] - 1) * b.stride(0) + b.shape[1]) * b.element_size()
    return sa < eb and sb < ea


@functools.lru_cache(maxsize=None)
def _pays_at(arch: str, N: int, K: int, bucket: int, normed: bool = False, quant: bool = False,
             splits: int = 0) -> bool:
    """The tuned files' figures at one bucket: the fused launch against rmsnorm_add(_quant) + the
    launch gap + gemm_bf16_splitk (the chain it replaces); `splits` > 0: x as that many split-K
    partials, the chain's norm rmsnorm_add(_quant)_splitk."""
    from autotune.costmodel import launch_gap_us
    from ops.gemm import gemm_bf16_splitk_kernel
    from ops.norm import rmsnorm_add, rmsnorm_add_quant, rmsnorm_add_quant_splitk, rmsnorm_add_splitk
    from ops.splitk_norm import _figure

    kern = kernel_for(normed, quant, splits > 0)
    prob = {"N": N, "K": K, **({"S": splits} if splits else {})}
    if (normed or quant) and _split_count(kern, arch, prob) != _split_count(gemm_bf16_splitk_kernel, arch,
                                                                            {"N": N, "K": K}):
        return False   # the shared down GEMM's files are keyed by the chain's split count (S)
    fused = _figure(kern, arch, prob, bucket)
    gemm = _figure(gemm_bf16_splitk_kernel, arch, {"N": N, "K": K}, bucket)
    if splits:
        norm = _figure(rmsnorm_add_quant_splitk if quant else rmsnorm_add_splitk, arch, {"D": K, "S": splits}, bucket)
    else:
        norm = _figure(rmsnorm_add_quant if quant else rmsnorm_add, arch, {"D": K}, bucket)
    if fused is None or gemm is None or norm is None:
        return False
    return fused < gemm + norm + launch_gap_us(arch)


def _split_count(kernel: Any, arch: str, problem: dict[str, int]) -> int | None:
    """SPLIT_K of the kernel's tuned M=1 entry at `problem` (None: no file)."""
    import warnings

    from autotune.store import lookup_figures
    from autotune import lookup_config

    if lookup_figures(kernel, arch, problem, 1) is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return int(lookup_config(kernel, arch, problem, 1).get("SPLIT_K", 1))


def addnorm_pays(arch: str, N: int, K: int, rows: int, normed: bool = False, quant: bool = False,
                 splits: int = 0) -> bool:
    """Whether a model whose decode and verify steps run at most `rows` rows (its cache's slots x
    the verify q_len, at most ops.splitk_norm.FUSED_SPAN) takes gemm_bf16_addnorm for every launch of
    up to `rows` rows (its _y / _yq variant: `normed` / `quant`; over `splits` split-K partials: the
    _splitk_ ones), by the tuned files (a host lookup on shapes):
    True only if it is predicted faster than the chain at EVERY bucket up to `rows` (and, for the
    gate|up + router forms, tuned at the chain GEMM's split count: the shared expert's down GEMM that
    reads the partials has its files at that S). One answer for
    all of them: the fused prologue sums a row's squares in its own order (NORM_K, num_warps), not
    rmsnorm_add's, so a decode row and its verify row must take the same path. Every program re-reads its rows, so the
    fused launch loses at large M (a batch-32 verify): a deployment with that many rows keeps the
    chain. No files (the interpreter): False."""
    from autotune.buckets import LADDER
    from ops.splitk_norm import FUSED_SPAN

    if rows < 1 or rows > FUSED_SPAN:
        return False
    top = next(b for b in LADDER if b >= rows)
    return all(_pays_at(arch, N, K, b, bool(normed), bool(quant), splits) for b in LADDER if b <= top)


KERNELS = (gemm_bf16_addnorm_kernel, gemm_bf16_addnorm_y_kernel, gemm_bf16_addnorm_yq_kernel,
           gemm_bf16_addnorm_splitk_y_kernel, gemm_bf16_addnorm_splitk_yq_kernel)
