"""The IR's op records: nodes are built and read by name, the verifier checks every node against its
record (naming the DSL line), the packed-load pass (not the emitter) decides an int4/fp4 load's masks,
and kernel parameters are records that the launcher and the AOT signature read."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

import kdsl as kd
from kdsl import aot
from kdsl.emit import emit_module
from kdsl.errors import TraceError
from kdsl.ir import Param, TraceContext, walk
from kdsl.irtools import verify
from kdsl.ops_schema import RECORDS, PackedTile
from kdsl.passes import run_passes
from kdsl.targets import get_target

INTERP = get_target("interpret")


@kd.kernel(name="t_ir_scale_rows")
def scale_rows(x: kd.In["M", "N", kd.f32], out: kd.Out["M", "N", kd.f32]):
    m, n = kd.grid("M", "N")
    v = x[m, n]
    out[m, n] = v * 2.0


@kd.kernel(name="t_ir_w4_gemm")
def w4_gemm(x: kd.In["M", "K", kd.i8], w: kd.In["N", "K", kd.int4("quark_reorder")], out: kd.Out["M", "N", kd.i32]):
    m, n = kd.grid(kd.tile("M", domain=(16,), default=16), kd.tile("N", domain=(16,), default=16))
    acc = kd.fold(kd.tiles("K", domain=(32,), default=32), kd.zeros((m, n), kd.i32),
                  lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))
    out[m, n] = acc


@kd.kernel(name="t_ir_w4_rows", static=("C",), example={"C": 32})
def w4_rows(off: kd.In["E", kd.i32], w: kd.In["N", "K", kd.int4("quark_reorder")], out: kd.Out["E", "N", "C", kd.i8]):
    e, n = kd.grid(kd.each("E"), kd.tile("N", domain=(16,), default=16))
    o = off[e]
    k = kd.span(o, kd.static("C"), label="K")        # a packed index read from memory
    out[e, n, k - o] = w[n, k]


@kd.kernel(name="t_ir_params")
def with_params(x: kd.In["M", "N", kd.bf16], n_ptr: kd.Scalar[kd.i32], out: kd.Out["M", "N", kd.bf16]):
    m, n = kd.grid("M", "N")
    out[m, n] = x[m, n] + n_ptr


def _line(kernel, text: str) -> int:
    src, first = inspect.getsourcelines(kernel.fn)
    return first + next(i for i, s in enumerate(src) if text in s)


def _trace(kernel, static=None) -> TraceContext:
    specs = kernel.tunables(INTERP, static)
    return kernel._trace(INTERP, {n: s.default for n, s in specs.items()}, dict(static or {}))


def _node(c: TraceContext, op: str):
    return next(n for n in walk(c.root) if n.op == op)


# -- records: build and read by name -----------------------------------------------------------

def test_nodes_are_read_and_written_by_name():
    c = _trace(scale_rows)
    ld = _node(c, "load")
    assert ld.a.handle is c.operands["x"] and len(ld.a.indices) == 2 and ld.a.mask is None
    assert ld.a.other == 0 and ld.a.bounds == ()      # an absent optional attribute reads its default
    st = _node(c, "store")
    assert st.a.value.node.op == "binary" and st.a.value.node.a.op == "*"
    with pytest.raises(AttributeError, match="op load has no field 'handel'"):
        ld.a.handel
    with pytest.raises(TypeError, match="no operand or attribute 'colour'"):
        RECORDS["load"].build({"handle": ld.a.handle, "indices": [], "masks": frozenset(), "other": 0, "colour": 1})


def test_every_op_the_language_builds_has_a_record():
    for k in (scale_rows, w4_gemm, with_params):
        for n in walk(_trace(k).root):
            assert n.op in RECORDS


# -- the verifier checks every node against its record -------------------------------------------

@pytest.mark.parametrize("breakage,message", [
    (lambda n: n.args.__setitem__(1, 5), r"load: operand indices must be a list of indices .*got int"),
    (lambda n: n.args.__setitem__(0, n.args[1][0]), r"load: operand handle must be an operand handle, got %"),
    (lambda n: n.attrs.pop("other"), r"load: attribute other is missing"),
    (lambda n: n.attrs.__setitem__("colour", "red"), r"load: attribute colour is not in the record"),
    (lambda n: n.attrs.__setitem__("bound_mode", "wrap"), r"load: attribute bound_mode='wrap' is not one of"),
    (lambda n: n.results.append(n.results[0]), r"load: 2 results, the record declares 1"),
    (lambda n: n.args.append(None), r"load: 5 operands, the record declares 4"),
    (lambda n: setattr(n, "op", "frobnicate"), r"frobnicate: unknown op 'frobnicate'"),
])
def test_verifier_rejects_a_node_that_breaks_its_record(breakage, message):
    c = _trace(scale_rows)
    verify(c.root, "t_ir_scale_rows")                 # as traced: valid
    breakage(_node(c, "load"))
    line = _line(scale_rows, "v = x[m, n]")
    with pytest.raises(TraceError, match=message) as e:
        verify(c.root, "t_ir_scale_rows", stage="a test")
    assert "IR verifier after a test" in str(e.value)
    assert f"test_kdsl_ir.py:{line}: v = x[m, n]" in str(e.value) and e.value.loc.line == line


def test_verifier_checks_typing_rules():
    c = _trace(scale_rows)
    mul = next(n for n in walk(c.root) if n.op == "binary" and n.results[0].dtype is kd.f32)
    mul.attrs["dtype"] = kd.i32                      # the result is f32
    with pytest.raises(TraceError, match=r"binary: result type f32 is not the record's dtype i32 .*"
                                         r"test_kdsl_ir.py:\d+: out\[m, n\] = v \* 2.0"):
        verify(c.root)


def test_a_pass_that_breaks_a_record_is_named():
    c = _trace(scale_rows)
    _node(c, "store").attrs.pop("axes")
    with pytest.raises(TraceError, match="IR verifier after trace: store: attribute axes is missing"):
        run_passes(c.root, INTERP, c.dims, kernel="t_ir_scale_rows")


# -- the packed-load pass decides the masks; the emitter prints them ----------------------------

def test_int4_pass_drops_the_packed_axis_mask_and_bounds_the_words():
    c = _trace(w4_gemm)
    ld = _node(c, "load_int4")
    kax = ld.a.indices[-1].axes[0]
    assert any(kax in m.axes for m in ld.a.masks) and ld.a.packed is None    # as traced: the fold's k < K
    run_passes(c.root, INTERP, c.dims, kernel="t_ir_w4_gemm")
    pk = ld.a.packed
    assert isinstance(pk, PackedTile) and (pk.axis.label, pk.axis.size, pk.per, pk.dim) == ("K_words", 4, 8, "K")
    assert not pk.lower_bound
    assert ld.a.masks and not any(kax in m.axes for m in ld.a.masks)        # only the row mask n < N is left
    src = emit_module(c, INTERP, "t_ir_w4_gemm", [])
    assert "_kw1 = k0_" in src and "< K // 8" in src


def test_int4_pass_keeps_a_lower_bound_for_a_packed_index_read_from_memory():
    c = _trace(w4_rows, {"C": 32})
    ld = _node(c, "load_int4")
    run_passes(c.root, INTERP, c.dims, kernel="t_ir_w4_rows")
    assert ld.a.packed.lower_bound and ld.a.packed.per == 8
    assert all(b[0] != 1 for b in ld.a.bounds)      # the packed index's bound became the word bounds
    src = emit_module(c, INTERP, "t_ir_w4_rows", [])
    line = next(s for s in src.splitlines() if "tl.load(w_ptr" in s)
    assert "< K // 8)" in line and ">= 0)" in line


def test_emitter_prints_the_record_it_is_given():
    c = _trace(w4_gemm)
    run_passes(c.root, INTERP, c.dims, kernel="t_ir_w4_gemm")
    ld = _node(c, "load_int4")
    plain = emit_module(c, INTERP, "t_ir_w4_gemm", [])
    assert ">= 0" not in plain
    ld.a.packed = dataclasses.replace(ld.a.packed, lower_bound=True)
    ld.a.masks = frozenset()
    text = emit_module(c, INTERP, "t_ir_w4_gemm", [])
    load = next(s for s in text.splitlines() if "tl.load(w_ptr" in s)
    assert load.split("mask=")[1].startswith("(_kw1[None, :] < K // 8) & (_kw1[None, :] >= 0)")
    ld.a.packed = None
    with pytest.raises(TraceError, match="without its packed-load legalization"):
        emit_module(c, INTERP, "t_ir_w4_gemm", [])


def test_packed_pass_names_a_packed_axis_that_is_not_last():
    c = _trace(w4_gemm)
    ld = _node(c, "load_int4")
    r = ld.results[0]
    r.axes = (r.axes[1], r.axes[0])
    with pytest.raises(TraceError, match=r"w: the packed axis must be the last axis of the loaded tile "
                                         r"\(at test_kdsl_ir.py:\d+"):
        run_passes(c.root, INTERP, c.dims, kernel="t_ir_w4_gemm")


# -- parameters are records -----------------------------------------------------------------------

def test_params_are_records_with_their_launch_source():
    sp = with_params.specialize({}, "gfx942")
    assert all(isinstance(p, Param) for p in sp.params)
    got = [(p.name, p.sig, p.kind, p.operand, p.dim) for p in sp.params]
    assert got == [("x_ptr", "*bf16", "ptr", "x", None), ("x_s0", "i32", "stride", "x", 0),
                   ("x_s1", "i32", "stride", "x", 1), ("n_ptr", "i32", "scalar", None, None),
                   ("out_ptr", "*bf16", "ptr", "out", None), ("out_s0", "i32", "stride", "out", 0),
                   ("out_s1", "i32", "stride", "out", 1), ("M", "i32", "dim", None, None),
                   ("N", "i32", "dim", None, None)]
    assert sp.sources["x_s1"] == ("stride", "x", 1) and sp.sources["n_ptr"] == ("scalar", "n_ptr", 0)


def test_aot_signature_reads_the_records():
    """A Scalar named like a pointer stays a scalar; strides take the contiguous shape's values."""
    sp = with_params.specialize({}, "gfx942")
    sig, consts, attrs = aot.signature_for(sp, {"M": 32, "N": 48, "n_ptr": 3})
    idx = {p.name: i for i, p in enumerate(sp.params)}
    assert sig["n_ptr"] == "i32" and (idx["n_ptr"],) not in attrs
    assert sig["x_ptr"] == "*bf16" and ["tt.pointer_range", 32] in attrs[(idx["x_ptr"],)]
    assert consts == {"x_s1": 1, "out_s1": 1} and sig["x_s0"] == "i32"
    assert attrs[(idx["x_s0"],)] == [["tt.divisibility", 16]]   # stride 48
