"""The residual-add norms over split-K partials (ops/norm.py rmsnorm_add_splitk, rmsnorm_add_quant_splitk:
the layer output given as f32 partials [S, M, D], e.g. o_proj's gemm_bf16_splitk) on the interpreter.

Reference: the partials added in split order and rounded to bf16 (ops.gemm.splitk_sum_ref), then
rmsnorm_add_ref / rms_norm_quant_ref. The residual sum is exact (the split sum and the residual add
are each f32 adds rounded once, in the same order); the normed rows agree to one bf16 ulp (rtol 2^-7:
the f32 sum of squares may be reduced in another order); q and scale are bit-exact against quantizing
the kernel's own normed rows."""
from __future__ import annotations

import pytest
import torch

from ops import norm
from ops.gemm import splitk_sum_ref
from ops.quant import quant_per_token_int8_ref
from tests.conftest import poisoned

BF16_TOL = dict(atol=1e-2, rtol=2 ** -7)


def _data(s: int, m: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    part = torch.randn(s, m, d, generator=g) * 2
    res = torch.randn(m, d, generator=g).bfloat16()
    w = (torch.rand(d, generator=g) + 0.5).bfloat16()
    return part, res, w


def _run(quant: bool, part, res, w, block_d: int) -> list[torch.Tensor]:
    """Every output of one kernel at BLOCK_D=block_d, into poisoned buffers."""
    _, m, d = part.shape
    y, r = poisoned((m, d), torch.bfloat16), poisoned((m, d), torch.bfloat16)
    cfg = {"BLOCK_D": block_d}
    if not quant:
        norm.rmsnorm_add_splitk(part, res, w, y, r, 1e-6, config=cfg)
        return [y, r]
    q, s = poisoned((m, d), torch.int8), poisoned((m,), torch.float32)
    norm.rmsnorm_add_quant_splitk(part, res, w, y, q, s, r, 1e-6, config=cfg)
    return [y, r, q, s]


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("s,m,d", [(1, 2, 48), (2, 3, 130), (3, 1, 96)])
def test_partials_match_reference_and_chunks_change_no_bit(quant: bool, s: int, m: int, d: int) -> None:
    part, res, w = _data(s, m, d, s * 100 + d)
    res_before, part_before = res.clone(), part.clone()
    whole = _run(quant, part, res, w, norm.WHOLE_ROW)
    assert all(not t.isnan().any() and not (t == -123).all(-1).any() for t in whole)
    y_ref, r_ref = norm.rmsnorm_add_ref(splitk_sum_ref(part), res, w, 1e-6)
    assert torch.equal(whole[1], r_ref)
    torch.testing.assert_close(whole[0].float(), y_ref.float(), **BF16_TOL)
    if quant:
        q_own, s_own = quant_per_token_int8_ref(whole[0])
        assert torch.equal(whole[2], q_own) and torch.equal(whole[3], s_own)
    for bd in (16, 32):
        for a, b in zip(_run(quant, part, res, w, bd), whole):
            assert torch.equal(a, b), f"BLOCK_D={bd} changed the output"
    assert torch.equal(res, res_before) and torch.equal(part, part_before)


def test_one_split_equals_the_bf16_row_kernels() -> None:
    """S = 1 partials holding a bf16 row give the bits of rmsnorm_add(_quant) over that row."""
    part, res, w = _data(1, 3, 130, 7)
    xb = part[0].bfloat16()
    part = xb.float().unsqueeze(0)
    y, r = norm.rms_norm(part, w, 1e-6, residual=res)
    y0, r0 = norm.rms_norm(xb, w, 1e-6, residual=res)
    assert torch.equal(y, y0) and torch.equal(r, r0)
    got, want = norm.rms_norm_quant(part, w, 1e-6, residual=res), norm.rms_norm_quant(xb, w, 1e-6, residual=res)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_strided_partials_and_torch_backend() -> None:
    """Partials read through a view of a wider buffer (another GEMM's columns), the torch backend
    computing the same reference, and the argument checks."""
    g = torch.Generator().manual_seed(5)
    buf = torch.randn(2, 4, 80, generator=g)
    part = buf[:, :, 16:64]
    _, res, w = _data(2, 4, 48, 9)
    y, r = norm.rms_norm(part, w, 1e-6, residual=res)
    yt, rt = norm.rms_norm(part, w, 1e-6, residual=res, backend="torch")
    assert torch.equal(r, rt)
    torch.testing.assert_close(y.float(), yt.float(), **BF16_TOL)
    q, s, yq, rq = norm.rms_norm_quant(part, w, 1e-6, residual=res)
    assert torch.equal(yq, y) and torch.equal(rq, r)
    with pytest.raises(ValueError, match="partials"):
        norm.rms_norm(part[:, :3], w, 1e-6, residual=res)
    with pytest.raises(ValueError, match="partials"):
        norm.rms_norm_quant(torch.zeros(2, 4, 40), w, 1e-6, residual=res)
