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
from dataclasses import dataclass
from typing import Any

import torch

import kdsl as kd
from ops._common import check_tensor, invariant_config
from ops.gemm import (BN_DOMAIN, MMA_ROWS, NORM_BM_DOMAIN, NORM_K_DOMAIN, NORM_SPLIT_SEARCH, SPLIT_K_DOMAIN, _backend,
                      _mma_rows, _partials, gemm_bf16_rmsnorm, output_split_gemm, splitk_sum_ref)
from ops.moe import route_and_align
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


def _addnorm_gemm(x, res, xw, w, part, res_out, eps, y=None, q=None, scale=None, rsum=_residual_sum, tail=None):
    """The kernels' body: part[p] = bf16(rmsnorm(r) * xw)[:, Kp] @ w[:, Kp]^T in f32 over the K range
    Kp of output split p (gemm_bf16_splitk's ranges), r = bf16(x + res) (`rsum`: x bf16 rows, or
    _partials_residual_sum: x split-K partials, bf16(bf16(their sum) + res)); res_out = r (and y = the
    normed bf16 rows; q, scale = their per-token int8 quant), stored by the programs of the first
    column tile for their K range (masked stores in the main loop). Each program sums its real
    rows' squares over all of K (a row at a time: BLOCK_M is a launch-only key, rows sit at their
    own place of the aligned 16 of the matrix dot), then scales each A tile by rstd * xw and rounds
    it to bf16 before the dot: rmsnorm_add's expressions. With q, the first column's programs also
    take each row's absmax in a second pass over the row (rmsnorm_add_quant's scale, absmax/127,
    and RNE codes; the other programs run no iteration of it). `tail(m, n, part)`: work after the
    main loop (the route kernels' `_route_tail`, passed in so that the base kernels reach none of it)."""
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
    if tail is not None:
        tail(m, n, part)


class _RouterColumns:
    """The router logits [P, M, E] as the last E columns of the partials part [P, M, N] (a view, not
    an operand: fewer kernel arguments, whose scalar registers the main loop needs)."""

    def __init__(self, part):
        self.part, self.splits = part, kd.dim("P")
        self.first = kd.dim("N") - kd.static("E")

    def __getitem__(self, idx):
        s, m, e = idx
        return self.part[s, m, e + self.first]


class _Segment:
    """`n` elements of a packed i32 operand from `off` on, stored like an operand of their own (every
    store masked to the segment): the route tail's block map and sorted slots share one operand."""

    def __init__(self, op, off, n):
        self.op, self.off, self.n = op, off, n

    def __setitem__(self, idx, value):
        self.op.store(idx + self.off, value=value, mask=idx < self.n)

    def store(self, idx, value, mask=None):
        inside = idx < self.n
        self.op.store(idx + self.off, value=value, mask=inside if mask is None else mask & inside)


def _route_tail(m, n, part, bias, ids, wts, aligned, counters, scale, lo):
    """The MoE routing of the M tokens, after the grid, by its last program (`kd.atomic_ticket` on
    counters[0], left at 0 for the next launch): ops.moe.route_and_align over the router columns of
    the partials every program stored (the last E of N), the same ids, weights, block map and sorted
    slots (both in `aligned`: NB block experts, then SL slots) as `moe_route_align(_local)` (the same
    helper), one launch and gap fewer. The tail's arguments are few and its dims compile-time (N, K,
    P too): the scalar registers of kernel arguments stay live through the main loop, and gfx942's
    _splitk_y spilled them with a pointer per output."""
    programs = kd.cdiv(kd.dim("M"), m.size) * kd.cdiv(kd.dim("N"), n.size) * kd.dim("P")
    ticket = kd.atomic_ticket(counters, [0])
    kd.exit_if(ticket != programs - 1)
    counters[0] = 0
    nb = kd.static("NB")
    route_and_align(_RouterColumns(part), bias, ids, wts, _Segment(aligned, 0, nb),
                    _Segment(aligned, nb, kd.static("SL")), scale, lo, slots="SL")


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


