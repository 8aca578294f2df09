"""The op records: every IR op kind with its named operands, attributes and result count.

A node keeps its operands in one list, in the order its record declares them: that is the generic
view the passes walk (uses, substitution, common subexpressions). Op-specific code builds a node by
names (`ctx.add("load", [out], handle=h, indices=ivals, ...)`) and reads or rewrites it by names
(`n.a.handle`, `n.a.indices`, `n.a.axis`), and `irtools.verify` checks every node against its record:
an op with no record, an operand of the wrong kind, a missing or undeclared attribute, a wrong result
count, or a broken typing rule is an error naming the node's DSL line."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from . import types as T

# operand kinds (the checks live in irtools.verify)
VALUE = "value"      # a Value (tile or scalar)
INDEX = "index"      # a Value or a Python int (a tile start, a loop bound)
INDICES = "indices"  # a list with one Value or int per dim of the accessed operand
MASKS = "masks"      # a frozenset of boolean Values (the index tiles' masks)
HANDLE = "handle"    # an OperandHandle (a tensor parameter)
VALUES = "values"    # variadic tail: zero or more Values

# attribute kinds
STR, INT, BOOL, NUMBER, DTYPE, AXIS, AXES = "str", "int", "bool", "number", "dtype", "axis", "axes"
ATTR_VALUE, ATTR_VALUES, ATTR_INDEX = "value", "values", "index"
PACK, BOUNDS, PACKED = "pack", "bounds", "packed"

KIND_TEXT = {VALUE: "a tile value", INDEX: "a tile value or an int", INDICES: "a list of indices (tile values or ints)",
             MASKS: "a frozenset of mask values", HANDLE: "an operand handle", VALUES: "a tile value",
             STR: "a string", INT: "an int", BOOL: "a bool", NUMBER: "a number", DTYPE: "an element type",
             AXIS: "an axis", AXES: "a tuple of axes", ATTR_VALUE: "a tile value", ATTR_VALUES: "a list of tile values",
             ATTR_INDEX: "a tile value or an int", PACK: "an int4 packing", BOUNDS: "a list of (pos, dim, lower, upper)",
             PACKED: "a PackedTile"}


@dataclass(frozen=True)
class OperandSpec:
    name: str
    kind: str
    optional: bool = False  # None allowed


@dataclass(frozen=True)
class AttrSpec:
    name: str
    kind: str
    required: bool = True   # the key must be present (a pass's annotations are not required)
    nullable: bool = False  # None allowed
    choices: tuple[Any, ...] = ()
    default: Any = None     # what `n.a.<name>` reads when the key is absent


@dataclass(frozen=True)
class PackedTile:
    """How a packed load (int4 words, fp4 bytes) addresses storage, decided by
    `passes.legalize_packed_loads`: the storage tile along the last dim lies on `axis` (`per`
    logical values per storage element), it is bounded by `dim // per`, and `lower_bound` asks for
    `>= 0` too (a packed index read from memory; the upper bound is the storage bound). The node's
    `masks` then hold only the index masks that still apply to the storage tile."""

    axis: Any  # ir.Axis of the storage tile
    per: int
    dim: str
    lower_bound: bool


Rule = Callable[[Any], "str | None"]  # a typing rule over a node: None, or what is wrong


@dataclass(frozen=True)
class OpRecord:
    name: str
    operands: tuple[OperandSpec, ...]
    attrs: tuple[AttrSpec, ...] = ()
    results: int | None = 1  # None: as many as the rule `count` says
    rule: Rule | None = None
    doc: str = ""
    operand_index: dict[str, int] = field(default_factory=dict, compare=False)
    attr_specs: dict[str, AttrSpec] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.operand_index.update({o.name: i for i, o in enumerate(self.operands)})
        self.attr_specs.update({a.name: a for a in self.attrs})
        if any(o.kind == VALUES for o in self.operands[:-1]):
            raise ValueError(f"{self.name}: only the last operand may be variadic")

    @property
    def variadic(self) -> bool:
        return bool(self.operands) and self.operands[-1].kind == VALUES

    def build(self, fields: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """(operand list, attrs) from named fields; an unknown or missing name is a kdsl bug."""
        args: list[Any] = []
        for o in self.operands:
            if o.kind == VALUES:
                args.extend(fields.pop(o.name, ()))
            elif o.name in fields:
                args.append(fields.pop(o.name))
            elif o.optional:
                args.append(None)
            else:
                raise TypeError(f"op {self.name}: operand {o.name!r} missing")
        for k in fields:
            if k not in self.attr_specs:
                raise TypeError(f"op {self.name}: no operand or attribute {k!r}; "
                                f"fields: {', '.join(self.field_names())}")
        return args, fields

    def field_names(self) -> list[str]:
        return [o.name for o in self.operands] + [a.name for a in self.attrs]


class Fields:
    """`node.a`: a node's operands and attributes by name (reads and writes)."""

    __slots__ = ("_node", "_rec")

    def __init__(self, node: Any, rec: OpRecord) -> None:
        object.__setattr__(self, "_node", node)
        object.__setattr__(self, "_rec", rec)

    def __getattr__(self, name: str) -> Any:
        rec, n = self._rec, self._node
        i = rec.operand_index.get(name)
        if i is not None:
            return n.args[i:] if rec.operands[i].kind == VALUES else n.args[i]
        a = rec.attr_specs.get(name)
        if a is not None:
            return n.attrs.get(name, a.default)
        raise AttributeError(f"op {rec.name} has no field {name!r}; fields: {', '.join(rec.field_names())}")

    def __setattr__(self, name: str, value: Any) -> None:
        rec, n = self._rec, self._node
        i = rec.operand_index.get(name)
        if i is not None:
            if rec.operands[i].kind == VALUES:
                n.args[i:] = list(value)
            else:
                n.args[i] = value
        elif name in rec.attr_specs:
            n.attrs[name] = value
        else:
            raise AttributeError(f"op {rec.name} has no field {name!r}; fields: {', '.join(rec.field_names())}")


