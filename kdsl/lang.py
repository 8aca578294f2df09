"""The tile language: what a kernel body calls while it is traced.

Every function here appends nodes to the current trace. Tunables are concrete Python values
during a trace (one trace per config), so ordinary Python `if`/`for` on them is allowed; tile
values have no truth value, which catches `if tile:` mistakes at trace time.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from . import types as T
from .ir import Axis, RangeInfo, TunableSpec, GridEntry, Value, ctx

Scalarish = Value | int | float | bool

DEFAULT_BLOCK_DOMAIN = (16, 32, 64, 128, 256)
DEFAULT_BLOCK = 64


# ----------------------------------------------------------------------------------------------
# values and type rules

def const(v: int | float | bool, dtype: T.DType | None = None) -> Value:
    if dtype is None:
        dtype = T.bool_ if isinstance(v, bool) else (T.i32 if isinstance(v, int) else T.f32)
    if isinstance(v, int) and not isinstance(v, bool) and not (-(2**31) <= v < 2**31) and dtype is T.i32:
        dtype = T.i64
    return Value(dtype, (), hint="c", const=v)


def as_value(x: Any, like: Value | None = None) -> Value:
    if isinstance(x, Value):
        return x
    if isinstance(x, bool):
        return const(x)
    if isinstance(x, int):
        return Value(like.dtype if like is not None and not like.dtype.is_float and like.dtype is not T.bool_
                     else T.i32, (), hint="c", const=x) if like is not None else const(x)
    if isinstance(x, float):
        return Value(like.dtype if like is not None and like.dtype.is_float else T.f32, (), hint="c", const=x)
    raise ctx().error(f"cannot use {type(x).__name__} {x!r} as a tile value")


def _rank(d: T.DType) -> int:
    return d.bits


def promote(a: T.DType, b: T.DType) -> T.DType:
    """Triton's promotion for two tensors (the rules we rely on, stated once)."""
    if T.is_fp4(a) or T.is_fp4(b):
        raise ctx().error(f"arithmetic on packed fp4 ({a!r}, {b!r}) is not allowed: use kd.dot_scaled or kd.mx_decode")
    if a == b:
        return a
    if a.is_fp8 or b.is_fp8:
        raise ctx().error(f"arithmetic on fp8 ({a!r}, {b!r}) is not allowed: cast to f32 first")
    if a is T.bool_:
        return b
    if b is T.bool_:
        return a
    if a.is_float and b.is_float:
        if a.bits == b.bits:  # bf16 with f16
            return T.f32
        return a if a.bits > b.bits else b
    if a.is_float:
        return a
    if b.is_float:
        return b
    if a.bits == b.bits:
        return a if not a.is_signed else b
    return a if a.bits > b.bits else b


def union_axes(*vals: Value) -> tuple[Axis, ...]:
    out: list[Axis] = []
    for v in vals:
        for ax in v.axes:
            if ax not in out:
                out.append(ax)
    return tuple(out)


def union_masks(*vals: Value) -> frozenset:
    m: frozenset = frozenset()
    for v in vals:
        m = m | v.masks
    return m


_ARITH = {"+", "-", "*", "/", "//", "%"}
_INT_ONLY = {"//", "%", "<<", ">>", "&", "|", "^"}
_CMP = {"<", "<=", ">", ">=", "==", "!="}


def binary(op: str, a: Any, b: Any) -> Value:
    if not isinstance(a, Value) and not isinstance(b, Value):
        raise ctx().error(f"binary {op} needs at least one tile value")
    a = as_value(a, like=b if isinstance(b, Value) else None)
    b = as_value(b, like=a)
    if a.const is not None and b.const is None:
        dt = b.dtype if (a.dtype.is_float == b.dtype.is_float or not a.dtype.is_float) else promote(a.dtype, b.dtype)
    elif b.const is not None and a.const is None:
        dt = a.dtype if (a.dtype.is_float == b.dtype.is_float or not b.dtype.is_float) else promote(a.dtype, b.dtype)
    else:
        dt = promote(a.dtype, b.dtype)
    if op in _INT_ONLY and dt.is_float:
        raise ctx().error(f"operator {op} needs integer operands, got {a.dtype!r} and {b.dtype!r}")
    if op == "/" and not dt.is_float:
        dt = T.f32
    if dt.is_fp8:
        raise ctx().error(f"arithmetic on fp8 is not allowed: cast to f32 first")
    res_dt = T.bool_ if op in _CMP else dt
    out = Value(res_dt, union_axes(a, b), union_masks(a, b), hint="t")
    ctx().add("binary", [out], lhs=a, rhs=b, op=op, dtype=dt)
    return out


def unary(op: str, a: Value, dtype: T.DType | None = None) -> Value:
    out = Value(dtype or a.dtype, a.axes, a.masks, hint="t")
    ctx().add("unary", [out], x=a, op=op)
    return out


def _install_operators() -> None:
    def mk(op: str, rev: bool = False):
        if rev:
            return lambda self, other: binary(op, other, self)
        return lambda self, other: binary(op, self, other)

    for op, name in [("+", "add"), ("-", "sub"), ("*", "mul"), ("/", "truediv"), ("//", "floordiv"),
                     ("%", "mod"), ("<<", "lshift"), (">>", "rshift"), ("&", "and"), ("|", "or"),
                     ("^", "xor")]:
        setattr(Value, f"__{name}__", mk(op))
        setattr(Value, f"__r{name}__", mk(op, rev=True))
    for op, name in [("<", "lt"), ("<=", "le"), (">", "gt"), (">=", "ge")]:
        setattr(Value, f"__{name}__", mk(op))
    Value.__eq__ = mk("==")  # type: ignore[assignment]
    Value.__ne__ = mk("!=")  # type: ignore[assignment]
    Value.__hash__ = object.__hash__  # type: ignore[assignment]
    Value.__neg__ = lambda self: unary("-", self)  # type: ignore[attr-defined]
    Value.__invert__ = lambda self: unary("~", self)  # type: ignore[attr-defined]

    def no_bool(self):
        raise ctx().error(f"a tile value ({self.name}) has no truth value while tracing: "
                          "use kd.where for data, kd.exit_if for an early return")

    Value.__bool__ = no_bool  # type: ignore[attr-defined]
    Value.to = lambda self, dtype, rounding=None: cast(self, dtype, rounding)  # type: ignore[attr-defined]
    Value.bitcast = lambda self, dtype: bitcast(self, dtype)  # type: ignore[attr-defined]


_install_operators()


def cast(x: Value, dtype: T.ElemType, rounding: str | None = None) -> Value:
    """Convert element type. `rounding` is None (round to nearest even) or "rtz" (toward zero)."""
    from .targets import resolve_dtype

    dtype = resolve_dtype(dtype, ctx().target)
    if rounding not in (None, "rtz"):
        raise ctx().error(f"rounding must be None (nearest even) or 'rtz', got {rounding!r}")
    if rounding == "rtz" and dtype is not T.bf16:
        raise ctx().error("round-toward-zero is supported for bf16 results only")
    x = as_value(x)
    if T.is_fp4(x.dtype) or T.is_fp4(dtype):
        raise ctx().error("packed fp4 tiles cannot be cast: use kd.mx_decode (to f32) or kd.dot_scaled")
    if x.dtype is dtype and rounding is None:
        return x
    out = Value(dtype, x.axes, x.masks, hint="t")
    ctx().add("cast", [out], x=x, dtype=dtype, rounding=rounding)
    return out


def bitcast(x: Value, dtype: T.DType) -> Value:
    if x.dtype.bits != dtype.bits:
        raise ctx().error(f"bitcast {x.dtype!r} -> {dtype!r} changes the bit width")
    out = Value(dtype, x.axes, x.masks, hint="t")
    ctx().add("bitcast", [out], x=x, dtype=dtype)
    return out


def _float_math(op: str, x: Any) -> Value:
    x = as_value(x)
    if x.dtype not in (T.f32, T.f64):
        x = cast(x, T.f32)
    return unary(op, x)


def exp(x: Any) -> Value: return _float_math("exp", x)
def exp2(x: Any) -> Value: return _float_math("exp2", x)
def log(x: Any) -> Value: return _float_math("log", x)
def log2(x: Any) -> Value: return _float_math("log2", x)
def sqrt(x: Any) -> Value: return _float_math("sqrt", x)
def rsqrt(x: Any) -> Value: return _float_math("rsqrt", x)
def sin(x: Any) -> Value: return _float_math("sin", x)
def cos(x: Any) -> Value: return _float_math("cos", x)
def sigmoid(x: Any) -> Value: return _float_math("sigmoid", x)
def abs(x: Any) -> Value: return unary("abs", as_value(x))  # noqa: A001


def silu(x: Any) -> Value:
    """x * sigmoid(x), computed in f32."""
    x = as_value(x)
    xf = cast(x, T.f32) if x.dtype is not T.f32 else x
    return xf * sigmoid(xf)


def maximum(a: Any, b: Any) -> Value:
    return _minmax("maximum", a, b)


def minimum(a: Any, b: Any) -> Value:
    return _minmax("minimum", a, b)


