"""Passes over the traced IR: dot-accumulate fusion, target legalization, dead code removal, and
bounds on gathers (an index computed from loaded data is checked against its operand's dim)."""
from __future__ import annotations

from typing import Any, Iterable

from . import types as T
from .ir import Block, Node, Value, walk
from .ops_schema import PackedTile
from .targets import Target, bf16_convert

SIDE_EFFECTS = {"store", "atomic_add", "atomic_ticket", "exit_if", "barrier"}


def _values_in(x: Any) -> Iterable[Value]:
    if isinstance(x, Value):
        yield x
    elif isinstance(x, (list, tuple, set, frozenset)):
        for y in x:
            yield from _values_in(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _values_in(y)


def node_inputs(n: Node) -> list[Value]:
    vals = list(_values_in(n.args))
    vals += list(_values_in({k: v for k, v in n.attrs.items() if k in ("yields",)}))
    for v in list(vals):
        vals += list(v.masks)  # a value's index masks are read wherever it indexes memory
    return vals


def use_counts(root: Block) -> dict[int, int]:
    counts: dict[int, int] = {}
    for n in walk(root):
        for v in node_inputs(n):
            counts[id(v)] = counts.get(id(v), 0) + 1
    return counts


def fuse_dot_accumulate(block: Block, counts: dict[int, int] | None = None) -> int:
    """`acc + dot(a, b)` becomes `dot(a, b, acc)` (one MFMA chain instead of a separate add)."""
    counts = counts if counts is not None else use_counts(block)
    fused = 0
    for n in list(block.nodes):
        for b in n.blocks:
            fused += fuse_dot_accumulate(b, counts)
        if n.op != "binary" or n.a.op != "+":
            continue
        pair = (n.a.lhs, n.a.rhs)
        for side in (0, 1):
            d, other = pair[side], pair[1 - side]
            dn = d.node
            if (dn is None or dn.op != "dot" or dn.a.acc is not None or dn not in block.nodes
                    or counts.get(id(d), 0) != 1 or other.dtype is not d.dtype
                    or set(other.axes) != set(d.axes) or other.const is not None):
                continue
            block.nodes.remove(dn)
            idx = block.nodes.index(n)
            dn.a.acc = other
            out = n.results[0]
            out.dtype, out.axes = d.dtype, d.axes
            dn.results = [out]
            out.node = dn
            block.nodes[idx] = dn
            fused += 1
            break
    return fused


def legalize(root: Block, target: Target) -> None:
    """Annotate nodes with the lowering the target needs (the emitter follows the annotations)."""
    interp = target.backend == "interpret"
    for n in walk(root):
        if n.op == "dot":
            f = n.a
            small = any(ax.size < 16 for ax in (f.i, f.k, f.j))
            f.form = "mulsum" if small else "mma"
            # the interpreter multiplies bf16 bit patterns: compute in f32 there (exact products)
            f.upcast = interp and f.a.dtype in (T.bf16, T.f16)
        elif n.op == "cast":
            dt, src = n.a.dtype, n.a.x.dtype
            if n.a.rounding == "rtz":
                n.a.lower = "rtz_bits"
            elif interp and dt is T.bf16 and src is not T.bf16:
                n.a.lower = "rne_bits"  # the interpreter truncates; emulate nearest-even
            elif interp and dt.is_fp8 and src.is_float and not src.is_fp8:
                # the interpreter's float -> fp8 cast rounds ties away and loses the carry into the
                # exponent (124.3 -> 64); round to the fp8 grid in f32 first, then cast exactly
                n.a.lower = "rne_fp8_bits"
            else:
                n.a.lower = "plain"
        elif n.op == "group_dot":
            n.a.upcast = interp  # the interpreter multiplies bf16 bit patterns: an f32 dot there (exact)
        elif n.op == "dequant":
            # gfx94x has no f32 -> bf16 convert: round by integer bits (exact products, no NaN guard);
            # the interpreter (which truncates) runs the same bits, so CPU tests cover that lowering
            n.a.lower = "native" if bf16_convert(target) and not interp else "rne_finite_bits"
        elif n.op in ("binary", "unary", "minmax", "where"):
            dt = n.results[0].dtype
            n.a.f32_then_round = interp and dt is T.bf16 and not (n.op == "unary" and n.a.op == "~")
        if n.op == "load" or n.op == "store" or n.op == "atomic_add":
            h = n.a.handle
            if h.dtype.is_fp8 and target.backend != "interpret":
                from .targets import native_fp8

                if h.dtype not in native_fp8(target):
                    from .errors import ConfigError

                    raise ConfigError(h.kernel, h.name, f"fp8 flavour {h.dtype!r} is not native to {target.name} "
                                      f"(native: {', '.join(d.name for d in native_fp8(target))}); declare it kd.fp8 "
                                      "or convert the data (REFERENCE: e4m3fn -> e4m3fnuz doubles the scale)")


def dce(root: Block) -> int:
    removed = 0
    while True:
        counts = use_counts(root)
        n_removed = _dce_block(root, counts)
        removed += n_removed
        if not n_removed:
            return removed


def _has_effects(n: Node) -> bool:
    if n.op in SIDE_EFFECTS:
        return True
    return any(_has_effects(m) for b in n.blocks for m in b.nodes)


def _dce_block(block: Block, counts: dict[int, int]) -> int:
    removed = 0
    keep = []
    for n in block.nodes:
        for b in n.blocks:
            removed += _dce_block(b, counts)
        if not _has_effects(n) and n.results and all(counts.get(id(r), 0) == 0 for r in n.results):
            removed += 1
            continue
        keep.append(n)
    block.nodes[:] = keep
    return removed


MEMORY_OPS = ("load", "load_int4", "load_fp4", "store", "atomic_add", "atomic_ticket")
DATA_SOURCES = ("load", "load_int4", "load_fp4", "atomic_ticket")  # ops whose results are memory contents, i.e. anything


def tainted_values(root: Block) -> set[int]:
    """ids of the values that depend on loaded data (through arithmetic, selects, reductions, casts,
    loop-carried state and loop bounds). Such a value used as an index is a gather: it may hold any
    number (a page table entry, a slot, an expert id), so the access it addresses must be bounded.
    Tile indices (program ids, ranges over dims, constants) are not tainted."""
    taint: set[int] = set()

    def any_in(xs: Iterable[Value]) -> bool:
        return any(id(v) in taint for v in xs)

    changed = True
    while changed:  # a fold's yields come after its body reads the carried values: iterate
        changed = False
        for n in walk(root):
            outs: list[Value] = []
            if n.op in DATA_SOURCES:
                outs = list(n.results)
            elif n.op == "fold":
                f = n.a
                lv = f.loopvar
                if id(lv) not in taint and any_in(_values_in([f.start, f.stop])):
                    outs.append(lv)
                for c, i, y in zip(n.results, f.inits, f.yields):
                    if any_in(_values_in([i, y])):
                        outs.append(c)
            elif n.op not in ("program_id", "full") and n.results:
                if any_in(_values_in(n.args)):
                    outs = list(n.results)
            for v in outs:
                if id(v) not in taint:
                    taint.add(id(v))
                    changed = True
    return taint


def _implied_bounds(v: Value, dim: str, dim_value: Any) -> tuple[bool, bool]:
    """(need lower, need upper) for `0 <= v < dim`: an unsigned index is never negative, and
    `x % dim` (remainder with the dividend's sign) is never >= dim."""
    lo, hi = True, True
    if not v.dtype.is_signed or v.dtype is T.bool_:
        lo = False
    n = v.node
    if n is not None and n.op == "binary" and n.a.op == "%":
        rhs = n.a.rhs
        if rhs is dim_value or (isinstance(rhs, Value) and rhs.const is not None and rhs.const == dim_value):
            hi = False
    return lo, hi


def _index_only(root: Block) -> set[int]:
    """ids of the values whose every use is as an index of a memory access (a page-table entry
    that only addresses the cache, for instance), never as data, a mask or loop state."""
    index_use: set[int] = set()
    other_use: set[int] = set()
    for n in walk(root):
        if n.op in MEMORY_OPS:
            for i in n.a.indices:
                if isinstance(i, Value):
                    index_use.add(id(i))
            rest: list[Any] = [n.a.masks, n.a.mask] + ([n.a.value] if n.op in ("store", "atomic_add") else [])
        else:
            rest = list(n.args) + [n.attrs.get("yields", [])]
        for v in _values_in(rest):
            other_use.add(id(v))
            other_use.update(id(m) for m in v.masks)
    return index_use - other_use


def bound_gathers(root: Block, dims: dict[str, Any]) -> int:
    """Mark every memory access whose index along some dim comes from loaded data with the bound
    `0 <= index < dim` (attrs["bounds"]: (position, dim name, check lower, check upper)); the
    emitter adds the compare to the access mask, so an out-of-range lane reads `other` and a
    store or atomic drops it.

    One exception keeps a table read cheap: a load from an `In` operand whose result is used only
    as an index of other (bounded) accesses, a page table read say, gets its index clamped into
    the dim instead (attrs["bound_mode"] = "clamp": an unsigned min, no extra mask term, which in
    the decode loops is what keeps the AMD kernels within their scalar registers). Such a lane
    reads an entry of the same table, which is itself bounded where it is used; the launch refuses
    an empty dim there (`Specialization.clamped`). Returns the number of bounded indices."""
    taint = tainted_values(root)
    index_only = _index_only(root)
    count = 0
    for n in walk(root):
        if n.op not in MEMORY_OPS:
            continue
        h, ivals = n.a.handle, n.a.indices
        bounds = []
        for pos, (d, i) in enumerate(zip(h.spec.dims, ivals)):
            if not isinstance(i, Value) or id(i) not in taint:
                continue
            lo, hi = _implied_bounds(i, d, dims.get(d))
            if lo or hi:
                bounds.append((pos, d, lo, hi))
        if bounds:
            n.a.bounds = bounds
            count += len(bounds)
            if (n.op == "load" and h.spec.kind == "in" and n.results and id(n.results[0]) in index_only
                    and (not h.is_int4)):
                n.a.bound_mode = "clamp"
    return count


def clamped_dims(root: Block) -> set[tuple[str, str]]:
    """(operand, dim) pairs read through a clamped index: such a dim must not be empty at launch."""
    return {(n.a.handle.name, b[1]) for n in walk(root) if n.op == "load" and n.a.bound_mode == "clamp"
            for b in n.a.bounds}


def constant_indices(root: Block) -> dict[tuple[str, str], int]:
    """(operand, dim) -> the largest constant (Python int) index any access uses along that dim,
    e.g. `part.load(0, rows, cols)`: the launch refuses a dim that does not hold it (a constant
    index carries no mask, so an empty split dim would read outside the operand)."""
    out: dict[tuple[str, str], int] = {}
    for n in walk(root):
        if n.op not in MEMORY_OPS:
            continue
        for d, i in zip(n.a.handle.spec.dims, n.a.indices):
            if isinstance(i, int) and not isinstance(i, bool):
                key = (n.a.handle.name, d)
                out[key] = max(out.get(key, i), i) if i >= 0 else min(out.get(key, i), i)
    return out


def lane_sums(root: Block) -> bool:
    """Whether the kernel adds floats across a tile axis (a float `kd.sum` over an axis of more than
    one element, or a float dot lowered to multiply-and-sum for tiles under 16): Triton's reduction
    tree follows the layout, which num_warps sets, so there num_warps changes the bits."""
    for n in walk(root):
        if n.op == "reduce" and n.a.op == "sum" and n.a.dtype.is_float and n.a.axis.size > 1:
            return True
        if n.op == "dot" and n.a.form == "mulsum" and n.a.dtype.is_float and n.a.k.size > 1:
            return True
    return False


PACKED_LOADS = {"load_int4": (8, "words"), "load_fp4": (T.FP4_PER_BYTE, "bytes")}  # values per element


def legalize_packed_loads(root: Block, kernel: str | None = None) -> int:
    """Decide how each packed load (int4 words, fp4 bytes) is masked, and write it into the node's
    record (`packed`, see ops_schema.PackedTile), so the emitter only prints it.

    The load reads storage elements `start // per + arange(size // per)` along the packed dim: the
    index masks over the packed axis (a fold's `k < K`) do not apply to that tile and are dropped
    from `masks`; the storage tile is bounded by `K // per` instead; a packed index read from memory
    keeps its lower bound `>= 0` (the storage bound is its upper one) and leaves `bounds`. Runs after
    `bound_gathers`, whose bounds it consumes. Returns the number of loads legalized."""
    from .errors import TraceError
    from .ir import Axis

    count = 0
    for n in walk(root):
        if n.op not in PACKED_LOADS or n.a.packed is not None:
            continue
        per, what = PACKED_LOADS[n.op]
        f, r = n.a, n.results[0]
        last_pos = len(f.indices) - 1
        last = f.indices[last_pos]
        kax = last.axes[0]
        if r.axes[-1] is not kax:
            where = f" (at {n.loc.short()}: {n.loc.text})" if n.loc else ""
            err = TraceError(kernel, f.handle.name,
                             f"{f.handle.name}: the packed axis must be the last axis of the loaded tile{where}")
            err.loc = n.loc  # type: ignore[attr-defined]
            raise err
        f.masks = frozenset(m for m in f.masks if kax not in m.axes)
        lower = any(b[0] == last_pos for b in f.bounds)
        if "bounds" in n.attrs:
            f.bounds = [b for b in f.bounds if b[0] != last_pos]
        storage = Axis(f"{kax.label}_{what}", last.range_info.size // per)
        f.packed = PackedTile(storage, per, f.handle.spec.dims[-1], lower)
        count += 1
    return count


def run_passes(root: Block, target: Target, dims: dict[str, Any] | None = None,
               kernel: str | None = None) -> dict[str, int]:
    from .irtools import verify

    verify(root, kernel, stage="trace")
    stats = {"dot_acc_fused": fuse_dot_accumulate(root)}
    verify(root, kernel, stage="dot-accumulate fusion")
    legalize(root, target)
    stats["cse"] = cse(root)
    verify(root, kernel, stage="common subexpressions")
    stats["hoisted"] = hoist_invariants(root)
    verify(root, kernel, stage="hoisting")
    stats["dead_removed"] = dce(root)
    verify(root, kernel, stage="dead code removal")
    if dims is not None:
        bounded = bound_gathers(root, dims)
        if bounded:  # absent otherwise: kernels without gathers keep their generated source
            stats["gathers_bounded"] = bounded
    legalize_packed_loads(root, kernel)  # not counted in stats: the header line stays as it was
    verify(root, kernel, stage="gather bounds and packed-load legalization")
    return stats


# ----------------------------------------------------------------------------------------------
# common subexpressions and loop-invariant values

PURE = {"binary", "unary", "minmax", "where", "cast", "bitcast", "reduce", "full", "broadcast", "pad", "iota",
        "argreduce", "scan", "math_ext", "pow", "fma", "program_id", "sort", "topk", "dot", "group_dot"}
HOISTABLE = (PURE - {"dot", "group_dot"}) | {"range"}


def _key(x: Any) -> Any:
    if isinstance(x, Value):
        return ("c", repr(x.const), x.dtype.name) if x.const is not None else ("v", id(x))
    if isinstance(x, (list, tuple)):
        return tuple(_key(y) for y in x)
    if isinstance(x, (set, frozenset)):
        return frozenset(_key(y) for y in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _key(v)) for k, v in x.items()))
    if isinstance(x, T.DType):
        return ("d", x.name)
    try:
        hash(x)
        return (type(x).__name__, x) if not hasattr(x, "__dict__") else ("o", id(x))
    except TypeError:
        return ("r", repr(x))


