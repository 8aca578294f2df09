"""Per-token dynamic activation quantization (the A side of W8A8, W4A8 and FP8 GEMMs).

Each row (token) gets its own scale = absmax(row) / qmax, and q = round_to_nearest_even(x / scale),
clamped to the representable range. int8 uses qmax = 127; fp8 uses the arch's native e4m3 flavour
(`kd.fp8`: e4m3fnuz, max 240, on gfx942; e4m3fn, max 448, elsewhere).

Rounding: a Triton float -> int cast truncates toward zero, so the int8 kernel rounds explicitly with
the f32 magic-number trick ((y + 1.5*2^23) - 1.5*2^23 is y rounded to nearest even for |y| < 2^22),
which matches `torch.round`. The float -> fp8 cast rounds to nearest even on every backend.
"""
from __future__ import annotations

import torch

import kdsl as kd
from kdsl.ir import ctx

from autotune import lookup_config

ROUND_MAGIC = 12582912.0  # 1.5 * 2**23
MIN_ABSMAX = 1e-10  # an all-zero row gets a tiny scale (its q is 0 anyway), never a division by zero
FLT_MAX = 3.4028234663852886e38
ROW_BLOCKS = (1, 2, 4, 8, 16)
K_BLOCKS = (64, 128, 256, 512, 1024)


def _round_rne(y):
    """Round an f32 tile to the nearest integer, ties to even (exact for |y| < 2^22)."""
    return (y + ROUND_MAGIC) - ROUND_MAGIC


def _int8_code(y):
    """The int8 of `_round_rne(y)` for y in [-127, 127] (clamped first), in fewer VALU: y + 1.5*2^23
    is 1.5*2^23 + rne(y) exactly (ulp 1 there), whose f32 bits are 0x4B400000 + rne(y), so the low
    byte is rne(y) as int8 (one add, no subtract and no float->int conversion). A NaN y gives 0, as
    the float->int conversion of NaN does."""
    return kd.bitcast(y + ROUND_MAGIC, kd.i32).to(kd.i8)


def _row_absmax(x, m):
    """max |x[m, :]| over K. Each lane keeps its own running max over the K tiles and the row is
    reduced across lanes once at the end (max is exact in any order): a reduction per tile would
    pay the cross-lane shuffles and a workgroup barrier every trip."""
    bk = kd.tile("K", "BLOCK_K", domain=K_BLOCKS, default=512).block_size()
    col = kd.arange(bk, "k")

    def body(k0, amax):
        k = col + k0
        return kd.maximum(amax, kd.abs(kd.load(x, m, k, mask=k < kd.dim("K")).to(kd.f32)))

    lanes = kd.fold(kd.indices(kd.dim("K"), step=bk, label="k"), kd.zeros((m, col), kd.f32), body)
    return kd.max(lanes, axis=col)


def _row_divider(s):
    """(divisor, its reciprocal RN(1/s)) for `_div_rn`, once per row. An infinite scale (an inf in
    the row) divides as FLT_MAX: a finite x / inf is 0 either way, and inf * 0 would make it NaN."""
    d = kd.minimum(s, FLT_MAX)
    return d, 1.0 / d


def _div_rn(a, d, r):
    """a / d correctly rounded (the bits of the IEEE division) from r = RN(1/d) by multiply-add steps:
    q0 = a*r is within 1.5 ulp, one residual step (exact remainder fma(-q, d, a)) makes it faithful
    and a second one correctly rounded (Markstein's theorem: r within 1/2 ulp of 1/d, q within
    1 ulp). 5 VALU per element instead of the ~11 of a full division (its operand scaling and
    reciprocal refinement depend on d only). Holds while the remainder does not underflow: |a/d| >= 0.5
    needs |a| >= 0.5 * MIN_ABSMAX / qmax, far above f32's normal range, and a smaller quotient rounds
    to 0 (int8) or keeps its fp8 code either way."""
    q = a * r
    q = kd.fma(kd.fma(-q, d, a), r, q)
    return kd.fma(kd.fma(-q, d, a), r, q)


def _div_int8(a, d, r):
    """a / d for an int8 code, one residual step fewer than `_div_rn` (3 VALU per element instead of 5):
    q0 = a*r plus one correction is faithful (within 1 ulp), and for a bf16 `a` and d = RN(absmax/127)
    of a bf16 row absmax (or the MIN_ABSMAX / FLT_MAX divisors) its clamped round-to-nearest-even
    integer equals that of `_div_rn`'s quotient for every input: checked exhaustively by
    tests/test_quant_div.py (all bf16 values against every absmax mantissa; the quotient is exact
    under power-of-two scaling of both). The int8 codes, not the f32 quotients, are what match."""
    q = a * r
    return kd.fma(kd.fma(-q, d, a), r, q)


@kd.kernel(example={"M": 1, "K": 7168})
def quant_per_token_int8(x: kd.In["M", "K", kd.bf16], q: kd.Out["M", "K", kd.i8], scale: kd.Out["M", kd.f32]):
    """Per-token symmetric int8: scale = absmax/127, q = clamp(rne(x/scale), -127, 127)."""
    (m,) = kd.grid(kd.tile("M", "BLOCK_M", domain=ROW_BLOCKS, default=1))
    s = kd.maximum(_row_absmax(x, m), MIN_ABSMAX) / 127.0
    scale[m] = s
    d, r = _row_divider(s)

    def body(k, dummy):
        y = kd.minimum(kd.maximum(_div_rn(x[m, k].to(kd.f32), d, r), -127.0), 127.0)
        q[m, k] = _round_rne(y).to(kd.i32).to(kd.i8)
        return dummy

    kd.fold(kd.tiles("K", block="BLOCK_K", domain=K_BLOCKS, default=512), kd.zeros((m,), kd.i32), body)