# ----------------------------------------------------------------------------------------------
# typing rules (what the emitter relies on beyond the operand kinds)

_COMPARE = frozenset(("<", "<=", ">", ">=", "==", "!="))


def _result_dtype(n: Any) -> str | None:
    """The result has the record's dtype (a comparison's result is bool)."""
    at = n.attrs  # the verifier has checked the attributes: read them directly (this runs per node per pass)
    want = T.bool_ if n.op == "binary" and at["op"] in _COMPARE else at["dtype"]
    r = n.results[0].dtype
    return None if r is want else f"result type {r!r} is not the record's dtype {want!r}"


def _axis_of_x(attr: str = "axis") -> Rule:
    def rule(n: Any) -> str | None:
        ax = getattr(n.a, attr)
        return None if ax in n.a.x.axes else f"{attr} {ax!r} is not an axis of the operand {list(n.a.x.axes)}"
    return rule


def _access(kind: str) -> Rule:
    """A memory access: one index per dim of the operand, and the handle's storage kind."""
    def rule(n: Any) -> str | None:
        h = n.a.handle
        if len(n.a.indices) != len(h.spec.dims):
            return f"{len(n.a.indices)} indices for {h.name}'s {len(h.spec.dims)} dims"
        int4, fp4 = h.is_int4, T.is_fp4(h.dtype)
        if kind == "int4" and not int4:
            return f"{h.name} is not packed int4"
        if kind == "fp4" and not fp4:
            return f"{h.name} is not packed fp4"
        if kind == "plain" and (int4 or fp4):
            return f"{h.name} is packed: it needs load_int4 or load_fp4"
        if n.op in ("store", "atomic_add") and n.a.value.dtype is not h.dtype:
            return f"stored value is {n.a.value.dtype!r}, {h.name} holds {h.dtype!r}"
        return None
    return rule


def _ticket(n: Any) -> str | None:
    """A ticket: an i32 counter, scalar indices, an i32 scalar result."""
    h = n.a.handle
    if len(n.a.indices) != len(h.spec.dims):
        return f"{len(n.a.indices)} indices for {h.name}'s {len(h.spec.dims)} dims"
    if h.dtype is not T.i32:
        return f"{h.name} holds {h.dtype!r}: a ticket counter holds i32"
    if any(getattr(i, "axes", ()) for i in n.a.indices):
        return "a ticket's indices must be scalars"
    r = n.results[0]
    return None if r.dtype is T.i32 and not r.axes else "the ticket must be an i32 scalar"


