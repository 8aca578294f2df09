"""Tier 0 (pure Python, no launches except where a launch error is raised before any run):
types, fp8 per target, operand annotations, option validation, tunables, launch errors, promotion."""
from __future__ import annotations

import pytest
import torch

import kdsl as kd
from kdsl import types as T
from kdsl.errors import ConfigError, LaunchError, TraceError
from kdsl.lang import promote
from kdsl.ir import TraceContext, tracing
from kdsl.targets import get_target, resolve_dtype


# ---------------------------------------------------------------------------------------------
# kernels used below (module level: one registration per name)

@kd.kernel
def t0_axpy(x: kd.In["M", "N", kd.f32], s: kd.In["M", kd.f32], out: kd.Out["M", "N", kd.f32]):
    m, n = kd.grid("M", "N")
    out[m, n] = x[m, n] * s[m]


@kd.kernel
def t0_fp8(x: kd.In["M", kd.fp8], out: kd.Out["M", kd.f32]):
    m, = kd.grid("M")
    out[m] = x[m].to(kd.f32)


@kd.kernel
def t0_require(x: kd.In["M", kd.f32], out: kd.Out["M", kd.f32]):
    bk = kd.tunable("BLOCK_K", (16, 32, 48, 64), 32)
    kd.require(bk % 32 == 0, "BLOCK_K must be a multiple of the quant group 32", "BLOCK_K")
    m, = kd.grid("M")
    out[m] = x[m]


@kd.kernel
def t0_truth(x: kd.In["M", kd.f32], out: kd.Out["M", kd.f32]):
    m, = kd.grid("M")
    v = x[m]
    if v:  # a Python `if` on a tile is a mistake the tracer must catch
        out[m] = v


@kd.kernel(checks=[("K", lambda d: d["K"] % 32 == 0, "K must be a multiple of 32")])
def t0_checks(x: kd.In["M", "K", kd.f32], out: kd.Out["M", "K", kd.f32]):
    m, k = kd.grid("M", "K")
    out[m, k] = x[m, k]


@kd.kernel
def t0_int4(w: kd.In["N", "K", kd.int4("ct")], out: kd.Out["N", "K", kd.i8]):
    n, k = kd.grid("N", kd.tile("K", domain=(16, 32), default=16))
    out[n, k] = w[n, k]


# ---------------------------------------------------------------------------------------------
# types

@pytest.mark.parametrize("pack,order,twos", [
    ("quark_order", (0, 1, 2, 3, 4, 5, 6, 7), True),
    ("quark_reorder", (0, 2, 4, 6, 1, 3, 5, 7), True),
    ("ct", (0, 1, 2, 3, 4, 5, 6, 7), False),
])
def test_int4_specs(pack, order, twos):
    t = kd.int4(pack)
    assert t.order == order and t.twos is twos
    assert t.storage is kd.i32 and t.per_word == 8
    assert resolve_dtype(t, get_target("gfx942")) is kd.i32
    assert repr(t) == f"int4({pack})"


def test_int4_unknown_packing():
    with pytest.raises(ValueError, match="unknown int4 packing 'gptq'.*quark_order"):
        kd.int4("gptq")


@pytest.mark.parametrize("arch,want", [("gfx942", T.fp8e4m3fnuz), ("gfx950", T.fp8e4m3fn), ("sm90", T.fp8e4m3fn)])
def test_fp8_resolves_per_target(arch, want):
    assert resolve_dtype(kd.fp8, get_target(arch)) is want
    # the generated signature carries the arch's flavour
    src = t0_fp8.source({}, arch)
    assert "@triton.jit" in src
    sp = t0_fp8.specialize({}, arch)
    assert ("x_ptr", f"*{want.sig}") in [(p.name, p.sig) for p in sp.params]


def test_fp8_max_values():
    assert kd.FP8_MAX[T.fp8e4m3fn] == 448.0 and kd.FP8_MAX[T.fp8e4m3fnuz] == 240.0


def test_dtype_torch_roundtrip():
    for d in (kd.bf16, kd.f16, kd.f32, kd.i8, kd.i32, kd.i64, kd.u8, T.fp8e4m3fn, T.fp8e4m3fnuz):
        assert T.from_torch(d.torch) is d
    with pytest.raises(TypeError, match="no kdsl equivalent"):
        T.from_torch(torch.complex64)


