"""A printer and a verifier for the traced IR (`python -m kdsl show KERNEL --emit ir`).

The verifier checks what the emitter relies on: every node matches its op's record
(ops_schema.RECORDS: operand kinds, required and declared attributes, result count, typing rule),
every value is defined before it is used, in the same block or an enclosing one (a fold's carried
values inside its body and after it), names are unique, elementwise results cover their operands'
axes, and masks are defined values."""
from __future__ import annotations

from typing import Any, Callable

from . import ops_schema as S
from . import types as T
from .ir import Axis, Block, Node, OperandHandle, TraceContext, Value
from .passes import node_inputs

ELEMENTWISE = {"binary", "unary", "minmax", "where", "cast", "bitcast", "math_ext", "pow", "fma"}


def fmt_value(v: Any) -> str:
    if isinstance(v, Value):
        if v.const is not None:
            return repr(v.const)
        return f"%{v.name}"
    if isinstance(v, Axis):
        return f"{v.label}:{v.size}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(fmt_value(x) for x in v) + "]"
    if hasattr(v, "spec") and hasattr(v, "name"):  # an operand handle
        return f"@{v.name}"
    if isinstance(v, (frozenset, set)):
        return "{" + ", ".join(sorted(fmt_value(x) for x in v)) + "}"
    if isinstance(v, S.PackedTile):
        return f"{{{fmt_value(v.axis)} < {v.dim}/{v.per}{', >= 0' if v.lower_bound else ''}}}"
    return repr(v)


def fmt_type(v: Value) -> str:
    axes = ", ".join(f"{a.label}:{a.size}" for a in v.axes)
    m = f" masks {fmt_value(v.masks)}" if v.masks else ""
    return f"{v.dtype.name}[{axes}]{m}"


def fmt_operands(n: Node) -> str:
    """Operands by position; by name (optional ones left out when absent) for ops whose record has
    a tensor operand or optional operands (memory accesses, dots), where position says little."""
    rec = S.RECORDS.get(n.op)
    if rec is None or not any(o.kind == S.HANDLE or o.optional for o in rec.operands):
        return ", ".join(fmt_value(x) for x in n.args)
    return ", ".join(f"{o.name}={fmt_value(x)}" for o, x in zip(rec.operands, n.args) if not (o.optional and x is None))


def format_ir(root: Block, indent: int = 0) -> str:
    """One line per node: results, op, operands, attributes, result types, DSL line."""
    lines: list[str] = []
    pad = "  " * indent
    for n in root.nodes:
        loc = f"  # {n.loc.short()}" if n.loc else ""
        attrs = {k: v for k, v in n.attrs.items() if k not in ("yields", "loopvar", "range")}
        a = " ".join(f"{k}={fmt_value(v)}" for k, v in attrs.items())
        if n.op == "fold":
            f = n.a
            carry = ", ".join(f"%{c.name}={fmt_value(i)}" for c, i in zip(n.results, f.inits))
            lines.append(f"{pad}fold %{f.loopvar.name} in [{fmt_value(f.start)}, {fmt_value(f.stop)}) "
                         f"{a} carry({carry}) {{{loc}")
            lines.append(format_ir(n.blocks[0], indent + 1).rstrip("\n")) if n.blocks[0].nodes else None
            ys = ", ".join(fmt_value(y) for y in f.yields)
            lines.append(f"{pad}  yield {ys}" if ys else f"{pad}  yield")
            lines.append(f"{pad}}}")
            continue
        res = ", ".join(f"%{r.name}" for r in n.results)
        types = "; ".join(fmt_type(r) for r in n.results)
        head = f"{res} = " if res else ""
        lines.append(f"{pad}{head}{n.op}({fmt_operands(n)}){' ' + a if a else ''}"
                     f"{' : ' + types if types else ''}{loc}")
    return "\n".join(x for x in lines if x is not None) + "\n"


def verify(root: Block, kernel: str | None = None, stage: str = "trace") -> None:
    """Raise a TraceError (naming the node's DSL line) at the first broken IR rule; `stage` says
    which pass left it broken."""
    names: dict[str, int] = {}
    _verify_block(root, set(), names, kernel, stage)