def _dot(n: Any) -> str | None:
    a, b, acc = n.a.a, n.a.b, n.a.acc
    if len(a.axes) != 2 or len(b.axes) != 2:
        return "operands must be 2-D tiles"
    if n.a.k not in a.axes or n.a.k not in b.axes:
        return f"the contracted axis {n.a.k!r} is not an axis of both operands"
    if acc is not None and acc.dtype is not n.results[0].dtype:
        return f"accumulator {acc.dtype!r} differs from the result {n.results[0].dtype!r}"
    return None


def _group_dot(n: Any) -> str | None:
    f = n.a
    a, b, sc, acc, r = f.a, f.b, f.scale, f.acc, n.results[0]
    if len(a.axes) != 2 or len(b.axes) != 2 or f.k not in a.axes or f.k not in b.axes:
        return f"operands must be 2-D tiles sharing the contracted axis {f.k!r}"
    q, x = (a, b) if f.q_is_a else (b, a)
    if q.dtype.is_float or q.dtype.bits != 8 or x.dtype is not T.bf16:
        return f"the quantized operand must be int8 and the other bf16, got {q.dtype!r} and {x.dtype!r}"
    if sc.dtype is not T.bf16 or f.g not in sc.axes or (f.i if f.q_is_a else f.j) not in sc.axes:
        return "scale must be bf16 over (the quantized operand's rows, groups)"
    if f.k.size % f.g.size:
        return f"the k tile ({f.k.size}) is not a whole number of groups ({f.g.size})"
    if r.dtype is not T.f32 or len(r.axes) != 3 or r.axes[1:] != (f.i, f.j) or r.axes[0].size != f.g.size:
        return f"the result must be f32 over (groups, {f.i}, {f.j}), got {r!r}"
    if acc is not None and (acc.dtype is not T.f32 or acc.axes != r.axes):
        return f"accumulator {acc!r} differs from the result {r!r}"
    return None


def _scalar_cond(n: Any) -> str | None:
    return "the condition must be a scalar" if n.a.cond.axes else None


def _fold(n: Any) -> str | None:
    if len(n.results) != len(n.a.inits):
        return f"{len(n.results)} carried values for {len(n.a.inits)} initial values"
    if len(n.a.yields) != len(n.a.inits):
        return f"yields {len(n.a.yields)} values for {len(n.a.inits)} carried values"
    if len(n.blocks) != 1:
        return "a fold has exactly one body block"
    return None


def _at_least_one_result(n: Any) -> str | None:
    return None if n.results else "needs at least one result"


def _op(*choices: str) -> AttrSpec:
    return AttrSpec("op", STR, choices=choices)


