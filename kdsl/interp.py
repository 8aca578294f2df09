"""Lowerings the Triton interpreter needs for ops whose `tl` forms are `@triton.jit` library functions
(not callable from an interpreted kernel) or backend libdevice calls (absent on the CPU): each takes and
returns interpreter tensors and computes with numpy, with the semantics of the GPU lowering.

What Triton 3.9's interpreter (an `InterpretedFunction`, as kdsl runs it) gets wrong or cannot run:
- `tl.argmax/argmin/cumsum/sort/topk` (like `tl.sum/max/sigmoid`) are `@triton.jit` functions of
  `triton.language.standard`: calling one raises "Cannot call @triton.jit'd outside of the scope of a
  kernel". The emitter uses `tl.reduce` with `_argmax/_argmin_combine_tie_break_left` (patched to numpy's
  leftmost arg-reductions) and `tl.associative_scan` with `_sum_combine` (patched to `np.cumsum`); the
  sorting network of sort/top-k is replaced by `sort`/`topk` below (the packed keys are the GPU's).
- `triton.language.extra.libdevice` (tanh, rint, pow) has no interpreter lowering (TypeError "cannot
  convert None to tensor"): `tanh`, `rint`, `pow` below. `tl.math.erf` runs (math.erf per element).
- `tl.fma` rounds twice (a * b, then + c) on Triton's interpreter before 3.9: `fma` below rounds once.
- `for i in range(...)` hands the body a Python int, so `i.to(...)` fails: the emitter casts it to i32.
- A user `@triton.jit` helper must be wrapped as `InterpretedFunction(helper.fn)` to be called."""
from __future__ import annotations

import math

import numpy as np
import triton.language as tl
from triton.runtime.interpreter import TensorHandle


def _wrap(data: np.ndarray, dtype: tl.dtype) -> tl.tensor:
    data = np.ascontiguousarray(data)
    ty = tl.block_type(dtype, list(data.shape)) if data.shape else dtype
    return tl.core.tensor(TensorHandle(data, dtype), ty)


def _data(t: tl.tensor) -> np.ndarray:
    return t.handle.data


def sort(x: tl.tensor, descending: bool) -> tl.tensor:
    """`tl.sort(x, descending=)` along the last dim."""
    d = np.sort(_data(x), axis=-1, kind="stable")
    return _wrap(d[..., ::-1] if descending else d, x.dtype)


def topk(x: tl.tensor, k: int, largest: bool) -> tl.tensor:
    """`tl.topk(x, k, descending=largest)` along the last dim: the k extreme values, sorted."""
    d = np.sort(_data(x), axis=-1, kind="stable")
    d = d[..., ::-1][..., :k] if largest else d[..., :k]
    return _wrap(d, x.dtype)


def _f32(fn):
    def run(x: tl.tensor) -> tl.tensor:
        d = _data(x)
        return _wrap(fn(d).astype(d.dtype), x.dtype)
    return run


tanh = _f32(np.tanh)
rint = _f32(np.rint)  # numpy rounds half to even, as libdevice rint
_erf = np.vectorize(math.erf, otypes=[np.float64])
erf = _f32(_erf)


def _as_f64(t: tl.tensor) -> np.ndarray:
    """A float tensor's values in f64 (bf16 is stored as its uint16 bits)."""
    d = _data(t)
    if t.dtype.scalar == tl.bfloat16:
        d = (d.astype(np.uint32) << 16).view(np.float32)
    return d.astype(np.float64)


def dot(a: tl.tensor, b: tl.tensor, acc: tl.tensor | None = None) -> tl.tensor:
    """`tl.dot` of float operands into f32 (+ acc), each output's products and their sum taken in
    f64 and rounded once to f32. Triton's interpreter multiplies in f32 with numpy's matmul, whose
    blocking, and so each output's summation order, follows the tile's shape: a wider tile changed
    bits. A GPU's matrix instruction sums an output's K products the same way at any tile width
    (tests/test_gemm_rmsnorm.py reads the instruction from the compiled code); here the products of
    bf16, f16 and f32 values are exact and their f64 sum is exact or within 2^-45 of it, so the tile's
    other dims change no bit of the f32 result (short of a sum that lands that close to a rounding
    boundary)."""
    with np.errstate(all="ignore"):
        r = np.matmul(_as_f64(a), _as_f64(b))
        if acc is not None:
            r = r + _as_f64(acc)
    return _wrap(r.astype(np.float32), tl.float32)


def pow(x: tl.tensor, y) -> tl.tensor:  # noqa: A001
    """libdevice pow in f32 (x and y tensors or numbers, broadcast-compatible)."""
    yd = _data(y) if isinstance(y, tl.tensor) else np.float32(y)
    xd = _data(x) if isinstance(x, tl.tensor) else np.float32(x)
    with np.errstate(all="ignore"):
        d = np.power(xd.astype(np.float32), np.asarray(yd, dtype=np.float32))
    shape = np.broadcast_shapes(xd.shape, np.shape(yd))
    return _wrap(np.broadcast_to(d, shape).astype(np.float32), tl.float32)


def fma(a: tl.tensor, b: tl.tensor, c: tl.tensor) -> tl.tensor:
    """`tl.fma(a, b, c)` in f32 with one rounding, as the GPU's fused multiply-add (f32 tensors of one
    shape or numbers). a * b is exact in f64; the f64 sum s and its exact error e (two-sum) give the sum rounded
    to odd (s, or its f64 neighbour toward e when s is inexact and even), whose rounding to f32 is
    the correctly rounded a * b + c (f64 keeps more than 24 + 2 bits)."""
    x, y, z = np.broadcast_arrays(*(np.asarray(_data(t) if isinstance(t, tl.tensor) else t, np.float32)
                                    .astype(np.float64) for t in (a, b, c)))
    with np.errstate(all="ignore"):
        p = x * y
        s = p + z
        bb = s - p
        e = (p - (s - bb)) + (z - bb)
        even = (s.view(np.int64) & 1) == 0
        bump = even & (e != 0) & np.isfinite(s) & np.isfinite(e)
        s = np.where(bump, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return _wrap(s.astype(np.float32), tl.float32)
