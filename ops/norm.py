"""RMSNorm (optionally fused with the residual add) and SiLU*mul, written in kdsl.

Why fused: in decode every layer does `r = x + residual; y = rmsnorm(r)`; one pass over the row
saves a round trip to memory. The residual sum is rounded to the activation dtype before the
norm, exactly as an unfused bf16 model would do, so fused and unfused runs agree bit-for-bit.
"""
from __future__ import annotations

import math
from typing import Any

import torch

import kdsl as kd
from ops._common import check_backend, check_tensor, config_for, invariant_config


# A row's outputs are split over BLOCK_D-wide chunks, one program per (row, chunk): at decode a
# handful of rows would otherwise give a handful of programs, too few to pull the row from HBM at
# speed. Every program still reduces its statistics over the WHOLE row with the same full-row tile,
# so the chunk size changes no output bit; only the stores (and their loads) are per chunk.
CHUNKS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CHUNKS_SEARCHED = (256, 512, 1024, 2048, 4096, 8192)
WHOLE_ROW = 8192  # the default chunk: one program per row for rows up to 8192 wide


def _row_and_chunk():
    """(row, full-row tile, chunk tile, chunk is the first of its row): the grid over (M, D chunks).
    A chunk as wide as the row is the row itself (no second load of the same values)."""
    bd = kd.tunable("BLOCK_D", CHUNKS, WHOLE_ROW, "outputs per program along D (the statistics always "
                    "cover the whole row)", search=CHUNKS_SEARCHED)
    d = kd.full_range("D")
    kd.require(bd <= d.size or bd == WHOLE_ROW, "BLOCK_D no wider than the row padded to a power of two "
               "(wider chunks are the same kernel as the row-wide one)", "BLOCK_D")
    row, dc = kd.grid(kd.each("M"), kd.tile("D", "BLOCK_D"))
    if dc.size >= d.size:
        return row, d, d, None
    return row, d, dc, dc.start < 1


def _residual_sum(x, res, row, t):
    """bf16(x + res) over the tile t: one f32 add rounded once, as an unfused bf16 model does."""
    return (x[row, t].to(kd.f32) + res[row, t].to(kd.f32)).to(kd.bf16)


def _inv_rms(rf, d, eps):
    """rsqrt(mean(row^2) + eps) of the whole f32 row (the same reduction in every chunk's program)."""
    ms = kd.sum(rf * rf, axis=d) / kd.static("D")
    return kd.rsqrt(ms + eps)


@kd.kernel(static=("D",), example={"M": 4, "D": 7168})
def rmsnorm(x: kd.In["M", "D", kd.bf16], w: kd.In["D", kd.bf16], out: kd.Out["M", "D", kd.bf16],
            eps: kd.Scalar[kd.f32]):
    """y = x * rsqrt(mean(x^2) + eps) * w, f32 math; one program per (row, BLOCK_D chunk)."""
    row, d, c, _ = _row_and_chunk()
    xf = x[row, d].to(kd.f32)
    inv = _inv_rms(xf, d, eps)
    xc = xf if c is d else x[row, c].to(kd.f32)
    out[row, c] = xc * inv * w[c].to(kd.f32)


@kd.kernel(static=("D",), example={"M": 4, "D": 7168})
def rmsnorm_add(x: kd.In["M", "D", kd.bf16], res: kd.In["M", "D", kd.bf16], w: kd.In["D", kd.bf16],
                out: kd.Out["M", "D", kd.bf16], res_out: kd.Out["M", "D", kd.bf16], eps: kd.Scalar[kd.f32]):
    """res_out = bf16(x + res); out = rmsnorm(res_out) * w. Fused residual add and norm, one program
    per (row, BLOCK_D chunk). The new residual goes to its own tensor: with several programs per
    row, an in-place update would overwrite chunks that another program still reads."""
    row, d, c, _ = _row_and_chunk()
    rd = _residual_sum(x, res, row, d)
    inv = _inv_rms(rd.to(kd.f32), d, eps)
    r = rd if c is d else _residual_sum(x, res, row, c)
    res_out[row, c] = r
    out[row, c] = r.to(kd.f32) * inv * w[c].to(kd.f32)


