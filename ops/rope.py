"""Rotary position embedding: the rotation is a kdsl kernel; the cos/sin cache is built in torch.

Two pairings: `interleaved` (GPT-J pairs (2i, 2i+1), the MLA rope dims of DeepSeek-V3/Kimi, output
kept interleaved as vLLM does: q_pe and k_pe use the same layout so q.k is unchanged) and `neox`
(pairs (i, i + R/2), the EAGLE-3 Llama draft). YaRN (DeepSeek flavour) blends interpolated and
extrapolated inverse frequencies over a linear ramp between the beta_fast/beta_slow correction dims
and multiplies cos/sin by mscale(factor, mscale)/mscale(factor, mscale_all_dim) (1.0 for Kimi).
"""
from __future__ import annotations

import math
from typing import Any

import torch

import kdsl as kd
from ops._common import check_backend, check_tensor, config_for


def _rotate(x, cos, sin, out, neox: bool) -> None:
    t, h = kd.grid(kd.each("T"), kd.tile("H", "BLOCK_H", domain=(1, 2, 4, 8, 16, 32, 64), default=16))
    i = kd.full_range("R2")
    c = cos[t, i]
    s = sin[t, i]
    if neox:
        lo, hi = i, i + kd.static("R2")
    else:
        lo, hi = i * 2, i * 2 + 1
    x0 = x[t, h, lo].to(kd.f32)
    x1 = x[t, h, hi].to(kd.f32)
    out[t, h, lo] = x0 * c - x1 * s
    out[t, h, hi] = x1 * c + x0 * s


_checks = [("x", lambda d: d["R"] == 2 * d["R2"], "rope dim R of x must be twice the cos/sin width R2")]


@kd.kernel(static=("R", "R2"), example={"T": 4, "H": 64, "R": 64, "R2": 32}, checks=_checks)
def rope_interleaved(x: kd.In["T", "H", "R", kd.bf16], cos: kd.In["T", "R2", kd.f32], sin: kd.In["T", "R2", kd.f32],
                     out: kd.Out["T", "H", "R", kd.bf16]):
    """GPT-J (interleaved) rotary embedding of x[t, h, :R] with per-token cos/sin [T, R/2]."""
    _rotate(x, cos, sin, out, neox=False)


@kd.kernel(static=("R", "R2"), example={"T": 4, "H": 64, "R": 128, "R2": 64}, checks=_checks)
def rope_neox(x: kd.In["T", "H", "R", kd.bf16], cos: kd.In["T", "R2", kd.f32], sin: kd.In["T", "R2", kd.f32],
              out: kd.Out["T", "H", "R", kd.bf16]):
    """NeoX (rotate-half) rotary embedding of x[t, h, :R] with per-token cos/sin [T, R/2]."""
    _rotate(x, cos, sin, out, neox=True)


# ---------------------------------------------------------------------------------------------
# cos/sin caches (torch)

def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_mscale(factor: float, mscale_all_dim: float) -> float:
    """The MLA softmax-scale multiplier is this value squared (REFERENCE §1)."""
    return _yarn_mscale(factor, mscale_all_dim)


def inv_freq(dim: int, base: float, scaling: dict[str, Any] | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] float64, cos/sin multiplier) for plain or YaRN rope."""
    exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    freq_extra = 1.0 / (base ** exps)
    if not scaling or scaling.get("type", scaling.get("rope_type")) != "yarn":
        return freq_extra, 1.0
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast", 32))
    beta_slow = float(scaling.get("beta_slow", 1))

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extra_mask = 1.0 - ramp
    freq_inter = freq_extra / factor
    inv = freq_inter * (1 - extra_mask) + freq_extra * extra_mask
    mult = _yarn_mscale(factor, float(scaling.get("mscale", 1.0))) / _yarn_mscale(
        factor, float(scaling.get("mscale_all_dim", 0.0)))
    return inv, mult


def cos_sin(positions: torch.Tensor, dim: int, base: float, scaling: dict[str, Any] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, dim/2] float32 for the given integer positions [T]."""
    inv, mult = inv_freq(dim, base, scaling)
    dev = positions.device  # computed where the positions are: no device -> host copy
    f = positions.to(torch.float64)[:, None] * inv.to(dev)[None, :]
    return (f.cos() * mult).float(), (f.sin() * mult).float()


# ---------------------------------------------------------------------------------------------
# reference and torch-facing function

def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [T, H, R] rotated with cos/sin [T, R/2], f32 math, result in x.dtype."""
    xf = x.float()
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    if style == "neox":
        r2 = x.shape[-1] // 2
        x0, x1 = xf[..., :r2], xf[..., r2:]
        return torch.cat([x0 * c - x1 * s, x1 * c + x0 * s], -1).to(x.dtype)
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], -1).flatten(-2).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "interleaved",
               out: torch.Tensor | None = None, backend: str = "triton", config: dict[str, Any] | None = None
               ) -> torch.Tensor:
    """Rotate x [T, H, R] (any strides, e.g. the rope slice of q) by per-token cos/sin [T, R/2].
    `out` may be x itself (in place: each program reads its tile before writing it)."""
    if style not in ("interleaved", "neox"):
        raise ValueError(f"rope style must be 'interleaved' or 'neox', got {style!r}")
    check_backend("apply_rope", backend)
    check_tensor("apply_rope", "x", x, 3, (torch.bfloat16,))
    T, H, R = x.shape
    if R < 2 or R % 2:
        raise ValueError(f"apply_rope: the rope dim of x must be even and >= 2, got {R}")
    check_tensor("apply_rope", "cos", cos, 2, (torch.float32, torch.bfloat16, torch.float16), x.device)
    check_tensor("apply_rope", "sin", sin, 2, (torch.float32, torch.bfloat16, torch.float16), x.device)
    if cos.shape != (T, R // 2) or sin.shape != (T, R // 2):
        raise ValueError(f"apply_rope: cos/sin must be [{T}, {R // 2}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if out is not None:
        check_tensor("apply_rope", "out", out, 3, (torch.bfloat16,), x.device)
        if out.shape != x.shape:
            raise ValueError(f"apply_rope: out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if backend == "torch":
        r = rope_ref(x, cos, sin, style)
        if out is not None:
            out.copy_(r)
            return out
        return r
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    out = torch.empty_like(x) if out is None else out
    k = rope_interleaved if style == "interleaved" else rope_neox
    cfg = config_for(k, {"T": T, "H": H, "R": R, "R2": R // 2}, T, config)
    if T:
        k(x, cos.float(), sin.float(), out, config=cfg)
    return out
