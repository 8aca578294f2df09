"""Targets as data: what the compiler, the report and the cost model need to know of a chip.

Figures come from vendor data sheets (REFERENCE §5). `interpret` is a target too: Triton's CPU
interpreter, which needs its own legalization (bf16 dots and bf16 rounding are wrong there).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from . import types as T


@dataclass(frozen=True)
class OptionSpec:
    """A launch option: its domain for tuning and its default."""

    name: str
    domain: tuple[Any, ...]
    default: Any


@dataclass(frozen=True)
class Target:
    name: str
    backend: str  # "hip" | "cuda" | "interpret"
    arch: Any  # GPUTarget arch: "gfx942" or 90
    warp_size: int
    fp8: T.DType  # native e4m3 flavour
    lds_bytes: int  # per workgroup limit
    lds_granule: int
    cu_count: int
    clock_ghz: float
    simd_per_cu: int  # schedulers per CU/SM; each issues one wave instruction per `valu_cycles`
    valu_cycles: int  # cycles one wave-wide VALU instruction occupies a SIMD
    vgprs_per_simd_lane: int  # register file per lane (VGPR + AGPR on CDNA)
    max_waves_per_simd: int
    hbm_gbps: float
    peak_tflops: dict[str, float]  # by operand type: bf16, fp8, i8
    options: tuple[OptionSpec, ...] = field(default_factory=tuple)
    matrix_prefix: tuple[str, ...] = ()  # mnemonics that count as matrix instructions
    device_names: tuple[str, ...] = ()

    @property
    def is_amd(self) -> bool:
        return self.backend == "hip"

    def option(self, name: str) -> OptionSpec | None:
        for o in self.options:
            if o.name == name:
                return o
        return None

    def option_names(self) -> list[str]:
        return [o.name for o in self.options]

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        if self.backend == "interpret":
            raise ValueError("the interpret target has no GPU binary to compile")
        return GPUTarget(self.backend, self.arch, self.warp_size)

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "backend": self.backend, "cu_count": self.cu_count,
                "lds_bytes": self.lds_bytes, "hbm_gbps": self.hbm_gbps}


_COMMON = (
    OptionSpec("num_warps", (1, 2, 4, 8, 16), 4),
    OptionSpec("num_stages", (1, 2, 3, 4), 2),
)
_HIP = _COMMON + (
    OptionSpec("waves_per_eu", (0, 1, 2, 3, 4), 0),
    OptionSpec("matrix_instr_nonkdim", (0, 16, 32), 0),
    OptionSpec("kpack", (1, 2), 1),
)
_HIP_950 = _COMMON + (
    OptionSpec("waves_per_eu", (0, 1, 2, 3, 4), 0),
    OptionSpec("matrix_instr_nonkdim", (0, 16, 32), 0),
    OptionSpec("kpack", (1,), 1),  # gfx950 forces kpack to 1; anything else is a config error
)
_CUDA = (OptionSpec("num_warps", (1, 2, 4, 8, 16), 4), OptionSpec("num_stages", (1, 2, 3, 4, 5), 3))

GFX942 = Target(
    name="gfx942", backend="hip", arch="gfx942", warp_size=64, fp8=T.fp8e4m3fnuz,
    lds_bytes=65536, lds_granule=512, cu_count=304, clock_ghz=2.1, simd_per_cu=4, valu_cycles=4,
    vgprs_per_simd_lane=512, max_waves_per_simd=8, hbm_gbps=5300.0,
    peak_tflops={"bf16": 1307.0, "f16": 1307.0, "fp8": 2615.0, "i8": 2615.0, "f32": 163.4},
    options=_HIP, matrix_prefix=("v_mfma", "v_smfmac"), device_names=("AMD Instinct MI300X", "AMD Instinct MI325X"),
)
GFX950 = Target(
    name="gfx950", backend="hip", arch="gfx950", warp_size=64, fp8=T.fp8e4m3fn,
    lds_bytes=163840, lds_granule=1280, cu_count=256, clock_ghz=2.4, simd_per_cu=4, valu_cycles=4,
    vgprs_per_simd_lane=512, max_waves_per_simd=8, hbm_gbps=8000.0,
    peak_tflops={"bf16": 2500.0, "f16": 2500.0, "fp8": 5000.0, "i8": 5000.0, "f32": 157.3},
    options=_HIP_950, matrix_prefix=("v_mfma", "v_smfmac"), device_names=("AMD Instinct MI350X", "AMD Instinct MI355X"),
)
SM90 = Target(
    name="sm90", backend="cuda", arch=90, warp_size=32, fp8=T.fp8e4m3fn,
    lds_bytes=232448, lds_granule=128, cu_count=132, clock_ghz=1.98, simd_per_cu=4, valu_cycles=1,
    vgprs_per_simd_lane=255, max_waves_per_simd=16, hbm_gbps=3350.0,
    peak_tflops={"bf16": 989.0, "f16": 989.0, "fp8": 1979.0, "i8": 1979.0, "f32": 67.0},
    options=_CUDA, matrix_prefix=("wgmma", "mma."), device_names=("NVIDIA H100", "NVIDIA H200"),
)
INTERPRET = Target(
    name="interpret", backend="interpret", arch="cpu", warp_size=1, fp8=T.fp8e4m3fn,
    lds_bytes=1 << 30, lds_granule=1, cu_count=1, clock_ghz=1.0, simd_per_cu=1, valu_cycles=1,
    vgprs_per_simd_lane=1 << 20, max_waves_per_simd=1, hbm_gbps=10.0,
    peak_tflops={"bf16": 0.01, "f16": 0.01, "fp8": 0.01, "i8": 0.01, "f32": 0.01},
    # the interpreter runs configs meant for any GPU, so it accepts every GPU option name
    options=_HIP,
)

TARGETS: dict[str, Target] = {t.name: t for t in (GFX942, GFX950, SM90, INTERPRET)}
AOT_TARGETS = ("gfx942", "gfx950", "sm90")


def get_target(name: str | Target) -> Target:
    if isinstance(name, Target):
        return name
    if name == "current":
        return current_target()
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown arch {name!r}; known: {', '.join(TARGETS)} or 'current'") from None


def current_target() -> Target:
    """The target that a launch on this machine uses: the GPU if torch sees one, else the interpreter
    (inside `kdsl.record.recording(t)`: t)."""
    import torch

    from .record import active

    rec = active()
    if rec is not None:
        return rec.target

    if not torch.cuda.is_available():
        return INTERPRET
    props = torch.cuda.get_device_properties(0)
    if getattr(torch.version, "hip", None):
        arch = props.gcnArchName.split(":")[0]
        if arch in TARGETS:
            return TARGETS[arch]
        return dataclasses.replace(GFX942, name=arch, arch=arch, cu_count=props.multi_processor_count)
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) == (9, 0):
        return dataclasses.replace(SM90, cu_count=props.multi_processor_count)
    return dataclasses.replace(SM90, name=f"sm{major}{minor}", arch=major * 10 + minor,
                               cu_count=props.multi_processor_count)


def resolve_dtype(dt: T.ElemType, target: Target) -> T.DType:
    """Resolve the abstract `fp8` to the arch flavour; int4 resolves to its int32 storage."""
    if isinstance(dt, T.Fp8):
        return target.fp8
    if isinstance(dt, T.Int4):
        return dt.storage
    return dt


def native_fp8(target: Target) -> tuple[T.DType, ...]:
    if target.backend == "interpret":
        return (T.fp8e4m3fn, T.fp8e4m3fnuz, T.fp8e5m2, T.fp8e5m2fnuz)
    if target.name.startswith("gfx94"):
        return (T.fp8e4m3fnuz, T.fp8e5m2fnuz)
    return (T.fp8e4m3fn, T.fp8e5m2)


def bf16_convert(target: Target) -> bool:
    """Whether the target converts f32 to bf16 (nearest even) in one instruction: gfx950
    (v_cvt_pk_bf16_f32) and NVIDIA do; gfx94x emulates it with integer ops and a NaN check."""
    return not (target.backend == "hip" and str(target.name).startswith("gfx94"))
