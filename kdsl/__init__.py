"""kdsl: a tile language that lowers to Triton for gfx942, gfx950, sm90 and the CPU interpreter.

    import kdsl as kd

    @kd.kernel
    def scale_rows(x: kd.In["M", "N", kd.f32], s: kd.In["M", kd.f32], out: kd.Out["M", "N", kd.f32]):
        m, n = kd.grid("M", "N")
        out[m, n] = x[m, n] * s[m]          # broadcasting follows axis identity, not position
"""
from .types import (  # noqa: F401
    DType, Int4, In, Out, InOut, Scalar, Dim, int4, fp8, FP8_MAX,
    bool_, i8, u8, i16, i32, u32, i64, f16, bf16, f32, f64, int8, int32, int64, uint8, float16, bfloat16, float32,
    fp8e4m3fn, fp8e4m3fnuz, fp8e5m2, fp8e5m2fnuz,
)
from .lang import (  # noqa: F401
    abs, arange, atomic_add, atomic_ticket, barrier, bitcast, broadcast, cast, cdiv, compile_option, cos, dequant, dim,
    dot, each, exit_if, exp, exp2, fold, full, full_range, grid, group_dot, load, log, log2, max, maximum, min, minimum,
    nest, pad, require, rsqrt, sigmoid,
    silu, sin, span, sqrt, static, store, sum, tile, tiles, tunable, where, zeros,
)
from .types import fp4_e2m1, e8m0, MX_GROUP  # noqa: F401  (OCP MX)
from .lang import dot_scaled, mx_decode, mx_groups  # noqa: F401  (OCP MX)
from .lang import (  # noqa: F401
    argmax, argmin, cumsum, erf, fma, grouped, indices, iota, pow, rint, sort, tanh, topk, triton_call,
)
from .errors import KdslError, ConfigError, LaunchError, TraceError, CompileError  # noqa: F401
from .kernel import Kernel, Specialization, kernel, REGISTRY  # noqa: F401
from .record import LaunchRecord, recording  # noqa: F401
from .targets import Target, TARGETS, AOT_TARGETS, get_target, current_target  # noqa: F401

__version__ = "0.1.0"
