"""Per-token activation quantization kernels (interpreter) against their torch references.

Tolerances: int8 q and scales are exact (same f32 math, round-half-to-even); fp8 q is bit-exact
against torch's cast (kdsl legalizes the interpreter's float->fp8 cast to round to nearest even)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import kdsl as kd
from ops.quant import (quant_per_token_fp8, quant_per_token_fp8_ref, quant_per_token_int8, quant_per_token_int8_ref,
                       quantize_fp8, quantize_int8)
from tests.conftest import poisoned


def _x(m, k, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * scale * torch.rand(m, 1, generator=g)).to(torch.bfloat16)
    return x


@kd.kernel(name="cast_to_fp8e4m3fn")
def _cast_fn(x: kd.In["N", kd.f32], y: kd.Out["N", kd.fp8e4m3fn]):
    (n,) = kd.grid(kd.tile("N", "BLOCK_N", domain=(1024,), default=1024))
    y[n] = x[n].to(kd.fp8e4m3fn)


@kd.kernel(name="cast_to_fp8e4m3fnuz")
def _cast_fnuz(x: kd.In["N", kd.f32], y: kd.Out["N", kd.fp8e4m3fnuz]):
    (n,) = kd.grid(kd.tile("N", "BLOCK_N", domain=(1024,), default=1024))
    y[n] = x[n].to(kd.fp8e4m3fnuz)


CAST_KERNELS = {"fp8e4m3fn": _cast_fn, "fp8e4m3fnuz": _cast_fnuz}


@given(m=st.sampled_from([1, 3, 4, 17]), k=st.integers(1, 300), bm=st.sampled_from([1, 2, 16]),
       seed=st.integers(0, 1000))
def test_int8_exact(m, k, bm, seed):
    x = _x(m, k, seed)
    q, s = poisoned((m, k), torch.int8), poisoned((m,), torch.float32)
    quant_per_token_int8(x, q, s, config={"BLOCK_M": bm, "BLOCK_K": 64})
    qr, sr = quant_per_token_int8_ref(x)
    assert torch.equal(s, sr)
    assert torch.equal(q, qr)


def test_division_exact_near_ties():
    """The kernels divide by multiply-add steps from the row's reciprocal (ops.quant._div_rn): int8
    and fp8 (e4m3fn) over every bf16 value of [-absmax, absmax] in rows of unrelated absmax (x /
    scale lands within an ulp of a rounding boundary for some: a plain x * (1 / scale) gets 8 int8
    codes wrong here), and the inf row (finite x / inf is 0), against torch's IEEE division."""
    g = torch.Generator().manual_seed(7)
    mags = torch.arange(0x3C00, 0x4700, dtype=torch.int16).view(torch.bfloat16).float()  # 2^-7 .. 2^15
    rows = []
    for a in (torch.rand(24, generator=g) * 900 + 1).tolist() + [127.0, 3.0, 0.75]:
        v = mags[mags <= a]
        rows.append(torch.cat([v, -v, torch.tensor([a])]).to(torch.bfloat16))
    k = max(len(r) for r in rows)
    x = torch.stack([torch.nn.functional.pad(r.float(), (0, k - len(r))).to(torch.bfloat16) for r in rows])
    q, s = poisoned(tuple(x.shape), torch.int8), poisoned((x.shape[0],), torch.float32)
    quant_per_token_int8(x, q, s, config={"BLOCK_M": 4, "BLOCK_K": 512})
    qr, sr = quant_per_token_int8_ref(x)
    assert torch.equal(s, sr) and torch.equal(q, qr)
    q8, s8 = poisoned(tuple(x.shape), torch.float8_e4m3fn), poisoned((x.shape[0],), torch.float32)
    quant_per_token_fp8(x, q8, s8, config={"BLOCK_M": 4, "BLOCK_K": 512})
    qr8, sr8 = quant_per_token_fp8_ref(x, torch.float8_e4m3fn)
    assert torch.equal(s8, sr8) and torch.equal(q8.view(torch.uint8), qr8.view(torch.uint8))
    xi = torch.tensor([[float("inf"), 1.0, -2.0, 0.0]], dtype=torch.bfloat16)
    qi, si = poisoned((1, 4), torch.int8), poisoned((1,), torch.float32)
    quant_per_token_int8(xi, qi, si)
    assert si.item() == float("inf") and qi[0, 1:].tolist() == [0, 0, 0]


