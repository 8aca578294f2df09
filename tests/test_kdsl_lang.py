"""Tier 0: the tile language at trace time (no launches): named-axes rules, dot contraction,
mask propagation, fold state, memory-op rules and the errors that name what is wrong."""
from __future__ import annotations

import pytest

import kdsl as kd
from kdsl.errors import TraceError
from kdsl.ir import TraceContext, Value, tracing
from kdsl.targets import get_target


def trace(body, *, dims=("M", "N", "K"), static=None):
    """Trace `body(ops, dims)` in a bare context with f32 operands x[M, K], w[N, K], out[M, N]."""
    from kdsl import types as T
    from kdsl.ir import OperandHandle

    c = TraceContext("lang_test", get_target("interpret"), {}, dict(static or {}))
    with tracing(c):
        for d in dims:
            if d in (static or {}):
                c.dims[d] = static[d]
            else:
                c.dims[d] = Value(T.i32, (), hint=d)
                c.dims[d].name = d

        def h(name, spec):
            strides = [Value(T.i32, (), hint="s") for _ in spec.dims]
            return OperandHandle(name, spec, spec.dtype if isinstance(spec.dtype, T.DType) else T.i32, strides, "lang_test")

        ops = {"x": h("x", kd.In["M", "K", kd.f32]), "w": h("w", kd.In["N", "K", kd.f32]),
               "q": h("q", kd.In["N", "K", kd.int4("quark_order")]), "i8": h("i8", kd.In["M", "K", kd.i8]),
               "out": h("out", kd.Out["M", "N", kd.f32])}
        result = body(ops)
    return c, result


def test_dot_contracts_shared_axis():
    def body(o):
        m, n = kd.grid("M", "N")
        k = kd.span(0, 32, kd.dim("K"), "K")
        d = kd.dot(o["x"][m, k], o["w"][n, k])
        return m, n, k, d

    _, (m, n, k, d) = trace(body)
    assert d.axes == (m.axes[0], n.axes[0]) and d.dtype is kd.f32
    assert not any(k.axes[0] in mk.axes for mk in d.masks)     # the contracted axis' mask is gone
    assert {mk.axes[0] for mk in d.masks} == {m.axes[0], n.axes[0]}


@pytest.mark.parametrize("make,msg", [
    (lambda o, m, n, k: kd.dot(o["x"][m, k], o["w"][n, kd.span(16, 16, None, "K")]), "share exactly one axis"),
    (lambda o, m, n, k: kd.dot(o["x"][m, k], o["x"][m, k]), "share exactly one axis"),
    (lambda o, m, n, k: kd.dot(o["i8"][m, k], o["w"][n, k]), "both be integer or both float"),
    (lambda o, m, n, k: kd.dot(o["x"][m, k], o["w"][n, k].to(kd.bf16)), "must have one type"),
    (lambda o, m, n, k: kd.dot(o["x"][m, k], k), "two 2-D tiles"),
])
def test_dot_errors(make, msg):
    def body(o):
        m, n = kd.grid("M", "N")
        k = kd.span(0, 16, kd.dim("K"), "K")
        make(o, m, n, k)

    with pytest.raises(TraceError, match=msg):
        trace(body)


def test_broadcast_by_axis_identity_and_masks():
    def body(o):
        m, n = kd.grid("M", "N")
        k = kd.span(0, 16, kd.dim("K"), "K")
        a = o["x"][m, k]          # (m, k)
        b = o["w"][n, k]          # (n, k)
        return m, n, k, a + b     # union of axes, union of masks

    _, (m, n, k, s) = trace(body)
    assert s.axes == (m.axes[0], k.axes[0], n.axes[0]) and len(s.masks) == 3


def test_store_value_axes_must_be_covered():
    def body(o):
        m, n = kd.grid("M", "N")
        k = kd.span(0, 16, kd.dim("K"), "K")
        o["out"][m, n] = o["x"][m, k]

    with pytest.raises(TraceError, match="stored value has axes.*not covered"):
        trace(body)


def test_store_into_input_and_index_errors():
    def store_in(o):
        m, n = kd.grid("M", "N")
        o["x"][m, n] = 1.0

    with pytest.raises(TraceError, match="declared In.*Out or InOut"):
        trace(store_in)

    def wrong_rank(o):
        m, n = kd.grid("M", "N")
        return o["x"][m]

    with pytest.raises(TraceError, match="x has 2 dims.*indexed with 1"):
        trace(wrong_rank)

    def float_index(o):
        m, n = kd.grid("M", "N")
        return o["x"][m, o["x"][m, n]]

    with pytest.raises(TraceError, match="not an integer"):
        trace(float_index)


def test_int4_tile_multiple_of_8():
    def body(o):
        n, = kd.grid("N")
        k = kd.span(0, 4, kd.dim("K"), "K")
        return o["q"][n, k]

    with pytest.raises(TraceError, match="multiple of 8, got 4"):
        trace(body)


def test_fold_state_rules():
    def grows(o):
        m, n = kd.grid("M", "N")
        return kd.fold("K", kd.zeros((m,), kd.f32), lambda k, acc: acc + o["x"][m, k])

    with pytest.raises(TraceError, match="fold state changed axes"):
        trace(grows)

    def count(o):
        m, n = kd.grid("M", "N")
        return kd.fold("K", (kd.zeros((m,), kd.f32), kd.zeros((m,), kd.f32)), lambda k, a, b: a)

    with pytest.raises(TraceError, match="returned 1 values for 2 state values"):
        trace(count)


