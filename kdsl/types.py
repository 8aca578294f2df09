"""Element types and operand declarations of the tile language.

Types are plain data so that the emitter, the launcher and the AOT compiler agree on one
description: the Triton spelling, the torch dtype and the bit width live together here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class DType:
    """A scalar element type. `triton` is the `tl.<name>` spelling, `sig` the signature spelling."""

    name: str
    triton: str
    sig: str
    torch_name: str
    bits: int
    is_float: bool
    is_signed: bool = True

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.torch_name)

    @property
    def is_fp8(self) -> bool:
        return self.is_float and self.bits == 8

    def __repr__(self) -> str:  # short, because it shows up in error messages
        return self.name


bool_ = DType("bool", "int1", "i1", "bool", 1, False, False)
i8 = DType("i8", "int8", "i8", "int8", 8, False)
u8 = DType("u8", "uint8", "u8", "uint8", 8, False, False)
i16 = DType("i16", "int16", "i16", "int16", 16, False)
i32 = DType("i32", "int32", "i32", "int32", 32, False)
u32 = DType("u32", "uint32", "u32", "uint32", 32, False, False)
i64 = DType("i64", "int64", "i64", "int64", 64, False)
f16 = DType("f16", "float16", "fp16", "float16", 16, True)
bf16 = DType("bf16", "bfloat16", "bf16", "bfloat16", 16, True)
f32 = DType("f32", "float32", "fp32", "float32", 32, True)
f64 = DType("f64", "float64", "fp64", "float64", 64, True)
fp8e4m3fn = DType("fp8e4m3fn", "float8e4nv", "fp8e4nv", "float8_e4m3fn", 8, True)
fp8e4m3fnuz = DType("fp8e4m3fnuz", "float8e4b8", "fp8e4b8", "float8_e4m3fnuz", 8, True)
fp8e5m2 = DType("fp8e5m2", "float8e5", "fp8e5", "float8_e5m2", 8, True)
fp8e5m2fnuz = DType("fp8e5m2fnuz", "float8e5b16", "fp8e5b16", "float8_e5m2fnuz", 8, True)

# Aliases that read like the DESIGN sketch.
int8, int32, int64, uint8, float16, bfloat16, float32 = i8, i32, i64, u8, f16, bf16, f32

FP8_MAX = {fp8e4m3fn: 448.0, fp8e4m3fnuz: 240.0, fp8e5m2: 57344.0, fp8e5m2fnuz: 57344.0}

ALL_DTYPES = {
    d.name: d
    for d in (bool_, i8, u8, i16, i32, u32, i64, f16, bf16, f32, f64,
              fp8e4m3fn, fp8e4m3fnuz, fp8e5m2, fp8e5m2fnuz)
}
_BY_TORCH = {d.torch: d for d in ALL_DTYPES.values()}


def from_torch(dt: torch.dtype) -> DType:
    try:
        return _BY_TORCH[dt]
    except KeyError:
        raise TypeError(f"torch dtype {dt} has no kdsl equivalent") from None


@dataclass(frozen=True)
class Fp8:
    """The arch's native e4m3 flavour: e4m3fnuz on gfx942, OCP e4m3fn elsewhere."""

    def __repr__(self) -> str:
        return "fp8"


fp8 = Fp8()

INT4_PACKINGS = {
    # name: (nibble order inside an int32 word, signed two's complement?)
    "quark_order": ((0, 1, 2, 3, 4, 5, 6, 7), True),
    "quark_reorder": ((0, 2, 4, 6, 1, 3, 5, 7), True),
    "ct": ((0, 1, 2, 3, 4, 5, 6, 7), False),  # compressed-tensors: offset binary, q + 8
    # compressed-tensors values in Quark's reorder nibble order: elements 2i and 2i+1 sit in nibbles
    # i and i+4, 16 bits apart, so one shift and mask yields both as bf16 mantissas (kd.group_dot)
    "ct_reorder": ((0, 2, 4, 6, 1, 3, 5, 7), False),
}


