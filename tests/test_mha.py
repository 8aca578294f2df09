"""Paged GQA decode/verify for the EAGLE-3 draft (interpreter, head_dim 32, small head counts).

Tolerance vs the float64 reference: atol 1e-2 (bf16 probabilities in PV, bf16 output)."""
from __future__ import annotations

import pytest
import torch

from ops import mha
from tests.conftest import poisoned

D, PS, SCALE = 32, 8, 0.2
TOL = dict(atol=1e-2, rtol=0)


def _setup(lens, q_len, hq, kvh, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    mp = max(-(-n // PS) for n in lens)
    npages = B * mp + 2
    kc = torch.randn(npages, PS, kvh, D, generator=g).bfloat16()
    vc = torch.randn(npages, PS, kvh, D, generator=g).bfloat16()
    bt = torch.randperm(npages, generator=g)[: B * mp].view(B, mp).to(torch.int32)
    q = torch.randn(B, q_len, hq, D, generator=g).bfloat16()
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("q_len,hq,kvh,splits", [(1, 2, 2, 1), (1, 4, 1, 3), (4, 4, 2, 2), (3, 2, 1, 1)])
def test_paged_mha_matches_reference(q_len, hq, kvh, splits) -> None:
    q, kc, vc, bt, lens = _setup([q_len + 4, 17], q_len, hq, kvh, seed=q_len * 10 + hq)  # 17: crosses 2 pages
    out = mha.paged_mha_decode(q, kc, vc, bt, lens, SCALE, splits=splits, config={"BLOCK_N": 16})
    torch.testing.assert_close(out.double(), mha.mha_decode_ref(q, kc, vc, bt, lens, SCALE), **TOL)


def test_kernel_writes_every_partial() -> None:
    q, kc, vc, bt, lens = _setup([3, 20], 1, 2, 1, seed=4)
    S = 4
    part, lse = poisoned((2, 1, 2, S, D), torch.float32), poisoned((2, 1, 2, S), torch.float32)
    mha.mha_decode(q, kc, vc, bt, lens, part, lse, SCALE, 2, 2 * S, config={"BLOCK_N": 16})
    assert not part.isnan().any() and not lse.isnan().any()


def test_append_kv() -> None:
    q, kc, vc, bt, lens = _setup([10], 1, 2, 2, seed=6)
    k2, v2 = kc.clone(), vc.clone()
    kn, vn = torch.randn(3, 2, D).bfloat16(), torch.randn(3, 2, D).bfloat16()
    slots = torch.tensor([2, -1, 9])
    mha.append_kv(kc, vc, kn, vn, slots)
    mha.append_kv(k2, v2, kn, vn, slots, backend="torch")
    assert torch.equal(kc, k2) and torch.equal(vc, v2)


def test_bad_inputs() -> None:
    q, kc, vc, bt, lens = _setup([20], 1, 4, 2)
    with pytest.raises(ValueError, match="block table too short"):
        mha.paged_mha_decode(q, kc, vc, bt[:, :2], lens, SCALE)
    with pytest.raises(ValueError, match="head dims do not match"):
        mha.paged_mha_decode(q[..., :16], kc, vc, bt, lens, SCALE)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        mha.paged_mha_decode(torch.randn(1, 1, 3, D).bfloat16(), kc, vc, bt, lens, SCALE)
    with pytest.raises(ValueError, match="q_len must be 1..8"):
        mha.paged_mha_decode(torch.randn(1, 9, 4, D).bfloat16(), kc, vc, bt, lens, SCALE)


@pytest.mark.aot
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm90"])
def test_aot_draft_shape(arch: str) -> None:
    """Draft shape (64 q heads, 128 head dim, page 64) at defaults: compiles, no spills, LDS fits."""
    from kdsl import aot

    for k in (mha.mha_decode, mha.mha_decode_combine, mha.mha_cache_append):
        r = aot.check(k, arch)
        assert r.spills == 0 and r.lds_bytes <= r.lds_limit