_ELEMENTWISE_ROUND = AttrSpec("f32_then_round", BOOL, required=False)  # legalize: interpreter bf16
_BINARY_OPS = ("+", "-", "*", "/", "//", "%", "<<", ">>", "&", "|", "^", "<", "<=", ">", ">=", "==", "!=")
_UNARY_OPS = ("-", "~", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sigmoid", "abs", "sin", "cos")
_BOUNDS = AttrSpec("bounds", BOUNDS, required=False, default=())  # bound_gathers: (pos, dim, lower, upper)
_ACCESS = (OperandSpec("handle", HANDLE), OperandSpec("indices", INDICES), OperandSpec("masks", MASKS),
           OperandSpec("mask", VALUE, optional=True))
_X = (OperandSpec("x", VALUE),)


def _rec(name: str, operands: tuple[OperandSpec, ...], attrs: tuple[AttrSpec, ...] = (), results: int | None = 1,
         rule: Rule | None = None, doc: str = "") -> OpRecord:
    return OpRecord(name, operands, attrs, results, rule, doc)


RECORDS: dict[str, OpRecord] = {r.name: r for r in (
    _rec("program_id", (), (AttrSpec("axis", INT, choices=(0, 1, 2)),), doc="this program's id on a grid axis"),
    _rec("range", (OperandSpec("start", INDEX),), (AttrSpec("size", INT),), doc="start + arange(size)"),
    _rec("iota", (), (AttrSpec("axis", AXIS),), doc="0..size-1 over an existing axis"),
    _rec("full", (), (AttrSpec("value", NUMBER), AttrSpec("dtype", DTYPE)), rule=_result_dtype),
    _rec("broadcast", _X),
    _rec("pad", (OperandSpec("x", VALUE), OperandSpec("offset", INDEX, optional=True)),
         (AttrSpec("axis", AXIS), AttrSpec("to", AXIS)), rule=_axis_of_x(),
         doc="x with `axis` widened to the tile `to` at rows [offset, offset + size), zeros elsewhere"),
    _rec("binary", (OperandSpec("lhs", VALUE), OperandSpec("rhs", VALUE)),
         (_op(*_BINARY_OPS), AttrSpec("dtype", DTYPE), _ELEMENTWISE_ROUND), rule=_result_dtype,
         doc="lhs op rhs, computed in dtype"),
    _rec("unary", _X, (_op(*_UNARY_OPS), _ELEMENTWISE_ROUND)),
    _rec("minmax", (OperandSpec("lhs", VALUE), OperandSpec("rhs", VALUE)),
         (_op("maximum", "minimum"), AttrSpec("dtype", DTYPE), _ELEMENTWISE_ROUND), rule=_result_dtype),
    _rec("where", (OperandSpec("cond", VALUE), OperandSpec("on_true", VALUE), OperandSpec("on_false", VALUE)),
         (AttrSpec("dtype", DTYPE), _ELEMENTWISE_ROUND), rule=_result_dtype),
    _rec("cast", _X, (AttrSpec("dtype", DTYPE), AttrSpec("rounding", STR, nullable=True, choices=(None, "rtz")),
                      AttrSpec("lower", STR, required=False,
                               choices=("plain", "rtz_bits", "rne_bits", "rne_fp8_bits"), default="plain")),
         rule=_result_dtype),
    _rec("bitcast", _X, (AttrSpec("dtype", DTYPE),), rule=_result_dtype),
    _rec("math_ext", _X, (_op("rint", "tanh", "erf"),)),
    _rec("pow", (OperandSpec("base", VALUE), OperandSpec("exponent", VALUE))),
    _rec("fma", (OperandSpec("a", VALUE), OperandSpec("b", VALUE), OperandSpec("c", VALUE)),
         doc="a * b + c in f32, rounded once"),
    _rec("reduce", _X, (_op("sum", "max", "min"), AttrSpec("axis", AXIS), AttrSpec("dtype", DTYPE)),
         rule=_axis_of_x()),
    _rec("argreduce", _X, (_op("argmax", "argmin"), AttrSpec("axis", AXIS)), rule=_axis_of_x()),
    _rec("scan", _X, (_op("sum"), AttrSpec("axis", AXIS)), rule=_axis_of_x()),
    _rec("sort", _X, (AttrSpec("axis", AXIS), AttrSpec("descending", BOOL)), rule=_axis_of_x()),
    _rec("topk", (OperandSpec("x", VALUE), OperandSpec("index", VALUE)),
         (AttrSpec("axes", AXES), AttrSpec("kaxis", AXIS), AttrSpec("k", INT), AttrSpec("largest", BOOL)), results=2),
    _rec("dot", (OperandSpec("a", VALUE), OperandSpec("b", VALUE), OperandSpec("acc", VALUE, optional=True)),
         (AttrSpec("i", AXIS), AttrSpec("k", AXIS), AttrSpec("j", AXIS), AttrSpec("dtype", DTYPE),
          AttrSpec("form", STR, required=False, choices=("mulsum", "mma")), AttrSpec("upcast", BOOL, required=False)),
         rule=_dot, doc="a @ b (+ acc), contracting k"),
    _rec("dot_scaled", (OperandSpec("a", VALUE), OperandSpec("a_scale", VALUE, optional=True), OperandSpec("b", VALUE),
                        OperandSpec("b_scale", VALUE), OperandSpec("acc", VALUE, optional=True)),
         (AttrSpec("i", AXIS), AttrSpec("k", AXIS), AttrSpec("j", AXIS), AttrSpec("ga", AXIS, nullable=True),
          AttrSpec("gb", AXIS), AttrSpec("fa", STR, choices=("e2m1", "e4m3", "e5m2", "bf16")),
          AttrSpec("fb", STR, choices=("e2m1",)), AttrSpec("dtype", DTYPE)), rule=_dot),
    _rec("mx_decode", (OperandSpec("packed", VALUE), OperandSpec("scale", VALUE, optional=True)),
         (AttrSpec("g", AXIS, nullable=True),)),
    _rec("group_dot", (OperandSpec("a", VALUE), OperandSpec("b", VALUE), OperandSpec("scale", VALUE),
                       OperandSpec("acc", VALUE, optional=True)),
         (AttrSpec("i", AXIS), AttrSpec("k", AXIS), AttrSpec("j", AXIS), AttrSpec("g", AXIS),
          AttrSpec("q_is_a", BOOL), AttrSpec("upcast", BOOL, required=False)),
         rule=_group_dot, doc="per scale group: f32 dot of the exact int8 values, times the group scale"),
    _rec("dequant", (OperandSpec("q", VALUE), OperandSpec("scale", VALUE)),
         (AttrSpec("g", AXIS), AttrSpec("dtype", DTYPE),
          AttrSpec("lower", STR, required=False, choices=("native", "rne_finite_bits"))),
         doc="int8 x per-group bf16 scale, rounded to bf16"),
    _rec("load", _ACCESS, (AttrSpec("other", NUMBER), _BOUNDS,
                           AttrSpec("bound_mode", STR, required=False, choices=("clamp",))), rule=_access("plain")),
    _rec("load_int4", _ACCESS, (AttrSpec("pack", PACK), AttrSpec("unpack", STR, choices=("shift", "bfe", "sbfe", "swar")),
                                _BOUNDS, AttrSpec("packed", PACKED, required=False)), rule=_access("int4"),
         doc="int4 words of a tile, unpacked to i8"),
    _rec("load_fp4", _ACCESS, (_BOUNDS, AttrSpec("packed", PACKED, required=False)), rule=_access("fp4"),
         doc="fp4 bytes of a tile (two values each)"),
    _rec("store", _ACCESS + (OperandSpec("value", VALUE),), (AttrSpec("axes", AXES), _BOUNDS), results=0,
         rule=_access("any")),
    _rec("atomic_add", _ACCESS + (OperandSpec("value", VALUE),), (AttrSpec("axes", AXES), _BOUNDS), results=0,
         rule=_access("any")),
    _rec("atomic_ticket", _ACCESS, (_BOUNDS,), results=1, rule=_ticket,
         doc="old = h[idx]; h[idx] += 1, acq_rel at gpu scope: the last-program-finishes counter"),
    _rec("exit_if", (OperandSpec("cond", VALUE),), results=0, rule=_scalar_cond),
    _rec("barrier", (), results=0, doc="workgroup barrier; orders this program's stores before its later loads"),
    _rec("fold", (OperandSpec("start", INDEX), OperandSpec("stop", INDEX), OperandSpec("inits", VALUES)),
         (AttrSpec("block", INT), AttrSpec("loopvar", ATTR_VALUE), AttrSpec("yields", ATTR_VALUES),
          AttrSpec("range", ATTR_VALUE, nullable=True), AttrSpec("step", ATTR_INDEX, required=False, nullable=True),
          AttrSpec("scalar", BOOL, required=False), AttrSpec("persistent", BOOL, required=False),
          AttrSpec("num_stages", INT, required=False), AttrSpec("unroll", BOOL, required=False)),
         results=None, rule=_fold, doc="a loop carrying state: results are the carried values"),
    _rec("triton_call", (OperandSpec("args", VALUES),),
         (AttrSpec("module", STR), AttrSpec("name", STR), AttrSpec("layout", AXES)), results=None,
         rule=_at_least_one_result, doc="a user @triton.jit helper"),
)}
