"""Int4 weight packing in plain torch: the three checkpoint layouts (REFERENCE §3) and the
W4A16 experts' kernel layout.

Eight signed int4 values share one int32 word along the last (K) dim. The layouts differ in which
element sits in which nibble and how the nibble encodes the value:
- "quark_order":   element 8c+i in nibble i (bits 4i..4i+3), two's complement.
- "quark_reorder": element 8c+order[i] in nibble i, order = [0,2,4,6,1,3,5,7], two's complement
                   (AMD Quark `pack_method: "reorder"`, the Kimi W4A8 checkpoint).
- "ct":            compressed-tensors pack-quantized: element 8c+i in nibble i, nibble = q + 8.
- "ct_reorder":    "ct" nibbles (q + 8) in the "quark_reorder" order: what the W4A16 expert kernels
                   read (kd.group_dot turns a nibble pair into two bf16 values with one mask), the
                   loader repacks "ct" checkpoints to it once.
Leading batch dims (e.g. experts [E, N, K]) are carried through.
"""
from __future__ import annotations

import torch

from kdsl.types import INT4_PACKINGS as PACKINGS  # (nibble order, two's complement?): the kernels' own table


def _layout(pack: str) -> tuple[tuple[int, ...], bool]:
    if pack not in PACKINGS:
        raise ValueError(f"unknown int4 packing {pack!r}; known: {sorted(PACKINGS)}")
    return PACKINGS[pack]


def pack_int4(q: torch.Tensor, pack: str) -> torch.Tensor:
    """Pack int4 values q (integer tensor [..., K], values in [-8, 7], K % 8 == 0) into int32 [..., K//8]."""
    order, signed = _layout(pack)
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise TypeError(f"pack_int4: q must be an integer tensor, got {q.dtype}")
    if q.dim() < 1 or q.shape[-1] % 8 != 0:
        raise ValueError(f"pack_int4: last dim (K) must be a multiple of 8, got shape {tuple(q.shape)}")
    qi = q.to(torch.int64)
    if qi.numel() and (int(qi.min()) < -8 or int(qi.max()) > 7):
        raise ValueError(f"pack_int4: values must lie in [-8, 7], got [{int(qi.min())}, {int(qi.max())}]")
    g = qi.reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    nib = (g & 0xF) if signed else (g + 8)
    word = torch.zeros(g.shape[:-1], dtype=torch.int64, device=q.device)
    for i, src in enumerate(order):
        word |= nib[..., src] << (4 * i)
    # reinterpret the unsigned 32-bit pattern as int32 (two's complement)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)
    return word.to(torch.int32)


def unpack_int4(words: torch.Tensor, pack: str) -> torch.Tensor:
    """Unpack int32 words [..., K//8] written by `pack_int4` into int8 values [..., K] in [-8, 7]."""
    order, signed = _layout(pack)
    if words.dtype != torch.int32:
        raise TypeError(f"unpack_int4: words must be int32, got {words.dtype}")
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(*words.shape, 8, dtype=torch.int64, device=words.device)
    for i, dst in enumerate(order):
        nib = (w >> (4 * i)) & 0xF
        out[..., dst] = (nib - 16 * (nib >= 8).to(torch.int64)) if signed else (nib - 8)
    return out.reshape(*words.shape[:-1], words.shape[-1] * 8).to(torch.int8)


def repack_int4(words: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    """Convert packed words between layouts (e.g. a "ct" checkpoint to "quark_order"): each nibble
    moves to the place `dst` gives its element, and flips its top bit where the encodings differ
    (two's complement q & 0xF = offset binary (q + 8) ^ 8). Word arithmetic only (meta tensors too)."""
    if src == dst:
        return words
    (so, ssigned), (do, dsigned) = _layout(src), _layout(dst)
    if words.dtype != torch.int32:
        raise TypeError(f"repack_int4: words must be int32, got {words.dtype}")
    w = words.to(torch.int64) & 0xFFFFFFFF
    if ssigned != dsigned:
        w = w ^ 0x88888888
    out = torch.zeros_like(w)
    for i, elem in enumerate(so):
        out |= ((w >> (4 * i)) & 0xF) << (4 * do.index(elem))
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def quantize_int4_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int4 quantization of w [..., N, K]: returns (q int8, scale f32 [..., N])."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1) / 7.0).clamp_min(1e-8)
    q = torch.round(wf / scale[..., None]).clamp(-8, 7).to(torch.int8)
    return q, scale


def quantize_int4_grouped(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group int4 quantization of w [..., N, K] along K: (q int8, scale f32 [..., N, K//group])."""
    if w.shape[-1] % group:
        raise ValueError(f"quantize_int4_grouped: K={w.shape[-1]} must be a multiple of group {group}")
    wf = w.float().reshape(*w.shape[:-1], w.shape[-1] // group, group)
    scale = (wf.abs().amax(dim=-1) / 7.0).clamp_min(1e-8)
    q = torch.round(wf / scale[..., None]).clamp(-8, 7).to(torch.int8)
    return q.reshape(w.shape), scale