def _verify_block(block: Block, defined: set[int], names: dict[str, int], kernel: str | None, stage: str) -> None:
    from .errors import TraceError

    for n in block.nodes:
        def bad(rule: str) -> Exception:
            where = f" (at {n.loc.short()}: {n.loc.text})" if n.loc else ""
            err = TraceError(kernel, None, f"IR verifier after {stage}: {n.op}: {rule}{where}")
            err.loc = n.loc  # type: ignore[attr-defined]
            return err

        problem = check_record(n)
        if problem:
            raise bad(problem)
        # a span's `< limit` mask is computed from the span itself: its own mask is not an input
        ins = [v for v in node_inputs(n) if isinstance(v, Value) and not any(v is r for r in n.results)]
        if n.op == "fold":
            ins = [v for v in ins if not any(v is y for y in n.a.yields)]
        for v in ins:
            if v.node is not None and v.const is None and id(v) not in defined:
                raise bad(f"uses %{v.name} before (or outside the scope of) its definition")
        for r in n.results:
            if r.name is None:
                raise bad("a result has no name")
            if names.get(r.name, id(r)) != id(r):
                raise bad(f"two values are named {r.name}")
            names[r.name] = id(r)
        if n.op in ELEMENTWISE:
            want = {a for v in n.args if isinstance(v, Value) for a in v.axes}
            if set(n.results[0].axes) != want:
                raise bad(f"result axes {list(n.results[0].axes)} differ from the operands' {sorted(want, key=str)}")
        if n.op == "fold":
            inner = set(defined) | {id(r) for r in n.results}
            _verify_block(n.blocks[0], inner, names, kernel, stage)
            for y in n.a.yields:
                if isinstance(y, Value) and y.node is not None and y.const is None and id(y) not in inner:
                    raise bad(f"yields %{y.name}, which is not defined in the loop or before it")
            defined.update(id(r) for r in n.results)
            continue
        for b in n.blocks:
            _verify_block(b, set(defined), names, kernel, stage)
        defined.update(id(r) for r in n.results)


def _is_index(x: Any) -> bool:
    return isinstance(x, Value) or (isinstance(x, int) and not isinstance(x, bool))