@kd.kernel(example={"M": 4, "I2": 4096, "I": 2048},
           checks=[("x", lambda d: d["I2"] == 2 * d["I"], "x must be [M, 2*I] (gate | up) for out [M, I]")])
def silu_mul(x: kd.In["M", "I2", kd.bf16], out: kd.Out["M", "I", kd.bf16]):
    """out = silu(gate) * up with x = [gate | up] along the last dim (f32 math)."""
    m, i = kd.grid(kd.each("M"), kd.tile("I", "BLOCK_I", domain=(256, 512, 1024, 2048), default=1024))
    g = x[m, i].to(kd.f32)
    u = x[m, i + kd.dim("I")].to(kd.f32)
    out[m, i] = kd.silu(g) * u


# ---------------------------------------------------------------------------------------------
# torch references

def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rmsnorm_add_ref(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    r = (x.float() + res.float()).to(x.dtype)
    return rmsnorm_ref(r, w, eps), r


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    g, u = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# torch-facing functions

def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _out_rows(op: str, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`out` as the [rows, D] view a norm kernel writes (x's shape, bf16, on x's device, a contiguous
    last dim, rows at any stride that a view expresses)."""
    check_tensor(op, "out", out, None, (torch.bfloat16,), x.device, last_contiguous=True)
    if out.shape != x.shape:
        raise ValueError(f"{op}: out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    try:
        return out.view(-1, out.shape[-1])
    except RuntimeError:
        raise ValueError(f"{op}: out (strides {tuple(out.stride())}) does not view as [rows, {out.shape[-1]}]") from None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
             backend: str = "triton", config: dict[str, Any] | None = None, out: torch.Tensor | None = None):
    """RMSNorm over the last dim. With `residual`: returns (rmsnorm(x + residual), x + residual), the
    sum rounded to x.dtype into a NEW tensor, in the same launch (no copy launch); `residual` is
    only read, so a decode step carries the returned sum as its residual stream. With `residual`
    [M, D], x may be the f32 split-K partials [S, M, D] of the layer output (gemm_bf16_splitk): they
    are added in split order and rounded to bf16 first (`splitk_sum_ref`), in the same launch.
    `out` (no residual): x's shape, bf16, a contiguous last dim and any row stride (e.g. one half of
    a wider row buffer, which then needs no concatenation launch): written and returned."""
    check_backend("rms_norm", backend)
    if out is not None and residual is not None:
        raise ValueError("rms_norm: out= is for the plain norm (no residual)")
    if residual is not None and isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        return _add_norm_partials("rms_norm", x, weight, eps, residual, backend, config, quant=False)
    check_tensor("rms_norm", "x", x, None, (torch.bfloat16,))
    check_tensor("rms_norm", "weight", weight, 1, (torch.bfloat16,), x.device, contiguous=True)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"rms_norm: x needs a non-empty last dim, got shape {tuple(x.shape)}")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"rms_norm: weight has {weight.shape[-1]} elements, x's last dim is {x.shape[-1]}")
    if residual is not None:
        check_tensor("rms_norm", "residual", residual, None, (torch.bfloat16,), x.device)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"rms_norm: eps must be a finite number >= 0, got {eps!r}")
    rows = None if out is None else _out_rows("rms_norm", out, x)
    if backend == "torch":
        if residual is None:
            y = rmsnorm_ref(x, weight, eps)
            return y if out is None else out.copy_(y)
        return rmsnorm_add_ref(x, residual, weight, eps)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    x2 = _rows(x)
    M, D = x2.shape
    if residual is None:
        y = torch.empty_like(x2) if rows is None else rows
        cfg = invariant_config(rmsnorm, {"D": D}, M, config)
        if M:
            rmsnorm(x2, weight, y, float(eps), config=cfg)
        return y.view(x.shape) if out is None else out
    y, r_out = torch.empty_like(x2), torch.empty_like(x2)
    cfg = invariant_config(rmsnorm_add, {"D": D}, M, config)
    if M:
        rmsnorm_add(x2, _rows(residual), weight, y, r_out, float(eps), config=cfg)
    return y.view(x.shape), r_out.view(x.shape)


def silu_and_mul(x: torch.Tensor, backend: str = "triton", config: dict[str, Any] | None = None) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I] (the gate|up layout of a merged MLP projection)."""
    check_backend("silu_and_mul", backend)
    check_tensor("silu_and_mul", "x", x, None, (torch.bfloat16,))
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even (gate | up), got {tuple(x.shape)}")
    if backend == "torch":
        return silu_mul_ref(x)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    x2 = _rows(x)
    M, I2 = x2.shape
    out = torch.empty((M, I2 // 2), dtype=x.dtype, device=x.device)
    cfg = config_for(silu_mul, {"M": M, "I2": I2, "I": I2 // 2}, M, config)
    if M:
        silu_mul(x2, out, config=cfg)
    return out.view(*x.shape[:-1], I2 // 2)


# ---------------------------------------------------------------------------------------------
# residual add + RMSNorm + per-token int8 quant (the A side of a W4A8 GEMM / MoE), one pass

def _norm_quant(rf, rc, row, d, c, first, w, out, q, scale, eps):
    """Shared tail: the bf16 normed row, then its per-token int8 quant (absmax/127, RNE) taken from
    the bf16-rounded values, exactly as quant_per_token_int8 would read them back. rf: the whole f32
    row (the statistics), rc: this program's chunk of it (the stores; rf itself for a row-wide chunk);
    `first` (None for a row-wide chunk) marks the one program of the row that stores its scale."""
    from ops.quant import MIN_ABSMAX, _round_rne

    inv = _inv_rms(rf, d, eps)
    # max |bf16(v)| == bf16(max |v|): RNE rounding is monotone and symmetric, so the absmax of the
    # bf16 rows costs one rounding, not one per element (the row-wide statistic every program pays)
    vmax = kd.max(kd.abs(rf * inv * w[d].to(kd.f32)), axis=d)
    s = kd.maximum(vmax.to(kd.bf16).to(kd.f32), MIN_ABSMAX) / 127.0
    y = (rc * inv * w[c].to(kd.f32)).to(kd.bf16)
    if first is None:
        scale[row] = s
    else:
        kd.store(scale, [row], s, mask=first)
    out[row, c] = y
    q[row, c] = _round_rne(kd.minimum(kd.maximum(y.to(kd.f32) / s, -127.0), 127.0)).to(kd.i32).to(kd.i8)


@kd.kernel(static=("D",), example={"M": 4, "D": 7168})
def rmsnorm_quant(x: kd.In["M", "D", kd.bf16], w: kd.In["D", kd.bf16], out: kd.Out["M", "D", kd.bf16],
                  q: kd.Out["M", "D", kd.i8], scale: kd.Out["M", kd.f32], eps: kd.Scalar[kd.f32]):
    """RMSNorm and per-token int8 quant of the bf16 result in one pass (one program per (row,
    BLOCK_D chunk)): the W4A8 experts read q/scale, bf16 consumers (shared expert, router) read out."""
    row, d, c, first = _row_and_chunk()
    rf = x[row, d].to(kd.f32)
    _norm_quant(rf, rf if first is None else x[row, c].to(kd.f32), row, d, c, first, w, out, q, scale, eps)


@kd.kernel(static=("D",), example={"M": 4, "D": 7168})
def rmsnorm_add_quant(x: kd.In["M", "D", kd.bf16], res: kd.In["M", "D", kd.bf16], w: kd.In["D", kd.bf16],
                      out: kd.Out["M", "D", kd.bf16], q: kd.Out["M", "D", kd.i8], scale: kd.Out["M", kd.f32],
                      res_out: kd.Out["M", "D", kd.bf16], eps: kd.Scalar[kd.f32]):
    """res_out = bf16(x + res); out = rmsnorm(res_out) * w; (q, scale) = per-token int8 of out. One
    launch instead of rmsnorm_add + quant_per_token_int8, one program per (row, BLOCK_D chunk);
    the new residual goes to its own tensor (as in rmsnorm_add)."""
    row, d, c, first = _row_and_chunk()
    rd = _residual_sum(x, res, row, d)
    r = rd if c is d else _residual_sum(x, res, row, c)
    res_out[row, c] = r
    rf = rd.to(kd.f32)
    _norm_quant(rf, rf if c is d else r.to(kd.f32), row, d, c, first, w, out, q, scale, eps)


# ---------------------------------------------------------------------------------------------
# the same residual-add norms reading the layer output as split-K partials [S, M, D] f32 (o_proj's
# gemm_bf16_splitk at world size 1): the partials are added in split order and rounded to bf16 (the
# row the plain GEMM would store) before the residual add, so the GEMM gets S times the programs
# and no launch is added


def _partials_residual_sum(x, res, row, t):
    """bf16(bf16(x[0] + ... + x[S-1]) + res) over the tile t: the split sum in split order, rounded
    as the GEMM's bf16 output (ops.gemm.splitk_rows), then the residual add of _residual_sum."""
    from ops.gemm import splitk_rows

    return (splitk_rows(x, row, t) + res[row, t].to(kd.f32)).to(kd.bf16)


@kd.kernel(static=("D",), example={"S": 2, "M": 4, "D": 7168})
def rmsnorm_add_splitk(x: kd.In["S", "M", "D", kd.f32], res: kd.In["M", "D", kd.bf16], w: kd.In["D", kd.bf16],
                       out: kd.Out["M", "D", kd.bf16], res_out: kd.Out["M", "D", kd.bf16], eps: kd.Scalar[kd.f32]):
    """rmsnorm_add with x given as split-K partials: res_out = bf16(bf16(sum_s x[s]) + res),
    out = rmsnorm(res_out) * w, one program per (row, BLOCK_D chunk)."""
    row, d, c, _ = _row_and_chunk()
    rd = _partials_residual_sum(x, res, row, d)
    inv = _inv_rms(rd.to(kd.f32), d, eps)
    r = rd if c is d else _partials_residual_sum(x, res, row, c)
    res_out[row, c] = r
    out[row, c] = r.to(kd.f32) * inv * w[c].to(kd.f32)


@kd.kernel(static=("D",), example={"S": 2, "M": 4, "D": 7168})
def rmsnorm_add_quant_splitk(x: kd.In["S", "M", "D", kd.f32], res: kd.In["M", "D", kd.bf16],
                             w: kd.In["D", kd.bf16], out: kd.Out["M", "D", kd.bf16], q: kd.Out["M", "D", kd.i8],
                             scale: kd.Out["M", kd.f32], res_out: kd.Out["M", "D", kd.bf16],
                             eps: kd.Scalar[kd.f32]):
    """rmsnorm_add_quant with x given as split-K partials (the residual sum of rmsnorm_add_splitk)."""
    row, d, c, first = _row_and_chunk()
    rd = _partials_residual_sum(x, res, row, d)
    r = rd if c is d else _partials_residual_sum(x, res, row, c)
    res_out[row, c] = r
    rf = rd.to(kd.f32)
    _norm_quant(rf, rf if c is d else r.to(kd.f32), row, d, c, first, w, out, q, scale, eps)


def rms_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Torch reference: rmsnorm(_add)_ref then quant_per_token_int8_ref of the bf16 normed rows."""
    from ops.quant import quant_per_token_int8_ref

    if residual is None:
        y, r = rmsnorm_ref(x, weight, eps), None
    else:
        y, r = rmsnorm_add_ref(x, residual, weight, eps)
    q, s = quant_per_token_int8_ref(y.reshape(-1, y.shape[-1]))
    return q.view(y.shape), s.view(y.shape[:-1]), y, r


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
                   backend: str = "triton", config: dict[str, Any] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q int8 [..., D], scale f32 [...], normed bf16 [..., D], residual_out or None) in one launch.

    With `residual`: residual_out = bf16(x + residual), a NEW tensor written by the same launch
    (`residual` is only read; a decode step carries residual_out on), and the norm runs on it (as
    `rms_norm`). q/scale equal `quantize_int8(normed)` bit for bit. With `residual` [M, D], x may be
    the f32 split-K partials [S, M, D] of the layer output (as `rms_norm`)."""
    if residual is not None and isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        return _add_norm_partials("rms_norm_quant", x, weight, eps, residual, backend, config, quant=True)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"rms_norm_quant: x must be bfloat16, got {x.dtype}")
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rms_norm_quant: weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm_quant: residual must be {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if backend == "torch":
        return rms_norm_quant_ref(x, weight, eps, residual)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    x2 = _rows(x)
    M, D = x2.shape
    out = torch.empty_like(x2)
    q = torch.empty(M, D, dtype=torch.int8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    lead = x.shape[:-1]
    if residual is None:
        cfg = invariant_config(rmsnorm_quant, {"D": D}, M, config)
        if M:
            rmsnorm_quant(x2, weight, out, q, s, float(eps), config=cfg)
        return q.view(x.shape), s.view(lead), out.view(x.shape), None
    r_out = torch.empty_like(x2)
    cfg = invariant_config(rmsnorm_add_quant, {"D": D}, M, config)
    if M:
        rmsnorm_add_quant(x2, _rows(residual), weight, out, q, s, r_out, float(eps), config=cfg)
    return q.view(x.shape), s.view(lead), out.view(x.shape), r_out.view(x.shape)


def _add_norm_partials(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor,
                       backend: str, config: dict[str, Any] | None, quant: bool) -> tuple:
    """rms_norm / rms_norm_quant with `residual` [M, D] and x the f32 split-K partials [S, M, D] (any
    strides, last dim contiguous): rmsnorm_add(_quant)_splitk, one launch. The config comes from the
    M=1 entry of (D, S) at every M (`invariant_config`): a row's bits do not depend on the batch."""
    from ops.gemm import splitk_sum_ref

    check_tensor(op, "x", x, 3, (torch.float32,), last_contiguous=True)
    check_tensor(op, "residual", residual, 2, (torch.bfloat16,), x.device)
    check_tensor(op, "weight", weight, 1, (torch.bfloat16,), x.device, contiguous=True)
    S, M, D = x.shape
    if S < 1 or D < 1 or tuple(residual.shape) != (M, D) or tuple(weight.shape) != (D,):
        raise ValueError(f"{op}: partials x [S, M, D] need S, D >= 1, residual [M, D] and weight [D], got x "
                         f"{tuple(x.shape)}, residual {tuple(residual.shape)}, weight {tuple(weight.shape)}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    if backend == "torch":
        xs = splitk_sum_ref(x)
        return rms_norm_quant_ref(xs, weight, eps, residual) if quant else rmsnorm_add_ref(xs, residual, weight, eps)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    res = _rows(residual)
    out, r_out = torch.empty_like(res), torch.empty_like(res)
    kernel = rmsnorm_add_quant_splitk if quant else rmsnorm_add_splitk
    cfg = invariant_config(kernel, {"D": D, "S": S}, M, config)
    if not quant:
        if M:
            rmsnorm_add_splitk(x, res, weight, out, r_out, float(eps), config=cfg)
        return out, r_out
    q = torch.empty(M, D, dtype=torch.int8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        rmsnorm_add_quant_splitk(x, res, weight, out, q, s, r_out, float(eps), config=cfg)
    return q, s, out, r_out
