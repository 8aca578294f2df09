"""Paged GQA decode/verify for the EAGLE-3 draft (interpreter, head_dim 32, small head counts).

Tolerance vs the float64 reference: atol 1e-2 (bf16 probabilities in PV, bf16 output)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

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


def _tree(B: int, q_len: int, tw: int, seed: int) -> torch.Tensor:
    """A random tree window mask [B, q_len, tw]: each new row sees a random subset of the earlier
    window rows (ancestors, with non-ancestors between them, as in a draft tree step) and itself."""
    g = torch.Generator().manual_seed(seed)
    m = (torch.rand(B, q_len, tw, generator=g) < 0.5).to(torch.int8)
    for r in range(q_len):
        m[:, r, tw - q_len + r] = 1
        m[:, r, tw - q_len + r + 1:] = 0                 # later new rows are not ancestors
    return m


def _tree_run(q, kc, vc, bt, lens, tm, splits, cfg):
    """mha_decode_tree into poisoned partials, then the combine: (out, part, lse)."""
    B, QL, HQ, _ = q.shape
    part, lse = poisoned((B, QL, HQ, splits, D), torch.float32), poisoned((B, QL, HQ, splits), torch.float32)
    G = HQ // kc.shape[2]
    mha.mha_decode_tree(q, kc, vc, bt, lens, tm, part, lse, SCALE, QL * G, B * splits, config=cfg)
    out = poisoned((B, QL, HQ, D), torch.bfloat16)
    mha.mha_decode_combine(part, lse, out, QL * HQ)
    return out, part, lse


@pytest.mark.parametrize("q_len,hq,kvh,extra,lens", [
    (1, 2, 2, 0, [5, 9]),          # one row, window = the row itself
    (4, 4, 2, 5, [9, 26]),         # GQA 2, window crosses pages (PS 8)
    (3, 4, 1, 6, [16, 17]),        # GQA 4 (MQA), window ends at / just past a page boundary
    (8, 2, 1, 9, [17, 40]),        # q_len 8, window of 17 rows over three pages
])
def test_tree_mask_matches_reference(q_len, hq, kvh, extra, lens) -> None:
    q, kc, vc, bt, lens = _setup(lens, q_len, hq, kvh, seed=100 + q_len)
    tm = _tree(len(lens), q_len, q_len + extra, seed=q_len)
    ref = mha.mha_decode_ref(q, kc, vc, bt, lens, SCALE, tree_mask=tm)
    out, part, lse = _tree_run(q, kc, vc, bt, lens, tm, 3, {"BLOCK_N": 16})
    assert not part.isnan().any() and not lse.isnan().any() and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, **TOL)
    via_op = mha.paged_mha_decode(q, kc, vc, bt, lens, SCALE, splits=2, config={"BLOCK_N": 32}, tree_mask=tm)
    torch.testing.assert_close(via_op.double(), ref, **TOL)
    if q_len > 1:                                       # the mask matters: it is not the causal result
        assert (ref - mha.mha_decode_ref(q, kc, vc, bt, lens, SCALE)).abs().max() > 5e-2


@settings(max_examples=6)
@given(splits=st.integers(1, 8), seed=st.integers(0, 2 ** 16), block_n=st.sampled_from([16, 32]))
def test_tree_mask_any_split_count(splits: int, seed: int, block_n: int) -> None:
    q, kc, vc, bt, lens = _setup([13, 37], 4, 4, 2, seed=seed)
    tm = _tree(2, 4, 11, seed=seed + 1)
    out, _, _ = _tree_run(q, kc, vc, bt, lens, tm, splits, {"BLOCK_N": block_n})
    torch.testing.assert_close(out.double(), mha.mha_decode_ref(q, kc, vc, bt, lens, SCALE, tree_mask=tm), **TOL)


def test_causal_tree_equals_causal_kernel() -> None:
    """A lower-triangular mask over exactly the new rows (MLA's mask format) is the causal case."""
    q, kc, vc, bt, lens = _setup([12, 21], 4, 4, 2, seed=8)
    tri = torch.ones(2, 4, 4, dtype=torch.int8).tril()
    a = mha.paged_mha_decode(q, kc, vc, bt, lens, SCALE, splits=2, config={"BLOCK_N": 16}, tree_mask=tri)
    b = mha.paged_mha_decode(q, kc, vc, bt, lens, SCALE, splits=2, config={"BLOCK_N": 16})
    assert torch.equal(a, b)


def test_tree_mask_errors() -> None:
    q, kc, vc, bt, lens = _setup([10, 20], 3, 2, 1)
    good = _tree(2, 3, 5, seed=0)
    with pytest.raises(ValueError, match="own ancestor"):
        bad = good.clone()
        bad[1, 2, 4] = 0
        mha.paged_mha_decode(q, kc, vc, bt, lens, SCALE, tree_mask=bad, validate=True)
    with pytest.raises(ValueError, match=r"tree_mask must be \[B, q_len, TW\]"):
        mha.paged_mha_decode(q, kc, vc, bt, lens, SCALE, tree_mask=good[:, :, :2])
    with pytest.raises(ValueError, match="longer than a sequence"):
        mha.paged_mha_decode(q, kc, vc, bt, lens, SCALE, tree_mask=_tree(2, 3, 11, seed=0), validate=True)


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
        mha.paged_mha_decode(q, kc, vc, bt[:, :2], lens, SCALE, validate=True)
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
    """Draft shape (64 q heads, 128 head dim, page 64; the tree kernel: 4 rows, 16-row window) at
    defaults: compiles, no spills, LDS fits."""
    from kdsl import aot

    for k in (mha.mha_decode, mha.mha_decode_tree, mha.mha_decode_combine, mha.mha_cache_append):
        r = aot.check(k, arch)
        assert r.spills == 0 and r.lds_bytes <= r.lds_limit