@dataclass(frozen=True)
class Int4:
    """Packed signed int4 along the last dim: eight values per int32 word.

    `order[i]` is the element (within the group of eight) that nibble i holds; `twos` says
    whether a nibble is two's complement (Quark) or offset binary q+8 (compressed-tensors).
    """

    pack: str

    def __post_init__(self) -> None:
        if self.pack not in INT4_PACKINGS:
            raise ValueError(f"unknown int4 packing {self.pack!r}; known: {sorted(INT4_PACKINGS)}")

    @property
    def order(self) -> tuple[int, ...]:
        return INT4_PACKINGS[self.pack][0]

    @property
    def twos(self) -> bool:
        return INT4_PACKINGS[self.pack][1]

    storage = i32
    per_word = 8

    def __repr__(self) -> str:
        return f"int4({self.pack})"


def int4(pack: str = "quark_order") -> Int4:
    return Int4(pack)


ElemType = DType | Fp8 | Int4


@dataclass(frozen=True)
class Operand:
    """A tensor parameter: symbolic dims (names shared between operands) and element type."""

    dims: tuple[str, ...]
    dtype: ElemType
    kind: str  # "in", "out", "inout"

    def __repr__(self) -> str:
        return f"{self.kind.capitalize()}[{', '.join(self.dims)}, {self.dtype!r}]"


class _OperandFactory:
    kind = "in"

    def __class_getitem__(cls, item: Any) -> Operand:
        if not isinstance(item, tuple):
            item = (item,)
        *dims, dtype = item
        if not isinstance(dtype, (DType, Fp8, Int4)):
            raise TypeError(f"{cls.__name__}[...] must end with an element type, got {dtype!r}")
        for d in dims:
            if not (isinstance(d, str) and d.isidentifier()):
                raise TypeError(f"{cls.__name__}[...] dims must be identifiers, got {d!r}")
        return Operand(tuple(dims), dtype, cls.kind)


class In(_OperandFactory):
    kind = "in"


class Out(_OperandFactory):
    kind = "out"


class InOut(_OperandFactory):
    kind = "inout"


@dataclass(frozen=True)
class ScalarParam:
    """A scalar argument (not a dim): a float such as a softmax scale or an epsilon."""

    dtype: DType

    def __repr__(self) -> str:
        return f"Scalar[{self.dtype!r}]"


class Scalar:
    def __class_getitem__(cls, dtype: DType) -> ScalarParam:
        return ScalarParam(dtype)


@dataclass(frozen=True)
class DimParam:
    """An integer argument that is a dim of its own (split count, page size, top-k...)."""

    def __repr__(self) -> str:
        return "Dim"


Dim = DimParam()


@dataclass
class Signature:
    """The parsed parameter list of a kernel function."""

    operands: dict[str, Operand] = field(default_factory=dict)
    scalars: dict[str, ScalarParam] = field(default_factory=dict)
    dim_params: list[str] = field(default_factory=list)
    order: list[str] = field(default_factory=list)

    def all_dims(self) -> list[str]:
        seen: list[str] = []
        for op in self.operands.values():
            for d in op.dims:
                if d not in seen:
                    seen.append(d)
        for d in self.dim_params:
            if d not in seen:
                seen.append(d)
        return seen


# ----------------------------------------------------------------------------------------------
# OCP microscaling (MX) types: FP4 E2M1 values packed two per byte, E8M0 scales per 32 values

# FP4 E2M1 (sign, 2 exponent bits, 1 mantissa bit; codes 0..15 = +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}),
# stored two per uint8 along the operand's LAST dim, element 2i in the low nibble (OCP MX v1.0 and
# Triton's dot_scaled agree on this order). An operand declared `In["N", "K", kd.fp4_e2m1]` names
# the logical K; its tensor is uint8 [N, K/2]. Tiles of it feed `kd.dot_scaled` only (no arithmetic).
fp4_e2m1 = DType("fp4e2m1", "uint8", "u8", "uint8", 4, True)
# E8M0 scale: one byte, value 2^(e-127); 0xFF is NaN (no sign, no mantissa, no zero).
e8m0 = DType("e8m0", "uint8", "u8", "uint8", 8, False, False)

MX_GROUP = 32  # values per E8M0 scale (OCP MX block size)
FP4_PER_BYTE = 2


def is_fp4(dt: Any) -> bool:
    """True for the packed FP4 element type (a tile of it is bytes holding two values each)."""
    return dt is fp4_e2m1