# the route tail's operands and dims (ops.moe.moe_route_align's; SL: sorted_ids' slots, AL = NB + SL:
# the packed block map and slots, C: counters)
_ROUTE_STATIC = ("E", "TOPK", "NG", "TOPKG", "NORM", "SOFTMAX", "EA", "BM", "MB", "N", "K", "P", "NB", "SL", "AL", "C")
_ROUTE_EXAMPLE = {"E": 384, "TOPK": 8, "NG": 1, "TOPKG": 1, "NORM": 1, "SOFTMAX": 0, "EA": 384, "BM": 16,
                  "MB": 1, "NB": 9, "SL": 144, "AL": 153, "C": 1}
_ROUTE_CHECKS = (("bias", lambda d: d["E"] <= d["N"], "the router columns are the last E of the N outputs"),
                 ("aligned", lambda d: d["AL"] == d["NB"] + d["SL"], "aligned holds the block map, then the slots"),
                 ("MB", lambda d: d["M"] <= d["MB"], "MB (the token tile) must cover M"))


@kd.kernel(name="gemm_bf16_addnorm_y_route", static=_ROUTE_STATIC, checks=_ROUTE_CHECKS, contiguous=True,
           example={"P": 1, "M": 1, "N": 896, "K": 7168, **_ROUTE_EXAMPLE})
def gemm_bf16_addnorm_y_route_kernel(
        x: kd.In["M", "K", kd.bf16], res: kd.In["M", "K", kd.bf16], xw: kd.In["K", kd.bf16],
        w: kd.In["N", "K", kd.bf16], part: kd.Out["P", "M", "N", kd.f32], res_out: kd.Out["M", "K", kd.bf16],
        y: kd.Out["M", "K", kd.bf16], bias: kd.In["E", kd.f32], ids: kd.Out["M", "TOPK", kd.i32],
        wts: kd.Out["M", "TOPK", kd.f32], aligned: kd.Out["AL", kd.i32], counters: kd.InOut["C", kd.i32],
        NB: kd.Dim, SL: kd.Dim, NG: kd.Dim, TOPKG: kd.Dim, NORM: kd.Dim, SOFTMAX: kd.Dim, EA: kd.Dim, BM: kd.Dim,
        MB: kd.Dim, eps: kd.Scalar[kd.f32], rscale: kd.Scalar[kd.f32], lo: kd.Scalar[kd.i32]):
    """gemm_bf16_addnorm_y whose last program then routes and aligns the tokens (`_route_tail`)."""
    _addnorm_gemm(x, res, xw, w, part, res_out, eps, y,
                  tail=lambda m, n, part: _route_tail(m, n, part, bias, ids, wts, aligned, counters, rscale, lo))


@kd.kernel(name="gemm_bf16_addnorm_yq_route", static=_ROUTE_STATIC, checks=_ROUTE_CHECKS, contiguous=True,
           example={"P": 1, "M": 1, "N": 896, "K": 7168, **_ROUTE_EXAMPLE})
def gemm_bf16_addnorm_yq_route_kernel(
        x: kd.In["M", "K", kd.bf16], res: kd.In["M", "K", kd.bf16], xw: kd.In["K", kd.bf16],
        w: kd.In["N", "K", kd.bf16], part: kd.Out["P", "M", "N", kd.f32], res_out: kd.Out["M", "K", kd.bf16],
        y: kd.Out["M", "K", kd.bf16], q: kd.Out["M", "K", kd.i8], scale: kd.Out["M", kd.f32],
        bias: kd.In["E", kd.f32], ids: kd.Out["M", "TOPK", kd.i32], wts: kd.Out["M", "TOPK", kd.f32],
        aligned: kd.Out["AL", kd.i32], counters: kd.InOut["C", kd.i32],
        NB: kd.Dim, SL: kd.Dim, NG: kd.Dim, TOPKG: kd.Dim, NORM: kd.Dim, SOFTMAX: kd.Dim, EA: kd.Dim, BM: kd.Dim,
        MB: kd.Dim, eps: kd.Scalar[kd.f32], rscale: kd.Scalar[kd.f32], lo: kd.Scalar[kd.i32]):
    """gemm_bf16_addnorm_yq whose last program then routes and aligns the tokens (`_route_tail`)."""
    _addnorm_gemm(x, res, xw, w, part, res_out, eps, y, q, scale,
                  tail=lambda m, n, part: _route_tail(m, n, part, bias, ids, wts, aligned, counters, rscale, lo))


