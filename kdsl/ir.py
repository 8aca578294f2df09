"""The IR: values over named axes, nodes in nested blocks, and the trace context.

A value's shape is a tuple of `Axis` objects rather than positions, so broadcasting, dot
contraction and gathers are decided by axis identity (a paged lookup `kv[page, pos % P, d]`
gives a [pos, d] tile because `page` and `pos % P` both live on the `pos` axis).
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from . import types as T
from .ops_schema import RECORDS, Fields

_KDSL_DIR = os.path.dirname(os.path.abspath(__file__))


class Axis:
    """One tile dimension. Identity matters, the label is for names and messages."""

    _ids = itertools.count()

    def __init__(self, label: str, size: int) -> None:
        if size < 1 or size & (size - 1):
            raise ValueError(f"axis {label!r}: tile size must be a power of two, got {size}")
        self.label, self.size, self.id = label, size, next(Axis._ids)

    def __repr__(self) -> str:
        return f"{self.label}:{self.size}"


@dataclass(frozen=True)
class Loc:
    file: str
    line: int
    text: str

    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


def caller_loc() -> Loc | None:
    """The first stack frame outside the kdsl package: the DSL line that made a node."""
    f = sys._getframe(1)
    while f is not None and os.path.dirname(os.path.abspath(f.f_code.co_filename)) == _KDSL_DIR:
        f = f.f_back
    if f is None:
        return None
    import linecache

    fn = f.f_code.co_filename
    return Loc(fn, f.f_lineno, linecache.getline(fn, f.f_lineno).strip())


@dataclass(eq=False)
class RangeInfo:
    """A contiguous tile `start + arange(size)`; kept so packed loads can index storage words."""

    start: Any  # Value or int
    size: int


class Value:
    """An SSA value produced by a node: a scalar (no axes) or a tile over named axes."""

    def __init__(self, dtype: T.DType, axes: tuple[Axis, ...], masks: frozenset = frozenset(),
                 hint: str = "v", range_info: RangeInfo | None = None, const: Any = None) -> None:
        self.dtype, self.axes, self.masks = dtype, tuple(axes), frozenset(masks)
        self.hint, self.range_info, self.const = hint, range_info, const
        self.name: str | None = None
        self.node: Node | None = None

    @property
    def is_scalar(self) -> bool:
        return not self.axes

    def __repr__(self) -> str:
        return f"Value({self.name or self.hint}: {self.dtype!r}{list(self.axes)})"

    # operator overloading lives in lang.py (installed there) to keep this module data-only
    __hash__ = object.__hash__


@dataclass(eq=False)
class Node:
    """One operation. `args` holds the operands in the order of the op's record (ops_schema.RECORDS),
    the generic view passes walk; op-specific code reads and writes fields by name through `a`."""

    op: str
    args: list[Any]
    attrs: dict[str, Any]
    results: list[Value]
    loc: Loc | None
    blocks: list["Block"] = field(default_factory=list)

    @property
    def a(self) -> Fields:
        """Operands and attributes by name: `n.a.handle`, `n.a.indices`, `n.a.axis`."""
        f = self.__dict__.get("_fields")
        if f is None:
            f = self.__dict__["_fields"] = Fields(self, RECORDS[self.op])
        return f


@dataclass(eq=False)
class Block:
    nodes: list[Node] = field(default_factory=list)


@dataclass
class TunableSpec:
    name: str
    domain: tuple[Any, ...]
    default: Any
    doc: str = ""
    # False: a variant switch (e.g. numerics) that tuners leave at its default; a tuple: the values
    # tuners try (the rest of the domain only by explicit config)
    search: bool | tuple[Any, ...] = True

    def searched(self) -> tuple[Any, ...]:
        """The values a tuner tries."""
        if self.search is True:
            return self.domain
        return tuple(self.search) if self.search else (self.default,)


@dataclass
class GridEntry:
    kind: str  # "tile", "each" or "nest" (one launch axis over the product of `parts`)
    dim: str
    block: int = 1
    parts: tuple["GridEntry", ...] = ()

    def count(self, dims: dict[str, int]) -> int:
        """Programs along this entry at `dims`."""
        if self.kind == "nest":
            n = 1
            for p in self.parts:
                n *= p.count(dims)
            return n
        d = dims[self.dim]
        return -(-d // self.block) if self.kind == "tile" else d

    def leaves(self) -> tuple["GridEntry", ...]:
        """The tile/each entries behind this one (itself unless a nest)."""
        return self.parts if self.kind == "nest" else (self,)


@dataclass(frozen=True)
class Param:
    """One parameter of the generated function and where a launch takes its value from: an
    operand's data pointer (`ptr`) or its stride along dim `dim` (`stride`), a Scalar parameter, or a
    dim's value (`dim`)."""

    name: str
    sig: str  # Triton signature type: "*bf16", "i32", "fp32", ...
    kind: str  # "ptr" | "stride" | "scalar" | "dim"
    operand: str | None = None  # the operand of a ptr or stride
    dim: int | None = None  # the dim of a stride

    @property
    def source(self) -> str:
        """The launch argument (operand, Scalar or dim name) the value comes from."""
        return self.operand if self.kind in ("ptr", "stride") else self.name  # type: ignore[return-value]


