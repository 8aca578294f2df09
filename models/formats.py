"""Per-tensor weight formats (REFERENCE §3): detection from the tensors present, and the in-memory layout.

In-memory representation (what the ops/model layer receive), decided once at load:
- dense weight: a plain `torch.Tensor` [out, in] in its stored dtype (bf16/f16/f32), or converted by
  value to the loader's `dtype`.
- `QuantLinear(kind="int4")`: `packed` int32 [N, K/8], K-contiguous, 8 nibbles per word in packing
  `pack` ("ct" | "quark_order" | "quark_reorder", see ops.packing; kept as stored unless the loader is
  asked for another packing, e.g. "ct_reorder" for the W4A16 expert kernels); `scale` f32 [N] (group == 0, per output channel) or [N, K/group]
  (group-wise along K) in the checkpoint's float dtype (bf16 for compressed-tensors: exact, and half
  the memory of f32: ~62 GB less for the full Kimi-K2.5). W[n, k] = q[n, k] * scale[n] (or
  scale[n, k // group]).
  Quark W4A8 two-stage scales are folded: scale[n] = weight_scale_2[n] * weight_scale (f32).
- `QuantLinear(kind="fp8")`: `packed` float8 [N, K] (e4m3fn, or e4m3fnuz when the target arch is gfx942;
  `pack` says which), `scale` f32 [N]; W = fp8 * scale[n]. Activations are dynamic per token.

Format detection, per linear `base` (e.g. `model.layers.3.mlp.experts.5.up_proj`), from tensors only:
  base.weight_packed (int32) + weight_scale + weight_shape           -> compressed-tensors INT4 group
  base.weight int32 + weight_scale_2 [out] + weight_scale [] / [1]    -> Quark W4A8 (int4 per-channel)
  base.weight int32 + weight_scale [out]                              -> Quark INT4 per-channel
  base.weight int32 [in, out/8] + weight_scale [in/g, out]            -> Quark INT4 per-group (transposed)
  base.weight float8_e4m3fn + weight_scale [out]                      -> Quark ptpc FP8
  base.weight uint8 [out, in/2] + weight_scale uint8 [out, in/32]      -> Quark MXFP4 (OCP MX, E8M0 scales)
  base.weight bf16/f16/f32                                            -> dense
The quantization config only supplies the Quark packing (export.pack_method); an int4/fp8 tensor in a
checkpoint whose config names no (or another) quant method is an error naming the tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

import torch

from ops.packing import PACKINGS, pack_int4, repack_int4, unpack_int4

__all__ = ["FormatError", "QuantLinear", "Weight", "AUX_SUFFIXES", "detect_format", "build_linear",
           "dequantize", "to_pack", "fp8_to_fnuz", "fp8_dtype_for_arch"]


class FormatError(ValueError):
    """A tensor is missing, has the wrong shape/dtype, or its format is unknown (message names it)."""


@dataclass
class QuantLinear:
    """A quantized linear weight in the layout the GEMM kernels read (module docstring)."""
    kind: str                       # "int4" | "fp8" | "mxfp4"
    packed: torch.Tensor            # int4: int32 [N, K/8]; fp8: float8 [N, K]
    scale: torch.Tensor             # f32 [N] (group == 0); [N, K/group] in the stored float dtype
    group: int                      # 0 = per output channel; else group size along K
    pack: str                       # int4: ops.packing name; fp8: "e4m3fn" | "e4m3fnuz"
    shape: tuple[int, int]          # logical (N, K) = (out, in)
    source: str                     # "compressed-tensors" | "quark-int4" | "quark-w4a8" | "quark-fp8"
    input_scale: Optional[torch.Tensor] = None   # static activation scale when the checkpoint has one

    def to(self, device: Union[str, torch.device]) -> "QuantLinear":
        return replace(self, packed=self.packed.to(device), scale=self.scale.to(device),
                       input_scale=None if self.input_scale is None else self.input_scale.to(device))

    @property
    def nbytes(self) -> int:
        n = self.packed.numel() * self.packed.element_size() + self.scale.numel() * self.scale.element_size()
        return n + (0 if self.input_scale is None else self.input_scale.numel() * 4)


Weight = Union[torch.Tensor, QuantLinear]

# tensors that belong to a linear's `weight` and are consumed with it
AUX_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_scale_2", "weight_zero_point",
                "input_scale", "weight_global_scale")

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


def fp8_dtype_for_arch(arch: Optional[str]) -> torch.dtype:
    """gfx942 computes in e4m3fnuz; gfx950, NVIDIA and the CPU interpreter in OCP e4m3fn."""
    return torch.float8_e4m3fnuz if (arch or "").startswith("gfx942") else torch.float8_e4m3fn


def fp8_to_fnuz(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn -> e4m3fnuz by bits (REFERENCE §3): 0x80 (-0) -> 0, reinterpret, scale x 2 (exact)."""
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_to_fnuz expects float8_e4m3fn, got {w.dtype}")
    b = w.view(torch.int8)
    b = torch.where(b == -128, torch.zeros((), dtype=torch.int8), b)
    return b.view(torch.float8_e4m3fnuz), scale.float() * 2.0