def _minmax(op: str, a: Any, b: Any) -> Value:
    a = as_value(a, like=b if isinstance(b, Value) else None)
    b = as_value(b, like=a)
    dt = promote(a.dtype, b.dtype) if (a.const is None and b.const is None) else (a.dtype if b.const is not None else b.dtype)
    out = Value(dt, union_axes(a, b), union_masks(a, b), hint="t")
    ctx().add("minmax", [out], lhs=a, rhs=b, op=op, dtype=dt)
    return out


def where(cond: Any, a: Any, b: Any) -> Value:
    cond = as_value(cond)
    a_v = as_value(a, like=b if isinstance(b, Value) else None)
    b_v = as_value(b, like=a_v)
    if a_v.const is not None and b_v.const is None:
        a_v = as_value(a, like=b_v)
    dt = promote(a_v.dtype, b_v.dtype) if (a_v.const is None and b_v.const is None) else (
        b_v.dtype if a_v.const is not None else a_v.dtype)
    out = Value(dt, union_axes(a_v, b_v, cond), union_masks(cond, a_v, b_v), hint="t")  # data axes lead
    ctx().add("where", [out], cond=cond, on_true=a_v, on_false=b_v, dtype=dt)
    return out


def _axis_of(x: Value, axis: Value | Axis) -> Axis:
    ax = axis if isinstance(axis, Axis) else (axis.axes[0] if isinstance(axis, Value) and len(axis.axes) == 1 else None)
    if ax is None or ax not in x.axes:
        raise ctx().error(f"reduction axis {axis!r} is not an axis of {x!r}")
    return ax


def _reduce(op: str, x: Value, axis: Value | Axis) -> Value:
    ax = _axis_of(x, axis)
    # masked-off lanes (the tail of a tile) must not take part: they hold the load's `other`
    # (0) or whatever was computed from it, so select the op's neutral element there first
    tail = sorted((mk for mk in x.masks if ax in mk.axes), key=lambda mk: mk.name)
    if tail:
        cond = tail[0]
        for mk in tail[1:]:
            cond = binary("&", cond, mk)
        if op == "sum":
            neutral: int | float = 0.0 if x.dtype.is_float else 0
        elif x.dtype.is_float:
            neutral = float("-inf") if op == "max" else float("inf")
        else:
            info = torch_iinfo(x.dtype)
            neutral = info[0] if op == "max" else info[1]
        x = where(cond, x, neutral)
    dt = x.dtype
    if op == "sum":
        dt = (T.f32 if dt.bits < 32 else dt) if dt.is_float else (T.i32 if dt.bits < 32 else dt)
    masks = frozenset(m for m in x.masks if ax not in m.axes)
    out = Value(dt, tuple(a for a in x.axes if a is not ax), masks, hint="r")
    ctx().add("reduce", [out], x=x, op=op, axis=ax, dtype=dt)
    return out


def torch_iinfo(dt: T.DType) -> tuple[int, int]:
    """(min, max) of an integer element type."""
    if dt is T.bool_:
        return 0, 1
    if dt.is_signed:
        return -(1 << (dt.bits - 1)), (1 << (dt.bits - 1)) - 1
    return 0, (1 << dt.bits) - 1


def sum(x: Value, axis: Value | Axis) -> Value:  # noqa: A001
    """Sum over one axis; narrow floats accumulate in f32, narrow ints in i32."""
    return _reduce("sum", x, axis)


def max(x: Value, axis: Value | Axis) -> Value:  # noqa: A001
    return _reduce("max", x, axis)


def min(x: Value, axis: Value | Axis) -> Value:  # noqa: A001
    return _reduce("min", x, axis)


def dot(a: Value, b: Value, acc: Value | None = None) -> Value:
    """Matrix product contracting the one axis `a` and `b` share: int8 -> i32, floats -> f32.

    Tiles smaller than 16 in any dim lower to a broadcast multiply and sum (a legal, VALU
    form for decode-sized tiles); larger ones lower to `tl.dot` (MFMA / wgmma)."""
    c = ctx()
    if len(a.axes) != 2 or len(b.axes) != 2:
        raise c.error(f"dot needs two 2-D tiles, got {a!r} and {b!r}")
    common = [ax for ax in a.axes if ax in b.axes]
    if len(common) != 1:
        raise c.error(f"dot operands must share exactly one axis to contract, got {a!r} and {b!r}")
    k = common[0]
    i = next(ax for ax in a.axes if ax is not k)
    j = next(ax for ax in b.axes if ax is not k)
    if a.dtype.is_float != b.dtype.is_float:
        raise c.error(f"dot operands must both be integer or both float, got {a.dtype!r} and {b.dtype!r}")
    if not a.dtype.is_float and (a.dtype.bits != 8 or b.dtype.bits != 8):
        raise c.error(f"integer dot takes int8 operands, got {a.dtype!r} and {b.dtype!r}")
    if a.dtype.is_float and a.dtype != b.dtype:
        raise c.error(f"float dot operands must have one type, got {a.dtype!r} and {b.dtype!r}: cast one")
    out_dt = T.f32 if a.dtype.is_float else T.i32
    if acc is not None:
        if set(acc.axes) != {i, j} or acc.dtype is not out_dt:
            raise c.error(f"dot accumulator must be {out_dt!r} over ({i}, {j}), got {acc!r}")
    masks = frozenset(m for m in (a.masks | b.masks) if k not in m.axes)
    out = Value(out_dt, (i, j), masks, hint="acc")
    c.add("dot", [out], a=a, b=b, acc=acc, i=i, k=k, j=j, dtype=out_dt)
    return out


# ----------------------------------------------------------------------------------------------
# OCP microscaling (MX): packed fp4 loads, scale groups, scaled dot, decode

MX_A_FORMATS = {"fp4e2m1": "e2m1", "fp8e4m3fn": "e4m3", "fp8e5m2": "e5m2", "bf16": "bf16"}


def _load_fp4(h, idx: Sequence[Any], mask: Value | None) -> Value:
    """Load a packed fp4 tile: the logical tile along the last (packed) dim must be contiguous and
    even; the result keeps the logical axes (its Triton value holds bytes, two values each)."""
    c = ctx()
    ivals = _index_values(h, idx)
    vals = [v for v in ivals if isinstance(v, Value)]
    last = ivals[-1]
    if not isinstance(last, Value) or last.range_info is None or len(last.axes) != 1:
        raise c.error(f"{h.name} is packed fp4: index its last dim with a contiguous tile", h.name)
    if last.range_info.size % T.FP4_PER_BYTE:
        raise c.error(f"{h.name} is packed fp4 (2 per byte): the tile along {h.spec.dims[-1]} must be even, "
                      f"got {last.range_info.size}", h.name)
    if mask is not None and last.axes[0] in mask.axes:
        raise c.error(f"{h.name}: an extra mask over the packed axis is not supported", h.name)
    axes = union_axes(*vals, *([mask] if mask is not None else []))
    if axes[-1] is not last.axes[0]:
        axes = tuple(a for a in axes if a is not last.axes[0]) + (last.axes[0],)
    out = Value(T.fp4_e2m1, axes, union_masks(*vals), hint=h.name)
    c.add("load_fp4", [out], handle=h, indices=ivals, masks=union_masks(*vals), mask=mask)
    return out


