"""o_proj's split-K GEMM with its residual-add RMSNorm (+ per-token int8 quant) tail in ONE launch.

The two-launch chain at world size 1 is `ops.gemm.gemm_bf16_splitk` (f32 partials [S, M, D]) then
`ops.norm.rmsnorm_add(_quant)_splitk` (sum the S partials in split order, round to bf16, add the
residual, RMSNorm, quant). The second launch is tiny at decode sizes, and each launch costs a gap
in a graph-replayed step. Here the GEMM's programs finish the reduction themselves ("the last
program finishes", as serial split-K / stream-K fix-ups do), in two levels, with per-launch ticket
counters (`kd.atomic_ticket`) that the caller owns (zeroed once; every launch leaves them at 0):
1. every (M tile, D tile, split) program stores its partial tile, then draws a ticket on its
   (M tile, D tile) counter; the last of the S splits sums the S partial tiles in split order,
   rounds to bf16, adds the residual and stores that tile of the new residual stream `res_out`
   (the distributed part: one program per column tile, all in parallel);
2. it then draws a ticket on its M tile's row counter; the last of the D tiles normalizes (and
   quantizes) the rows of its M tile from `res_out`: the only serial, row-wide part.
Every value is the chain's: `res_out` is the chain's bf16 residual sum (`splitk_rows` + residual,
rounded once) and the row statistics are computed by the chain's own helpers from those bf16
values (ops.norm._norm_quant / _inv_rms), so on the interpreter the bits equal the chain's. On a
GPU the row reduction follows this launch's layout (num_warps): the same for every row at every M
(the numerics keys come from the M=1 entry), not necessarily the chain kernel's.

Counters: [MT * (NT + 1)] int32, MT = cdiv(M, BLOCK_M) row tiles, NT = cdiv(D, BLOCK_N) column
tiles: NT column counters then one row counter per M tile (`counters_needed`). Launches on one
stream run one after another and each returns its counters to 0, so one buffer serves a call site
in every layer.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

import kdsl as kd
from ops._common import check_backend, check_tensor, invariant_config
from ops.gemm import BK_DOMAIN, BM_DOMAIN, BN_DOMAIN, SPLIT_K_DEFAULT, SPLIT_K_DOMAIN, SPLIT_K_SEARCH, splitk_rows
from ops.norm import _inv_rms, _norm_quant

EXAMPLE = {"S": SPLIT_K_DEFAULT, "M": 1, "D": 7168, "K": 8192, "C": 4096}


def _partials_then_tiles(x, w, res, part, res_out, counters):
    """Levels 0 and 1: this program's f32 partial tile part[s, m, d]; the last split of a (m, d)
    tile stores res_out[m, d] = bf16(bf16(sum_s part[s]) + res) and resets its counter; returns
    the M tile for the row-wide level, run (after `kd.exit_if`) only by the last tile of the row."""
    kd.tunable("SPLIT_K", SPLIT_K_DOMAIN, SPLIT_K_DEFAULT, "splits along K (the S dim of part): more programs",
               search=SPLIT_K_SEARCH)
    m, d, s = kd.grid(kd.tile("M", "BLOCK_M", domain=BM_DOMAIN, default=16),
                      kd.tile("D", "BLOCK_N", domain=BN_DOMAIN, default=64), kd.each("S"))
    bk = kd.tunable("BLOCK_K", BK_DOMAIN, 64)
    K = kd.dim("K")
    ks = kd.cdiv(kd.cdiv(K, kd.dim("S")), bk) * bk
    k0 = s * ks
    k1 = kd.minimum(K, k0 + ks)
    span = kd.tiles(start=k0, stop=k1, block="BLOCK_K", domain=BK_DOMAIN, default=64, label="K")
    part[s, m, d] = kd.fold(span, kd.zeros((m, d), kd.f32), lambda k, acc: acc + kd.dot(x[m, k], w[d, k]))
    nt = kd.cdiv(kd.dim("D"), d.size)
    base = m.start // m.size * (nt + 1)
    col = base + d.start // d.size
    tile_ticket = kd.atomic_ticket(counters, [col])
    kd.exit_if(tile_ticket != kd.dim("S") - 1)
    counters[col] = 0
    res_out[m, d] = (splitk_rows(part, m, d) + res[m, d].to(kd.f32)).to(kd.bf16)
    row_ticket = kd.atomic_ticket(counters, [base + nt])
    kd.exit_if(row_ticket != nt - 1)
    counters[base + nt] = 0
    return m


def _rows_of(m):
    """The real rows of the M tile m, one at a time."""
    return kd.indices(kd.minimum(kd.dim("M"), m.start + m.size), start=m.start, label="row")


@kd.kernel(name="gemm_bf16_splitk_norm", static=("D",), example=EXAMPLE)
def gemm_bf16_splitk_norm_kernel(x: kd.In["M", "K", kd.bf16], w: kd.In["D", "K", kd.bf16],
                                 res: kd.In["M", "D", kd.bf16], nw: kd.In["D", kd.bf16],
                                 part: kd.Out["S", "M", "D", kd.f32], out: kd.Out["M", "D", kd.bf16],
                                 res_out: kd.Out["M", "D", kd.bf16], counters: kd.InOut["C", kd.i32],
                                 eps: kd.Scalar[kd.f32]):
    """res_out = bf16(bf16(x @ w^T) + res), out = rmsnorm(res_out) * nw in one launch: the split-K
    GEMM of gemm_bf16_splitk whose last programs run rmsnorm_add_splitk's tail (module doc)."""
    m = _partials_then_tiles(x, w, res, part, res_out, counters)

    def row(r):
        dd = kd.full_range("D")
        rf = res_out[r, dd].to(kd.f32)
        out[r, dd] = rf * _inv_rms(rf, dd, eps) * nw[dd].to(kd.f32)

    kd.fold(_rows_of(m), None, row)