@kd.kernel(example={"M": 1, "K": 7168})
def quant_per_token_fp8(x: kd.In["M", "K", kd.bf16], q: kd.Out["M", "K", kd.fp8], scale: kd.Out["M", kd.f32]):
    """Per-token fp8 in the arch-native e4m3 flavour: scale = absmax/fp8max, q = fp8(x/scale)."""
    fmax = kd.FP8_MAX[ctx().target.fp8]
    (m,) = kd.grid(kd.tile("M", "BLOCK_M", domain=ROW_BLOCKS, default=1))
    s = kd.maximum(_row_absmax(x, m), MIN_ABSMAX) / fmax
    scale[m] = s
    d, r = _row_divider(s)

    def body(k, dummy):
        y = kd.minimum(kd.maximum(_div_rn(x[m, k].to(kd.f32), d, r), -fmax), fmax)
        q[m, k] = y.to(kd.fp8)
        return dummy

    kd.fold(kd.tiles("K", block="BLOCK_K", domain=K_BLOCKS, default=512), kd.zeros((m,), kd.i32), body)


# ----------------------------------------------------------------------------------------------
# torch references and torch-facing functions

def fp8_dtype(arch: str | None = None) -> torch.dtype:
    """The torch dtype of the native e4m3 flavour of `arch` (current target when None)."""
    t = kd.get_target(arch or "current")
    return {kd.fp8e4m3fn: torch.float8_e4m3fn, kd.fp8e4m3fnuz: torch.float8_e4m3fnuz}[t.fp8]


def quant_per_token_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `quant_per_token_int8` (same f32 math, round half to even)."""
    xf = x.float()
    s = xf.abs().amax(dim=-1).clamp_min(MIN_ABSMAX) / 127.0
    q = torch.round((xf / s[:, None]).clamp(-127.0, 127.0)).to(torch.int8)
    return q, s


def quant_per_token_fp8_ref(x: torch.Tensor, fp8: torch.dtype = torch.float8_e4m3fn
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `quant_per_token_fp8` for the fp8 flavour `fp8`."""
    fmax = float(torch.finfo(fp8).max)
    xf = x.float()
    s = xf.abs().amax(dim=-1).clamp_min(MIN_ABSMAX) / fmax
    q = (xf / s[:, None]).clamp(-fmax, fmax).to(fp8)
    return q, s


def _check_x(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name}: x must be bfloat16, got {x.dtype}")
    if x.shape[1] < 1:
        raise ValueError(f"{name}: x must have K >= 1 columns, got shape {tuple(x.shape)}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name}: x must be contiguous along K (stride {x.stride(1)})")


def quantize_int8(x: torch.Tensor, backend: str = "triton", config: dict | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 quantization of bf16 x [M, K] -> (q int8 [M, K], scale f32 [M])."""
    _check_x("quantize_int8", x)
    if backend == "torch":
        return quant_per_token_int8_ref(x)
    if backend != "triton":
        raise ValueError(f"quantize_int8: backend must be 'triton' or 'torch', got {backend!r}")
    M, K = x.shape
    if config is None:
        config = lookup_config(quant_per_token_int8, kd.current_target().name, {"K": K}, max(M, 1))
    q = torch.empty(M, K, dtype=torch.int8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        quant_per_token_int8(x, q, s, config=config)
    return q, s


def quantize_fp8(x: torch.Tensor, backend: str = "triton", config: dict | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 (native flavour of the current target) of bf16 x [M, K] -> (q, scale f32 [M])."""
    _check_x("quantize_fp8", x)
    fp8 = fp8_dtype()
    if backend == "torch":
        return quant_per_token_fp8_ref(x, fp8)
    if backend != "triton":
        raise ValueError(f"quantize_fp8: backend must be 'triton' or 'torch', got {backend!r}")
    M, K = x.shape
    if config is None:
        config = lookup_config(quant_per_token_fp8, kd.current_target().name, {"K": K}, max(M, 1))
    q = torch.empty(M, K, dtype=fp8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        quant_per_token_fp8(x, q, s, config=config)
    return q, s


def fp8_weight_to_native(w: torch.Tensor, w_scale: torch.Tensor, arch: str | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert an e4m3fn checkpoint weight (and its scale) to the native flavour of `arch`.

    gfx942 computes in e4m3fnuz: the same bits are worth half as much there (bias 8 vs 7), so the
    bits are reinterpreted, -0 (0x80, NaN in fnuz) becomes 0, and the scale is doubled (REFERENCE §3)."""
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_weight_to_native: expected a float8_e4m3fn weight, got {w.dtype}")
    target = fp8_dtype(arch)
    if target == torch.float8_e4m3fn:
        return w, w_scale
    bits = w.view(torch.int8).clone()
    bits[bits == -128] = 0
    return bits.view(torch.float8_e4m3fnuz), w_scale * 2.0