def test_misc_rules():
    def twice(o):
        kd.grid("M")
        kd.grid("N")

    with pytest.raises(TraceError, match="once per kernel"):
        trace(twice)

    def bad_exit(o):
        m, = kd.grid("M")
        kd.exit_if(m < 3)

    with pytest.raises(TraceError, match="scalar condition"):
        trace(bad_exit)

    def bad_bitcast(o):
        m, = kd.grid("M")
        m.bitcast(kd.bf16)

    with pytest.raises(TraceError, match="changes the bit width"):
        trace(bad_bitcast)

    def bad_rtz(o):
        m, n = kd.grid("M", "N")
        o["out"][m, n].to(kd.f16, rounding="rtz")

    with pytest.raises(TraceError, match="bf16 results only"):
        trace(bad_rtz)

    def bad_reduce(o):
        m, n = kd.grid("M", "N")
        kd.sum(o["x"][m, kd.span(0, 16, kd.dim("K"), "K")], axis=n)

    with pytest.raises(TraceError, match="reduction axis"):
        trace(bad_reduce)

    def int_op_on_float(o):
        m, n = kd.grid("M", "N")
        return o["out"][m, n] % 2

    with pytest.raises(TraceError, match="needs integer operands"):
        trace(int_op_on_float)

    def unknown_dim(o):
        kd.grid("Q")

    with pytest.raises(TraceError, match="unknown dim 'Q'"):
        trace(unknown_dim)


def test_const_and_dtype_rules():
    def body(o):
        m, k = kd.grid("M", "K")
        a = o["i8"][m, k]
        return a + 1, a * 0.5, a / 2, (a < 3), kd.sum(a, axis=k), a.to(kd.bf16) + a.to(kd.f16), kd.exp(a)

    _, (add_c, mul_f, div, cmp, red, mix, ex) = trace(body)
    assert add_c.dtype is kd.i8          # a Python int adopts the tile's integer type
    assert mul_f.dtype is kd.f32 and div.dtype is kd.f32 and cmp.dtype is kd.bool_
    assert red.dtype is kd.i32           # narrow ints accumulate in i32
    assert mix.dtype is kd.f32 and ex.dtype is kd.f32


def test_full_range_pads_and_masks():
    def body(o):
        return kd.full_range("K"), kd.full_range("N")

    _, (k, n) = trace(body, static={"K": 24, "N": 32})
    assert k.axes[0].size == 32 and len(k.masks) == 1      # 24 -> 32 with a k < 24 mask
    assert n.axes[0].size == 32 and not n.masks             # exact power of two: no mask

    def not_static(o):
        kd.full_range("M")

    with pytest.raises(TraceError, match="must be static"):
        trace(not_static, static={"K": 24})


def test_span_power_of_two():
    def body(o):
        kd.span(0, 24, None, "K")

    with pytest.raises(TraceError, match="power of two, got 24"):
        trace(body)


def test_tunable_search_values_are_a_part_of_the_domain():
    """search=(values...) names what a tuner tries; a value outside the domain is refused."""
    c, v = trace(lambda o: kd.tunable("ST", (0, 64, 128), 64, search=(64, 128)))
    assert v == 64 and c.tunables["ST"].searched() == (64, 128)
    c, _ = trace(lambda o: kd.tunable("PV", (0, 1), 0, search=False))
    assert c.tunables["PV"].searched() == (0,)
    with pytest.raises(TraceError, match="search values"):
        trace(lambda o: kd.tunable("ST", (0, 64), 64, search=(64, 256)))


def test_compile_option_sets_the_launch_option_of_its_specialization():
    """kd.compile_option asks the compiler for a launch option where a tile needs it: applied where
    the config leaves the default, an error against another explicit value, an unknown name or a
    value the target does not allow; a no-op on the interpreter."""
    from kdsl import ConfigError

    @kd.kernel(example={"M": 64, "N": 32})
    def opt_copy(x: kd.In["M", "N", kd.f32], out: kd.Out["M", "N", kd.f32]):
        m, n = kd.grid(kd.tile("M", "BLOCK_M", domain=(64,), default=64), kd.tile("N", "BLOCK_N", domain=(32,), default=32))
        if kd.tunable("SMALL_MMA", (0, 1), 0, "16x16 matrix instructions"):
            kd.compile_option("matrix_instr_nonkdim", 16)
        out[m, n] = x[m, n]

    assert opt_copy.specialize({"SMALL_MMA": 1}, "gfx942").options["matrix_instr_nonkdim"] == 16
    assert opt_copy.specialize({"SMALL_MMA": 0}, "gfx942").options["matrix_instr_nonkdim"] == 0
    assert opt_copy.specialize({"SMALL_MMA": 1, "matrix_instr_nonkdim": 16}, "gfx950").options["matrix_instr_nonkdim"] == 16
    with pytest.raises(ConfigError, match="kd.compile_option"):
        opt_copy.specialize({"SMALL_MMA": 1, "matrix_instr_nonkdim": 32}, "gfx942")
    from kdsl.options import backend_options

    interp = get_target("interpret")  # the interpreter hands no option to its launch
    assert backend_options("opt_copy", interp, opt_copy.specialize({"SMALL_MMA": 1}, interp).options) == {}

    def bad(name, value):
        def body(o):
            kd.compile_option(name, value)
        return body

    with pytest.raises(TraceError, match="unknown launch option"):
        trace(bad("matrix_instr_nonkdm", 16))