@kd.kernel(name="gemm_bf16_splitk_norm_quant", static=("D",), example=EXAMPLE)
def gemm_bf16_splitk_norm_quant_kernel(x: kd.In["M", "K", kd.bf16], w: kd.In["D", "K", kd.bf16],
                                       res: kd.In["M", "D", kd.bf16], nw: kd.In["D", kd.bf16],
                                       part: kd.Out["S", "M", "D", kd.f32], out: kd.Out["M", "D", kd.bf16],
                                       q: kd.Out["M", "D", kd.i8], scale: kd.Out["M", kd.f32],
                                       res_out: kd.Out["M", "D", kd.bf16], counters: kd.InOut["C", kd.i32],
                                       eps: kd.Scalar[kd.f32]):
    """gemm_bf16_splitk_norm plus rmsnorm_add_quant_splitk's per-token int8 quant of the normed rows."""
    m = _partials_then_tiles(x, w, res, part, res_out, counters)

    def row(r):
        dd = kd.full_range("D")
        rf = res_out[r, dd].to(kd.f32)
        _norm_quant(rf, rf, r, dd, dd, None, nw, out, q, scale, eps)

    kd.fold(_rows_of(m), None, row)


KERNELS = (gemm_bf16_splitk_norm_kernel, gemm_bf16_splitk_norm_quant_kernel)  # by `quant`


def fused_config(M: int, D: int, K: int, quant: bool, config: dict | None = None) -> dict:
    """The batch-invariant config at (D, K): numerics keys (split count, tiles) from the M=1 entry."""
    kernel = gemm_bf16_splitk_norm_quant_kernel if quant else gemm_bf16_splitk_norm_kernel
    return invariant_config(kernel, {"D": D, "K": K}, M, config)


def counters_needed(M: int, D: int, config: dict[str, Any]) -> int:
    """Ticket counters one launch uses: per M tile, its column tiles and one row counter."""
    bm, bn = int(config.get("BLOCK_M", 16)), int(config.get("BLOCK_N", 64))
    return math.ceil(M / bm) * (math.ceil(D / bn) + 1)