def _subst(x: Any, repl: dict[int, Value]) -> Any:
    if isinstance(x, Value):
        return repl.get(id(x), x)
    if isinstance(x, list):
        return [_subst(y, repl) for y in x]
    if isinstance(x, tuple):
        return tuple(_subst(y, repl) for y in x)
    if isinstance(x, frozenset):
        return frozenset(_subst(y, repl) for y in x)
    return x


def _subst_value(v: Value, repl: dict[int, Value]) -> None:
    if v.masks:
        v.masks = frozenset(repl.get(id(m), m) for m in v.masks)
    if v.range_info is not None and isinstance(v.range_info.start, Value):
        v.range_info.start = repl.get(id(v.range_info.start), v.range_info.start)


def cse(root: Block) -> int:
    """Share pure computations that repeat (same op, operands, attributes and result type/axes/masks)
    with one that dominates them: the same block earlier, or an enclosing block."""
    repl: dict[int, Value] = {}
    return _cse_block(root, {}, repl)


def _cse_block(block: Block, avail: dict[Any, Node], repl: dict[int, Value]) -> int:
    removed = 0
    keep = []
    for n in block.nodes:
        n.args = _subst(n.args, repl)
        for r in n.results:
            _subst_value(r, repl)
        for k in list(n.attrs):
            if k != "yields":
                n.attrs[k] = _subst(n.attrs[k], repl)
        for b in n.blocks:
            removed += _cse_block(b, dict(avail), repl)
        if "yields" in n.attrs:
            n.attrs["yields"] = _subst(n.attrs["yields"], repl)
        if n.op in PURE and not n.blocks and n.results:
            key = (n.op, _key(n.args), _key({k: v for k, v in n.attrs.items()}),
                   tuple((r.dtype.name, tuple(a.id for a in r.axes), frozenset(id(m) for m in r.masks))
                         for r in n.results))
            prev = avail.get(key)
            if prev is not None:
                for old, new in zip(n.results, prev.results):
                    repl[id(old)] = new
                removed += 1
                continue
            avail[key] = n
        keep.append(n)
    block.nodes[:] = keep
    return removed