@kd.kernel(name="gemm_bf16_addnorm_splitk_y_route", static=_ROUTE_STATIC + ("S",), checks=_ROUTE_CHECKS,
           contiguous=True, example={"S": 4, "P": 1, "M": 1, "N": 4480, "K": 7168, **_ROUTE_EXAMPLE})
def gemm_bf16_addnorm_splitk_y_route_kernel(
        x: kd.In["S", "M", "K", kd.f32], res: kd.In["M", "K", kd.bf16], xw: kd.In["K", kd.bf16],
        w: kd.In["N", "K", kd.bf16], part: kd.Out["P", "M", "N", kd.f32], res_out: kd.Out["M", "K", kd.bf16],
        y: kd.Out["M", "K", kd.bf16], bias: kd.In["E", kd.f32], ids: kd.Out["M", "TOPK", kd.i32],
        wts: kd.Out["M", "TOPK", kd.f32], aligned: kd.Out["AL", kd.i32], counters: kd.InOut["C", kd.i32],
        NB: kd.Dim, SL: kd.Dim, NG: kd.Dim, TOPKG: kd.Dim, NORM: kd.Dim, SOFTMAX: kd.Dim, EA: kd.Dim, BM: kd.Dim,
        MB: kd.Dim, eps: kd.Scalar[kd.f32], rscale: kd.Scalar[kd.f32], lo: kd.Scalar[kd.i32]):
    """gemm_bf16_addnorm_splitk_y whose last program then routes and aligns the tokens (`_route_tail`)."""
    _addnorm_gemm(x, res, xw, w, part, res_out, eps, y, rsum=_partials_residual_sum,
                  tail=lambda m, n, part: _route_tail(m, n, part, bias, ids, wts, aligned, counters, rscale, lo))


@kd.kernel(name="gemm_bf16_addnorm_splitk_yq_route", static=_ROUTE_STATIC + ("S",), checks=_ROUTE_CHECKS,
           contiguous=True, example={"S": 4, "P": 1, "M": 1, "N": 4480, "K": 7168, **_ROUTE_EXAMPLE})
def gemm_bf16_addnorm_splitk_yq_route_kernel(
        x: kd.In["S", "M", "K", kd.f32], res: kd.In["M", "K", kd.bf16], xw: kd.In["K", kd.bf16],
        w: kd.In["N", "K", kd.bf16], part: kd.Out["P", "M", "N", kd.f32], res_out: kd.Out["M", "K", kd.bf16],
        y: kd.Out["M", "K", kd.bf16], q: kd.Out["M", "K", kd.i8], scale: kd.Out["M", kd.f32],
        bias: kd.In["E", kd.f32], ids: kd.Out["M", "TOPK", kd.i32], wts: kd.Out["M", "TOPK", kd.f32],
        aligned: kd.Out["AL", kd.i32], counters: kd.InOut["C", kd.i32],
        NB: kd.Dim, SL: kd.Dim, NG: kd.Dim, TOPKG: kd.Dim, NORM: kd.Dim, SOFTMAX: kd.Dim, EA: kd.Dim, BM: kd.Dim,
        MB: kd.Dim, eps: kd.Scalar[kd.f32], rscale: kd.Scalar[kd.f32], lo: kd.Scalar[kd.i32]):
    """gemm_bf16_addnorm_splitk_yq whose last program then routes and aligns the tokens (`_route_tail`)."""
    _addnorm_gemm(x, res, xw, w, part, res_out, eps, y, q, scale, rsum=_partials_residual_sum,
                  tail=lambda m, n, part: _route_tail(m, n, part, bias, ids, wts, aligned, counters, rscale, lo))