def test_int8_rounds_to_nearest_not_truncates():
    # row absmax 127 -> scale 1: x/scale = x exactly; 2.5 -> 2 (even), 1.5 -> 2, -0.75 -> -1, 0.5 -> 0
    x = torch.tensor([[127.0, 2.5, 1.5, -0.75, 0.5, -126.5, 3.25, 0.0]], dtype=torch.bfloat16)
    q, s = poisoned((1, 8), torch.int8), poisoned((1,), torch.float32)
    quant_per_token_int8(x, q, s)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 2, 2, -1, 0, -126, 3, 0]]
    zero = torch.zeros(2, 16, dtype=torch.bfloat16)
    q0, s0 = quantize_int8(zero)
    assert torch.equal(q0, torch.zeros(2, 16, dtype=torch.int8)) and bool((s0 > 0).all())


@given(m=st.sampled_from([1, 4, 5]), k=st.integers(1, 260), seed=st.integers(0, 1000))
def test_fp8_bit_exact(m, k, seed):
    x = _x(m, k, seed)
    q, s = poisoned((m, k), torch.float8_e4m3fn), poisoned((m,), torch.float32)
    quant_per_token_fp8(x, q, s, config={"BLOCK_K": 64})
    qr, sr = quant_per_token_fp8_ref(x, torch.float8_e4m3fn)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.parametrize("fp8", [kd.fp8e4m3fn, kd.fp8e4m3fnuz])
def test_kdsl_fp8_cast_rne_in_interpreter(fp8):
    """kdsl extension: the interpreter's float->fp8 cast is legalized to round to nearest even
    (the raw interpreter gives 124.3 -> 64 and rounds ties away). Checked on all finite values,
    the midpoints between them (ties) and random values, against torch."""
    tdt = fp8.torch
    cast_k = CAST_KERNELS[fp8.name]
    fin = torch.arange(256, dtype=torch.uint8).view(tdt).float()
    fin = fin[torch.isfinite(fin)].sort().values.unique()
    mids = (fin[1:] + fin[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    rnd = torch.randn(400, generator=g) * torch.exp2(torch.randint(-12, 8, (400,), generator=g).float())
    x = torch.cat([fin, mids, rnd]).clamp(-float(torch.finfo(tdt).max), float(torch.finfo(tdt).max))
    y = poisoned((x.numel(),), torch.float32).to(tdt)
    cast_k(x, y)
    assert torch.equal(y.view(torch.uint8), x.to(tdt).view(torch.uint8))


def test_torch_facing_and_errors():
    x = _x(3, 40, 1)
    for backend in ("triton", "torch"):
        q, s = quantize_int8(x, backend=backend)
        assert q.dtype == torch.int8 and s.shape == (3,)
        qf, sf = quantize_fp8(x, backend=backend)
        assert qf.dtype == torch.float8_e4m3fn  # interpreter target: OCP e4m3fn
    with pytest.raises(TypeError, match="bfloat16"):
        quantize_int8(x.float())
    with pytest.raises(ValueError, match="backend"):
        quantize_int8(x, backend="cuda")
    with pytest.raises(kd.KdslError, match="q"):
        quant_per_token_int8(x, torch.empty(3, 41, dtype=torch.int8), torch.empty(3))


def test_fp8_weight_to_native_gfx942():
    from ops.quant import fp8_weight_to_native

    g = torch.Generator().manual_seed(2)
    w = (torch.randn(8, 16, generator=g) * 100).to(torch.float8_e4m3fn)
    w[0, 0] = -0.0
    s = torch.rand(8, generator=g)
    wn, sn = fp8_weight_to_native(w, s, "gfx942")
    assert wn.dtype == torch.float8_e4m3fnuz and not torch.isnan(wn.float()).any()
    assert torch.equal(wn.float() * sn[:, None], w.float() * s[:, None])
    same, s2 = fp8_weight_to_native(w, s, "gfx950")
    assert same is w and s2 is s