# ---------------------------------------------------------------------------------------------
# operand annotations

def test_operand_annotation_parsing():
    op = kd.In["M", "K", kd.i8]
    assert op.dims == ("M", "K") and op.dtype is kd.i8 and op.kind == "in"
    assert kd.Out["N", kd.bf16].kind == "out" and kd.InOut["N", kd.f32].kind == "inout"
    assert repr(op) == "In[M, K, i8]"


@pytest.mark.parametrize("bad,msg", [
    (lambda: kd.In["M", "K"], "must end with an element type"),
    (lambda: kd.In["M", 3, kd.f32], "dims must be identifiers"),
    (lambda: kd.In["M-1", kd.f32], "dims must be identifiers"),
    (lambda: kd.Out[torch.float32], "must end with an element type"),
])
def test_operand_annotation_errors(bad, msg):
    with pytest.raises(TypeError, match=msg):
        bad()


def test_parameter_without_annotation():
    def no_ann(x: kd.In["M", kd.f32], y):
        kd.grid("M")

    with pytest.raises(ConfigError, match="kernel 'no_ann', parameter 'y'.*annotation"):
        kd.kernel(no_ann)


def test_static_dim_must_exist():
    def bad_static(x: kd.In["M", kd.f32]):
        kd.grid("M")

    with pytest.raises(ConfigError, match="static dim 'D'"):
        kd.kernel(static=("D",))(bad_static)


# ---------------------------------------------------------------------------------------------
# options and tunables

def test_unknown_option_names_kernel_and_option():
    with pytest.raises(ConfigError) as e:
        t0_axpy.specialize({"num_wraps": 4}, "gfx942")
    assert e.value.kernel == "t0_axpy" and e.value.param == "num_wraps"
    assert "unknown option 'num_wraps'" in str(e.value) and "num_warps" in str(e.value)


def test_kpack2_rejected_on_gfx950_only():
    with pytest.raises(ConfigError, match="gfx950 supports only kpack=1"):
        t0_axpy.specialize({"kpack": 2}, "gfx950")
    t0_axpy.specialize({"kpack": 2}, "gfx942")  # legal there


def test_num_warps_power_of_two():
    with pytest.raises(ConfigError, match="num_warps=3.*power of two") as e:
        t0_axpy.specialize({"num_warps": 3}, "gfx942")
    assert e.value.param == "num_warps"


def test_amd_option_on_nvidia_is_unknown():
    with pytest.raises(ConfigError, match="unknown option 'waves_per_eu' for sm90"):
        t0_axpy.specialize({"waves_per_eu": 2}, "sm90")


def test_block_outside_domain_and_defaults():
    tun = t0_axpy.tunables()
    assert set(tun) == {"BLOCK_M", "BLOCK_N"} and tun["BLOCK_M"].default == 64
    cfg = t0_axpy.default_config("gfx942")
    assert cfg["BLOCK_M"] == 64 and cfg["num_warps"] == 4 and cfg["kpack"] == 1


def test_require_names_the_rule():
    t0_require.specialize({"BLOCK_K": 64})
    with pytest.raises(ConfigError, match="BLOCK_K must be a multiple of the quant group 32") as e:
        t0_require.specialize({"BLOCK_K": 48})
    assert e.value.kernel == "t0_require" and e.value.param == "BLOCK_K"


def test_tunable_value_outside_domain():
    with pytest.raises(ConfigError, match="BLOCK_K=128 is outside its domain \\[16, 32, 48, 64\\]") as e:
        t0_require.specialize({"BLOCK_K": 128})
    assert e.value.kernel == "t0_require" and e.value.param == "BLOCK_K"
    with pytest.raises(ConfigError, match="BLOCK_M=512 is outside its domain"):
        t0_axpy.specialize({"BLOCK_M": 512})


def test_not_a_tunable():
    with pytest.raises(ConfigError, match="kernel 't0_axpy', parameter 'BLOCK_Q'.*unknown option"):
        t0_axpy.specialize({"BLOCK_Q": 16}, "gfx942")


