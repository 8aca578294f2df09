"""Problem models of the paged decode attention kernels (autotune/problems.py): the tuned-config key
(q_len and head shapes; neither batch nor table width nor context), the launch dims the ops
compute (split count from the CU count, tokens per split), the bytes and flops, and that the ops'
lookups use exactly the key the tuner writes."""
from __future__ import annotations

import math

import pytest
import torch

from autotune import problems as P
from autotune import store
from autotune.space import build
from kdsl.targets import get_target
from ops import mha, mla

KIMI_MLA = {"QL": 1, "H": 64, "DL": 512, "DR": 64, "PS": 64}
DRAFT_MHA = {"QL": 1, "HQ": 64, "KVH": 64, "D": 128, "PS": 64}


@pytest.mark.parametrize("kern, prob, key", [
    (mla.mla_decode_split, KIMI_MLA, "QL1_H64_DL512_DR64_PS64"),
    (mla.mla_decode_split_tree, {**KIMI_MLA, "QL": 4}, "QL4_H64_DL512_DR64_PS64"),
    (mha.mha_decode, {**DRAFT_MHA, "QL": 4, "KVH": 16}, "QL4_HQ64_KVH16_D128_PS64"),
])
def test_key_has_q_len_and_heads_not_batch_table_or_context(kern, prob, key) -> None:
    noisy = {**prob, "B": 7, "MP": 33, "NP": 999, "S": 5, "CTX": 1234}
    assert P.problem_key(kern, noisy) == key
    assert P.strip_m(kern, noisy) == prob
    assert store.file_name(kern, noisy) == f"{kern.name}__{key}.json"


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("ql, m", [(1, 1), (1, 64), (4, 4), (4, 256)])
def test_mla_launch_dims_match_the_op(arch: str, ql: int, m: int) -> None:
    t = get_target(arch)
    b = m // ql
    # batch-invariant (the default, SPLIT_TOKENS 256): fixed chunks of the context, whatever B and q_len
    cfg = {"BLOCK_M": 32, "BLOCK_N": 64}
    d = P.full_dims(mla.mla_decode_split, {**KIMI_MLA, "QL": ql}, m, cfg, t)
    # the step's table holds the context and the q_len new tokens: 8192 + q_len -> 129 pages of 64
    cap = math.ceil((P.NOMINAL_CTX + ql) / 64) * 64
    assert (d["B"], d["QH"], d["DQ"], d["MP"]) == (b, 64 * ql, 576, cap // 64)
    assert d["S"] == mla.launch_split_count(cap, b, ql * 64, 32, 64, 256, t.cu_count, mla.max_splits_for(64))
    assert d["S"] == mla.invariant_splits(cap, 256, mla.max_splits_for(64)) == P.NOMINAL_CTX // 256 + 1
    # ops.mla.split_range: SPLIT_TOKENS, or (context + MAX_Q_LEN - 1) / max_splits rounded up to
    # BLOCK_N when that is longer (64 heads: 64 splits; 8199 / 64 -> 129 -> 192 at ctx 8192, under 256)
    assert mla.max_splits_for(64) == 64
    chunk = max(256, math.ceil(math.ceil((P.NOMINAL_CTX + mla.MAX_Q_LEN - 1) / 64) / 64) * 64)
    assert d["CHUNK"] == chunk == 256
    assert P.loop_iters(mla.mla_decode_split, d, cfg) == chunk // 64
    # SPLIT_TOKENS 0: the CU-derived split count; each split walks cdiv(ctx, S) rounded up to BLOCK_N
    cfg0 = {**cfg, "SPLIT_TOKENS": 0}
    d = P.full_dims(mla.mla_decode_split, {**KIMI_MLA, "QL": ql}, m, cfg0, t)
    want = mla.num_splits([cap] * b, ql, 64, 32, cu_count=t.cu_count, block_n=64, max_splits=mla.max_splits_for(64))
    assert d["S"] == want
    assert d["CHUNK"] == math.ceil(math.ceil((P.NOMINAL_CTX + ql) / want) / 64) * 64
    assert P.loop_iters(mla.mla_decode_split, d, cfg0) == d["CHUNK"] // 64


@pytest.mark.parametrize("heads, splits", [(8, 65), (16, 65), (32, 65), (64, 64), (128, 32)])
def test_mla_split_cap_follows_the_heads(heads: int, splits: int) -> None:
    """Fewer heads per rank (TP8: 8) may cut the context into more splits (up to MAX_SPLITS): the
    partials a row writes (heads x splits) stay under MAX_SPLIT_ROWS. SPLIT_TOKENS 128 at 8k (a
    table of 8192 + 1 tokens: 129 pages, 65 chunks of 128 where the cap allows)."""
    t = get_target("gfx942")
    assert mla.max_splits_for(heads) == min(mla.MAX_SPLITS, mla.MAX_SPLIT_ROWS // heads)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_TOKENS": 128}
    d = P.full_dims(mla.mla_decode_split, {**KIMI_MLA, "QL": 1, "H": heads}, 2, cfg, t)
    assert d["S"] == splits
    cap = mla.max_splits_for(heads)
    assert d["CHUNK"] == max(128, math.ceil(math.ceil((P.NOMINAL_CTX + mla.MAX_Q_LEN - 1) / cap) / 64) * 64)
    assert d["S"] * d["CHUNK"] >= P.NOMINAL_CTX   # the splits cover the table's capacity


@pytest.mark.parametrize("arch, heads", [("gfx942", 8), ("gfx942", 64), ("gfx950", 8), ("gfx950", 16), ("gfx950", 64)])
def test_combine_uv_scored_at_the_split_count_the_op_launches(arch: str, heads: int) -> None:
    """The tuner scores mla_combine_uv at the S that mla_decode gives it at the nominal context (a
    table of that context and the new token, in pages of 64, as bench.step's): the split plan of the
    tuned q_len-1 split config of that arch and head count (its SPLIT_TOKENS), not a fixed 256. Its main loop is the split loop nested in each DL tile: DL/BLOCK_C x S/BLOCK_S trips."""
    from ops._common import invariant_config
    from ops.mla_fused import mla_combine_uv

    t = get_target(arch)
    p1 = {**KIMI_MLA, "H": heads}
    for m in (1, 8):
        cfg = invariant_config(mla.mla_decode_split, p1, m, None, p1, arch=arch)
        table = math.ceil((P.NOMINAL_CTX + 1) / 64) * 64
        want = mla.split_plan(mla.mla_decode_split, cfg, {"QL": 1, "DL": 512, "DR": 64}, m, table, heads,
                              cfg.get("BLOCK_M", 16), None, True, t.cu_count, "test", mla.max_splits_for(heads))
        c = {"BLOCK_C": 128, "BLOCK_S": 16}
        d = P.full_dims(mla_combine_uv, {"H": heads, "DL": 512, "V": 128}, m, c, t)
        assert d["S"] == want and d["BQ"] == m
        assert P.loop_iters(mla_combine_uv, d, c) == 4 * math.ceil(want / 16)
    bound = P.full_dims(mla_combine_uv, {"H": heads, "DL": 512, "V": 128, "S": 65}, 2, c, t)  # a recorded launch
    assert bound["S"] == 65 and P.loop_iters(mla_combine_uv, bound, c) == 4 * 5


def test_mha_launch_dims_match_the_op() -> None:
    """paged_mha_decode plans its splits over the page table's capacity (the context and the q_len new
    tokens in whole pages), as mla_decode does: at 8192 + 4 tokens, 129 pages of 64 -> 8256 tokens,
    17 chunks of 512 (the context alone would give 16) and the 32-split cap at 256."""
    t = get_target("gfx942")
    cap = math.ceil((P.NOMINAL_CTX + 4) / 64) * 64
    for st, splits in ((256, 32), (512, 17)):
        d = P.full_dims(mha.mha_decode, {**DRAFT_MHA, "QL": 4, "KVH": 16}, 8,
                        {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_TOKENS": st}, t)
        assert (d["B"], d["QG"], d["MP"]) == (2, 16, cap // 64)
        assert d["S"] == mla.invariant_splits(cap, st) == splits and d["BS"] == 2 * splits
        assert d["S"] * d["CHUNK"] >= cap
    d = P.full_dims(mha.mha_decode, {**DRAFT_MHA, "QL": 4, "KVH": 16}, 8,
                    {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_TOKENS": 0}, t)
    rows = 16 * 16  # KVH x cdiv(QG, BLOCK_M) x BLOCK_M, as paged_mha_decode passes it
    assert d["S"] == mla.num_splits([cap] * 2, 1, rows, 16, cu_count=304, block_n=64)
    assert d["BS"] == 2 * d["S"]


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_combines_scored_at_the_split_count_the_op_launches(arch: str) -> None:
    """mha_decode_combine and mla_decode_combine(_f32) are scored at the S their split kernel launches
    at the nominal step (the tuned q_len-1 split config's SPLIT_TOKENS over the table's capacity), as
    mla_combine_uv is: S is static and sets their merge loop."""
    from ops._common import invariant_config

    t = get_target(arch)
    for ql in (1, 4):
        cap = math.ceil((P.NOMINAL_CTX + ql) / 64) * 64
        p1 = {"QL": 1, "HQ": 64, "KVH": 64, "D": 128, "PS": 64}
        st = invariant_config(mha.mha_decode, p1, 1, None, arch=arch).get("SPLIT_TOKENS", 256)
        d = P.full_dims(mha.mha_decode_combine, {"QL": ql, "H": 64, "DL": 128}, 2 * ql, {}, t)
        assert d["S"] == mla.invariant_splits(cap, st)
        p1 = {**KIMI_MLA, "QL": 1}
        st = invariant_config(mla.mla_decode_split, p1, 1, None, arch=arch).get("SPLIT_TOKENS", 256)
        d = P.full_dims(mla.mla_decode_combine_f32, {"QL": ql, "H": 64, "DL": 512}, 2 * ql, {}, t)
        assert d["S"] == mla.invariant_splits(cap, st, mla.max_splits_for(64))


def test_bytes_and_flops_by_hand() -> None:
    """KV read once (B x ctx x 576 bf16), q read, bf16 output, block table; flops of QK^T over 576
    and PV over 512 per (row, head, token). A CTX in the problem overrides the nominal length."""
    pm = P.model_for(mla.mla_decode_split)
    p = {**KIMI_MLA, "QL": 4, "CTX": 1024}
    b, rows = 2, 2 * 4 * 64
    kv = b * 1024 * 576 * 2
    assert P.shared_bytes(mla.mla_decode_split, p, 8) == kv
    assert pm.bytes_fn(p, 8) == kv + rows * 576 * 2 + rows * 512 * 2 + b * 16 * 4
    assert pm.flops_fn(p, 8) == 2.0 * rows * 1024 * (512 + 576)
    q = P.model_for(mha.mha_decode)
    pq = {**DRAFT_MHA, "KVH": 8, "CTX": 2048}
    assert P.shared_bytes(mha.mha_decode, pq, 3) == 3 * 2048 * 8 * 128 * 2 * 2
    assert q.flops_fn(pq, 3) == 2.0 * 3 * 64 * 2048 * 256


def test_space_keeps_numerics_switch_and_does_not_cap_the_head_tile() -> None:
    """PV_F32 changes the numerics: the tuner leaves it at 0. BLOCK_M tiles heads, not batch x
    q_len: a bucket of 1 still tries every head tile."""
    t = get_target("gfx942")
    sp = build(mla.mla_decode_split, t, {"QL": 1, "DL": 512, "DR": 64}, 1, seed=0, max_candidates=4, m_block=None)
    assert sp.domains["PV_F32"] == (0,)
    assert sp.domains["SPLIT_TOKENS"] == (64, 128, 256, 512)  # searched, but never 0 (batch-dependent)
    assert set(sp.domains["BLOCK_M"]) == {16, 32, 64}
    assert set(sp.domains["KV_ROWS"]) == {0, 1}
    assert P.model_for(mla.mla_decode_split).m_block is None


def _spy_lookups(monkeypatch) -> list[tuple[str, dict, int]]:
    import autotune

    seen: list[tuple[str, dict, int]] = []

    def spy(kernel, arch, problem, m, strict=False, root=None):
        seen.append((kernel.name, dict(problem), m))
        return {}

    monkeypatch.setattr(autotune, "lookup_config", spy)
    return seen


def test_ops_look_up_the_tuned_key(monkeypatch) -> None:
    """mla_decode / paged_mha_decode ask for exactly the key the tuner writes, with M = batch x q_len."""
    seen = _spy_lookups(monkeypatch)
    g = torch.Generator().manual_seed(0)
    B, QL, H, PS = 3, 4, 2, 8
    kv = torch.randn(12, PS, 48, generator=g).bfloat16()
    bt = torch.arange(12, dtype=torch.int32).view(3, 4)
    lens = torch.tensor([9, 20, 31], dtype=torch.int32)
    q = torch.randn(B, QL, H, 48, generator=g).bfloat16()
    mla.mla_decode(q, kv, bt, lens, 0.3, latent_dim=32)
    name, prob, m = seen[0]
    assert name == "mla_decode_split" and m == B * QL
    assert prob == {"QL": QL, "H": H, "DL": 32, "DR": 16, "PS": PS}
    assert P.strip_m(mla.mla_decode_split, prob) == prob

    seen.clear()
    kc = torch.randn(12, PS, 1, 16, generator=g).bfloat16()
    qm = torch.randn(B, QL, 2, 16, generator=g).bfloat16()
    mha.paged_mha_decode(qm, kc, kc.clone(), bt, lens, 0.25)
    name, prob, m = seen[0]
    assert name == "mha_decode" and m == B * QL
    assert prob == {"QL": QL, "HQ": 2, "KVH": 1, "D": 16, "PS": PS}
    assert P.strip_m(mha.mha_decode, prob) == prob
