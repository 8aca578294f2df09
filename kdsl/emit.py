"""Triton source emitter: one `@triton.jit` function per specialization, readable, with each
statement group preceded by the DSL line it came from."""
from __future__ import annotations

import math
import os
from typing import Any

from . import types as T
from .ir import Axis, Block, Node, OperandHandle, TraceContext, Value

UNARY = {"exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "log2": "tl.log2", "sqrt": "tl.sqrt",
         "rsqrt": "tl.rsqrt", "sigmoid": "tl.sigmoid", "abs": "tl.abs", "sin": "tl.sin", "cos": "tl.cos"}


def lit(v: Any) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        if math.isinf(v):
            return 'float("inf")' if v > 0 else 'float("-inf")'
        if math.isnan(v):
            return 'float("nan")'
        return repr(v)
    return repr(v)


def tl_type(dt: T.DType) -> str:
    return f"tl.{dt.triton}"


class Emitter:
    def __init__(self, c: TraceContext, target: Any, fn_name: str) -> None:
        self.c, self.target, self.fn_name = c, target, fn_name
        self.biased: set[int] = set()  # int4 tiles emitted as bf16 q + INT4_BIAS (kd.group_dot's operands)
        self.lines: list[str] = []
        self.indent = 1
        self.last_loc: tuple[str, int] | None = None
        self.tmp = 0

    # -- helpers --------------------------------------------------------------------------------
    def w(self, s: str) -> None:
        self.lines.append("    " * self.indent + s)

    def fresh(self, hint: str) -> str:
        self.tmp += 1
        return f"_{hint}{self.tmp}"

    def ref(self, v: Value | int | float) -> str:
        if not isinstance(v, Value):
            return lit(v)
        if v.const is not None:
            return lit(v.const)
        return v.name

    def aligned(self, v: Value | int | float, axes: tuple[Axis, ...]) -> str:
        """Expression for `v` laid out over `axes` (permuted, with None for broadcast dims)."""
        if not isinstance(v, Value) or v.const is not None or not v.axes:
            return self.ref(v)
        return self._align(v.name, v.axes, axes)

    def _align(self, expr: str, vaxes: tuple[Axis, ...], axes: tuple[Axis, ...]) -> str:
        """`expr` (a name over `vaxes`) laid out over `axes`."""
        if not vaxes:
            return expr
        missing = [a for a in vaxes if a not in axes]
        if missing:
            raise self.c.error(f"value {expr} has axes {missing} that the context {list(axes)} lacks",
                               loc=getattr(self, "cur_loc", None))
        present = [a for a in axes if a in vaxes]
        if present != list(vaxes):
            perm = [vaxes.index(a) for a in present]
            expr = f"tl.trans({expr})" if len(perm) == 2 else f"tl.permute({expr}, {tuple(perm)})"
        if len(present) != len(axes):
            expr += "[" + ", ".join(":" if a in vaxes else "None" for a in axes) + "]"
        return expr

    def shape(self, axes: tuple[Axis, ...]) -> str:
        return "(" + ", ".join(str(a.size) for a in axes) + ("," if len(axes) == 1 else "") + ")"

    def mask_expr(self, masks: Any, extra: Value | None, axes: tuple[Axis, ...],
                  bounds: list[str] | None = None) -> str | None:
        parts = [self.aligned(m, axes) for m in sorted(masks, key=lambda m: m.name)]
        if extra is not None:
            if not extra.axes and axes and getattr(self.target, "backend", None) == "interpret":
                # the interpreter cannot mix a scalar bool into a vector mask (bound_exprs): a vector
                vec = self.fresh("mv")
                self.w(f"{vec} = tl.full({self.shape(axes)}, 0, tl.int1) | {self.ref(extra)}")
                parts.append(vec)
            else:
                parts.append(self.aligned(extra, axes))
        parts += bounds or []
        if not parts:
            return None
        return " & ".join(f"({p})" if " " in p else p for p in parts)

    def bound_exprs(self, n: Node, h: OperandHandle, ivals: list[Any], axes: tuple[Axis, ...]) -> list[str]:
        """Emit the checks `0 <= index < dim` the bounds pass asked for (indices computed from
        loaded data) and return them laid out over the access axes, for the access mask."""
        out = []
        for pos, dname, lo, hi in n.a.bounds:
            i = ivals[pos]
            src = self.ref(i)
            if not i.axes and axes and getattr(self.target, "backend", None) == "interpret":
                # the interpreter cannot mix a scalar bool into a vector mask: compare a vector
                vec = self.fresh("iv")
                self.w(f"{vec} = {src} + tl.full({self.shape(axes)}, 0, {tl_type(i.dtype)})")
                src, vaxes = vec, axes
            else:
                vaxes = i.axes
            dv = self.ref(self.c.dims[dname])
            if lo and hi:  # one unsigned compare: a negative index wraps to a huge one
                u = "uint64" if i.dtype.bits == 64 else "uint32"
                conds = [f"({src}.to(tl.{u}, bitcast=True) < {dv})"]
            else:
                conds = [f"({src} >= 0)"] if lo else [f"({src} < {dv})"]
            rule = f"in [0, {dv})" if lo and hi else (f">= 0 (a remainder by {dv})" if lo else f"< {dv} (unsigned)")
            b = self.fresh("inb")
            self.w(f"{b} = {' & '.join(conds)}  # bounded gather: {h.name} index {pos} (dim {dname}) "
                   f"comes from loaded data, must be {rule}")
            out.append(self._align(b, vaxes, axes))
        return out

    def offsets(self, h: OperandHandle, ivals: list[Any], axes: tuple[Axis, ...], last_override: str | None = None,
                wide: list[str] | None = None) -> str:
        """The 32-bit offset sum; with `wide` given, the 64-bit terms of the operand's wide dims go
        there instead (see `address`)."""
        terms = []
        n = len(ivals)
        for d, (i, s) in enumerate(zip(ivals, h.strides)):
            if d == n - 1 and last_override is not None:
                e = last_override
            else:
                e = self.aligned(i, axes)
            if isinstance(i, int) and i == 0 and last_override is None:
                continue
            stride = self.ref(s)
            if wide is not None and d in h.wide:  # a 64-bit product: offsets along d pass 2^31 elements
                wide.append(f"{self._paren(e)} * tl.cast({stride}, tl.int64)")
            else:
                terms.append(e if stride == "1" else f"{self._paren(e)} * {stride}")
        return " + ".join(terms) if terms else "0"

    def address(self, h: OperandHandle, ivals: list[Any], axes: tuple[Axis, ...], last_override: str | None = None) -> str:
        """`ptr + (offsets)`. For an operand with 64-bit dims: `ptr + wide terms + (32-bit sum)`, so
        the 64-bit products move the base pointer (per row for a gathered page) and the tile's own
        offsets stay 32-bit pointer increments that the compiler can still vectorize."""
        wide: list[str] = []
        narrow = self.offsets(h, ivals, axes, last_override, wide if h.wide else None)
        head = "".join(f"({w}) + " for w in wide)
        return f"{h.name}_ptr + {head}{self._paren(narrow)}"

    @staticmethod
    def _paren(e: str) -> str:
        return f"({e})" if any(ch in e for ch in " +-*/%&|") and not e.endswith("]") else e

    def loc_comment(self, n: Node) -> None:
        if n.loc is None:
            return
        key = (n.loc.file, n.loc.line)
        if key != self.last_loc:
            self.last_loc = key
            self.w(f"# {os.path.basename(n.loc.file)}:{n.loc.line}: {n.loc.text}")

    # -- program -------------------------------------------------------------------------------
    def _loop_range(self, n: Node, start: Any, stop: Any) -> str:
        """`range(start, stop, step)`; `tl.range(..., num_stages=)` where the fold asks for stages."""
        step = n.a.step
        step_s = str(n.a.block) if step is None else self.ref(step)
        if getattr(n.a, "unroll", False):
            return f"tl.static_range({self.ref(start)}, {self.ref(stop)}, {step_s})"
        stages = n.a.num_stages
        if stages is not None and getattr(self.target, "backend", None) != "interpret":
            return f"tl.range({self.ref(start)}, {self.ref(stop)}, {step_s}, num_stages={stages})"
        return f"range({self.ref(start)}, {self.ref(stop)}, {step_s})"

    def emit_block(self, b: Block) -> None:
        for n in b.nodes:
            self.cur_loc = n.loc  # trace errors raised while emitting name this node's DSL line
            self.loc_comment(n)
            getattr(self, f"op_{n.op}")(n)

    def op_program_id(self, n: Node) -> None:
        self.w(f"{n.results[0].name} = tl.program_id({n.a.axis})")

    def op_range(self, n: Node) -> None:
        r = n.results[0]
        start = n.a.start
        ar = f"tl.arange(0, {n.a.size})"
        if isinstance(start, int) and start == 0:
            self.w(f"{r.name} = {ar}")
        else:
            self.w(f"{r.name} = {self.ref(start)} + {ar}")

    def _f32_round(self, expr: str, n: Node) -> str:
        """In the interpreter, bf16 results are computed in f32 and rounded to nearest even."""
        if not n.a.f32_then_round:
            return expr
        tmp = self.fresh("f")
        self.w(f"{tmp} = {expr}")
        return self._rne_bf16(tmp)

    def _rne_bf16(self, src: str) -> str:
        u = self.fresh("u")
        self.w(f"{u} = {src}.to(tl.float32).to(tl.uint32, bitcast=True)")
        # NaN stays a quiet NaN (adding the rounding bias could carry a NaN payload into inf)
        self.w(f"{u} = tl.where(({u} & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, "
               f"({u} + (0x7FFF + (({u} >> 16) & 1))) & 0xFFFF0000)")
        # the high half is the bf16 pattern; a bit move (not a float cast) keeps subnormals exact
        return f"({u} >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)"

    # (mantissa bits, exponent of the smallest normal) per fp8 flavour
    FP8_GRID = {"fp8e4m3fn": (3, -6), "fp8e4m3fnuz": (3, -7), "fp8e5m2": (2, -14), "fp8e5m2fnuz": (2, -15)}

    def _rne_fp8(self, src: str, dt: T.DType) -> str:
        """Round to the fp8 grid (nearest even; subnormals by the magic-number add) in f32."""
        mbits, emin = self.FP8_GRID[dt.name]
        drop = 23 - mbits
        f, u, sub = self.fresh("f"), self.fresh("u"), self.fresh("sub")
        self.w(f"{f} = {src}.to(tl.float32)")
        self.w(f"{u} = {f}.to(tl.uint32, bitcast=True)")
        self.w(f"{u} = ({u} + ({(1 << (drop - 1)) - 1} + (({u} >> {drop}) & 1))) & {0xFFFFFFFF ^ ((1 << drop) - 1)}")
        c = 1.5 * 2.0 ** (23 + emin - mbits)
        self.w(f"{sub} = (tl.abs({f}) + {c!r}) - {c!r}")
        if dt.name.endswith("fnuz"):  # no negative zero there (its bit pattern is NaN): -tiny -> +0
            self.w(f"{sub} = tl.where(({f} < 0) & ({sub} != 0), -{sub}, {sub})")
        else:
            self.w(f"{sub} = tl.where({f} < 0, -{sub}, {sub})  # keep the sign of values that round to 0")
        return (f"tl.where(tl.abs({f}) < {2.0 ** emin!r}, {sub}, {u}.to(tl.float32, bitcast=True))"
                f".to({tl_type(dt)})")

    def _as_f32(self, v: Any, axes: tuple[Axis, ...], f32: bool) -> str:
        e = self.aligned(v, axes)
        if f32 and isinstance(v, Value) and v.const is None and v.dtype is T.bf16:
            return f"{e}.to(tl.float32)"
        return e

    def op_binary(self, n: Node) -> None:
        r = n.results[0]
        f32 = bool(n.a.f32_then_round)
        a, b = (self._as_f32(x, r.axes, f32) for x in (n.a.lhs, n.a.rhs))
        op = n.a.op
        self.w(f"{r.name} = {self._f32_round(f'{a} {op} {b}', n)}")

    def op_unary(self, n: Node) -> None:
        r, op = n.results[0], n.a.op
        a = self._as_f32(n.a.x, r.axes, bool(n.a.f32_then_round))
        expr = f"{op}{a}" if op in ("-", "~") else f"{UNARY[op]}({a})"
        if op == "sigmoid" and getattr(self.target, "backend", None) == "interpret":
            expr = f"1.0 / (1.0 + tl.exp(-{self._paren(a)}))"  # tl.sigmoid is a JITFunction: not interpretable
        self.w(f"{r.name} = {self._f32_round(expr, n)}")

    def op_minmax(self, n: Node) -> None:
        r = n.results[0]
        f32 = bool(n.a.f32_then_round)
        a, b = (self._as_f32(x, r.axes, f32) for x in (n.a.lhs, n.a.rhs))
        fn = n.a.op
        self.w(f"{r.name} = {self._f32_round(f'tl.{fn}({a}, {b})', n)}")

    def op_where(self, n: Node) -> None:
        r = n.results[0]
        f = n.a
        f32 = bool(f.f32_then_round)
        cnd = self.aligned(f.cond, r.axes)
        a, b = (self._as_f32(x, r.axes, f32) for x in (f.on_true, f.on_false))
        expr = f"tl.where({cnd}, {a}, {b})"
        if f32:  # select never rounds; only a mixed-type select needs the cast
            expr = f"({expr}).to(tl.bfloat16)" if any(
                isinstance(x, Value) and x.const is None and x.dtype is not T.bf16 for x in (f.on_true, f.on_false)) else expr
        self.w(f"{r.name} = {expr}")

    def op_cast(self, n: Node) -> None:
        r, src = n.results[0], n.a.x
        dt = n.a.dtype
        s = self.ref(src)
        lower = n.a.lower
        if lower == "rtz_bits":
            self.w(f"{r.name} = ({s}.to(tl.float32).to(tl.uint32, bitcast=True) >> 16)"
                   f".to(tl.uint16).to(tl.bfloat16, bitcast=True)")
        elif lower == "rne_bits":
            self.w(f"{r.name} = {self._rne_bf16(s)}")
        elif lower == "rne_fp8_bits":
            self.w(f"{r.name} = {self._rne_fp8(s, dt)}")
        else:
            self.w(f"{r.name} = {s}.to({tl_type(dt)})")

    def op_bitcast(self, n: Node) -> None:
        r = n.results[0]
        self.w(f"{r.name} = {self.ref(n.a.x)}.to({tl_type(n.a.dtype)}, bitcast=True)")

    def op_reduce(self, n: Node) -> None:
        r, x, f = n.results[0], n.a.x, n.a
        ax = x.axes.index(f.axis)
        src = self.ref(x)
        if f.op == "sum" and x.dtype is not f.dtype:
            src = f"{src}.to({tl_type(f.dtype)})"
        self.w(f"{r.name} = {self._reduce_call(f.op, src, ax)}")

    _INTERP_COMBINE = {"sum": "_sum_combine", "max": "_elementwise_max", "min": "_elementwise_min"}

    def _reduce_call(self, op: str, src: str, ax: int) -> str:
        """`tl.sum/max/min`; on the interpreter, `tl.reduce` with the standard combine function,
        because tl.sum is a JITFunction there (not interpretable) while the patched tl.reduce maps
        these combine functions to numpy reductions."""
        if getattr(self.target, "backend", None) == "interpret":
            return f"tl.reduce({src}, {ax}, tl.standard.{self._INTERP_COMBINE[op]})"
        return f"tl.{op}({src}, axis={ax})"

    def op_full(self, n: Node) -> None:
        r = n.results[0]
        self.w(f"{r.name} = tl.full({self.shape(r.axes)}, {lit(n.a.value)}, {tl_type(n.a.dtype)})")

    def op_broadcast(self, n: Node) -> None:
        r = n.results[0]
        self.w(f"{r.name} = tl.broadcast_to({self.aligned(n.a.x, r.axes)}, {self.shape(r.axes)})")

    def op_pad(self, n: Node) -> None:
        """Double the padded axis until it is the target's size: join (a new last dim), move that dim
        in front of the axis, merge the two. No offset: join with zeros (x's rows first, no
        arithmetic). An offset: join x with itself (x repeated to.size / size times), then keep the
        copy at block offset // size and zero the others (one select)."""
        r, x, off = n.results[0], n.a.x, n.a.offset
        pos, nd = x.axes.index(n.a.axis), len(x.axes)
        shape = [ax.size for ax in x.axes]
        size = shape[pos]
        cur = self.ref(x)
        perm = tuple(list(range(pos)) + [nd] + list(range(pos, nd)))
        dt = tl_type(x.dtype)
        while shape[pos] < n.a.to.size:
            other = f"tl.full({tuple(shape)}, 0, {dt})" if off is None else cur
            shape[pos] *= 2
            nxt = self.fresh("pad")
            self.w(f"{nxt} = tl.reshape(tl.permute(tl.join({cur}, {other}), {perm}), {tuple(shape)})")
            cur = nxt
        if off is not None and shape[pos] > size:
            index = "[" + ", ".join(":" if d == pos else "None" for d in range(nd)) + "]"
            block = f"(tl.arange(0, {shape[pos]}) // {size}){index if nd > 1 else ''}"
            nxt = self.fresh("pad")
            self.w(f"{nxt} = tl.where({block} == ({self.ref(off)} // {size}), {cur}, tl.full({tuple(shape)}, 0, {dt}))")
            cur = nxt
        self.w(f"{r.name} = {cur}")

    def op_dot(self, n: Node) -> None:
        f = n.a
        a, b, acc = f.a, f.b, f.acc
        r = n.results[0]
        i, k, j = f.i, f.k, f.j
        A, B = self.aligned(a, (i, k)), self.aligned(b, (k, j))
        out = tl_type(f.dtype)
        if f.form == "mulsum":
            A3 = f"{self._paren(A)}.to({out})[:, :, None]"
            B3 = f"{self._paren(B)}.to({out})[None, :, :]"
            expr = self._reduce_call("sum", f"{A3} * {B3}", 1)
            if acc is not None:
                expr = f"{self.aligned(acc, (i, j))} + {expr}"
            self.w(f"{r.name} = {expr}")
            return
        if f.upcast:
            A, B = f"{self._paren(A)}.to(tl.float32)", f"{self._paren(B)}.to(tl.float32)"
        extra = ""
        if a.dtype is T.f32 or f.upcast:
            extra = ', input_precision="ieee"'
        floats = (T.bf16, T.f16, T.f32)
        if self.interp and f.dtype is T.f32 and (f.upcast or (a.dtype in floats and b.dtype in floats)) and \
                (acc is None or acc.dtype is T.f32):
            # each output summed in f64 whatever the tile's shape (kdsl.interp.dot), as a matrix instruction
            self.need("from kdsl import interp as _kdi")
            acc_a = f", {self.aligned(acc, (i, j))}" if acc is not None else ""
            self.w(f"{r.name} = _kdi.dot({A}, {B}{acc_a})")
            return
        acc_s = f", acc={self.aligned(acc, (i, j))}" if acc is not None else f", out_dtype={out}"
        self.w(f"{r.name} = tl.dot({A}, {B}{acc_s}{extra})")

    def clamped_indices(self, n: Node, h: OperandHandle, ivals: list[Any]) -> list[Any]:
        """For a load whose bounds clamp (see passes.bound_gathers): the indices with each bounded
        one replaced by a name holding it clamped into [0, dim)."""
        out = list(ivals)
        for pos, dname, lo, hi in n.a.bounds:
            i = ivals[pos]
            src, dv = self.ref(i), self.ref(self.c.dims[dname])
            if lo and hi:  # unsigned min: a negative index wraps to a huge one, then to dim - 1
                u = "uint64" if i.dtype.bits == 64 else "uint32"
                expr = (f"tl.minimum({src}.to(tl.{u}, bitcast=True), {self._paren(dv)} - 1)"
                        f".to({tl_type(i.dtype)}, bitcast=True)")
                rule = f"clamped into [0, {dv})"
            elif lo:
                expr, rule = f"tl.maximum({src}, 0)", f"clamped to >= 0 (a remainder by {dv})"
            else:
                expr, rule = f"tl.minimum({src}, {self._paren(dv)} - 1)", f"clamped to < {dv} (unsigned)"
            name = self.fresh("inb")
            self.w(f"{name} = {expr}  # bounded gather: {h.name} index {pos} (dim {dname}) comes from loaded "
                   f"data, {rule}: the entry read is only used as a bounded index")
            v = Value(i.dtype, i.axes, hint="inb")
            v.name = name
            out[pos] = v
        return out

    def op_load(self, n: Node) -> None:
        f = n.a
        h, ivals = f.handle, f.indices
        r = n.results[0]
        if f.bound_mode == "clamp":
            ivals = self.clamped_indices(n, h, ivals)
            bounds: list[str] = []
        else:
            bounds = self.bound_exprs(n, h, ivals, r.axes)
        ptr = self.address(h, ivals, r.axes)
        m = self.mask_expr(f.masks, f.mask, r.axes, bounds)
        if m is None:
            self.w(f"{r.name} = tl.load({ptr})")
        else:
            other = f.other
            if h.dtype.is_fp8 and isinstance(other, int):
                other = float(other)  # the interpreter cannot cast an int `other` to fp8
            self.w(f"{r.name} = tl.load({ptr}, mask={m}, other={lit(other)})")

    def _packed_access(self, n: Node, hint: str) -> tuple[str, str, tuple[Axis, ...]]:
        """(address, mask, storage axes) of a packed load as `passes.legalize_packed_loads` recorded
        it (`n.a.packed`): storage elements `start // per + arange(size // per)` along the last dim."""
        f = n.a
        pk = f.packed
        if pk is None:
            raise self.c.error(f"{n.op} of {f.handle.name} reached the emitter without its packed-load legalization",
                               f.handle.name, loc=getattr(self, "cur_loc", None))
        h, ivals, r = f.handle, f.indices, n.results[0]
        size, start = ivals[-1].range_info.size, ivals[-1].range_info.start
        saxes = r.axes[:-1] + (pk.axis,)
        ks = self.fresh(hint)
        st = self.ref(start)
        base = "" if st == "0" else f"{self._paren(st)} // {pk.per} + "
        self.w(f"{ks} = {base}tl.arange(0, {size // pk.per})")
        ks_al = ks + "[" + ", ".join("None" for _ in saxes[:-1]) + (", :]" if len(saxes) > 1 else ":]")
        addr = self.address(h, ivals, saxes, last_override=ks_al)
        parts = [self.aligned(m, saxes) for m in sorted(f.masks, key=lambda m: m.name)]
        if f.mask is not None:
            parts.append(self.aligned(f.mask, saxes))
        parts.append(f"{ks_al} < {self._paren(self.ref(self.c.dims[pk.dim]))} // {pk.per}")
        if pk.lower_bound:
            parts.append(f"{ks_al} >= 0")
        parts += self.bound_exprs(n, h, ivals, saxes)
        return addr, " & ".join(f"({p})" for p in parts), saxes

    def op_load_int4(self, n: Node) -> None:
        r = n.results[0]
        pack: T.Int4 = n.a.pack
        addr, wmask, waxes = self._packed_access(n, "kw")
        words = self.fresh("words")
        self.w(f"{words} = tl.load({addr}, mask={wmask}, other=0)")
        if _pair_order(pack) and self._feeds_group_dots_only(r):
            self._int4_biased_bf16(r, words, waxes, pack)
            return
        if n.a.unpack in ("bfe", "sbfe"):
            self._int4_bfe(r, words, waxes, pack, signed=n.a.unpack == "sbfe")
            return
        if n.a.unpack == "swar":
            self._int4_swar(r, words, waxes, pack)
            return
        nib = self.fresh("sh")
        if pack.order == (0, 1, 2, 3, 4, 5, 6, 7):
            self.w(f"{nib} = tl.arange(0, 8) * 4")
        else:  # nibble i holds element order[i]: element e sits at nibble inverse[e]
            inv = [pack.order.index(e) for e in range(8)]
            assert inv == [e // 2 + 4 * (e % 2) for e in range(8)], "only the Quark reorder is supported"
            self.w(f"{nib} = ((tl.arange(0, 8) >> 1) + (tl.arange(0, 8) & 1) * 4) * 4  # Quark reorder {list(pack.order)}")
        w3 = f"{words}[{', '.join(':' for _ in waxes)}, None]"
        sh3 = f"{nib}[{', '.join('None' for _ in waxes)}, :]"
        q = self.fresh("q")
        if pack.twos:
            self.w(f"{q} = ({w3} << (28 - {sh3})) >> 28")
        else:
            self.w(f"{q} = (({w3} >> {sh3}) & 15) - 8")
        self.w(f"{r.name} = tl.reshape({q}, {self.shape(r.axes)}).to(tl.int8)")

    def _feeds_group_dots_only(self, v: Value) -> bool:
        """Every reader of `v` is a kd.group_dot (which can take the biased bf16 form)."""
        from .passes import node_inputs, walk

        users = [m for m in walk(self.c.root) if any(x is v for x in node_inputs(m))]
        return bool(users) and all(m.op == "group_dot" for m in users)

    def _int4_biased_bf16(self, r: Value, words: str, waxes: tuple[Axis, ...], pack: T.Int4) -> None:
        """`r` as bf16 values q + INT4_BIAS, two per word operation: nibbles i and i+4 (elements 2i,
        2i+1 of a pair-ordered pack) sit 16 bits apart, so `(w >> 4i) & 0x000F000F | 0x43004300` is
        the bf16 pair (128 + n0, 128 + n1) with n = q + 8 (the exponent of 128 makes the nibble the
        integer part of the mantissa). No convert, no sign extension: kd.group_dot subtracts the bias
        through each group's row sums of its other operand (`op_group_dot`). On AMD the mask and or are
        one `v_and_or_b32` (inline: with two literal constants LLVM emits an and and an or, as GFX9's
        three-operand encodings take no literal): 1 shift + 1 op per two weights."""
        if pack.twos:  # two's complement: flipping each nibble's top bit gives q + 8
            flipped = self.fresh("wx")
            self.w(f"{flipped} = {words} ^ -2004318072  # 0x88888888")
            words = flipped
        pairs = []
        for i in range(4):
            t, pr = self.fresh("t"), self.fresh("pr")
            shifted = f"({words} >> {4 * i})" if i else words
            if getattr(self.target, "backend", None) == "hip":
                self.w(f'{t} = tl.inline_asm_elementwise("v_and_or_b32 $0, $1, $2, $3", "=v,v,v,v", '
                       f'[{shifted}, tl.full([], 0x000F000F, tl.int32), tl.full([], 0x43004300, tl.int32)], '
                       f'dtype=tl.int32, is_pure=True, pack=1)  # elements {2 * i}, {2 * i + 1} as bf16 128 + q + 8')
            else:
                self.w(f"{t} = ({shifted} & 0x000F000F) | 0x43004300  # elements {2 * i}, {2 * i + 1} as bf16 128 + q + 8")
            self.w(f"{pr} = tl.join({t}.to(tl.int16).to(tl.bfloat16, bitcast=True), "
                   f"({t} >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True))")
            pairs.append(pr)
        jj = self.fresh("jj")
        self.w(f"{jj} = tl.join(tl.join({pairs[0]}, {pairs[1]}), tl.join({pairs[2]}, {pairs[3]}))")
        nd = len(waxes)  # [..., element in pair, pair bit 0, pair bit 1] -> row-major elements 0..7
        perm = tuple(range(nd)) + (nd + 2, nd + 1, nd)
        self.w(f"{r.name} = tl.reshape(tl.permute({jj}, {perm}), {self.shape(r.axes)})  # int4 + {INT4_BIAS}, bf16")
        self.biased.add(id(r))

    def op_dequant(self, n: Node) -> None:
        """int8 (rows, k) x bf16 (rows, groups) broadcast along k in registers, rounded to bf16."""
        r, q, s = n.results[0], n.a.q, n.a.scale
        rows, k = r.axes
        g = n.a.g
        sc = self.aligned(s, (rows, g))
        sf, prod = self.fresh("sf"), self.fresh("dq")
        self.w(f"{sf} = tl.reshape(tl.broadcast_to(({sc}).to(tl.float32)[:, :, None], "
               f"({rows.size}, {g.size}, {k.size // g.size})), ({rows.size}, {k.size}))")
        self.w(f"{prod} = {self.aligned(q, (rows, k))}.to(tl.float32) * {sf}")
        if n.a.lower == "rne_finite_bits":  # int8 x bf16 products: a NaN's low half is zero
            u = self.fresh("u")
            self.w(f"{u} = {prod}.to(tl.uint32, bitcast=True)")
            self.w(f"{r.name} = (({u} + 0x7FFF + (({u} >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)")
        else:
            self.w(f"{r.name} = {prod}.to(tl.bfloat16)")

    def op_group_dot(self, n: Node) -> None:
        """Per scale group one f32 dot of the exact int values, times the group's scale: a batched
        (groups, rows, cols) tl.dot over the K tile reshaped to (groups, K per group)."""
        f = n.a
        r = n.results[0]
        i, k, j, g = f.i, f.k, f.j, f.g
        G, KG = g.size, k.size // g.size
        A, B = self.aligned(f.a, (i, k)), self.aligned(f.b, (j, k))
        q = f.a if f.q_is_a else f.b
        biased = id(q) in self.biased
        if not biased:
            if f.q_is_a:
                A = self._exact_bf16(A)
            else:
                B = self._exact_bf16(B)
        prec = ""
        if f.upcast:
            A, B = f"{self._paren(A)}.to(tl.float32)", f"{self._paren(B)}.to(tl.float32)"
            prec = ', input_precision="ieee"'
        a3, b3, p = self.fresh("ga"), self.fresh("gb"), self.fresh("gp")
        self.w(f"{a3} = tl.permute(tl.reshape({A}, ({i.size}, {G}, {KG})), (1, 0, 2))")
        self.w(f"{b3} = tl.permute(tl.reshape({B}, ({j.size}, {G}, {KG})), (1, 2, 0))")
        self.w(f"{p} = tl.dot({a3}, {b3}, out_dtype=tl.float32{prec})")
        rows = i if f.q_is_a else j
        s = f"tl.permute(({self.aligned(f.scale, (rows, g))}).to(tl.float32), (1, 0))"
        s = f"{s}[:, :, None]" if f.q_is_a else f"{s}[:, None, :]"
        if biased:  # q arrived as q + INT4_BIAS: less the bias times each group's sums of the other operand
            other, n_other = (B, j) if f.q_is_a else (A, i)
            rs = self.fresh("rs")
            sums = self._reduce_call("sum", f"tl.reshape({self._paren(other)}.to(tl.float32), "
                                     f"({n_other.size}, {G}, {KG}))", 2)
            self.w(f"{rs} = tl.permute({sums}, (1, 0))  # [groups, rows] sums")
            p = f"({p} - {float(INT4_BIAS)} * {rs}[:, None, :])" if f.q_is_a else f"({p} - {float(INT4_BIAS)} * {rs}[:, :, None])"
        expr = f"{p} * {s}"
        if f.acc is not None:
            expr = f"{self.aligned(f.acc, r.axes)} + {expr}"
        self.w(f"{r.name} = {expr}")

    def _exact_bf16(self, q: str) -> str:
        """int8 -> bf16 with no rounding: every int8 is exact in bf16, so the f32 value's high half
        is the bf16 pattern (a bit move; no NaN or rounding logic)."""
        t = self.fresh("qb")
        self.w(f"{t} = ({self._paren(q)}.to(tl.float32).to(tl.uint32, bitcast=True) >> 16)"
               f".to(tl.uint16).to(tl.bfloat16, bitcast=True)")
        return t

    def _int4_bfe(self, r: Value, words: str, waxes: tuple[Axis, ...], pack: T.Int4, signed: bool = False) -> None:
        """Unpack with constant shifts per nibble (AMD: one v_bfe_i32 each), then interleave
        (`_join_eight`)."""
        el = []
        if signed and not pack.twos:  # offset binary (q + 8): flip each nibble's top bit, then sign-extend
            flipped = self.fresh("wx")
            self.w(f"{flipped} = {words} ^ -2004318072  # 0x88888888")
            words = flipped
        for e in range(8):
            i = pack.order.index(e)  # the nibble holding element e
            v = self.fresh("e")
            if pack.twos or signed:
                self.w(f"{v} = ({words} << {28 - 4 * i}) >> 28")
            else:
                self.w(f"{v} = (({words} >> {4 * i}) & 15) - 8")
            el.append(v)
        self.w(f"{r.name} = tl.reshape({self._join_eight(el)}, {self.shape(r.axes)}).to(tl.int8)")

    def _join_eight(self, el: list[str]) -> str:
        """Elements 0..7 of each word (one name each) as a [..., 2, 2, 2] tensor whose row-major
        flattening is element order: join(join(join(e0, e4), join(e2, e6)), join(join(e1, e5), join(e3, e7)))."""
        def j(a: str, b: str) -> str:
            t = self.fresh("j")
            self.w(f"{t} = tl.join({a}, {b})")
            return t

        return j(j(j(el[0], el[4]), j(el[2], el[6])), j(j(el[1], el[5]), j(el[3], el[7])))

    def _int4_swar(self, r: Value, words: str, waxes: tuple[Axis, ...], pack: T.Int4) -> None:
        """Unpack four nibbles per word operation: `w & 0x0F0F0F0F` and `(w >> 4) & 0x0F0F0F0F` put
        nibbles 0, 2, 4, 6 and 1, 3, 5, 7 in the bytes of two words, and each byte u = q + 8 becomes
        the int8 q as `(u + 0x78) ^ 0x80` (u + 0x78 is 0x78..0x87: no carry leaves a byte). A
        two's-complement pack first flips each nibble's top bit (q + 8). The bytes are then only
        reordered into element order (byte permutes): ~1.25 VALU per weight with those (gfx942: 40
        for 32 weights) against ~2.4 with a bit-field extract each; exact."""
        if pack.twos:
            flipped = self.fresh("wx")
            self.w(f"{flipped} = {words} ^ -2004318072  # 0x88888888: q + 8 in every nibble")
            words = flipped
        halves = []
        for half in range(2):
            t = self.fresh("sw")
            shifted = f"({words} >> 4)" if half else words
            self.w(f"{t} = ((({shifted} & 0x0F0F0F0F) + 0x78787878) ^ -2139062144)  # nibbles {half}, {half + 2}, "
                   f"{half + 4}, {half + 6} as int8 bytes (^ 0x80808080)")
            halves.append(t)
        el: list[str] = [""] * 8
        for nib in range(8):  # nibble nib sits in byte nib // 2 of half nib % 2 and holds element order[nib]
            src, byte = halves[nib % 2], nib // 2
            v = self.fresh("e")
            self.w(f"{v} = ({src} >> {8 * byte}).to(tl.int8)" if byte else f"{v} = {src}.to(tl.int8)")
            el[pack.order[nib]] = v
        self.w(f"{r.name} = tl.reshape({self._join_eight(el)}, {self.shape(r.axes)})")

    def _store_like(self, n: Node, fn: str) -> None:
        f = n.a
        h, ivals, axes = f.handle, f.indices, f.axes
        ptr = self.address(h, ivals, axes)
        v = self.aligned(f.value, axes)
        m = self.mask_expr(f.masks, f.mask, axes, self.bound_exprs(n, h, ivals, axes))
        sem = ', sem="relaxed"' if fn == "atomic_add" else ""
        mk = "" if m is None else f", mask={m}"
        self.w(f"tl.{fn}({ptr}, {v}{mk}{sem})")

    def op_store(self, n: Node) -> None:
        self._store_like(n, "store")

    def op_atomic_add(self, n: Node) -> None:
        self._store_like(n, "atomic_add")

    def op_atomic_ticket(self, n: Node) -> None:
        # one RMW: release orders this program's earlier stores (after kd.barrier: every wave's),
        # acquire orders the tail's later loads (kdsl.lang.atomic_ticket says why that suffices)
        backend = getattr(self.target, "backend", None)
        if backend in ("hip", "cuda"):
            # every thread (so every wave) first waits for its own stores, then the workgroup barrier
            # (_store_wait_barrier); the ticket's release below covers only the issuing thread's wave
            self._store_wait_barrier("fence.acq_rel.gpu;")
        ptr = self.address(n.a.handle, n.a.indices, ())
        self.w(f'{n.results[0].name} = tl.atomic_add({ptr}, 1, sem="acq_rel", scope="gpu")')

    def op_exit_if(self, n: Node) -> None:
        self.w(f"if {self.ref(n.a.cond)}:")
        self.w("    return")

    def op_barrier(self, n: Node) -> None:
        # bar.sync alone orders the CTA's global stores before its later loads on NVIDIA; AMD's
        # s_barrier waits for no memory operation, so each wave first waits for its own stores
        if getattr(self.target, "backend", None) == "hip":
            self._store_wait_barrier()
        else:
            self.w("tl.debug_barrier()")

    def _store_wait_barrier(self, cuda_fence: str | None = None) -> None:
        """Every thread waits for its own global stores (AMD `s_waitcnt vmcnt(0)`: the write-through L1
        has handed them to L2, which all waves of the workgroup read through one L1; NVIDIA: the given
        fence), then a workgroup barrier: after it, each wave's loads see every wave's earlier stores."""
        fence = "s_waitcnt vmcnt(0)" if getattr(self.target, "backend", None) == "hip" else cuda_fence
        if fence:
            self.w(f'tl.inline_asm_elementwise("{fence}", "=r,r", [tl.full([], 0, tl.int32)], '
                   'dtype=tl.int32, is_pure=False, pack=1)')
        self.w("tl.debug_barrier()")

    def op_fold(self, n: Node) -> None:
        f = n.a
        start, stop, inits = f.start, f.stop, f.inits
        carried = n.results
        for c, i in zip(carried, inits):
            e = self.aligned(i, c.axes)
            if isinstance(i, Value) and i.const is not None:
                e = f"tl.full({self.shape(c.axes)}, {e}, {tl_type(c.dtype)})"
            self.w(f"{c.name} = {e}")
        lv = f.loopvar
        self.w(f"for {lv.name} in {self._loop_range(n, start, stop)}:")
        self.indent += 1
        if self.interp:  # the interpreter's range yields Python ints: make the loop variable an i32 scalar
            self.w(f"{lv.name} = tl.cast({lv.name}, tl.int32)")
        self.emit_block(n.blocks[0])
        for c, y in zip(carried, f.yields):
            e = self.aligned(y, c.axes)
            if set(y.axes) != set(c.axes) or (isinstance(y, Value) and y.const is not None):
                e = f"tl.broadcast_to({e}, {self.shape(c.axes)})" if c.axes else e
            if y.dtype is not c.dtype:
                e = f"({e}).to({tl_type(c.dtype)})"
            self.w(f"{c.name} = {e}")
        self.indent -= 1
        self.last_loc = None

    # -- OCP microscaling ----------------------------------------------------------------------
    def op_load_fp4(self, n: Node) -> None:
        """Bytes of a packed fp4 tile: byte offsets start/2 + arange(size/2) along the packed dim."""
        addr, wmask, _ = self._packed_access(n, "kb")
        self.w(f"{n.results[0].name} = tl.load({addr}, mask={wmask}, other=0)  # fp4 e2m1 x2")

    def _e8m0_f32(self, s: str) -> str:
        """E8M0 bytes -> f32 2^(e-127) by bits: 0 -> 2^-127 (a subnormal), 0xFF -> NaN."""
        u = self.fresh("su")
        self.w(f"{u} = {s}.to(tl.uint32)")
        self.w(f"{u} = tl.where({u} == 0, 0x00400000, tl.where({u} == 255, 0x7FC00000, {u} << 23)).to(tl.uint32)")
        return f"{u}.to(tl.float32, bitcast=True)"

    def _fp4_f32(self, packed: str, rows: int, k: int, scale: str | None, groups: int) -> str:
        """Packed e2m1 bytes [rows, k/2] -> f32 [rows, k], exact, element 2i from the low nibble;
        times the per-32 E8M0 scale [rows, groups] when given."""
        lo, hi, c, bits, out = (self.fresh(x) for x in ("lo", "hi", "c", "fb", "dq"))
        self.w(f"{lo} = ({packed} & 15).to(tl.uint32)")
        self.w(f"{hi} = (({packed} >> 4) & 15).to(tl.uint32)")
        self.w(f"{c} = tl.reshape(tl.join({lo}, {hi}), ({rows}, {k}))")
        # |code| = e:m (2+1 bits): e == 0 -> m * 0.5; else (1 + m/2) * 2^(e-1); bit 3 is the sign
        self.w(f"{bits} = tl.where((({c} >> 1) & 3) == 0, ({c} & 1) * 0x3F000000, "
               f"(((({c} >> 1) & 3) + 126) << 23) | (({c} & 1) << 22)).to(tl.uint32)")
        self.w(f"{bits} = {bits} | (({c} & 8) << 28)")
        self.w(f"{out} = {bits}.to(tl.float32, bitcast=True)")
        if scale is not None:
            sf = self._e8m0_f32(scale)
            self.w(f"{out} = {out} * tl.reshape(tl.broadcast_to(({sf})[:, :, None], ({rows}, {groups}, {k // groups})), "
                   f"({rows}, {k}))")
        return out

    def op_mx_decode(self, n: Node) -> None:
        v, s = n.a.packed, n.a.scale
        r = n.results[0]
        rows, k = v.axes
        g = n.a.g
        sc = self.aligned(s, (rows, g)) if s is not None else None
        out = self._fp4_f32(self.ref(v), rows.size, k.size, sc, g.size if g is not None else 1)
        self.w(f"{r.name} = {out}")

    def op_dot_scaled(self, n: Node) -> None:
        f = n.a
        a, sa, b, sb, acc = f.a, f.a_scale, f.b, f.b_scale, f.acc
        r = n.results[0]
        i, k, j, ga, gb = f.i, f.k, f.j, f.ga, f.gb
        fa = f.fa
        A = self.aligned(a, (i, k))
        SB = self.aligned(sb, (j, gb))
        ACC = self.aligned(acc, (i, j)) if acc is not None else None
        if getattr(self.target, "backend", None) == "interpret" and fa == "bf16":
            # the interpreter's dot_scaled rounds bf16 operands through fp16: decode and use an f32 dot
            bd = self._fp4_f32(self.aligned(b, (j, k)), j.size, k.size, SB, gb.size)
            acc_s = f", acc={ACC}" if ACC is not None else ", out_dtype=tl.float32"
            self.w(f"{r.name} = tl.dot({self._paren(A)}.to(tl.float32), tl.trans({bd}){acc_s}, input_precision=\"ieee\")")
            return
        B = self.aligned(b, (k, j))  # packed along K: [K/2, N] (rhs_k_pack)
        SA = self.aligned(sa, (i, ga)) if sa is not None else "None"
        acc_s = f", acc={ACC}" if ACC is not None else ""
        self.w(f"{r.name} = tl.dot_scaled({A}, {SA}, \"{fa}\", {B}, {SB}, \"e2m1\"{acc_s}, out_dtype=tl.float32)")

    # -- index reductions, scans, sorts, more math, foreign calls ----------------------------------
    @property
    def interp(self) -> bool:
        return getattr(self.target, "backend", None) == "interpret"

    def need(self, line: str) -> None:
        """A module-level import the generated file needs (written after `import triton.language`)."""
        if not hasattr(self, "imports"):
            self.imports: list[str] = []
        if line not in self.imports:
            self.imports.append(line)

    def op_iota(self, n: Node) -> None:
        self.w(f"{n.results[0].name} = tl.arange(0, {n.a.axis.size})")

    def op_argreduce(self, n: Node) -> None:
        r, x = n.results[0], n.a.x
        ax = x.axes.index(n.a.axis)
        op = n.a.op
        src = self.ref(x)
        if self.interp:  # the patched tl.reduce maps these combine functions to numpy's (leftmost) arg-reductions
            self.w(f"{r.name} = tl.reduce(({src}, {src}), {ax}, tl.standard._{op}_combine_tie_break_left)[1]")
        else:
            self.w(f"{r.name} = tl.{op}({src}, axis={ax}, tie_break_left=True)")

    def op_scan(self, n: Node) -> None:
        r, x = n.results[0], n.a.x
        ax = x.axes.index(n.a.axis)
        if self.interp:  # tl.cumsum is a JITFunction; the patched associative_scan maps _sum_combine to numpy
            self.w(f"{r.name} = tl.associative_scan({self.ref(x)}, {ax}, tl.standard._sum_combine)")
        else:
            self.w(f"{r.name} = tl.cumsum({self.ref(x)}, axis={ax})")

    def _last_layout(self, x: Value, sel: tuple[Axis, ...]) -> tuple[str, tuple[Axis, ...]]:
        others = tuple(a for a in x.axes if a not in sel)
        lay = others + sel
        return self.aligned(x, lay), others

    def op_sort(self, n: Node) -> None:
        x, r = n.a.x, n.results[0]
        X, _ = self._last_layout(x, (n.a.axis,))
        desc = bool(n.a.descending)
        if self.interp:
            self.need("from kdsl import interp as _kdi")
            self.w(f"{r.name} = _kdi.sort({X}, {desc})")
        else:
            self.w(f"{r.name} = tl.sort({X}, descending={desc})")

    def op_topk(self, n: Node) -> None:
        """Pack (value, index) into one i64 key that orders by value then by index, sort the keys
        along the last dim (the selected axes moved last and flattened), and unpack."""
        x, idx = n.a.x, n.a.index
        vals, ids = n.results
        sel, k, largest = n.a.axes, n.a.k, n.a.largest
        X, others = self._last_layout(x, tuple(sel))
        lay = others + tuple(sel)
        total = 1
        for a in sel:
            total *= a.size
        I = self.aligned(idx, lay)
        if set(idx.axes) != set(lay):
            I = f"tl.broadcast_to({I}, {self.shape(lay)})"
        flat = "(" + ", ".join([str(a.size) for a in others] + [str(total)]) + ("," if not others else "") + ")"
        o, key, srt = self.fresh("ord"), self.fresh("key"), self.fresh("ks")
        if x.dtype.is_float:  # f32 bits as a signed int that orders like the float
            xi = self.fresh("xi")
            self.w(f"{xi} = {self._paren(X)}.to(tl.int32, bitcast=True)")
            self.w(f"{o} = tl.where({xi} < 0, {xi} ^ 0x7FFFFFFF, {xi})")
        else:
            self.w(f"{o} = {X}")
        low = f"(0x7FFFFFFF - {self._paren(I)})" if largest else I
        self.w(f"{key} = ({o}.to(tl.int64) << 32) | {low}.to(tl.int64)")
        if len(sel) > 1:
            self.w(f"{key} = tl.reshape({key}, {flat})")
        if self.interp:
            self.need("from kdsl import interp as _kdi")
            call = f"_kdi.sort({key}, {largest})" if k == total else f"_kdi.topk({key}, {k}, {largest})"
        else:
            call = (f"tl.sort({key}, descending={largest})" if k == total
                    else f"tl.topk({key}, {k}, descending={largest})")
        self.w(f"{srt} = {call}")
        hi = self.fresh("hi")
        self.w(f"{hi} = ({srt} >> 32).to(tl.int32)")
        if x.dtype.is_float:
            self.w(f"{vals.name} = tl.where({hi} < 0, {hi} ^ 0x7FFFFFFF, {hi}).to(tl.float32, bitcast=True)")
        else:
            self.w(f"{vals.name} = {hi}")
        lo = f"({srt} & 0x7FFFFFFF).to(tl.int32)"
        self.w(f"{ids.name} = {'0x7FFFFFFF - ' + lo if largest else lo}")

    def op_math_ext(self, n: Node) -> None:
        r, op = n.results[0], n.a.op
        a = self.ref(n.a.x)
        if op == "erf":
            self.w(f"{r.name} = tl.math.erf({a})")
        elif self.interp:
            self.need("from kdsl import interp as _kdi")
            self.w(f"{r.name} = _kdi.{op}({a})")
        else:
            self.need("from triton.language.extra import libdevice")
            self.w(f"{r.name} = libdevice.{op}({a})")

    def op_fma(self, n: Node) -> None:
        r = n.results[0]
        args = []
        for x in (n.a.a, n.a.b, n.a.c):
            e = self.aligned(x, r.axes)
            if r.axes and not (isinstance(x, Value) and x.axes):  # tl.fma wants tensors of one shape
                e = f"tl.full({self.shape(r.axes)}, {e}, tl.float32)"
            args.append(e)
        if self.interp:      # one rounding on every Triton's interpreter (before 3.9 it rounds twice)
            self.need("from kdsl import interp as _kdi")
            self.w(f"{r.name} = _kdi.fma({', '.join(args)})")
        else:
            self.w(f"{r.name} = tl.fma({', '.join(args)})")

    def op_pow(self, n: Node) -> None:
        r = n.results[0]
        base, exponent = n.a.base, n.a.exponent
        a, b = (self.aligned(x, r.axes) for x in (base, exponent))
        if self.interp:
            self.need("from kdsl import interp as _kdi")
            self.w(f"{r.name} = _kdi.pow({a}, {b})")
        else:
            self.need("from triton.language.extra import libdevice")
            if not exponent.axes and base.axes:
                b = f"tl.full({self.shape(r.axes)}, {b}, tl.float32)"
            elif not base.axes and exponent.axes:
                a = f"tl.full({self.shape(r.axes)}, {a}, tl.float32)"
            self.w(f"{r.name} = libdevice.pow({a}, {b})")

    def op_triton_call(self, n: Node) -> None:
        mod, name, lay = n.a.module, n.a.name, n.a.layout
        alias = f"_ext_{name}"
        self.need("import importlib")
        if self.interp:
            self.need("from triton.runtime.interpreter import InterpretedFunction as _Interp")
            self.need(f"{alias} = _Interp(importlib.import_module({mod!r}).{name}.fn)")
        else:
            self.need(f"{alias} = importlib.import_module({mod!r}).{name}")
        args = ", ".join(self.aligned(a, lay) if a.axes else self.ref(a) for a in n.a.args)
        outs = n.results
        res = self.fresh("call")
        self.w(f"{res} = {alias}({args})")
        for i, r in enumerate(outs):
            e = res if len(outs) == 1 else f"{res}[{i}]"
            if r.axes:
                e = f"tl.broadcast_to({e}, {self.shape(r.axes)})"
            self.w(f"{r.name} = {e}.to({tl_type(r.dtype)})")


INT4_BIAS = 136  # bf16 0x4300 | (q + 8) = 128 + q + 8


def _pair_order(pack: T.Int4) -> bool:
    """Elements 2i and 2i+1 of each group of eight sit in nibbles i and i+4 (16 bits apart)."""
    return all(pack.order[i] == 2 * i and pack.order[i + 4] == 2 * i + 1 for i in range(4))


def emit_module(c: TraceContext, target: Any, fn_name: str, header: list[str]) -> str:
    em = Emitter(c, target, fn_name)
    em.emit_block(c.root)
    params = ", ".join(p.name for p in c.params)
    out = ["# " + h for h in header]
    out += ["import triton", "import triton.language as tl", *getattr(em, "imports", []), "", "",
            "@triton.jit", f"def {fn_name}({params}):"]
    out += em.lines if em.lines else ["    pass"]
    return "\n".join(out) + "\n"