def detect_format(base: str, present: Callable[[str], bool], dtype_of: Callable[[str], torch.dtype]) -> str:
    """Name the format of linear `base` from the tensors present: "dense" | "ct-int4" | "quark-w4a8" |
    "quark-int4" | "quark-fp8" (per-group vs per-channel Quark int4 is told apart by scale rank)."""
    if present(base + ".weight_packed"):
        return "ct-int4"
    w = base + ".weight"
    if not present(w):
        raise FormatError(f"tensor {w!r} (or {base + '.weight_packed'!r}) is missing")
    dt = dtype_of(w)
    if dt in _FLOAT:
        return "dense"
    if dt == torch.int32:
        return "quark-w4a8" if present(base + ".weight_scale_2") else "quark-int4"
    if dt == torch.float8_e4m3fn:
        return "quark-fp8"
    if dt == torch.uint8:
        return "quark-mxfp4"
    raise FormatError(f"tensor {w!r}: unsupported weight dtype {dt} (no known format stores it)")


def _need(name: str, present: Callable[[str], bool], why: str) -> None:
    if not present(name):
        raise FormatError(f"tensor {name!r} is missing ({why})")


def _shape_err(name: str, got: torch.Size, want: str) -> FormatError:
    return FormatError(f"tensor {name!r} has wrong shape {list(got)}; expected {want}")