def _all_index(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(_is_index(i) for i in x)


def _all_values(x: Any) -> bool:
    return isinstance(x, (list, tuple, frozenset)) and all(isinstance(v, Value) for v in x)


# kind -> the types an instance must have (and, for containers, a check of the elements)
OPERAND_KINDS: dict[str, tuple[tuple[type, ...], Callable[[Any], bool] | None]] = {
    S.VALUE: ((Value,), None),
    S.INDEX: ((Value, int), _is_index),
    S.INDICES: ((list, tuple), _all_index),
    S.MASKS: ((frozenset,), _all_values),
    S.HANDLE: ((OperandHandle,), None),
    S.VALUES: ((Value,), None),
}

ATTR_KINDS: dict[str, tuple[tuple[type, ...], Callable[[Any], bool] | None]] = {
    S.STR: ((str,), None),
    S.INT: ((int,), lambda x: not isinstance(x, bool)),
    S.BOOL: ((bool,), None),
    S.NUMBER: ((int, float), None),
    S.DTYPE: ((T.DType,), None),
    S.AXIS: ((Axis,), None),
    S.AXES: ((tuple,), lambda x: all(isinstance(a, Axis) for a in x)),
    S.ATTR_VALUE: ((Value,), None),
    S.ATTR_VALUES: ((list, tuple), _all_values),
    S.ATTR_INDEX: ((Value, int), _is_index),
    S.PACK: ((T.Int4,), None),
    S.BOUNDS: ((list, tuple), lambda x: all(isinstance(b, tuple) and len(b) == 4 for b in x)),
    S.PACKED: ((S.PackedTile,), lambda x: isinstance(x.axis, Axis)),
}


def _kind_ok(table: dict, kind: str, x: Any) -> bool:
    types, more = table[kind]
    return isinstance(x, types) and (more is None or more(x))


def _kind_text(x: Any) -> str:
    return f"%{x.name}" if isinstance(x, Value) else type(x).__name__


class _Plan:
    """A record's checks laid out for speed (the verifier runs after every pass)."""

    def __init__(self, rec: S.OpRecord) -> None:
        self.rec = rec
        self.variadic = rec.variadic
        fixed = rec.operands[:-1] if self.variadic else rec.operands
        self.n_fixed = len(fixed)
        self.operands = [(*OPERAND_KINDS[o.kind], o.optional) for o in fixed]
        self.tail = OPERAND_KINDS[rec.operands[-1].kind] if self.variadic else None
        self.attrs = {a.name: (*ATTR_KINDS[a.kind], a.nullable, a.choices) for a in rec.attrs}
        self.required = frozenset(a.name for a in rec.attrs if a.required)
        self.declared = frozenset(self.attrs)

    def ok(self, n: Node) -> bool:
        args = n.args
        if len(args) != self.n_fixed and not (self.variadic and len(args) > self.n_fixed):
            return False
        for x, (types, more, optional) in zip(args, self.operands):
            if x is None:
                if optional:
                    continue
                return False
            if not isinstance(x, types) or (more is not None and not more(x)):
                return False
        if self.tail is not None:
            types, more = self.tail
            for x in args[self.n_fixed:]:
                if not isinstance(x, types) or (more is not None and not more(x)):
                    return False
        attrs = n.attrs
        keys = attrs.keys()
        if not (self.required <= keys and keys <= self.declared):
            return False
        for k, v in attrs.items():
            types, more, nullable, choices = self.attrs[k]
            if v is None and nullable:
                continue
            if not isinstance(v, types) or (more is not None and not more(v)) or (choices and v not in choices):
                return False
        want = self.rec.results
        return want is None or len(n.results) == want


_PLANS: dict[str, _Plan] = {}


def check_record(n: Node) -> str | None:
    """What is wrong with `n` against its op's record (None: nothing)."""
    plan = _PLANS.get(n.op)
    if plan is None:
        rec = S.RECORDS.get(n.op)
        if rec is None:
            return f"unknown op {n.op!r} (no record in ops_schema.RECORDS)"
        plan = _PLANS[n.op] = _Plan(rec)
    rec = plan.rec
    if plan.ok(n):
        return rec.rule(n) if rec.rule is not None else None
    return _record_problem(n, rec) or "does not match its record"


def _record_problem(n: Node, rec: S.OpRecord) -> str | None:
    """The first way `n` breaks its record, in words."""
    ops, args = rec.operands, n.args
    fixed = len(ops) - (1 if rec.variadic else 0)
    if len(args) < fixed or (not rec.variadic and len(args) != fixed):
        return f"{len(args)} operands, the record declares {fixed}{' or more' if rec.variadic else ''}"
    last = len(ops) - 1
    for i, x in enumerate(args):
        o = ops[i if i < last else last]
        if x is None and o.optional:
            continue
        if not _kind_ok(OPERAND_KINDS, o.kind, x):
            return f"operand {o.name} must be {S.KIND_TEXT[o.kind]}{' or None' if o.optional else ''}, got {_kind_text(x)}"
    attrs, specs = n.attrs, rec.attr_specs
    for a in rec.attrs:
        if a.required and a.name not in attrs:
            return f"attribute {a.name} is missing"
    for k, v in attrs.items():
        a = specs.get(k)
        if a is None:
            return f"attribute {k} is not in the record (declared: {', '.join(specs) or 'none'})"
        if v is None and a.nullable:
            continue
        if not _kind_ok(ATTR_KINDS, a.kind, v):
            return f"attribute {k} must be {S.KIND_TEXT[a.kind]}, got {v!r}"
        if a.choices and v not in a.choices:
            return f"attribute {k}={v!r} is not one of {list(a.choices)}"
    if rec.results is not None and len(n.results) != rec.results:
        return f"{len(n.results)} results, the record declares {rec.results}"
    return None


def kernel_ir(kernel: Any, config: dict[str, Any] | None, target: Any, static: dict[str, int] | None) -> str:
    """The IR of one specialization after the passes, as `show --emit ir` prints it."""
    from .options import split_config
    from .passes import run_passes
    from .targets import get_target

    target = get_target(target)
    static = kernel._static_values(static)
    specs = kernel.tunables(target, static)
    tun, _ = split_config(kernel.name, target, dict(config or {}), specs)
    c: TraceContext = kernel._trace(target, {n: tun.get(n, s.default) for n, s in specs.items()}, static)
    stats = run_passes(c.root, target, kernel=kernel.name)
    head = [f"// kdsl IR of {kernel.name} for {target.name}, passes: {stats}",
            "// params: " + ", ".join(f"{p.name}: {p.sig}" for p in c.params)]
    return "\n".join(head) + "\n" + format_ir(c.root)