def hoist_invariants(block: Block) -> int:
    """Move pure scalar and 1-D values that do not depend on a fold's loop out of it (before the
    loop), innermost loops first; wider tiles stay (hoisting them would lengthen register live ranges)."""
    moved = 0
    i = 0
    while i < len(block.nodes):
        n = block.nodes[i]
        for b in n.blocks:
            moved += hoist_invariants(b)
        if n.op == "fold" and n.blocks:
            out = _hoist_from(n)
            block.nodes[i:i] = out
            i += len(out)
            moved += len(out)
        i += 1
    return moved


def _hoist_from(fold: Node) -> list[Node]:
    inside: set[int] = {id(fold.a.loopvar)} | {id(r) for r in fold.results}
    body = fold.blocks[0]
    out, keep = [], []
    for n in body.nodes:
        ins = node_inputs(n)
        movable = (n.op in HOISTABLE and not n.blocks and n.results and all(len(r.axes) <= 1 for r in n.results)
                   and not any(id(v) in inside for v in ins))
        if movable:
            out.append(n)
            continue
        keep.append(n)
        for m in [n, *(x for b in n.blocks for x in walk(b))]:
            inside.update(id(r) for r in m.results)
            if m.op == "fold":
                inside.add(id(m.a.loopvar))
    body.nodes[:] = keep
    return out