def test_tunable_default_outside_domain():
    @kd.kernel
    def t0_baddefault(x: kd.In["M", kd.f32], out: kd.Out["M", kd.f32]):
        kd.tunable("SPLIT", (1, 2, 4), 3)
        m, = kd.grid("M")
        out[m] = x[m]

    with pytest.raises(TraceError, match="default 3 is not in the domain"):
        t0_baddefault.tunables()


def test_value_has_no_truth_value():
    with pytest.raises(TraceError, match="no truth value.*kd.where.*kd.exit_if"):
        t0_truth.source()


# ---------------------------------------------------------------------------------------------
# launch errors (raised while binding, before anything runs)

def _args(M=3, N=5):
    return torch.randn(M, N), torch.randn(M), torch.empty(M, N)


def test_launch_shape_mismatch_names_kernel_param_dims():
    x, s, out = _args()
    with pytest.raises(LaunchError) as e:
        t0_axpy(x, torch.randn(4), out)
    msg = str(e.value)
    assert "t0_axpy" in msg and "'s'" in msg and "dim M" in msg and "s.shape[0] = 4" in msg and "x.shape[0] = 3" in msg


def test_launch_wrong_dtype():
    x, s, out = _args()
    with pytest.raises(LaunchError, match="t0_axpy.*parameter 'x'.*dtype must be torch.float32, got torch.float16"):
        t0_axpy(x.half(), s, out)


def test_launch_wrong_ndim():
    x, s, out = _args()
    with pytest.raises(LaunchError, match="parameter 's'.*must have 1 dims"):
        t0_axpy(x, s[:, None], out)


def test_launch_non_cpu_tensor_on_interpreter():
    x, s, out = _args()
    with pytest.raises(LaunchError, match="interpret target runs on CPU tensors, got meta"):
        t0_axpy(x.to("meta"), s.to("meta"), out.to("meta"), target="interpret")


def test_launch_int4_dtype_and_check_rule():
    with pytest.raises(LaunchError, match="packed int4: 8 values per int32 word"):
        t0_int4(torch.zeros(4, 2, dtype=torch.int8), torch.empty(4, 16, dtype=torch.int8))
    with pytest.raises(LaunchError, match="dim K.*w.shape\\[1\\]\\*8"):
        t0_int4(torch.zeros(4, 2, dtype=torch.int32), torch.empty(4, 15, dtype=torch.int8))
    with pytest.raises(LaunchError, match="K must be a multiple of 32"):
        t0_checks(torch.randn(2, 40), torch.empty(2, 40))


def test_launch_argument_errors():
    x, s, out = _args()
    with pytest.raises(LaunchError, match="missing argument"):
        t0_axpy(x, s)
    with pytest.raises(LaunchError, match="parameter 'bogus'.*unknown argument"):
        t0_axpy(x, s, out, bogus=1)
    with pytest.raises(LaunchError, match="expected a torch.Tensor"):
        t0_axpy(x, [1.0, 2.0, 3.0], out)


# ---------------------------------------------------------------------------------------------
# promotion rules

@pytest.mark.parametrize("a,b,want", [
    (kd.bf16, kd.f16, kd.f32), (kd.bf16, kd.f32, kd.f32), (kd.f16, kd.f32, kd.f32),
    (kd.i8, kd.i32, kd.i32), (kd.i32, kd.f32, kd.f32), (kd.i8, kd.bf16, kd.bf16),
    (kd.bool_, kd.i8, kd.i8), (kd.u8, kd.i8, kd.u8), (kd.i32, kd.i64, kd.i64), (kd.f32, kd.f32, kd.f32),
])
def test_promotion(a, b, want):
    c = TraceContext("promo", get_target("interpret"), {}, {})
    with tracing(c):
        assert promote(a, b) is want
        assert promote(b, a) is want


def test_fp8_arithmetic_rejected():
    c = TraceContext("promo", get_target("interpret"), {}, {})
    with tracing(c):
        with pytest.raises(TraceError, match="cast to f32 first"):
            promote(T.fp8e4m3fn, kd.f32)


def test_language_outside_trace():
    with pytest.raises(RuntimeError, match="inside a @kdsl.kernel"):
        kd.grid("M")
