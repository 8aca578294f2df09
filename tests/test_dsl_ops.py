"""Index reductions, scans, top-k, sort and the added math on the interpreter against torch at ragged
(non power of two, masked) sizes, and compiled for gfx942, gfx950 and sm90 with no spills.

Tolerances: argmax/argmin, top-k ids and values, sort and rint exact; cumsum 1e-5 relative (the
scan's association differs from torch's); tanh/erf/pow 2e-6 relative + 1e-6 absolute (libm vs numpy)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import kdsl as kd
from tests.conftest import poisoned


@kd.kernel(static=("N",), example={"M": 64, "N": 100})
def d_arg(x: kd.In["M", "N", kd.f32], amax: kd.Out["M", kd.i32], amin: kd.Out["M", kd.i32],
          cs: kd.Out["M", "N", kd.f32], srt: kd.Out["M", "N", kd.f32], sd: kd.Out["M", "N", kd.f32],
          si: kd.Out["M", "N", kd.i32]):
    m, = kd.grid(kd.tile("M", domain=(1, 2, 4, 8), default=4))
    n = kd.full_range("N")
    v = x[m, n]
    amax[m] = kd.argmax(v, axis=n)
    amin[m] = kd.argmin(v, axis=n)
    cs[m, n] = kd.cumsum(v, axis=n)
    srt[m, n] = kd.sort(v, axis=n)
    vals, idx = kd.sort(v, axis=n, descending=True, return_indices=True)
    sd[m, n] = vals
    si[m, n] = idx


@kd.kernel(static=("N", "K"), example={"M": 64, "N": 100, "K": 6})
def d_topk(x: kd.In["M", "N", kd.bf16], tv: kd.Out["M", "K", kd.bf16], ti: kd.Out["M", "K", kd.i32],
           bv: kd.Out["M", "K", kd.bf16], bi: kd.Out["M", "K", kd.i32]):
    m, = kd.grid(kd.tile("M", domain=(1, 2, 4, 8), default=4))
    n, kk = kd.full_range("N"), kd.full_range("K")
    v = x[m, n]
    tv[m, kk], ti[m, kk] = kd.topk(v, kd.static("K"), axis=n, into=kk)
    bv[m, kk], bi[m, kk] = kd.topk(v, kd.static("K"), axis=n, into=kk, largest=False)


@kd.kernel(static=("N",), example={"M": 64, "N": 100})
def d_int(x: kd.In["M", "N", kd.i16], amax: kd.Out["M", kd.i32], cs: kd.Out["M", "N", kd.i32]):
    m, = kd.grid(kd.tile("M", domain=(1, 2, 4, 8), default=4))
    n = kd.full_range("N")
    amax[m] = kd.argmax(x[m, n], axis=n)
    cs[m, n] = kd.cumsum(x[m, n], axis=n)


@kd.kernel(example={"M": 64, "N": 100})
def d_math(x: kd.In["M", "N", kd.f32], e: kd.In["N", kd.f32], out: kd.Out["M", "N", kd.f32],
           r: kd.Out["M", "N", kd.f32], p: kd.Out["M", "N", kd.f32]):
    m, n = kd.grid(kd.tile("M", domain=(16, 32), default=16), kd.tile("N", domain=(16, 32), default=16))
    v = x[m, n]
    out[m, n] = kd.tanh(v) + kd.erf(v * 0.5)
    r[m, n] = kd.rint(v * 4.0)
    p[m, n] = v ** 3 + kd.abs(v) ** e[n] + 2.0 ** v + v ** -2


def _ties(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Copy some values inside each row so that ties occur at known places."""
    M, N = x.shape
    for i in range(M):
        a, b = torch.randint(0, N, (2,), generator=g).tolist()
        x[i, b] = x[i, a]
    return x


@given(M=st.integers(1, 11), N=st.integers(2, 37), seed=st.integers(0, 2**16))
def test_arg_cumsum_sort(M, N, seed):
    g = torch.Generator().manual_seed(seed)
    x = _ties(torch.randn(M, N, generator=g), g)
    outs = [poisoned((M,), torch.int32), poisoned((M,), torch.int32), poisoned((M, N), torch.float32),
            poisoned((M, N), torch.float32), poisoned((M, N), torch.float32), poisoned((M, N), torch.int32)]
    d_arg(x, *outs)
    amax, amin, cs, srt, sd, si = outs
    assert torch.equal(amax.long(), x.argmax(1)) and torch.equal(amin.long(), x.argmin(1))  # torch: first index
    torch.testing.assert_close(cs, x.cumsum(1), rtol=1e-5, atol=1e-5)
    assert torch.equal(srt, x.sort(1).values)
    ref = torch.sort(x, dim=1, descending=True, stable=True)
    assert torch.equal(sd, ref.values) and torch.equal(si.long(), ref.indices)


@given(M=st.integers(1, 9), N=st.integers(6, 45), K=st.sampled_from([1, 3, 4, 6]), seed=st.integers(0, 2**16))
def test_topk_bf16(M, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = _ties(torch.randn(M, N, generator=g), g).to(torch.bfloat16)
    tv, ti = poisoned((M, K), torch.bfloat16), poisoned((M, K), torch.int32)
    bv, bi = poisoned((M, K), torch.bfloat16), poisoned((M, K), torch.int32)
    d_topk(x, tv, ti, bv, bi)
    ref = torch.sort(x.float(), dim=1, descending=True, stable=True)       # ties: lowest index first
    assert torch.equal(tv.float(), ref.values[:, :K]) and torch.equal(ti.long(), ref.indices[:, :K])
    ref = torch.sort(x.float(), dim=1, stable=True)
    assert torch.equal(bv.float(), ref.values[:, :K]) and torch.equal(bi.long(), ref.indices[:, :K])


def test_int_argmax_cumsum():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-300, 300, (7, 29), generator=g, dtype=torch.int16)
    x[:, 20] = x.max(1).values                                           # a tie with an earlier max or not
    amax, cs = poisoned((7,), torch.int32), poisoned((7, 29), torch.int32)
    d_int(x, amax, cs)
    assert torch.equal(amax.long(), x.argmax(1)) and torch.equal(cs, x.int().cumsum(1).int())


def test_math():
    g = torch.Generator().manual_seed(4)
    M, N = 19, 27
    x = torch.randn(M, N, generator=g) * 2
    x[0, :8] = torch.tensor([0.125, 0.375, -0.625, 2.5 / 4, -1.5 / 4, 0.0, -0.0, 1e-30])  # rint ties, zeros
    e = torch.rand(N, generator=g) * 3
    out, r, p = (poisoned((M, N), torch.float32) for _ in range(3))
    d_math(x, e, out, r, p)
    torch.testing.assert_close(out, torch.tanh(x) + torch.erf(x * 0.5), rtol=2e-6, atol=1e-6)
    assert torch.equal(r, torch.round(x * 4))                            # torch.round: half to even
    torch.testing.assert_close(p, x ** 3 + x.abs() ** e + 2.0 ** x + x ** -2, rtol=2e-6, atol=1e-5)


@pytest.mark.aot
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm90"])
@pytest.mark.parametrize("kern", [d_arg, d_topk, d_int, d_math], ids=lambda k: k.name)
def test_compiles_without_spills(kern, arch):
    from kdsl import aot

    r = aot.report(kern, arch)
    assert r.ok and r.spills == 0, (r.errors, r.text())
