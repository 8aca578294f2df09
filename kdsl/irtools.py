"""A printer and a verifier for the traced IR (`python -m kdsl show KERNEL --emit ir`).

The verifier checks what the emitter relies on: every value is defined before it is used, in the
same block or an enclosing one (a fold's carried values inside its body and after it), names are
unique, elementwise results cover their operands' axes, and masks are defined values."""
from __future__ import annotations

from typing import Any

from .ir import Axis, Block, TraceContext, Value
from .passes import node_inputs

ELEMENTWISE = {"binary", "unary", "minmax", "where", "cast", "bitcast", "math_ext", "pow"}


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
    return repr(v)


def fmt_type(v: Value) -> str:
    axes = ", ".join(f"{a.label}:{a.size}" for a in v.axes)
    m = f" masks {fmt_value(v.masks)}" if v.masks else ""
    return f"{v.dtype.name}[{axes}]{m}"


def format_ir(root: Block, indent: int = 0) -> str:
    """One line per node: results, op, operands, attributes, result types, DSL line."""
    lines: list[str] = []
    pad = "  " * indent
    for n in root.nodes:
        loc = f"  # {n.loc.short()}" if n.loc else ""
        attrs = {k: v for k, v in n.attrs.items() if k not in ("yields", "loopvar", "range")}
        a = " ".join(f"{k}={fmt_value(v)}" for k, v in attrs.items())
        if n.op == "fold":
            start, stop, *inits = n.args
            carry = ", ".join(f"%{c.name}={fmt_value(i)}" for c, i in zip(n.results, inits))
            lines.append(f"{pad}fold %{n.attrs['loopvar'].name} in [{fmt_value(start)}, {fmt_value(stop)}) "
                         f"{a} carry({carry}) {{{loc}")
            lines.append(format_ir(n.blocks[0], indent + 1).rstrip("\n")) if n.blocks[0].nodes else None
            ys = ", ".join(fmt_value(y) for y in n.attrs.get("yields", []))
            lines.append(f"{pad}  yield {ys}" if ys else f"{pad}  yield")
            lines.append(f"{pad}}}")
            continue
        res = ", ".join(f"%{r.name}" for r in n.results)
        types = "; ".join(fmt_type(r) for r in n.results)
        head = f"{res} = " if res else ""
        lines.append(f"{pad}{head}{n.op}({', '.join(fmt_value(x) for x in n.args)}){' ' + a if a else ''}"
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

        # a span's `< limit` mask is computed from the span itself: its own mask is not an input
        ins = [v for v in node_inputs(n) if isinstance(v, Value) and not any(v is r for r in n.results)]
        if n.op == "fold":
            ins = [v for v in ins if not any(v is y for y in n.attrs.get("yields", []))]
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
            for y in n.attrs.get("yields", []):
                if isinstance(y, Value) and y.node is not None and y.const is None and id(y) not in inner:
                    raise bad(f"yields %{y.name}, which is not defined in the loop or before it")
            defined.update(id(r) for r in n.results)
            continue
        for b in n.blocks:
            _verify_block(b, set(defined), names, kernel, stage)
        defined.update(id(r) for r in n.results)


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
    stats = run_passes(c.root, target)
    head = [f"// kdsl IR of {kernel.name} for {target.name}, passes: {stats}",
            "// params: " + ", ".join(f"{p[0]}: {p[1]}" for p in c.params)]
    return "\n".join(head) + "\n" + format_ir(c.root)
