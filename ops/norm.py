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
from ops._common import check_backend, check_tensor, config_for


@kd.kernel(static=("D",), example={"M": 4, "D": 7168})
def rmsnorm(x: kd.In["M", "D", kd.bf16], w: kd.In["D", kd.bf16], out: kd.Out["M", "D", kd.bf16],
            eps: kd.Scalar[kd.f32]):
    """y = x * rsqrt(mean(x^2) + eps) * w, one program per row, f32 math."""
    row, = kd.grid(kd.each("M"))
    d = kd.full_range("D")
    xv = x[row, d].to(kd.f32)
    ms = kd.sum(xv * xv, axis=d) / kd.static("D")
    out[row, d] = xv * kd.rsqrt(ms + eps) * w[d].to(kd.f32)


@kd.kernel(static=("D",), example={"M": 4, "D": 7168})
def rmsnorm_add(x: kd.In["M", "D", kd.bf16], res: kd.InOut["M", "D", kd.bf16], w: kd.In["D", kd.bf16],
                out: kd.Out["M", "D", kd.bf16], eps: kd.Scalar[kd.f32]):
    """res <- bf16(x + res); out = rmsnorm(res) * w. Fused residual add and norm, one row per program."""
    row, = kd.grid(kd.each("M"))
    d = kd.full_range("D")
    r = (x[row, d].to(kd.f32) + res[row, d].to(kd.f32)).to(kd.bf16)
    res[row, d] = r
    rf = r.to(kd.f32)
    ms = kd.sum(rf * rf, axis=d) / kd.static("D")
    out[row, d] = rf * kd.rsqrt(ms + eps) * w[d].to(kd.f32)


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
             backend: str = "triton", config: dict[str, Any] | None = None, inplace: bool = False):
    """RMSNorm over the last dim. With `residual`: returns (rmsnorm(x + residual), x + residual), the
    sum rounded to x.dtype; `residual` is not modified (a new tensor holds the sum) unless
    `inplace=True` (a contiguous residual): then the sum is written into it and it is returned
    (no copy launch: what a decode step wants for its residual stream)."""
    check_backend("rms_norm", backend)
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
    if inplace and (residual is None or not residual.is_contiguous()):
        raise ValueError("rms_norm: inplace=True needs a contiguous residual")
    if backend == "torch":
        if residual is None:
            return rmsnorm_ref(x, weight, eps)
        y, r = rmsnorm_add_ref(x, residual, weight, eps)
        if inplace:
            residual.copy_(r)
            r = residual
        return y, r
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    x2 = _rows(x)
    M, D = x2.shape
    out = torch.empty_like(x2)
    if residual is None:
        cfg = config_for(rmsnorm, {"M": M, "D": D}, M, config)
        if M:
            rmsnorm(x2, weight, out, float(eps), config=cfg)
        return out.view(x.shape)
    r2 = residual.view(-1, D) if inplace else residual.reshape(-1, D).clone()
    cfg = config_for(rmsnorm_add, {"M": M, "D": D}, M, config)
    if M:
        rmsnorm_add(x2, r2, weight, out, float(eps), config=cfg)
    return out.view(x.shape), (residual if inplace else r2.view(x.shape))


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

def _norm_quant_tail(rf, row, d, w, out, q, scale, eps):
    """Shared tail: bf16 normed row (stored), then its per-token int8 quant (absmax/127, RNE) taken
    from the bf16-rounded values, exactly as quant_per_token_int8 would read them back."""
    from ops.quant import MIN_ABSMAX, _round_rne

    ms = kd.sum(rf * rf, axis=d) / kd.static("D")
    y = (rf * kd.rsqrt(ms + eps) * w[d].to(kd.f32)).to(kd.bf16)
    out[row, d] = y
    yf = y.to(kd.f32)
    s = kd.maximum(kd.max(kd.abs(yf), axis=d), MIN_ABSMAX) / 127.0
    scale[row] = s
    q[row, d] = _round_rne(kd.minimum(kd.maximum(yf / s, -127.0), 127.0)).to(kd.i32).to(kd.i8)


@kd.kernel(static=("D",), example={"M": 4, "D": 7168})
def rmsnorm_quant(x: kd.In["M", "D", kd.bf16], w: kd.In["D", kd.bf16], out: kd.Out["M", "D", kd.bf16],
                  q: kd.Out["M", "D", kd.i8], scale: kd.Out["M", kd.f32], eps: kd.Scalar[kd.f32]):
    """RMSNorm and per-token int8 quant of the bf16 result in one pass (one row per program): the
    W4A8 experts read q/scale, bf16 consumers (shared expert, router) read out."""
    row, = kd.grid(kd.each("M"))
    d = kd.full_range("D")
    _norm_quant_tail(x[row, d].to(kd.f32), row, d, w, out, q, scale, eps)


@kd.kernel(static=("D",), example={"M": 4, "D": 7168})
def rmsnorm_add_quant(x: kd.In["M", "D", kd.bf16], res: kd.InOut["M", "D", kd.bf16], w: kd.In["D", kd.bf16],
                      out: kd.Out["M", "D", kd.bf16], q: kd.Out["M", "D", kd.i8], scale: kd.Out["M", kd.f32],
                      eps: kd.Scalar[kd.f32]):
    """res <- bf16(x + res); out = rmsnorm(res) * w; (q, scale) = per-token int8 of out. One launch
    instead of rmsnorm_add + quant_per_token_int8, one row per program."""
    row, = kd.grid(kd.each("M"))
    d = kd.full_range("D")
    r = (x[row, d].to(kd.f32) + res[row, d].to(kd.f32)).to(kd.bf16)
    res[row, d] = r
    _norm_quant_tail(r.to(kd.f32), row, d, w, out, q, scale, eps)


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
                   inplace: bool = False, backend: str = "triton", config: dict[str, Any] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q int8 [..., D], scale f32 [...], normed bf16 [..., D], residual_out or None) in one launch.

    With `residual`: residual_out = bf16(x + residual) and the norm runs on it (as `rms_norm`);
    `inplace=True` writes the sum into `residual` itself (contiguous bf16; saves the copy launch a
    decode step would otherwise pay), else a new tensor holds it. q/scale equal
    `quantize_int8(normed)` bit for bit."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"rms_norm_quant: x must be bfloat16, got {x.dtype}")
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rms_norm_quant: weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm_quant: residual must be {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if inplace and (residual is None or not residual.is_contiguous()):
        raise ValueError("rms_norm_quant: inplace=True needs a contiguous residual")
    if backend == "torch":
        q, s, y, r = rms_norm_quant_ref(x, weight, eps, residual)
        if inplace:
            residual.copy_(r)
            r = residual
        return q, s, y, r
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    x2 = _rows(x)
    M, D = x2.shape
    out = torch.empty_like(x2)
    q = torch.empty(M, D, dtype=torch.int8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    lead = x.shape[:-1]
    if residual is None:
        cfg = config_for(rmsnorm_quant, {"M": M, "D": D}, M, config)
        if M:
            rmsnorm_quant(x2, weight, out, q, s, float(eps), config=cfg)
        return q.view(x.shape), s.view(lead), out.view(x.shape), None
    r2 = residual.view(-1, D) if inplace else residual.reshape(-1, D).clone()
    cfg = config_for(rmsnorm_add_quant, {"M": M, "D": D}, M, config)
    if M:
        rmsnorm_add_quant(x2, r2, weight, out, q, s, float(eps), config=cfg)
    return q.view(x.shape), s.view(lead), out.view(x.shape), (residual if inplace else r2.view(x.shape))