def build_linear(base: str, get: Callable[[str], torch.Tensor], present: Callable[[str], bool],
                 dtype_of: Callable[[str], torch.dtype], quant_method: Optional[str],
                 quark_pack: Optional[str], arch: Optional[str] = None, int4_pack: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None) -> tuple[Weight, list[str]]:
    """Read linear `base` in whatever format its tensors say; return (weight, tensor names consumed).

    quant_method/quark_pack come from the checkpoint's quantization config; arch picks the fp8 flavour;
    int4_pack (None = keep stored) repacks int4 words; dtype converts dense float weights by value.
    Reads each stored tensor once; temporaries are per tensor (never a second copy of the model).
    """
    fmt = detect_format(base, present, dtype_of)
    w = base + ".weight"
    used: list[str] = []

    def take(name: str) -> torch.Tensor:
        used.append(name)
        return get(name)

    if fmt == "dense":
        t = take(w)
        return (t.to(dtype) if dtype is not None and t.dtype != dtype else t), used

    if fmt == "ct-int4":
        if quant_method not in ("compressed-tensors", None):
            raise FormatError(f"tensor {base + '.weight_packed'!r} is compressed-tensors packed but the "
                              f"config's quant method is {quant_method!r}")
        for s in ("weight_scale", "weight_shape"):
            _need(f"{base}.{s}", present, "compressed-tensors pack-quantized needs it")
        ws = take(base + ".weight_shape")
        if ws.dtype.is_floating_point or ws.dtype == torch.bool:
            raise FormatError(f"tensor {base + '.weight_shape'!r} must be an integer tensor, got {ws.dtype}")
        shp = ws.flatten().tolist()
        if len(shp) != 2:
            raise _shape_err(base + ".weight_shape", torch.Size([len(shp)]), "[2]")
        n, k = int(shp[0]), int(shp[1])
        packed = take(base + ".weight_packed")
        if packed.dtype != torch.int32:
            raise FormatError(f"tensor {base + '.weight_packed'!r} must be int32, got {packed.dtype}")
        if k % 8 or tuple(packed.shape) != (n, k // 8):
            raise _shape_err(base + ".weight_packed", packed.shape, f"[{n}, {k // 8}] from weight_shape {shp}")
        scale = take(base + ".weight_scale")
        if scale.dim() != 2 or scale.shape[0] != n or scale.shape[1] == 0 or k % scale.shape[1]:
            raise _shape_err(base + ".weight_scale", scale.shape, f"[{n}, {k}/group]")
        group = k // scale.shape[1]
        _check_zero_point(base, get, present, used)
        if not scale.dtype.is_floating_point:
            raise FormatError(f"tensor {base + '.weight_scale'!r} must be a float tensor, got {scale.dtype}")
        q = QuantLinear("int4", packed, scale, group, "ct", (n, k), "compressed-tensors")
        return (to_pack(q, int4_pack) if int4_pack else q), used

    # Quark formats
    if quant_method != "quark":
        raise FormatError(f"tensor {w!r} is {dtype_of(w)} (a quantized format) but the config's quant "
                          f"method is {quant_method!r}; expected 'quark'")
    _need(base + ".weight_scale", present, f"{fmt} needs it")
    if fmt == "quark-fp8":
        wt = take(w)
        if wt.dim() != 2:
            raise _shape_err(w, wt.shape, "[out, in]")
        n, k = wt.shape
        scale = take(base + ".weight_scale").float()
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(n).contiguous()
        elif scale.numel() != n:
            raise _shape_err(base + ".weight_scale", scale.shape, f"[{n}] (per output channel)")
        scale = scale.reshape(n)
        ins = take(base + ".input_scale").float().reshape(-1) if present(base + ".input_scale") else None
        pack = "e4m3fn"
        if fp8_dtype_for_arch(arch) == torch.float8_e4m3fnuz:
            wt, scale = fp8_to_fnuz(wt, scale)
            ins = None if ins is None else ins * 2.0
            pack = "e4m3fnuz"
        return QuantLinear("fp8", wt, scale, 0, pack, (int(n), int(k)), "quark-fp8", ins), used

    if fmt == "quark-mxfp4":
        return _mxfp4_linear(base, take, present), used

    if quark_pack is None:
        raise FormatError(f"tensor {w!r}: Quark int4 weight but no pack method known "
                          "(quantization_config.export.pack_method)")
    if quark_pack not in PACKINGS:
        raise FormatError(f"tensor {w!r}: unknown pack method {quark_pack!r}")
    wt = take(w)
    if wt.dim() != 2:
        raise _shape_err(w, wt.shape, "[out, in/8]")
    raw_scale = take(base + ".weight_scale")
    scale = raw_scale.float()
    _check_zero_point(base, get, present, used)
    if fmt == "quark-w4a8":
        n, k = wt.shape[0], wt.shape[1] * 8
        s2 = take(base + ".weight_scale_2").float()
        if scale.numel() != 1:
            raise _shape_err(base + ".weight_scale", scale.shape, "[] or [1] (per-tensor, W4A8 stage 1)")
        if s2.numel() != n:
            raise _shape_err(base + ".weight_scale_2", s2.shape, f"[{n}] (per output channel)")
        q = QuantLinear("int4", wt, s2.reshape(n) * scale.reshape(()), 0, quark_pack, (n, k), "quark-w4a8")
    elif scale.dim() == 2 and scale.shape[1] != 1:
        # per-group, stored transposed: weight [in, out/8], scale [in/g, out]
        k, n = wt.shape[0], wt.shape[1] * 8
        if scale.shape[1] != n or scale.shape[0] == 0 or k % scale.shape[0]:
            raise _shape_err(base + ".weight_scale", scale.shape, f"[{k}/group, {n}] (per-group, transposed)")
        group = k // scale.shape[0]
        if k % 8:
            raise _shape_err(w, wt.shape, "[in, out/8] with in % 8 == 0")
        words = pack_int4(unpack_int4(wt, quark_pack).t().contiguous(), quark_pack)
        del wt
        q = QuantLinear("int4", words, raw_scale.t().contiguous(), group, quark_pack, (n, k), "quark-int4")
    else:
        n, k = wt.shape[0], wt.shape[1] * 8
        if scale.numel() != n:
            raise _shape_err(base + ".weight_scale", scale.shape, f"[{n}] (per output channel)")
        q = QuantLinear("int4", wt, scale.reshape(n), 0, quark_pack, (n, k), "quark-int4")
    if present(base + ".input_scale"):
        q.input_scale = take(base + ".input_scale").float().reshape(-1)
    return (to_pack(q, int4_pack) if int4_pack else q), used


def _check_zero_point(base: str, get: Callable[[str], torch.Tensor], present: Callable[[str], bool],
                      used: list[str]) -> None:
    zp = base + ".weight_zero_point"
    if present(zp):
        used.append(zp)
        if bool((get(zp) != 0).any()):
            raise FormatError(f"tensor {zp!r}: asymmetric int4 (non-zero zero points) is not supported")


def to_pack(q: QuantLinear, pack: str) -> QuantLinear:
    """The same int4 weight in another packing (one new word tensor; returns q itself if unchanged)."""
    if q.kind != "int4":
        raise ValueError(f"to_pack: only int4 weights have a packing, got kind {q.kind!r}")
    if pack == q.pack:
        return q
    return replace(q, packed=repack_int4(q.packed, q.pack, pack), pack=pack)


def dequantize(w: Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] a QuantLinear (or dense tensor) stands for; for tests and the torch backend."""
    if isinstance(w, torch.Tensor):
        return w.to(dtype)
    n, k = w.shape
    if w.kind == "int4":
        qv = unpack_int4(w.packed, w.pack).float()
        if w.group:
            out = (qv.reshape(n, k // w.group, w.group) * w.scale.float()[:, :, None]).reshape(n, k)
        else:
            out = qv * w.scale.float()[:, None]
    elif w.kind == "fp8":
        out = w.packed.float() * w.scale.float()[:, None]
    elif w.kind == "mxfp4":
        from ops.mxfp4 import dequant_mxfp4_ref

        out = dequant_mxfp4_ref(w.packed, w.scale)
    else:
        raise ValueError(f"dequantize: unknown QuantLinear kind {w.kind!r}")
    return out.to(dtype)


def _mxfp4_linear(base: str, take: Callable[[str], torch.Tensor], present: Callable[[str], bool]) -> QuantLinear:
    """Quark MXFP4 (OCP MX): `weight` uint8 [N, K/2] (two E2M1 codes per byte along K, element 2i in
    the low nibble), `weight_scale` uint8 [N, K/32] (E8M0), optional static `input_scale` (the
    W4A8-FP8 scheme). Kept as stored: QuantLinear(kind="mxfp4", packed, scale=E8M0 bytes, group 32,
    pack "e2m1"); `dequantize` gives the exact values."""
    w = base + ".weight"
    wt = take(w)
    if wt.dim() != 2:
        raise _shape_err(w, wt.shape, "[out, in/2] (two fp4 per byte)")
    n, k = int(wt.shape[0]), int(wt.shape[1]) * 2
    if k % 32:
        raise _shape_err(w, wt.shape, "[out, in/2] with in a multiple of 32 (one E8M0 scale per 32)")
    sn = base + ".weight_scale"
    scale = take(sn)
    if scale.dtype != torch.uint8:
        raise FormatError(f"tensor {sn!r} must be uint8 E8M0 scales for an MXFP4 weight, got {scale.dtype}")
    if tuple(scale.shape) != (n, k // 32):
        raise _shape_err(sn, scale.shape, f"[{n}, {k // 32}] (one E8M0 per 32 inputs)")
    ins = None
    if present(base + ".input_scale"):
        ins = take(base + ".input_scale").float().reshape(-1)
        if ins.numel() != 1:
            raise _shape_err(base + ".input_scale", ins.shape, "[] or [1] (static per-tensor fp8 activation scale)")
    return QuantLinear("mxfp4", wt.contiguous(), scale.contiguous(), 32, "e2m1", (n, k), "quark-mxfp4", ins)
