"""Fused residual add + RMSNorm + per-token int8 quant (ops/norm.py rmsnorm_(add_)quant) on the
interpreter against the composition rmsnorm_add_ref + quant_per_token_int8_ref.

Tolerances: the residual sum is exact (one f32 add rounded once). q and scale are bit-exact against
quant_per_token_int8_ref of the kernel's own bf16 normed rows (same f32 math, RNE). The normed rows
match rmsnorm_ref to one bf16 ulp (rtol 2^-7: the f32 sum of squares may be reduced in another
order); on the rows where they are equal, q and scale equal the full reference composition."""
from __future__ import annotations

import pytest
import torch

from ops import norm
from ops.quant import quant_per_token_int8_ref
from tests.conftest import poisoned

BF16_TOL = dict(atol=1e-2, rtol=2 ** -7)


def _data(m: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, d, generator=g) * 3).bfloat16()
    res = torch.randn(m, d, generator=g).bfloat16()
    w = (torch.rand(d, generator=g) + 0.5).bfloat16()
    return x, res, w


def _check(q, s, y, q_ref, s_ref, y_ref):
    torch.testing.assert_close(y.float(), y_ref.float(), **BF16_TOL)
    q_own, s_own = quant_per_token_int8_ref(y.reshape(-1, y.shape[-1]))
    assert torch.equal(q.reshape(q_own.shape), q_own) and torch.equal(s.reshape(-1), s_own)
    same = (y == y_ref).all(-1).reshape(-1)
    assert same.float().mean() >= 0.5, "most rows should round identically"
    assert torch.equal(q.reshape(q_own.shape)[same], q_ref.reshape(q_own.shape)[same])
    assert torch.equal(s.reshape(-1)[same], s_ref.reshape(-1)[same])


@pytest.mark.parametrize("m,d,seed", [(1, 7168, 1), (4, 7168, 2), (3, 130, 3), (5, 48, 4)])
def test_rmsnorm_add_quant_kernel(m, d, seed):
    x, res, w = _data(m, d, seed)
    q_ref, s_ref, y_ref, r_ref = norm.rms_norm_quant_ref(x, w, 1e-6, res)
    r = poisoned((m, d), torch.bfloat16)
    y, q, s = poisoned((m, d), torch.bfloat16), poisoned((m, d), torch.int8), poisoned((m,), torch.float32)
    norm.rmsnorm_add_quant(x, res, w, y, q, s, r, 1e-6)
    assert torch.equal(r, r_ref)
    assert not y.isnan().any() and not s.isnan().any() and (q != -123).any(-1).all()
    _check(q, s, y, q_ref, s_ref, y_ref)


@pytest.mark.parametrize("m,d,seed", [(1, 7168, 5), (2, 96, 6)])
def test_rmsnorm_quant_kernel(m, d, seed):
    x, _, w = _data(m, d, seed)
    q_ref, s_ref, y_ref, _ = norm.rms_norm_quant_ref(x, w, 1e-5)
    y, q, s = poisoned((m, d), torch.bfloat16), poisoned((m, d), torch.int8), poisoned((m,), torch.float32)
    norm.rmsnorm_quant(x, w, y, q, s, 1e-5)
    assert not y.isnan().any() and not s.isnan().any()
    _check(q, s, y, q_ref, s_ref, y_ref)


def test_rms_norm_quant_wrapper_shapes_and_residual():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    res = torch.randn(2, 3, 64, generator=g).bfloat16()
    w = (torch.rand(64, generator=g) + 0.5).bfloat16()
    q, s, y, r = norm.rms_norm_quant(x, w, 1e-6, residual=res)
    q_ref, s_ref, y_ref, r_ref = norm.rms_norm_quant_ref(x, w, 1e-6, res)
    assert q.shape == x.shape and q.dtype == torch.int8 and s.shape == (2, 3) and y.shape == x.shape
    assert torch.equal(r, r_ref) and not torch.equal(res, r_ref)  # the sum is a new tensor, residual only read
    _check(q, s, y, q_ref, s_ref, y_ref)
    y4, r4 = norm.rms_norm(x, w, 1e-6, residual=res)  # fused == unfused: rms_norm then the quant
    q4, s4 = quant_per_token_int8_ref(y4.reshape(-1, 64))
    assert torch.equal(y4, y) and torch.equal(r4, r) and torch.equal(q4, q.reshape(-1, 64)) and torch.equal(s4, s.reshape(-1))
    q3, s3, y3, r3 = norm.rms_norm_quant(x, w, 1e-6)
    assert r3 is None and q3.shape == x.shape
    _check(q3, s3, y3, *norm.rms_norm_quant_ref(x, w, 1e-6)[:3])


def test_rms_norm_quant_errors():
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm_quant(x, torch.randn(7).bfloat16())
    with pytest.raises(TypeError, match="bfloat16"):
        norm.rms_norm_quant(x.float(), torch.randn(8).bfloat16())
    with pytest.raises(ValueError, match="residual"):
        norm.rms_norm_quant(x, torch.randn(8).bfloat16(), residual=torch.randn(2, 4).bfloat16())


@pytest.mark.aot
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_aot_norm_quant(arch):
    from kdsl import aot

    for k in (norm.rmsnorm_quant, norm.rmsnorm_add_quant):
        r = aot.check(k, arch)
        assert r.spills == 0