def residual_sum_ref(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """bf16(x + res), one f32 add rounded once (ops.norm.rmsnorm_add's res_out)."""
    return (x.float() + res.float()).to(torch.bfloat16)


@dataclass(frozen=True)
class RouteTail:
    """The MoE routing a gate|up + router GEMM runs after its grid (`gemm_bf16_addnorm(route=)`): the
    arguments of ops.moe.route_align for the router columns, the last E = bias.shape[0] of w's rows.
    `local` (expert parallel): the rank's (first expert, count). `counters`: the int32 ticket counter
    (element 0, zero between launches; each launch leaves it at 0), the caller's so that it exists
    before a graph capture; None: this module's per-device one."""
    bias: torch.Tensor
    top_k: int
    block_m: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    local: tuple[int, int] | None = None
    counters: torch.Tensor | None = None


def route_tail_fits(m: int, n_experts: int, top_k: int) -> bool:
    """Whether `gemm_bf16_addnorm(route=)` can route m tokens in its tail: what one moe_route_align
    program does with the few-rows align (p2(m) x top_k <= ops.moe.ALIGN_ROWS_MAX_T)."""
    from ops.moe import ALIGN_ROWS_MAX_T, _p2, route_align_fuses

    return route_align_fuses(m, n_experts, top_k) and _p2(m) * top_k <= ALIGN_ROWS_MAX_T


_COUNTERS: dict[str, torch.Tensor] = {}


def _ticket_counter(device: torch.device) -> torch.Tensor:
    """The route tail's ticket counter on `device`: zeroed once, every launch leaves it at 0 (launches
    on one stream run one after another), so one buffer serves every layer and graph replay."""
    key = str(device)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _route_operands(name: str, route: RouteTail, res: torch.Tensor, w: torch.Tensor) -> tuple[tuple, tuple]:
    """(tensors the route tail writes: ids, weights, sorted slots, block map; the kernel's route
    arguments after y/q/scale) for `route` over the router columns (the last E rows of w; res stands
    for the routed rows), checked as ops.moe.route_align checks them."""
    from ops.moe import _check_route, route_align_operands

    check_tensor(name, "route.bias", route.bias, 1, (torch.float32, torch.bfloat16, torch.float16), w.device)
    M, (N, E) = res.shape[0], (w.shape[0], route.bias.shape[0])
    if not 1 <= E <= N:
        raise ValueError(f"{name}: the router columns (E={E}) must be among the N={N} outputs")
    _check_route(res, w[N - E:], route.bias, route.top_k, route.n_group, route.topk_group, route.scoring_func,
                 route.local)
    if isinstance(route.block_m, bool) or not isinstance(route.block_m, int) or route.block_m < 1:
        raise ValueError(f"{name}: route.block_m must be a positive int, got {route.block_m!r}")
    if not route_tail_fits(M, E, route.top_k):
        raise ValueError(f"{name}: routing {M} tokens (top_k={route.top_k}, {E} experts) is more than one "
                         "program's route tail (route_tail_fits)")
    n = route.local[1] if route.local is not None else E
    outs, args, aligned = route_align_operands(M, route.bias, route.top_k, route.n_group, route.topk_group,
                                               route.norm_topk_prob, route.scoring_func, n, route.block_m)
    counters = route.counters if route.counters is not None else _ticket_counter(w.device)
    check_tensor(name, "route.counters", counters, 1, (torch.int32,), w.device)
    sid, bexp = outs[2:]
    return outs, (*args[:3], aligned, counters, bexp.shape[0], sid.shape[0], *args[5:])


def gemm_bf16_addnorm(x: torch.Tensor, res: torch.Tensor, x_norm_w: torch.Tensor, w: torch.Tensor, eps: float,
                      backend: str = "triton", config: dict | None = None, invariant: bool = True,
                      partials: bool = False, res_out: torch.Tensor | None = None, normed: bool = False,
                      quant: bool = False, route: RouteTail | None = None) -> tuple[torch.Tensor, ...]:
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
    rms_norm_quant returns), fourth and fifth. `route` (`normed` or `quant`; `route_tail_fits`): the
    grid's last program then routes and aligns the tokens over the router columns (the last E rows
    of w), the same bits as ops.moe.route_align on those partials; (ids, weights, sorted_ids,
    block_expert) follow the other outputs."""
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
    if route is not None and not (normed or quant):
        raise ValueError(f"{name}: route= needs normed=True or quant=True (the MoE half's first GEMM)")
    kern = kernel_for(normed, quant, splitk, route is not None)
    explicit = config
    config = addnorm_config(M, N, K, config, invariant, kernel_for(normed, quant, splitk), x.shape[0] if splitk else 0)
    if backend == "torch":
        from ops.norm import rms_norm_quant_ref, rmsnorm_ref

        res_out.copy_(residual_sum_ref(splitk_sum_ref(x) if splitk else x, res))
        parts = gemm_bf16_rmsnorm(res_out, x_norm_w, w, eps, backend="torch", config=config, partials=True)
        gemm = parts if partials else splitk_sum_ref(parts)
        if quant:
            q, sc, yq, _ = rms_norm_quant_ref(res_out, x_norm_w, eps)
            out: tuple[torch.Tensor, ...] = (gemm, res_out, yq, q, sc)
        else:
            out = (gemm, res_out, rmsnorm_ref(res_out, x_norm_w, eps)) if normed else (gemm, res_out)
        return out + (_route_torch(route, out[2], w, parts) if route is not None else ())
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
    routed: tuple = ()
    if route is not None:
        routed, rargs = _route_operands(name, route, res, w)
        if M:      # the route form: its base's numerics, launch keys of its own (its file's)
            rcfg = config if explicit is not None else _route_config(kern, config, N, K, x.shape[0] if splitk else 0,
                                                                     route, M)
            lo = route.local[0] if route.local is not None else 0
            kern(x, res, x_norm_w, w, part, res_out, *extra, *rargs, float(eps), float(route.routed_scaling_factor),
                 int(lo), config=rcfg)
    elif M:
        kern(x, res, x_norm_w, w, part, res_out, *extra, float(eps), config=config)
    return (part if partials else splitk_sum_ref(part), res_out, *extra, *routed)


def _route_key(route: RouteTail) -> dict[str, int]:
    """The route form's key dims beyond its base's (moe_route_align's)."""
    E = route.bias.shape[0]
    return {"E": E, "TOPK": route.top_k, "NG": route.n_group, "EA": route.local[1] if route.local is not None else E,
            "BM": route.block_m}


def _route_config(kernel: Any, base_config: dict[str, Any], N: int, K: int, splits: int, route: RouteTail,
                  M: int) -> dict[str, Any]:
    """The route form's config at M: its own file's (the base file's numerics tile, launch keys
    searched for the longer kernel: autotune configs_of) where that file keeps the numerics of
    `base_config`, else `base_config` itself (no file, or one tuned against other numerics): the
    GEMM's bits are the base's either way."""
    import warnings

    from autotune import lookup_config
    from autotune.problems import launch_only_keys
    from autotune.store import lookup_figures

    prob = {"N": N, "K": K, **({"S": splits} if splits else {}), **_route_key(route)}
    arch = kd.current_target().name
    if lookup_figures(kernel, arch, prob, max(M, 1)) is None:
        return base_config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        own = lookup_config(kernel, arch, prob, max(M, 1))
    keys = launch_only_keys(kernel, own)
    if any(own.get(k) != v for k, v in base_config.items() if k not in keys):
        return base_config
    return own


def _route_torch(route: RouteTail, rows: torch.Tensor, w: torch.Tensor, parts: torch.Tensor) -> tuple:
    """The torch backend's route tail: ops.moe.route_align's torch path over the router columns."""
    from ops.moe import route_align

    E = route.bias.shape[0]
    return route_align(rows, w[w.shape[0] - E:], route.bias, route.top_k, route.n_group, route.topk_group,
                       route.norm_topk_prob, route.routed_scaling_factor, block_m=route.block_m, backend="torch",
                       scoring_func=route.scoring_func, local=route.local, logits=parts[..., w.shape[0] - E:])


def kernel_for(normed: bool = False, quant: bool = False, splitk: bool = False, route: bool = False) -> Any:
    """gemm_bf16_addnorm, its _y (normed rows out) or _yq (and their int8 quant) variant; `splitk`:
    the _splitk_y / _splitk_yq kernels (x as split-K partials); `route` (_y / _yq forms): the
    variant whose last program routes the tokens (`_route_tail`)."""
    if route:
        return ROUTE_KERNELS[2 * int(splitk) + int(bool(quant))]
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


@functools.lru_cache(maxsize=None)
def route_tail_pays(arch: str, N: int, K: int, rows: int, quant: bool, splits: int, n_experts: int, top_k: int,
                    n_group: int, n_local: int, block_m: int) -> bool:
    """Whether the shared gate|up + router GEMM (gemm_bf16_addnorm's _y / _yq form at (N, K), over
    `splits` split-K partials: _splitk_) routes `rows` tokens in its last program (`route=`) rather
    than leave it to moe_route_align (_local with `n_local` < `n_experts` experts), by the tuned files:
    the route form's figures (its own file: the base file's numerics, its own launch keys; spills of
    the longer kernel show there) against the base's + route_align's + the launch gap, at rows'
    bucket. Per bucket, not per deployment: the tail changes no bit of the GEMM or of the routing. No
    files: False."""
    import warnings

    from autotune import lookup_config
    from autotune.costmodel import launch_gap_us
    from autotune.problems import launch_only_keys
    from ops.moe import moe_route_align, moe_route_align_local
    from ops.splitk_norm import _figure

    if not route_tail_fits(rows, n_experts, top_k):
        return False
    base, route = kernel_for(True, quant, splits > 0), kernel_for(True, quant, splits > 0, route=True)
    prob = {"N": N, "K": K, **({"S": splits} if splits else {})}
    rkey = {"E": n_experts, "TOPK": top_k, "NG": n_group, "EA": n_local, "BM": block_m}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ran, want = lookup_config(route, arch, {**prob, **rkey}, rows), lookup_config(base, arch, prob, rows)
    keys = launch_only_keys(route, ran)
    if any(ran.get(k) != v for k, v in want.items() if k not in keys):
        return False     # the route file was tuned against other numerics of the base: its figures say nothing
    align = moe_route_align_local if n_local < n_experts else moe_route_align
    tail, gemm, alone = (_figure(route, arch, {**prob, **rkey}, rows), _figure(base, arch, prob, rows),
                         _figure(align, arch, rkey, rows))
    return None not in (tail, gemm, alone) and tail < gemm + alone + launch_gap_us(arch)


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
ROUTE_KERNELS = (gemm_bf16_addnorm_y_route_kernel, gemm_bf16_addnorm_yq_route_kernel,
                 gemm_bf16_addnorm_splitk_y_route_kernel, gemm_bf16_addnorm_splitk_yq_route_kernel)