def counters_for(max_tokens: int, D: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed counters for any launch of up to `max_tokens` rows at any tile of the domains (the
    smallest tiles need the most): a call site allocates them once, with its other buffers."""
    n = counters_needed(max(1, max_tokens), D, {"BLOCK_M": min(BM_DOMAIN), "BLOCK_N": min(BN_DOMAIN)})
    return torch.zeros(n, dtype=torch.int32, device=device)


def gemm_splitk_add_norm_ref(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                             eps: float, quant: bool, splits: int, block_k: int) -> tuple:
    """The chain in torch: split-K partials, their split-order sum, the residual add, RMSNorm (and
    per-token int8 quant). Returns (q, scale, out, res_out) with quant, else (out, res_out)."""
    from ops.gemm import gemm_bf16_splitk_ref
    from ops.norm import _add_norm_partials

    part = gemm_bf16_splitk_ref(x, w, splits, block_k).to(x.device)
    return _add_norm_partials("gemm_splitk_add_norm", part, norm_w, eps, residual, "torch", None, quant)


def gemm_splitk_add_norm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                         eps: float, counters: torch.Tensor, quant: bool, backend: str = "triton",
                         config: dict | None = None) -> tuple:
    """o_proj + residual add + RMSNorm (+ int8 quant) in one launch: x [M, K] bf16 @ w [D, K]^T, then
    the tail of `ops.norm.rms_norm(_quant)` over the split-K partials with `residual` [M, D].
    Returns (q, scale, out, res_out) with `quant`, else (out, res_out) (the chain's tuples).
    `counters`: int32, zeroed once by the caller (`counters_for`), left at 0 by every launch."""
    op = "gemm_splitk_add_norm"
    check_backend(op, backend)
    check_tensor(op, "x", x, 2, (torch.bfloat16,))
    check_tensor(op, "w", w, 2, (torch.bfloat16,), x.device, contiguous=True)
    check_tensor(op, "residual", residual, 2, (torch.bfloat16,), x.device)
    check_tensor(op, "norm_w", norm_w, 1, (torch.bfloat16,), x.device, contiguous=True)
    check_tensor(op, "counters", counters, 1, (torch.int32,), x.device, contiguous=True)
    M, K = x.shape
    D = w.shape[0]
    if w.shape[1] != K or tuple(residual.shape) != (M, D) or tuple(norm_w.shape) != (D,) or D < 1 or K < 1:
        raise ValueError(f"{op}: need x [M, K], w [D, K], residual [M, D], norm_w [D]; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}, residual {tuple(residual.shape)}, norm_w {tuple(norm_w.shape)}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    cfg = fused_config(M, D, K, quant, config)
    splits = int(cfg.get("SPLIT_K", SPLIT_K_DEFAULT))
    if splits not in SPLIT_K_DOMAIN:
        raise ValueError(f"{op}: SPLIT_K must be one of {SPLIT_K_DOMAIN}, got {splits!r}")
    if backend == "torch":
        return gemm_splitk_add_norm_ref(x, w, residual, norm_w, eps, quant, splits, int(cfg.get("BLOCK_K", 64)))
    need = counters_needed(M, D, cfg)
    if counters.numel() < need:
        raise ValueError(f"{op}: counters hold {counters.numel()} tickets, this launch needs {need} "
                         f"(ops.splitk_norm.counters_for)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    res = residual if residual.stride(-1) == 1 else residual.contiguous()
    part = torch.empty(splits, M, D, dtype=torch.float32, device=x.device)
    out = torch.empty(M, D, dtype=torch.bfloat16, device=x.device)
    r_out = torch.empty_like(out)
    if not quant:
        if M:
            gemm_bf16_splitk_norm_kernel(x, w, res, norm_w, part, out, r_out, counters, float(eps), config=cfg)
        return out, r_out
    q = torch.empty(M, D, dtype=torch.int8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        gemm_bf16_splitk_norm_quant_kernel(x, w, res, norm_w, part, out, q, s, r_out, counters, float(eps),
                                           config=cfg)
    return q, s, out, r_out


def _figure(kernel: Any, arch: str, problem: dict[str, int], bucket: int) -> float | None:
    from autotune.store import lookup_figures

    f = lookup_figures(kernel, arch, problem, bucket)
    return float(f["predicted_us"]) if f and "predicted_us" in f else None


@functools.lru_cache(maxsize=None)
def _pays_at(arch: str, D: int, K: int, quant: bool, bucket: int) -> bool:
    """The tuned files' figures at one bucket: the fused launch (its serial tail included) against
    gemm_bf16_splitk + rmsnorm_add(_quant)_splitk + the launch gap between them."""
    from autotune.costmodel import launch_gap_us
    from autotune.store import lookup_config
    from ops.gemm import gemm_bf16_splitk_kernel
    from ops.norm import rmsnorm_add_quant_splitk, rmsnorm_add_splitk

    fused = _figure(KERNELS[quant], arch, {"D": D, "K": K}, bucket)
    gemm = _figure(gemm_bf16_splitk_kernel, arch, {"N": D, "K": K}, bucket)
    splits = int(lookup_config(gemm_bf16_splitk_kernel, arch, {"N": D, "K": K}, 1).get("SPLIT_K", SPLIT_K_DEFAULT))
    tail = _figure(rmsnorm_add_quant_splitk if quant else rmsnorm_add_splitk, arch, {"D": D, "S": splits}, bucket)
    if fused is None or gemm is None or tail is None:
        return False
    return fused < gemm + tail + launch_gap_us(arch)


# Rows up to which the model's decode and verify steps run (every tuned bucket of the files): one
# path for all of them
FUSED_SPAN = 128


def fused_pays(arch: str, D: int, K: int, quant: bool, M: int) -> bool:
    """Whether the model runs `gemm_splitk_add_norm` instead of the two-launch chain at M rows on
    `arch`, by the tuned files (a host lookup on shapes: no device read): one answer for every M up
    to FUSED_SPAN, True only if the fused launch is predicted faster at EVERY bucket up to it. Why
    not per bucket: a row's bits must not depend on the batch or q_len, and on a GPU the fused tail
    reduces a row's sum of squares in its own layout (its num_warps), not the chain kernel's, so a
    decode row (M = B) and its verify row (M = B x q_len) must take the same path. Above FUSED_SPAN
    (prefill) the chain. No files (the interpreter): False."""
    from autotune.buckets import LADDER

    if M < 1 or M > FUSED_SPAN:
        return False
    return all(_pays_at(arch, D, K, bool(quant), b) for b in LADDER if b <= FUSED_SPAN)