def mx_groups(k: Value, limit: Value | int | None = None, group: int = T.MX_GROUP) -> Value:
    """The scale-group tile of a contiguous K tile: `k.start // group + arange(k.size // group)`,
    masked by `< limit` (the scale operand's group dim). Index E8M0 scales with it."""
    c = ctx()
    if k.range_info is None or len(k.axes) != 1:
        raise c.error("mx_groups takes a contiguous 1-D tile (a fold's K tile)")
    size = k.range_info.size
    if size % group:
        raise c.error(f"mx_groups: the K tile ({size}) must be a multiple of the group size {group}")
    start = k.range_info.start
    g0 = start // group if isinstance(start, int) else binary("//", start, group)
    return span(g0, size // group, limit, f"{k.axes[0].label}_g")


def _mx_scale_axes(s: Value, rows: Axis, k: Axis, what: str) -> Axis:
    c = ctx()
    if s.dtype not in (T.e8m0, T.u8):
        raise c.error(f"dot_scaled: {what} must be E8M0 bytes (kd.e8m0 or u8), got {s.dtype!r}")
    if len(s.axes) != 2 or rows not in s.axes:
        raise c.error(f"dot_scaled: {what} must be a 2-D tile over ({rows}, groups), got {s!r}")
    g = next(ax for ax in s.axes if ax is not rows)
    if g.size * T.MX_GROUP != k.size:
        raise c.error(f"dot_scaled: {what} has {g.size} groups for a K tile of {k.size} "
                      f"(one E8M0 scale per {T.MX_GROUP} values): index it with kd.mx_groups(k)")
    return g


def dot_scaled(a: Value, a_scale: Value | None, b: Value, b_scale: Value, acc: Value | None = None) -> Value:
    """Microscaled matrix product contracting the one axis `a` and `b` share, f32 result:
    sum_k (a[i,k] * 2^(sa[i,k//32]-127)) * (b[j,k] * 2^(sb[j,k//32]-127)).

    `b` is packed fp4 (kd.fp4_e2m1) with E8M0 scales per 32 along K; `a` is fp4 (scales required),
    OCP fp8 e4m3/e5m2 (scales optional: None = a per-tensor scale applied by the caller) or bf16
    (no scales). Lowers to `tl.dot_scaled`: gfx950 runs e2m1/e4m3 operands on the scaled MFMA
    (`v_mfma_scale_f32_*_f8f6f4`); other targets upcast (Triton's emulation). On the interpreter,
    bf16 x e2m1 decodes `b` to f32 and runs an f32 dot (its own dot_scaled rounds bf16 through fp16).
    All tile dims must be >= 16 and the K tile a multiple of 32."""
    c = ctx()
    if len(a.axes) != 2 or len(b.axes) != 2:
        raise c.error(f"dot_scaled needs two 2-D tiles, got {a!r} and {b!r}")
    common = [ax for ax in a.axes if ax in b.axes]
    if len(common) != 1:
        raise c.error(f"dot_scaled operands must share exactly one axis to contract, got {a!r} and {b!r}")
    k = common[0]
    i = next(ax for ax in a.axes if ax is not k)
    j = next(ax for ax in b.axes if ax is not k)
    if not T.is_fp4(b.dtype):
        raise c.error(f"dot_scaled: b must be packed fp4 (kd.fp4_e2m1), got {b.dtype!r}")
    fa = MX_A_FORMATS.get(a.dtype.name)
    if fa is None:
        raise c.error(f"dot_scaled: a must be fp4_e2m1, fp8e4m3fn, fp8e5m2 or bf16, got {a.dtype!r}")
    for v, nm in ((a, "a"), (b, "b")):
        if T.is_fp4(v.dtype) and v.axes[-1] is not k:
            raise c.error(f"dot_scaled: {nm} is packed along its last axis, which must be the contracted one")
    if k.size % T.MX_GROUP or i.size < 16 or j.size < 16:
        raise c.error(f"dot_scaled: tiles must be >= 16 in M and N and K a multiple of {T.MX_GROUP}, "
                      f"got {i.size}x{j.size}x{k.size}")
    gb = _mx_scale_axes(b_scale, j, k, "b_scale")
    ga = None
    if fa == "e2m1" and a_scale is None:
        raise c.error("dot_scaled: an fp4 a needs its E8M0 scales")
    if fa == "bf16" and a_scale is not None:
        raise c.error("dot_scaled: a bf16 a takes no scales (pass None)")
    if a_scale is not None:
        ga = _mx_scale_axes(a_scale, i, k, "a_scale")
    if acc is not None and (set(acc.axes) != {i, j} or acc.dtype is not T.f32):
        raise c.error(f"dot_scaled accumulator must be f32 over ({i}, {j}), got {acc!r}")
    drop = {k, gb} | ({ga} if ga is not None else set())
    allm = a.masks | b.masks | b_scale.masks | (a_scale.masks if a_scale is not None else frozenset())
    masks = frozenset(m for m in allm if not (set(m.axes) & drop))
    out = Value(T.f32, (i, j), masks, hint="acc")
    c.add("dot_scaled", [out], a=a, a_scale=a_scale, b=b, b_scale=b_scale, acc=acc,
          i=i, k=k, j=j, ga=ga, gb=gb, fa=fa, fb="e2m1", dtype=T.f32)
    return out


def mx_decode(v: Value, scale: Value | None = None) -> Value:
    """Decode a packed fp4 tile to f32 (exact), times its E8M0 group scales when given
    (2^(e-127); byte 0xFF gives NaN). The dequantizing path for targets without MX matrix cores."""
    c = ctx()
    if not T.is_fp4(v.dtype) or len(v.axes) != 2:
        raise c.error(f"mx_decode takes a 2-D packed fp4 tile, got {v!r}")
    rows, k = v.axes
    g = _mx_scale_axes(scale, rows, k, "scale") if scale is not None else None
    masks = v.masks | (scale.masks if scale is not None else frozenset())
    masks = frozenset(m for m in masks if g is None or g not in m.axes)
    out = Value(T.f32, v.axes, masks, hint="dq")
    c.add("mx_decode", [out], packed=v, scale=scale, g=g)
    return out


def dequant(q: Value, scale: Value, dtype: T.ElemType = T.bf16) -> Value:
    """Group-scaled dequant of an int8 tile (e.g. unpacked int4): `(q * scale[row, k // group])`
    rounded to nearest even in `dtype` (bf16), the group being `k.size // groups`.

    `q` is a 2-D integer tile over (rows, k); `scale` a bf16 tile over (rows, groups) (index its
    group dim with `kd.mx_groups(k, limit, group)`). One scale load per group, broadcast along k in
    registers (not a gather per element), and the product of an int8 and a bf16 is exact in f32,
    so the one rounding is that of a bf16 dequant. Targets without a bf16 convert (gfx94x, and the
    interpreter) round by integer bits: the NaN guard of a general cast is not needed, because the
    low half of the f32 product of a bf16 NaN is zero, so the rounding bias cannot carry it into an
    infinity."""
    c = ctx()
    if len(q.axes) != 2 or q.dtype.is_float or q.dtype.bits != 8:
        raise c.error(f"dequant takes a 2-D int8 tile (rows, k), got {q!r}")
    if scale.dtype is not T.bf16 or len(scale.axes) != 2:
        raise c.error(f"dequant: scale must be a 2-D bf16 tile (rows, groups), got {scale!r}")
    rows, k = q.axes
    if rows not in scale.axes:
        raise c.error(f"dequant: scale {scale!r} must share the rows axis {rows} of {q!r}")
    g = next(ax for ax in scale.axes if ax is not rows)
    if g is k or k.size % g.size:
        raise c.error(f"dequant: the k tile ({k.size}) must be a whole number of scale groups ({g.size})")
    if dtype is not T.bf16:
        raise c.error(f"dequant: only bf16 results are supported, got {dtype!r}")
    masks = frozenset(m for m in q.masks | scale.masks if g not in m.axes)
    out = Value(T.bf16, q.axes, masks, hint="dq")
    c.add("dequant", [out], q=q, scale=scale, g=g, dtype=T.bf16)
    return out


def group_dot(a: Value, b: Value, scale: Value, acc: Value | None = None) -> Value:
    """Group-scaled matrix product with the scale applied after the dot, per scale group:
    `out[g, i, j] = acc[g, i, j] + scale[row, g] * sum_{k in group g} a[i, k] * b[j, k]`.

    One of `a`, `b` is an int8 tile (unpacked int4, `q`), the other bf16; `scale` is a bf16 tile
    over (q's other axis, groups), indexed with `kd.mx_groups(k, KG, group)`. The integer values
    convert to bf16 exactly (a bit move: no rounding, no multiply per weight) and each group's
    partial sum is one f32 matrix dot, so a weight costs its unpack and convert only. When `q` is an
    int4 load of a pack whose nibbles i and i+4 hold elements 2i and 2i+1 ("ct_reorder",
    "quark_reorder") and only group dots read it, two weights become the bf16 pair 136 + q with one
    shift and one mask-and-or (no convert), and the dot subtracts 136 x each group's sums of the other
    operand: gfx950's W4A16 stage-1 loop 3.3 -> 2.1 VALU per weight, the f32 partial carrying the
    bias's rounding.
    (`kd.dequant` instead multiplies and rounds every weight: `q * s` to bf16, coarser numerics.) The result keeps the groups as a leading axis (the accumulator's own when `acc` is
    given): carry it through the K loop and `kd.sum` it over that axis once at the end, so no
    cross-warp sum runs per K tile. All of a's and b's non-K dims and the group (K tile / groups)
    must be >= 16 (matrix-core tiles)."""
    c = ctx()
    if len(a.axes) != 2 or len(b.axes) != 2:
        raise c.error(f"group_dot needs two 2-D tiles, got {a!r} and {b!r}")
    common = [ax for ax in a.axes if ax in b.axes]
    if len(common) != 1:
        raise c.error(f"group_dot operands must share exactly one axis to contract, got {a!r} and {b!r}")
    k = common[0]
    i = next(ax for ax in a.axes if ax is not k)
    j = next(ax for ax in b.axes if ax is not k)
    ints = [v for v in (a, b) if not v.dtype.is_float]
    if len(ints) != 1 or ints[0].dtype.bits != 8 or any(v.dtype is not T.bf16 for v in (a, b) if v.dtype.is_float):
        raise c.error(f"group_dot takes one int8 tile and one bf16 tile, got {a!r} and {b!r}")
    q = ints[0]
    rows = i if q is a else j
    if scale.dtype is not T.bf16 or len(scale.axes) != 2 or rows not in scale.axes:
        raise c.error(f"group_dot: scale must be a 2-D bf16 tile over ({rows}, groups), got {scale!r}")
    g = next(ax for ax in scale.axes if ax is not rows)
    if g is k or k.size % g.size:
        raise c.error(f"group_dot: the k tile ({k.size}) must be a whole number of scale groups ({g.size})")
    if i.size < 16 or j.size < 16 or k.size // g.size < 16:
        raise c.error(f"group_dot: tiles must be >= 16 in both dims and per group, got {i.size}x{j.size} "
                      f"with groups of {k.size // g.size}")
    gout = g
    if acc is not None:
        if len(acc.axes) != 3 or acc.axes[1:] != (i, j) or acc.axes[0].size != g.size or acc.dtype is not T.f32:
            raise c.error(f"group_dot accumulator must be f32 over (groups of {g.size}, {i}, {j}), got {acc!r}")
        gout = acc.axes[0]
    drop = {k, g}
    masks = frozenset(m for m in a.masks | b.masks | scale.masks if not (set(m.axes) & drop))
    if acc is not None:
        masks |= acc.masks
    out = Value(T.f32, (gout, i, j), masks, hint="acc")
    c.add("group_dot", [out], a=a, b=b, scale=scale, acc=acc, i=i, k=k, j=j, g=g, q_is_a=q is a)
    return out


def zeros(axes: Sequence[Value | Axis], dtype: T.ElemType) -> Value:
    return full(axes, 0, dtype)


def full(axes: Sequence[Value | Axis], value: int | float, dtype: T.ElemType) -> Value:
    from .targets import resolve_dtype

    dtype = resolve_dtype(dtype, ctx().target)
    axs = []
    for a in axes:
        if isinstance(a, Axis):
            axs.append(a)
        elif isinstance(a, Value) and len(a.axes) == 1:
            axs.append(a.axes[0])
        else:
            raise ctx().error(f"full/zeros take tile ranges or axes, got {a!r}")
    out = Value(dtype, tuple(axs), hint="z")
    ctx().add("full", [out], value=value, dtype=dtype)
    return out


def broadcast(x: Value, axes: Sequence[Value | Axis]) -> Value:
    """Broadcast `x` explicitly to the given axes (needed only where a shape must be exact)."""
    axs = [a if isinstance(a, Axis) else a.axes[0] for a in axes]
    if not set(x.axes) <= set(axs):
        raise ctx().error(f"cannot broadcast {x!r} to {axs}")
    out = Value(x.dtype, tuple(axs), x.masks, hint="b")
    ctx().add("broadcast", [out], x=x)
    return out


def pad(x: Value, axis: Value | Axis, to: Value | Axis, offset: Value | int = 0) -> Value:
    """`x` with its `axis` widened to the tile `to` (a power-of-two multiple of it): x's values at
    positions [offset, offset + axis.size), zeros elsewhere. A few-row tile thus feeds a 16-row
    matrix dot without computing its padding rows (a zero row changes no other row's products);
    `offset` (a runtime multiple of axis.size below to.size) keeps each row at its own place in the
    16 (row mod 16), so the dot meets a row at the same position whatever the tile size. Lowers to
    register-level joins (offset 0: with zeros, no arithmetic; else x repeated and one select).
    Masks over `axis` are dropped: the result is defined everywhere, `to` carries its own."""
    c = ctx()
    a = axis if isinstance(axis, Axis) else axis.axes[0]
    b = to if isinstance(to, Axis) else to.axes[0]
    if a not in x.axes:
        raise c.error(f"pad: {a!r} is not an axis of {x!r}")
    if b in x.axes:
        raise c.error(f"pad: {x!r} already has the target axis {b!r}")
    if b.size < a.size or b.size % a.size:
        raise c.error(f"pad: the target tile {b!r} must be a power-of-two multiple of {a!r}")
    if isinstance(offset, Value):
        if offset.axes or offset.dtype.is_float:
            raise c.error(f"pad: offset must be a scalar integer, got {offset!r}")
    elif not isinstance(offset, int) or offset < 0 or offset >= b.size or offset % a.size:
        raise c.error(f"pad: offset must be a multiple of {a.size} below {b.size}, got {offset!r}")
    axes = tuple(b if ax is a else ax for ax in x.axes)
    masks = frozenset(mk for mk in x.masks if a not in mk.axes)
    out = Value(x.dtype, axes, masks, hint="pad")
    if isinstance(offset, int) and offset == 0:
        c.add("pad", [out], x=x, axis=a, to=b)
    else:
        c.add("pad", [out], x=x, offset=offset, axis=a, to=b)
    return out


# ----------------------------------------------------------------------------------------------
# tunables, dims, grids and ranges

def tunable(name: str, domain: Sequence[Any], default: Any, doc: str = "",
            search: bool | Sequence[Any] = True) -> Any:
    """Declare a tunable where it is used; returns its value in the config being traced.
    `search=False` marks a variant switch that changes the numerics (not only the speed): a config
    may set it, a tuner leaves it at its default. A sequence: the values a tuner tries (e.g. only the
    batch-invariant ones of a domain that also holds a non-invariant mode)."""
    c = ctx()
    domain = tuple(domain)
    if default not in domain:
        raise c.error(f"default {default!r} is not in the domain {domain}", name)
    if not isinstance(search, bool):
        search = tuple(search)
        if not search or any(v not in domain for v in search):
            raise c.error(f"search values {search} must be a non-empty part of the domain {domain}", name)
    spec = c.tunables.get(name)
    if spec is None:
        c.tunables[name] = TunableSpec(name, domain, default, doc, search)
    value = c.config.get(name, default)
    if value not in domain:  # a config from a file or the CLI: say which values are allowed
        from .errors import ConfigError

        raise ConfigError(c.kernel_name, name, f"{name}={value!r} is outside its domain {list(domain)}")
    c.used_config.add(name)
    return value


def require(cond: bool, rule: str, param: str | None = None) -> None:
    """A validity rule on tunables or static dims: a config that breaks it is rejected by name."""
    from .errors import ConfigError

    if not cond:
        c = ctx()
        raise ConfigError(c.kernel_name, param, rule)


def dim(name: str) -> Value | int:
    """A symbolic dim: a Python int when static for this trace, else a runtime i32 scalar."""
    c = ctx()
    if name not in c.dims:
        raise c.error(f"unknown dim {name!r}; declared: {sorted(c.dims)}")
    return c.dims[name]


def static(name: str) -> int:
    v = dim(name)
    if not isinstance(v, int):
        raise ctx().error(f"dim {name!r} must be static for this use: declare it in @kernel(static=...)")
    return v


class tile:
    """A grid spec: tile the dim `dim` with block tunable `block` (default BLOCK_<dim>)."""

    def __init__(self, dim: str, block: str | int | None = None,
                 domain: Sequence[int] = DEFAULT_BLOCK_DOMAIN, default: int | None = None) -> None:
        self.dim, self.block, self.domain, self.default = dim, block, tuple(domain), default

    def block_size(self) -> int:
        if isinstance(self.block, int):
            return self.block
        name = self.block or f"BLOCK_{self.dim}"
        c = ctx()
        if name in c.tunables:
            return tunable(name, c.tunables[name].domain, c.tunables[name].default)
        d = self.default if self.default is not None else (DEFAULT_BLOCK if DEFAULT_BLOCK in self.domain else self.domain[0])
        return tunable(name, self.domain, d)


class each:
    """A grid spec: one program per index of `dim`; the kernel sees a scalar index."""

    def __init__(self, dim: str) -> None:
        self.dim = dim


class nest:
    """A grid spec: one launch axis that enumerates every combination of its specs' programs (the
    last spec fastest), for a kernel with more than three grid dims; the kernel sees each spec's
    tile (or index) as if it had its own axis."""

    def __init__(self, *specs: str | tile | each) -> None:
        if len(specs) < 2 or any(isinstance(s, nest) for s in specs):
            raise ctx().error("kd.nest takes two or more tile/each specs (no nested nest)")
        self.specs = specs


def _program_id(axis: int) -> Value:
    out = Value(T.i32, (), hint="pid")
    ctx().add("program_id", [out], axis=axis)
    return out


def span(start: Value | int, size: int, limit: Value | int | None = None, label: str = "r") -> Value:
    """The tile `start + arange(size)`, masked by `< limit` when a limit is given."""
    c = ctx()
    if size < 1 or size & (size - 1):
        raise c.error(f"tile size must be a power of two, got {size} for {label!r}")
    ax = Axis(label, size)
    out = Value(T.i32, (ax,), hint=f"{label.lower()}", range_info=RangeInfo(start, size))
    c.add("range", [out], start=start, size=size)
    if limit is not None:
        pred = binary("<", out, limit)
        pred.masks = frozenset()
        out.masks = frozenset({pred})
    return out


def arange(size: int, label: str = "r", limit: Value | int | None = None) -> Value:
    return span(0, size, limit, label)


def full_range(name: str) -> Value:
    """All of a static dim as one tile (padded to a power of two and masked when needed)."""
    n = static(name)
    size = 1 << (n - 1).bit_length()
    return span(0, size, n if size != n else None, name)


def grid(*specs: str | tile | each | nest, order: "grouped | None" = None, programs: str | None = None) -> list[Value]:
    """Launch one program per tile of the listed dims; returns each program's tile (or index), a
    `kd.nest(...)` spec giving one per spec it holds.

    `order=kd.grouped(...)` remaps program ids to a grouped order; `programs="P"` launches P programs
    (a dim of the kernel) that each loop over tiles P apart (a persistent schedule): the rest of the
    kernel body runs once per tile."""
    c = ctx()
    if c.grid:
        raise c.error("kd.grid may be called once per kernel")
    if not 1 <= len(specs) <= 3:
        raise c.error(f"grid takes 1 to 3 dims, got {len(specs)}")
    if order is not None or programs is not None:
        if any(isinstance(s, nest) for s in specs):
            raise c.error("a remapped grid (order= or programs=) takes no kd.nest spec")
        return _grid_remapped(specs, order, programs)
    out = []
    for axis, s in enumerate(specs):
        if isinstance(s, nest):
            out.extend(_grid_nest(axis, s))
            continue
        s = tile(s) if isinstance(s, str) else s
        dim(s.dim)  # validates the name
        pid = _program_id(axis)
        if isinstance(s, each):
            c.grid.append(GridEntry("each", s.dim))
            out.append(pid)
        else:
            b = s.block_size()
            c.grid.append(GridEntry("tile", s.dim, b))
            out.append(span(pid * b, b, dim(s.dim), s.dim))
    return out


def _grid_nest(axis: int, spec: nest) -> list[Value]:
    """The tiles (or indices) of a `kd.nest` axis: its program id read as mixed-radix digits, the
    last spec fastest; a spec with one program (a static count of 1) gets index 0 without a division."""
    c = ctx()
    parts = [tile(s) if isinstance(s, str) else s for s in spec.specs]
    entries, counts, blocks = [], [], []
    for s in parts:
        n = dim(s.dim)
        if isinstance(s, each):
            entries.append(GridEntry("each", s.dim))
            counts.append(n)
            blocks.append(None)
        else:
            b = s.block_size()
            entries.append(GridEntry("tile", s.dim, b))
            counts.append(cdiv(n, b))
            blocks.append(b)
    c.grid.append(GridEntry("nest", "*".join(e.dim for e in entries), parts=tuple(entries)))
    rem = _program_id(axis)
    ids: list[Any] = [None] * len(parts)
    for i in range(len(parts) - 1, 0, -1):
        if isinstance(counts[i], int) and counts[i] == 1:
            ids[i] = 0
        else:
            ids[i] = rem % counts[i]
            rem = rem // counts[i]
    ids[0] = rem
    out = []
    for s, b, i in zip(parts, blocks, ids):
        n = dim(s.dim)
        exact = isinstance(n, int) and n % b == 0  # a static dim the tiles cover exactly: no mask
        out.append(i if b is None else span(i * b, b, None if exact else n, s.dim))
    return out


def cdiv(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return (a + (b - 1)) // b


# ----------------------------------------------------------------------------------------------
# loops

class tiles:
    """What a fold walks: [start, stop) in steps of a tile; `dim` gives stop = that dim.
    `unroll=True` unrolls the loop at compile time (`tl.static_range`): its bounds must be constants
    (static dims), e.g. a short loop over split partials whose every trip the ISA should show."""

    def __init__(self, dim: str | None = None, *, start: Value | int = 0, stop: Value | int | None = None,
                 block: str | int | None = None, domain: Sequence[int] = DEFAULT_BLOCK_DOMAIN,
                 default: int | None = None, label: str | None = None, step: Value | int | None = None,
                 num_stages: int | None = None, unroll: bool = False) -> None:
        if dim is None and stop is None:
            raise ctx().error("tiles needs a dim or a stop")
        self.dim, self.start, self.stop, self.block = dim, start, stop, block
        self.step, self.num_stages = step, num_stages  # step None: the block
        self.unroll = unroll
        self.domain, self.default = tuple(domain), default
        self.label = label or dim or "r"

    def resolve(self) -> tuple[Value | int, Value | int, int]:
        stop = dim(self.dim) if self.stop is None else self.stop
        if isinstance(self.block, int):
            b = self.block
        else:
            b = tile(self.dim or self.label, self.block, self.domain, self.default).block_size()
        return self.start, stop, b


def fold(over: "str | tiles | indices", init: Value | Sequence[Value] | None, body: Callable[..., Any]) -> Any:
    """Loop over tiles carrying state: `body(tile, *state) -> new state` (a value or a tuple).

    `init=()` or None: no state (the body returns None). Over `kd.indices(...)` the body gets a scalar."""
    c = ctx()
    spec = tiles(over) if isinstance(over, str) else over
    if isinstance(spec, indices):
        start, stop, block = spec.start, spec.stop, 1
    else:
        start, stop, block = spec.resolve()
    if isinstance(spec.num_stages, bool) or not (spec.num_stages is None or (isinstance(spec.num_stages, int)
                                                                            and spec.num_stages >= 1)):
        raise c.error(f"num_stages must be an int >= 1, got {spec.num_stages!r}")
    unroll = getattr(spec, "unroll", False)
    if not isinstance(unroll, bool):
        raise c.error(f"unroll must be True or False, got {unroll!r}")
    if unroll and not (isinstance(start, int) and isinstance(stop, int)
                       and (spec.step is None or isinstance(spec.step, int))):
        raise c.error("unroll=True needs constant loop bounds (static dims or ints), got "
                      f"start={start!r}, stop={stop!r}")
    if unroll and spec.num_stages is not None:
        raise c.error("unroll=True and num_stages exclude each other (an unrolled loop is not pipelined)")
    stateless = init is None or (isinstance(init, (tuple, list)) and not init)
    init = () if init is None else init
    single = isinstance(init, Value)
    inits = [init] if single else list(init)
    for v in inits:
        if not isinstance(v, Value):
            raise c.error(f"fold state must be tile values, got {v!r}")
    carried = [Value(v.dtype, v.axes, v.masks, hint="carry") for v in inits]
    for v in carried:
        v.name = c.fresh("carry")
    loopvar = Value(T.i32, (), hint="i")
    loopvar.name = c.fresh(spec.label.lower() + "0")
    from .ir import Block

    body_block = Block()
    c.stack.append(body_block)
    try:
        r = loopvar if isinstance(spec, indices) else span(loopvar, block, stop, spec.label)
        res = body(r, *carried)
    finally:
        c.stack.pop()
    if stateless and res is not None and not (isinstance(res, (tuple, list)) and not res):
        raise c.error("a fold with no state (init=()) needs a body that returns None")
    outs = [] if stateless else [res] if single else list(res) if isinstance(res, (tuple, list)) else [res]
    if len(outs) != len(inits):
        raise c.error(f"fold body returned {len(outs)} values for {len(inits)} state values")
    for o, v in zip(outs, carried):
        o = as_value(o, like=v)
        if not set(o.axes) <= set(v.axes):
            raise c.error(f"fold state changed axes from {list(v.axes)} to {list(o.axes)}")
    outs = [as_value(o, like=v) for o, v in zip(outs, carried)]
    node = c.add("fold", [], start=start, stop=stop, inits=inits, block=block, loopvar=loopvar, yields=outs, range=r)
    if isinstance(spec, indices) or spec.step is not None:
        node.a.step = spec.step
        node.a.scalar = isinstance(spec, indices)
    if spec.num_stages is not None:
        node.a.num_stages = spec.num_stages
    if unroll:
        node.a.unroll = True
    node.results = carried
    for v in carried:
        v.node = node
    node.blocks = [body_block]
    if stateless:
        return None
    return carried[0] if single else tuple(carried)


def exit_if(cond: Value) -> None:
    """Return early from the whole program when a scalar condition holds."""
    if cond.axes:
        raise ctx().error("exit_if needs a scalar condition")
    if getattr(ctx(), "persistent", False):
        raise ctx().error("exit_if would end every remaining tile of a persistent schedule (programs=): "
                          "guard the stores with a mask instead")
    ctx().add("exit_if", [], cond=cond)


def compile_option(name: str, value: Any) -> None:
    """Ask the backend compiler for launch option `name` = `value` in this specialization, where a
    tile's layout needs it: e.g. `matrix_instr_nonkdim=16`, the 16x16 matrix instructions that
    spread 8 warps over a [64, 32] score tile one 16x16 block each where the compiler would pick
    32x32 ones (2 blocks for 8 warps). It applies where the config leaves the option at the
    target's default; a config that sets another value is an error, and so is a value the target
    does not allow. On a target without the option (the interpreter; CUDA for an AMD option) it is
    a no-op. Call it while tracing, typically under a tunable: `if pv_t: kd.compile_option(...)`."""
    from .targets import TARGETS

    c = ctx()
    known = {o.name for t in TARGETS.values() for o in t.options}
    if name not in known:
        raise c.error(f"compile_option: unknown launch option {name!r}; known: {', '.join(sorted(known))}")
    spec = c.target.option(name) if hasattr(c.target, "option") else None
    if spec is not None and value not in spec.domain:
        raise c.error(f"compile_option: {name}={value!r} is not allowed on {c.target.name}; allowed: {list(spec.domain)}")
    if c.option_requests.get(name, value) != value:
        raise c.error(f"compile_option: {name} asked for both {c.option_requests[name]!r} and {value!r}")
    c.option_requests[name] = value


def barrier() -> None:
    """A workgroup barrier: every thread of this program waits here until all have arrived, and the
    program's global-memory stores before it are visible to its loads after it, so a program can
    re-read what it stored with a different layout or offset (store, `kd.barrier()`, load).
    Orders nothing between programs (use `kd.atomic_add` or separate launches for that). On the
    interpreter one program runs sequentially, so it is a no-op there."""
    ctx().add("barrier", [])


# ----------------------------------------------------------------------------------------------
# memory

def _index_values(h, idx: Sequence[Any]) -> list[Value | int]:
    c = ctx()
    dims = h.spec.dims
    if len(idx) != len(dims):
        raise c.error(f"{h.name} has {len(dims)} dims {dims}, indexed with {len(idx)}", h.name)
    out = []
    for d, i in zip(dims, idx):
        if isinstance(i, slice):
            if i != slice(None):
                raise c.error(f"only ':' slices are allowed (whole static dim), got {i}", h.name)
            i = full_range(d)
        if isinstance(i, Value) and i.dtype.is_float:
            raise c.error(f"index into {h.name} along {d} is {i.dtype!r}, not an integer", h.name)
        if not isinstance(i, (Value, int)):
            raise c.error(f"index into {h.name} along {d} must be a tile or int, got {i!r}", h.name)
        out.append(i)
    return out


INT4_UNPACKS = ("shift", "bfe", "sbfe", "swar")


def load(h, *idx: Any, mask: Value | None = None, other: int | float = 0, unpack: str = "shift") -> Value:
    """Gather-load `h[idx...]`: the result has the union of the indices' axes, masked by theirs.

    For packed int4 operands `unpack` picks the lowering: "shift" extracts the eight nibbles with one
    vector of shift amounts (2 shifts per element); "bfe" extracts each nibble with constant shifts
    (one sign-extending bit-field extract per element on AMD for two's-complement packings) and
    interleaves them with tl.join; "sbfe" is "bfe" that first flips an offset-binary packing's sign
    bits (one XOR per word), so every nibble is one signed extract there too; "swar" sign-extends
    four nibbles per word operation into bytes (mask, add, xor on whole words, then byte moves)."""
    if T.is_fp4(h.dtype):
        return _load_fp4(h, idx, mask)
    c = ctx()
    ivals = _index_values(h, idx)
    vals = [v for v in ivals if isinstance(v, Value)]
    extra = [mask] if mask is not None else []
    axes = union_axes(*vals, *extra)
    masks = union_masks(*vals)
    if h.is_int4:
        last = ivals[-1]
        if not isinstance(last, Value) or last.range_info is None or len(last.axes) != 1:
            raise c.error(f"{h.name} is packed int4: index its last dim with a contiguous tile", h.name)
        if last.range_info.size % 8:
            raise c.error(f"{h.name} is packed int4 (8 per word): the tile along {h.spec.dims[-1]} "
                          f"must be a multiple of 8, got {last.range_info.size}", h.name)
        if mask is not None and last.axes[0] in mask.axes:
            raise c.error(f"{h.name}: an extra mask over the packed axis is not supported", h.name)
        if unpack not in INT4_UNPACKS:
            raise c.error(f"{h.name}: unknown int4 unpack {unpack!r}; known: {', '.join(INT4_UNPACKS)}", h.name)
        out = Value(T.i8, axes, masks, hint=h.name)
        c.add("load_int4", [out], handle=h, indices=ivals, masks=masks, mask=mask, pack=h.spec.dtype, unpack=unpack)
        return out
    out = Value(h.dtype, axes, masks, hint=h.name)
    c.add("load", [out], handle=h, indices=ivals, masks=masks, mask=mask, other=other)
    return out


def store(h, idx: Sequence[Any], value: Any, mask: Value | None = None) -> None:
    c = ctx()
    if h.spec.kind == "in":
        raise c.error(f"{h.name} is declared In[...]: declare it Out or InOut to store", h.name)
    if h.is_int4 or T.is_fp4(h.dtype):
        raise c.error(f"{h.name}: storing packed int4/fp4 is not supported (store the bytes to a u8 operand)", h.name)
    ivals = _index_values(h, idx)
    vals = [v for v in ivals if isinstance(v, Value)]
    axes = union_axes(*vals)
    value = as_value(value)
    if not set(value.axes) <= set(axes):
        raise c.error(f"stored value has axes {list(value.axes)} not covered by the index axes {list(axes)}", h.name)
    if value.dtype is not h.dtype:
        value = cast(value, h.dtype)
    c.add("store", [], handle=h, indices=ivals, masks=union_masks(*vals), mask=mask, value=value, axes=axes)


def atomic_add(h, idx: Sequence[Any], value: Any, mask: Value | None = None) -> None:
    """`h[idx] += value` atomically across programs (relaxed ordering)."""
    c = ctx()
    if h.spec.kind == "in":
        raise c.error(f"{h.name} is declared In[...]: atomics need Out or InOut", h.name)
    ivals = _index_values(h, idx)
    vals = [v for v in ivals if isinstance(v, Value)]
    axes = union_axes(*vals)
    value = as_value(value)
    if value.dtype is not h.dtype:
        value = cast(value, h.dtype)
    c.add("atomic_add", [], handle=h, indices=ivals, masks=union_masks(*vals), mask=mask, value=value, axes=axes)


def atomic_ticket(h, idx: Sequence[Any]) -> Value:
    """Draw one ticket from a counter: `old = h[idx]; h[idx] = old + 1` as ONE atomic read-modify-write
    with acq_rel semantics at gpu scope (AMD: agent), returning `old` (an i32 scalar). The pattern it
    serves is "the last program finishes" (serial split-K / stream-K fix-ups): every program stores
    its partial tile, `kd.barrier()`, draws a ticket; the program that draws `programs - 1` runs the
    tail (`kd.exit_if(ticket != programs - 1)`), reads every partial and stores 0 back so the next
    launch (graph replay) starts from a zeroed counter. The ticket brings its own ordering (no
    `kd.barrier()` needed before it). Why the tail sees every partial:
    - all waves' stores complete before the release: every thread first waits for its own global
      stores (AMD `s_waitcnt vmcnt(0)`: the write-through L1 has handed them to L2; NVIDIA
      `fence.acq_rel.gpu`), then a workgroup barrier (s_barrier / bar.sync), and only then one
      thread draws the ticket; an s_barrier alone waits for no memory operation on gfx942/gfx950;
    - the ticket releases and acquires at gpu/agent scope: AMD writes L2 back (buffer_wbl2 sc1,
      for programs on another XCD) and waits before the atomic and invalidates (buffer_inv sc1)
      after it; NVIDIA emits atom.acq_rel.gpu. Every earlier ticket's release heads a release
      sequence that the later RMWs on the counter continue, so each earlier program's stores
      happen before the last program's acquire (both memory models);
    - the last program's loads follow the acquire in program order (the exit_if depends on the
      ticket's value, which the other threads get through a barrier after the acquire).
    Indices are scalars (tile starts, program ids, constants): the op sizes the counter operand.
    On the interpreter programs run one after another, so a test there proves the tail's bits, not
    the ordering."""
    c = ctx()
    if h.spec.kind == "in":
        raise c.error(f"{h.name} is declared In[...]: a ticket counter must be InOut", h.name)
    if h.dtype is not T.i32:
        raise c.error(f"{h.name}: a ticket counter must hold i32, not {h.dtype!r}", h.name)
    ivals = _index_values(h, idx)
    if any(isinstance(v, Value) and v.axes for v in ivals):
        raise c.error(f"{h.name}: a ticket is drawn at one counter: index it with scalars", h.name)
    out = Value(T.i32, (), hint="ticket")
    c.add("atomic_ticket", [out], handle=h, indices=ivals, masks=frozenset(), mask=None)
    return out


def _install_operand_methods() -> None:
    from .ir import OperandHandle

    def getitem(self, idx):
        return load(self, *(idx if isinstance(idx, tuple) else (idx,)))

    def setitem(self, idx, value):
        store(self, idx if isinstance(idx, tuple) else (idx,), value)

    OperandHandle.__getitem__ = getitem  # type: ignore[attr-defined]
    OperandHandle.__setitem__ = setitem  # type: ignore[attr-defined]
    OperandHandle.load = lambda self, *idx, mask=None, other=0, unpack="shift": load(  # type: ignore[attr-defined]
        self, *idx, mask=mask, other=other, unpack=unpack)
    OperandHandle.store = lambda self, *idx, value, mask=None: store(self, idx, value, mask)  # type: ignore[attr-defined]
    OperandHandle.atomic_add = lambda self, *idx, value, mask=None: atomic_add(self, idx, value, mask)  # type: ignore[attr-defined]


_install_operand_methods()

# ----------------------------------------------------------------------------------------------
# index reductions, scans, top-k and sort, more math

def _masked_fill(x: Value, axes: Sequence[Axis], fill: int | float) -> Value:
    """`x` with `fill` in the masked-off lanes of `axes` (the tail of a tile holds the load's `other`)."""
    tail = sorted((mk for mk in x.masks if any(a in mk.axes for a in axes)), key=lambda mk: mk.name)
    if not tail:
        return x
    cond = tail[0]
    for mk in tail[1:]:
        cond = binary("&", cond, mk)
    return where(cond, x, fill)


def _lowest(dt: T.DType) -> int | float:
    return float("-inf") if dt.is_float else torch_iinfo(dt)[0]


def _highest(dt: T.DType) -> int | float:
    return float("inf") if dt.is_float else torch_iinfo(dt)[1]


def _key_operand(v: Any, what: str) -> Value:
    """Values that index reductions and sorts compare: floats in f32, integers in i32."""
    v = as_value(v)
    if v.dtype.is_float:
        if v.dtype is T.f64:
            raise ctx().error(f"{what} compares f32 or narrower floats, got f64: cast to f32")
        return cast(v, T.f32) if v.dtype is not T.f32 else v
    if v.dtype.bits > 32 or v.dtype is T.u32:
        raise ctx().error(f"{what} compares i32 or narrower integers, got {v.dtype!r}")
    return cast(v, T.i32) if v.dtype is not T.i32 else v


def _argreduce(op: str, v: Any, axis: Value | Axis) -> Value:
    x = _key_operand(v, f"kd.{op}")
    ax = _axis_of(x, axis)
    x = _masked_fill(x, [ax], _lowest(x.dtype) if op == "argmax" else _highest(x.dtype))
    masks = frozenset(m for m in x.masks if ax not in m.axes)
    out = Value(T.i32, tuple(a for a in x.axes if a is not ax), masks, hint="idx")
    ctx().add("argreduce", [out], x=x, op=op, axis=ax)
    return out


def argmax(v: Any, axis: Value | Axis) -> Value:
    """Position (0-based, within the tile) of the largest element along `axis`; ties: lowest position.
    Masked-off lanes never win. Add the tile's `.start` for a global index."""
    return _argreduce("argmax", v, axis)


def argmin(v: Any, axis: Value | Axis) -> Value:
    """Position of the smallest element along `axis`; ties: lowest position."""
    return _argreduce("argmin", v, axis)


def cumsum(v: Any, axis: Value | Axis) -> Value:
    """Inclusive prefix sum along `axis`; masked-off lanes count as zero. Narrow floats sum in f32,
    narrow ints in i32 (as `kd.sum`)."""
    x = as_value(v)
    ax = _axis_of(x, axis)
    dt = x.dtype
    dt = (T.f32 if dt.bits < 32 else dt) if dt.is_float else (T.i32 if dt.bits < 32 else dt)
    if dt is not x.dtype:
        x = cast(x, dt)
    x = _masked_fill(x, [ax], 0.0 if dt.is_float else 0)
    out = Value(dt, x.axes, x.masks, hint="cs")
    ctx().add("scan", [out], x=x, op="sum", axis=ax)
    return out


def iota(axis: Value | Axis) -> Value:
    """The positions 0..size-1 of an existing axis, as an i32 tile over that axis."""
    ax = axis if isinstance(axis, Axis) else (axis.axes[0] if isinstance(axis, Value) and len(axis.axes) == 1 else None)
    if ax is None:
        raise ctx().error(f"iota takes one axis (a 1-D tile or an Axis), got {axis!r}")
    out = Value(T.i32, (ax,), hint="pos")
    ctx().add("iota", [out], axis=ax)
    return out


def _axes_arg(x: Value, axis: Any) -> list[Axis]:
    axs = [_axis_of(x, a) for a in (axis if isinstance(axis, (tuple, list)) else (axis,))]
    if len(set(axs)) != len(axs):
        raise ctx().error(f"axis {axis!r} names one axis twice")
    return axs


def topk(v: Any, k: int, axis: Any, index: Value | None = None, largest: bool = True,
         into: Value | None = None) -> tuple[Value, Value]:
    """The `k` largest (`largest=False`: smallest) elements along `axis`, sorted, and their indices.

    Ties go to the lowest index. The index of an element is its position along `axis` (row-major
    over a tuple of axes), or the value of `index` (a non-negative i32 tile over some of `v`'s axes,
    e.g. an expert id) when given. The result lies on a new axis of size k (padded to a power of
    two and masked), or along `into` (a 1-D tile of that padded size, e.g. `kd.full_range("K")`, so the
    results can index a store). Masked-off lanes of `v` rank last. Floats compare as f32 (-0.0 below +0.0,
    NaN above +inf); integers as i32. Values come back in `v`'s type."""
    c = ctx()
    src = as_value(v)
    x = _key_operand(src, "kd.topk")
    axs = _axes_arg(x, axis)
    n = 1
    for a in axs:
        n *= a.size
    if not isinstance(k, int) or not 1 <= k <= n:
        raise c.error(f"topk: k={k!r} must be an int in [1, {n}] (the tile size along {axs})")
    x = _masked_fill(x, axs, _lowest(x.dtype) if largest else _highest(x.dtype))
    if index is None:
        pos = None
        for a in axs:
            p = iota(a)
            pos = p if pos is None else pos * a.size + p
        index = pos
    index = as_value(index)
    if index.dtype.is_float or index.dtype.bits > 32:
        raise c.error(f"topk: index must be an i32 tile, got {index.dtype!r}")
    if not set(index.axes) <= set(x.axes):
        raise c.error(f"topk: index axes {list(index.axes)} are not axes of the value {list(x.axes)}")
    index = cast(index, T.i32) if index.dtype is not T.i32 else index
    kp2 = 1 << (k - 1).bit_length()
    others = tuple(a for a in x.axes if a not in axs)
    omasks = frozenset(m for m in x.masks | index.masks if not any(a in m.axes for a in axs))
    if into is not None and into is not False:
        if not isinstance(into, Value) or len(into.axes) != 1 or into.axes[0].size != kp2 or into.axes[0] in x.axes:
            raise c.error(f"topk: into= must be a 1-D tile of size {kp2} (k={k} padded to a power of two) "
                          f"on an axis the value does not have, got {into!r}")
        kax, kmasks = into.axes[0], into.masks
    elif len(axs) == 1 and kp2 == n and into is False:  # kd.sort: the result stays on the same axis
        kax = axs[0]
        kmasks = frozenset(m for m in x.masks if kax in m.axes)
    else:
        kr = span(0, kp2, k if kp2 != k else None, "k")
        kax, kmasks = kr.axes[0], kr.masks
    vals = Value(x.dtype, others + (kax,), omasks | kmasks, hint="top")
    ids = Value(T.i32, others + (kax,), omasks | kmasks, hint="top_id")
    c.add("topk", [vals, ids], x=x, index=index, axes=tuple(axs), kaxis=kax, k=kp2, largest=largest)
    if src.dtype is not x.dtype and src.dtype.is_float:
        vals = cast(vals, src.dtype)
    return vals, ids


def sort(v: Any, axis: Value | Axis, descending: bool = False, return_indices: bool = False) -> Any:
    """`v` sorted along one axis (masked-off lanes go last, so the tile's mask still marks the valid
    lanes). With `return_indices=True`, also the positions the elements came from (ties: lowest
    first, i.e. a stable sort)."""
    c = ctx()
    src = as_value(v)
    x = _key_operand(src, "kd.sort")
    (ax,) = _axes_arg(x, axis)
    if return_indices:
        vals, ids = topk(src, ax.size, ax, largest=descending, into=False)  # type: ignore[arg-type]
        return vals, ids
    x = _masked_fill(x, [ax], _lowest(x.dtype) if descending else _highest(x.dtype))
    others = tuple(a for a in x.axes if a is not ax)
    out = Value(x.dtype, others + (ax,), x.masks, hint="sorted")
    c.add("sort", [out], x=x, axis=ax, descending=descending)
    return cast(out, src.dtype) if src.dtype is not x.dtype and src.dtype.is_float else out


def rint(x: Any) -> Value:
    """Round to the nearest integer, ties to even (f32)."""
    return _unary_ext("rint", x)


def tanh(x: Any) -> Value:
    return _unary_ext("tanh", x)


def erf(x: Any) -> Value:
    return _unary_ext("erf", x)


def _unary_ext(op: str, x: Any) -> Value:
    x = as_value(x)
    if x.dtype not in (T.f32, T.f64):
        x = cast(x, T.f32)
    out = Value(x.dtype, x.axes, x.masks, hint="t")
    ctx().add("math_ext", [out], x=x, op=op)
    return out


def pow(x: Any, y: Any) -> Value:  # noqa: A001
    """`x ** y`. A small integer constant exponent becomes multiplications (exact, in x's type);
    otherwise both sides are computed in f32 with the target's pow."""
    if isinstance(y, int) and not isinstance(y, bool) and isinstance(x, Value) and -8 <= y <= 8:
        if y == 0:
            one = 1.0 if x.dtype.is_float else 1
            return where(x == x, one, one)
        base = x if y > 0 or x.dtype.is_float else cast(x, T.f32)
        r, p, e = None, base, _abs_int(y)
        while e:
            if e & 1:
                r = p if r is None else binary("*", r, p)
            e >>= 1
            if e:
                p = binary("*", p, p)
        return r if y > 0 else binary("/", 1.0, r)
    xv = as_value(x, like=y if isinstance(y, Value) else None)
    yv = as_value(y, like=xv)
    xv = cast(xv, T.f32) if xv.dtype is not T.f32 else xv
    yv = cast(yv, T.f32) if yv.dtype is not T.f32 else yv
    out = Value(T.f32, union_axes(xv, yv), union_masks(xv, yv), hint="t")
    ctx().add("pow", [out], base=xv, exponent=yv)
    return out


def fma(a: Any, b: Any, c: Any) -> Value:
    """a * b + c in f32 with one rounding (the hardware fused multiply-add; exact on the
    interpreter too), e.g. the exact remainder a - q * b of a division, fma(-q, b, a)."""
    vals = [as_value(v) for v in (a, b, c)]
    vals = [cast(v, T.f32) if v.dtype is not T.f32 else v for v in vals]
    out = Value(T.f32, union_axes(*vals), union_masks(*vals), hint="t")
    ctx().add("fma", [out], a=vals[0], b=vals[1], c=vals[2])
    return out


def _abs_int(n: int) -> int:
    return n if n >= 0 else -n


Value.__pow__ = lambda self, other: pow(self, other)  # type: ignore[attr-defined]
Value.__rpow__ = lambda self, other: pow(other, self)  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------------
# loops over scalar counts, tile starts, program-id remapping

class indices:
    """What a fold walks when its body wants a scalar: `range(start, stop, step)` (the body gets an
    i32 scalar). `num_stages` asks the target's software pipeliner for that many stages."""

    def __init__(self, stop: Value | int, start: Value | int = 0, step: Value | int = 1,
                 num_stages: int | None = None, label: str = "i") -> None:
        self.start, self.stop, self.step, self.num_stages, self.label = start, stop, step, num_stages, label


def _install_tile_accessors() -> None:
    def start(self: Value) -> Value | int:
        if self.range_info is None:
            raise ctx().error(f"{self.name} is not a tile made by kd.grid, kd.fold or kd.span: it has no start")
        return self.range_info.start

    def size(self: Value) -> int:
        if self.range_info is None:
            raise ctx().error(f"{self.name} is not a tile made by kd.grid, kd.fold or kd.span: it has no size")
        return self.range_info.size

    Value.start = property(start)  # type: ignore[attr-defined]
    Value.size = property(size)  # type: ignore[attr-defined]


_install_tile_accessors()


class grouped:
    """Program order for a 2-D tile grid: `group` consecutive tiles of the first dim share each tile
    of the second (L2 reuse of the second operand's tiles, as in grouped GEMM orderings). `group`
    is an int or the name of a tunable (domain `domain`, default `default`)."""

    def __init__(self, group: int | str = "GROUP_M", domain: Sequence[int] = (1, 2, 4, 8, 16),
                 default: int = 8) -> None:
        self.group, self.domain, self.default = group, tuple(domain), default

    def size(self) -> int:
        if isinstance(self.group, int):
            if self.group < 1:
                raise ctx().error(f"grouped: group must be >= 1, got {self.group}")
            return self.group
        return tunable(self.group, self.domain, self.default)


def _open_loop(start: Value | int, stop: Value | int, step: Value | int, label: str) -> Value:
    """A stateless scalar loop whose body stays open to the end of the trace (persistent schedules)."""
    from .ir import Block

    c = ctx()
    loopvar = Value(T.i32, (), hint=label)
    loopvar.name = c.fresh(label)
    node = c.add("fold", [], start=start, stop=stop, block=1, loopvar=loopvar, yields=[], range=None,
                 step=step, scalar=True, persistent=True)
    body = Block()
    node.blocks = [body]
    c.stack.append(body)
    c.persistent = True  # type: ignore[attr-defined]
    return loopvar


def _grid_remapped(specs: Sequence[str | tile | each], order: grouped | None, programs: str | None) -> list[Value]:
    """`kd.grid(..., order=, programs=)`: tile ids from a remapped program id."""
    c = ctx()
    if len(specs) > 2:
        raise c.error("a remapped grid (order= or programs=) takes 1 or 2 dims")
    if order is not None and len(specs) != 2:
        raise c.error("order=kd.grouped(...) needs a 2-D grid")
    norm = [tile(s) if isinstance(s, str) else s for s in specs]
    counts, blocks = [], []
    for s in norm:
        dim(s.dim)
        if isinstance(s, each):
            blocks.append(None)
            counts.append(dim(s.dim))
        else:
            b = s.block_size()
            blocks.append(b)
            counts.append(cdiv(dim(s.dim), b))
    if programs is not None:
        nprog = dim(programs)
        c.grid.append(GridEntry("each", programs))
        pid = _program_id(0)
        total = counts[0] if len(counts) == 1 else counts[0] * counts[1]
        lin = _open_loop(pid, total, nprog, "tile_id")
    else:
        for axis, s in enumerate(norm):
            c.grid.append(GridEntry("each", s.dim) if isinstance(s, each) else GridEntry("tile", s.dim, blocks[axis]))
        lin = _program_id(0)
        if len(norm) == 2:
            lin = lin + _program_id(1) * counts[0]  # dispatch order: axis 0 runs fastest
    if len(norm) == 1:
        ids = [lin]
    elif order is None:
        ids = [lin // counts[1], lin % counts[1]]
    else:
        g = order.size()
        width = counts[1] * g
        first = (lin // width) * g
        gsz = minimum(counts[0] - first, g)
        ids = [first + (lin % width) % gsz, (lin % width) // gsz]
    out = []
    for s, b, i in zip(norm, blocks, ids):
        out.append(i if b is None else span(i * b, b, dim(s.dim), s.dim))
    return out


# ----------------------------------------------------------------------------------------------
# the escape hatch: call a @triton.jit helper

def triton_call(fn: Any, *args: Any, dtype: T.ElemType | None = None, axes: Sequence[Value | Axis] | None = None,
                results: int = 1) -> Any:
    """Call a `@triton.jit` function `fn` (defined at module level in an importable user module)
    on tiles and scalars; returns `results` tile values.

    Each tile argument reaches `fn` as a Triton tensor laid out over the union of all tile arguments'
    axes (in order of first appearance), with size-1 dims where an argument lacks an axis, so the
    arguments broadcast against each other; scalars and Python numbers pass as they are. Each result
    must broadcast to `axes` (default: that union) and is converted to `dtype` (default: the first
    tile argument's type). Limits: no masks go in (`fn` sees whatever masked-off lanes hold, usually the
    load's `other`); results carry the union of the arguments' masks; operands (pointers) cannot be
    passed; `fn` must be interpretable by Triton's interpreter to run on CPU tensors."""
    c = ctx()
    if not (hasattr(fn, "fn") and hasattr(fn, "run")) or not callable(getattr(fn, "fn", None)):
        raise c.error(f"triton_call needs a @triton.jit function, got {fn!r}")
    mod = getattr(fn.fn, "__module__", None)
    qual = getattr(fn.fn, "__qualname__", "")
    if not mod or "." in qual or "<" in qual:
        raise c.error(f"triton_call: {qual or fn!r} must be defined at module level of an importable module")
    if mod.split(".")[0] in ("ops",):
        raise c.error(f"triton_call: helpers live in user modules, not in {mod} (kernels in ops/ are DSL only)")
    vals = [as_value(a) if isinstance(a, (Value, bool, int, float)) else a for a in args]
    for a in vals:
        if not isinstance(a, Value):
            raise c.error(f"triton_call: arguments are tiles, scalars or numbers, got {type(a).__name__}")
    tiles_ = [a for a in vals if a.axes]
    lay = union_axes(*tiles_)
    if axes is not None:
        out_axes = tuple(a if isinstance(a, Axis) else a.axes[0] for a in axes)
    else:
        out_axes = lay
    if not set(out_axes) <= set(lay) and lay:
        raise c.error(f"triton_call: result axes {list(out_axes)} are not among the arguments' axes {list(lay)}")
    if dtype is None:
        first = tiles_[0] if tiles_ else vals[0] if vals else None
        if first is None:
            raise c.error("triton_call: give dtype= when no argument fixes the result type")
        dt = first.dtype
    else:
        from .targets import resolve_dtype

        dt = resolve_dtype(dtype, c.target)
    masks = frozenset(m for m in union_masks(*vals) if all(a in out_axes for a in m.axes))
    outs = [Value(dt, out_axes, masks, hint=fn.fn.__name__) for _ in range(results)]
    c.add("triton_call", outs, args=list(vals), module=mod, name=fn.fn.__name__, layout=lay)
    return outs[0] if results == 1 else tuple(outs)


__all__ = [n for n in dir() if not n.startswith("_")] + ["math"]