@dataclass
class OperandHandle:
    name: str
    spec: T.Operand
    dtype: T.DType  # resolved storage type
    strides: list[Any]  # Value or int per dim (storage dims)
    kernel: str
    wide: tuple[int, ...] = ()  # dims whose offset terms are 64-bit (the operand's span reaches 2^31)

    @property
    def is_int4(self) -> bool:
        return isinstance(self.spec.dtype, T.Int4)


class TraceContext:
    """Everything a trace accumulates: the node tree, tunables, grid, params, rules."""

    def __init__(self, kernel_name: str, target: Any, config: dict[str, Any],
                 static: dict[str, int]) -> None:
        self.kernel_name, self.target, self.config, self.static = kernel_name, target, config, static
        self.root = Block()
        self.stack: list[Block] = [self.root]
        self.tunables: dict[str, TunableSpec] = {}
        self.grid: list[GridEntry] = []
        self.params: list[Param] = []
        self.dims: dict[str, Any] = {}
        self.operands: dict[str, OperandHandle] = {}
        self.used_config: set[str] = set()
        self.option_requests: dict[str, Any] = {}  # kd.compile_option: launch options the kernel asks for
        self._names = itertools.count()
        self.auto_names: set[str] = set()  # names `fresh` gave out: a user variable's name avoids them

    def fresh(self, hint: str) -> str:
        name = f"{hint}_{next(self._names)}"
        self.auto_names.add(name)
        return name

    def add(self, op: str, results: list[Value], /, *, loc: Loc | None = None, **fields: Any) -> Node:
        """Append a node built from named operands and attributes (the op's record says which)."""
        args, attrs = RECORDS[op].build(fields)
        node = Node(op, args, attrs, results, loc or caller_loc())
        for r in results:
            r.node = node
            if r.name is None:
                r.name = self.fresh(r.hint)
        self.stack[-1].nodes.append(node)
        return node

    def error(self, rule: str, param: str | None = None, loc: "Loc | None" = None):
        """A TraceError naming the DSL line being traced (or `loc`) as `file:line: text`."""
        from .errors import TraceError

        loc = loc or caller_loc()
        err = TraceError(self.kernel_name, param, rule + (f" (at {loc.short()}: {loc.text})" if loc else ""))
        err.loc = loc  # type: ignore[attr-defined]
        return err


_local = threading.local()


def ctx() -> TraceContext:
    c = getattr(_local, "ctx", None)
    if c is None:
        raise RuntimeError("kdsl language functions can only be used inside a @kdsl.kernel while it is traced")
    return c


class tracing:
    def __init__(self, c: TraceContext) -> None:
        self.c = c

    def __enter__(self) -> TraceContext:
        self.prev = getattr(_local, "ctx", None)
        _local.ctx = self.c
        self.prev_profile = sys.getprofile()
        sys.setprofile(_naming_profiler(self.c, self.prev_profile))
        return self.c

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self.prev_profile)
        _local.ctx = self.prev


def walk(block: Block):
    """All nodes, depth first, in program order."""
    for n in block.nodes:
        yield n
        for b in n.blocks:
            yield from walk(b)


# ----------------------------------------------------------------------------------------------
# user variable names for generated code

_RESERVED = {"tl", "triton", "range", "float", "int", "len", "min", "max", "abs", "print", "importlib",
             "libdevice", "self"}


def _is_auto(v: Value) -> bool:
    """A name the trace made up (`hint_N`), which a user variable name may replace."""
    n = v.name
    if n is None or v.const is not None or getattr(v, "_user_named", False):
        return False
    head, _, tail = n.rpartition("_")
    return head == v.hint and tail.isdigit()


def name_from_locals(c: TraceContext, local_vars: dict[str, Any]) -> None:
    """Give auto-named values the names of the user variables bound to them."""
    used = getattr(c, "_user_names", None)
    if used is None:
        used = c._user_names = {p.name for p in c.params} | set(c.operands) | set(c.dims)  # type: ignore[attr-defined]
    for var, v in local_vars.items():
        if not isinstance(v, Value) or not _is_auto(v) or not var.isidentifier():
            continue
        if var.startswith("_") or var in _RESERVED or var == c.kernel_name:
            continue
        base = var
        if base.rpartition("_")[2].isdigit():
            base += "_v"
        name, i = base, 1
        while name in used or name in c.auto_names:
            i += 1
            name = f"{base}_{i}"
        used.add(name)
        v.name = name
        v._user_named = True  # type: ignore[attr-defined]


def _naming_profiler(c: TraceContext, chained: Any):
    """A profile hook active while tracing: when a function outside kdsl returns, the tile values
    its local variables hold take those variables' names."""
    def prof(frame, event, arg):
        if event == "return":
            fn = frame.f_code.co_filename
            if not fn.startswith(_KDSL_DIR) and "site-packages" not in fn and not fn.startswith("<"):
                try:
                    name_from_locals(c, frame.f_locals)
                except Exception:  # naming is cosmetic: never break a trace
                    pass
        if chained is not None:
            return chained(frame, event, arg)
    return prof
