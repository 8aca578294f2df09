"""Fused MoE (ops/moe.py): routing, align, the two GEMM stages in three weight formats, the layer op,
input errors, and AOT resource checks.

Tolerances: routing ids exact, routing weights 1e-6 abs (f32, different summation order);
W4A8 i32 accumulators exact; routed-expert outputs (f32) vs the torch reference that replays the
same roundings (bf16 intermediate, int8 row quant; W4A16 weights q * s exact): 1e-2 x max|ref| abs, because a
different f32 summation order may flip one bf16 rounding of the intermediate; the layer output (bf16)
2e-2 x max|ref| abs.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ops import moe
from ops.packing import pack_int4, quantize_int4_grouped, quantize_int4_per_channel
from tests.conftest import poisoned

SMALL = dict(E=16, top_k=4, H=64, I=32)
# interpreter-sized tiles (the kernel defaults are GPU-sized and 4x slower to interpret here)
FAST = {"stage1": {"BLOCK_N": 32, "BLOCK_K": 64}, "stage2": {"BLOCK_N": 64, "BLOCK_K": 32},
        "quant": {"BLOCK_M": 16, "BLOCK_K": 64}}
KIMI_SMALL = dict(E=384, top_k=8, H=64, I=32)


def make_weights(fmt: str, E: int, H: int, I: int, seed: int = 0) -> moe.MoEWeights:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.1
    w2 = torch.randn(E, H, I, generator=g) * 0.1
    if fmt == "bf16":
        return moe.MoEWeights("bf16", w13.bfloat16(), w2.bfloat16())
    if fmt == "w4a8":
        q13, s13 = quantize_int4_per_channel(w13)
        q2, s2 = quantize_int4_per_channel(w2)
        return moe.MoEWeights("w4a8", pack_int4(q13, "quark_reorder"), pack_int4(q2, "quark_reorder"), s13, s2)
    q13, s13 = quantize_int4_grouped(w13)
    q2, s2 = quantize_int4_grouped(w2)
    return moe.MoEWeights("w4a16", pack_int4(q13, "ct_reorder"), pack_int4(q2, "ct_reorder"), s13.bfloat16(), s2.bfloat16())


def make_inputs(M: int, E: int, H: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).bfloat16()
    wg = (torch.randn(E, H, generator=g) * 0.2).bfloat16()
    bias = torch.randn(E, generator=g) * 0.05
    return x, wg, bias


# ----------------------------------------------------------------------------------------------
# routing

def _sig(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _onehot_router(logits: list[float], H: int = 16):
    """x = e_0, Wgate[:, 0] = logits: the router logits are exactly `logits` (bf16-representable)."""
    E = len(logits)
    x = torch.zeros(1, H)
    x[0, 0] = 1.0
    wg = torch.zeros(E, H)
    wg[:, 0] = torch.tensor(logits)
    wg[:, 1:] = torch.randn(E, H - 1)  # never multiplied by a nonzero x entry
    return x.bfloat16(), wg.bfloat16()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_route_hand_bias_selects_but_does_not_weight(backend):
    logits = [0.0, 1.0, -1.0, 2.0, 0.5, -2.0, 3.0, -0.5]
    x, wg = _onehot_router(logits)
    bias = torch.zeros(8)
    bias[7] = 10.0  # expert 7 wins the selection, but its weight is its unbiased score
    ids, w = moe.route(x, wg, bias, 2, norm_topk_prob=True, routed_scaling_factor=2.0, backend=backend)
    assert ids.tolist() == [[7, 6]]
    s7, s6 = _sig(-0.5), _sig(3.0)
    torch.testing.assert_close(w, torch.tensor([[2 * s7 / (s7 + s6), 2 * s6 / (s7 + s6)]]), atol=1e-6, rtol=0)
    ids, w = moe.route(x, wg, bias, 2, norm_topk_prob=False, routed_scaling_factor=1.5, backend=backend)
    torch.testing.assert_close(w, torch.tensor([[1.5 * s7, 1.5 * s6]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_route_hand_group_limited(backend):
    # groups of 2: g0 = {3, -3} (sum of sigmoids 1.0), g1 = {1, 0.9} (1.44), g2 = {0.5, 0.4} (1.22),
    # g3 = {-1, -1.5}: the best single expert (0) sits in a losing group, so top-2 of groups {1, 2}
    logits = [3.0, -3.0, 1.0, 0.875, 0.5, 0.375, -1.0, -1.5]
    x, wg = _onehot_router(logits)
    ids, _ = moe.route(x, wg, torch.zeros(8), 3, n_group=4, topk_group=2, backend=backend)
    assert ids.tolist() == [[2, 3, 4]]
    ids, _ = moe.route(x, wg, torch.zeros(8), 3, n_group=1, topk_group=1, backend=backend)
    assert ids.tolist() == [[0, 2, 3]]


@pytest.mark.parametrize("shape,ng,tkg", [(SMALL, 1, 1), (SMALL, 4, 2), (KIMI_SMALL, 1, 1),
                                          (dict(E=16, top_k=4, H=1100), 1, 1)])  # 3 ragged H splits
@pytest.mark.parametrize("M", [1, 4, 16, 7])
def test_route_matches_reference(shape, ng, tkg, M):
    x, wg, bias = make_inputs(M, shape["E"], shape["H"], seed=M)
    ids, w = moe.route(x, wg, bias, shape["top_k"], ng, tkg, True, 2.827)
    rids, rw = moe.moe_route_ref(x, wg, bias, shape["top_k"], ng, tkg, True, 2.827)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# align

@pytest.mark.parametrize("E,M,K,bm", [(384, 1, 8, 16), (16, 16, 4, 16), (16, 7, 4, 32), (384, 4, 8, 16), (384, 40, 8, 16)])
def test_align_invariants(E, M, K, bm):
    g = torch.Generator().manual_seed(E + M)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    sid, bexp = moe.moe_align(ids, E, bm)  # the kdsl kernels
    tsid, tbexp = moe.moe_align(ids, E, bm, backend="torch")
    assert torch.equal(sid, tsid) and torch.equal(bexp, tbexp)
    T = M * K
    assert sid.numel() == bexp.numel() * bm
    real = sid[sid < T]
    assert sorted(real.tolist()) == list(range(T))  # every (token, k) row exactly once
    flat = ids.reshape(-1)
    for b, e in enumerate(bexp.tolist()):
        rows = sid[b * bm:(b + 1) * bm]
        if e < 0:
            assert (rows == T).all()
        else:
            r = rows[rows < T]
            assert r.numel() > 0 and (flat[r.long()] == e).all()
    used = (bexp >= 0).sum().item()
    assert (bexp[:used] >= 0).all() and (bexp[used:] < 0).all()
    if M == 1:
        assert used == K  # decode: one block per touched expert


# ----------------------------------------------------------------------------------------------
# stage kernels: W4A8 exact in int32

@pytest.mark.parametrize("M,unpack", [(1, "bfe"), (5, "bfe"), (5, "shift"), (1, "swar"), (5, "swar")])
def test_stage1_w4a8_i32_exact(M, unpack):
    E, H, I, K = 16, 64, 32, 4
    W = make_weights("w4a8", E, H, I)
    g = torch.Generator().manual_seed(3)
    x8 = torch.randint(-127, 128, (M, H), generator=g, dtype=torch.int8)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    sid, bexp = moe.moe_align(ids, E, 16)
    ag, au = poisoned((sid.numel(), I), torch.int32), poisoned((sid.numel(), I), torch.int32)
    moe.moe_stage1_w4a8_acc(x8, W.w13, sid, bexp, ag, au, K, config={"INT4_UNPACK": unpack, "BLOCK_K": 32})
    acc = torch.cat([ag, au], 1)
    from ops.packing import unpack_int4

    q13 = unpack_int4(W.w13, "quark_reorder").long()
    for s, t in enumerate(sid.tolist()):
        if t < M * K:
            ref = q13[ids.reshape(-1)[t]] @ x8[t // K].long()
            assert torch.equal(acc[s].long(), ref), f"row {s}"


def test_stage2_w4a8_i32_exact():
    """Integer intermediate rows with absmax 127 quantize to themselves (scale 1); with unit weight
    scales and routing weights the f32 output equals the i32 dot exactly (|acc| < 2^24)."""
    E, H, I, K, M = 16, 64, 32, 4, 3
    W = make_weights("w4a8", E, H, I)
    g = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    sid, bexp = moe.moe_align(ids, E, 16)
    h = torch.randint(-126, 127, (sid.numel(), I), generator=g)  # |h| <= 127 also fits int8
    h[:, 0] = 127
    inter = h.bfloat16()
    T = M * K
    part = poisoned((T, H), torch.float32)
    out = torch.empty(0, H)
    moe.moe_stage2_w4a8(inter, W.w2, torch.ones(E, H), sid, bexp, torch.ones(T), out, part, K,
                        config={"REDUCE": "partial"})
    from ops.packing import unpack_int4

    q2 = unpack_int4(W.w2, "quark_reorder").long()
    for s, t in enumerate(sid.tolist()):
        if t < T:
            ref = q2[ids.reshape(-1)[t]] @ h[s]
            assert torch.equal(part[t].long(), ref) and torch.equal(part[t], part[t].round())
    part2 = poisoned((T, H), torch.float32)
    moe.moe_stage2_w4a8_pq(h.to(torch.int8), torch.ones(sid.numel()), W.w2, torch.ones(E, H), sid, bexp,
                           torch.ones(T), out, part2, K, config={"REDUCE": "partial"})
    assert torch.equal(part2, part)


@pytest.mark.parametrize("w_rows,bn", [(0, 32), (1, 32), (1, 16)])
def test_stage1_w4a8_w_rows_exact(w_rows, bn):
    """W_ROWS (which side of the dot the weight rows take) leaves the i32 accumulators bit-identical."""
    E, H, I, K, M = 16, 64, 32, 4, 5
    W = make_weights("w4a8", E, H, I, seed=w_rows + bn)
    g = torch.Generator().manual_seed(30 + bn + w_rows)
    x8 = torch.randint(-127, 128, (M, H), generator=g, dtype=torch.int8)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    sid, bexp = moe.moe_align(ids, E, 16)
    ag, au = poisoned((sid.numel(), I), torch.int32), poisoned((sid.numel(), I), torch.int32)
    moe.moe_stage1_w4a8_acc(x8, W.w13, sid, bexp, ag, au, K, config={"W_ROWS": w_rows, "BLOCK_N": bn, "BLOCK_K": 32})
    acc = torch.cat([ag, au], 1)
    from ops.packing import unpack_int4

    q13 = unpack_int4(W.w13, "quark_reorder").long()
    for s, t in enumerate(sid.tolist()):
        if t < M * K:
            assert torch.equal(acc[s].long(), q13[ids.reshape(-1)[t]] @ x8[t // K].long()), f"row {s}"


@pytest.mark.parametrize("w_rows", [0, 1])
def test_stage2_w4a8_pq_w_rows_exact(w_rows):
    """Both W_ROWS forms of the pre-quantized stage 2: with unit scales the f32 output is the i32 dot."""
    E, H, I, K, M = 16, 64, 32, 4, 3
    W = make_weights("w4a8", E, H, I, seed=7 + w_rows)
    g = torch.Generator().manual_seed(40 + w_rows)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    sid, bexp = moe.moe_align(ids, E, 16)
    h = torch.randint(-127, 128, (sid.numel(), I), generator=g)
    T = M * K
    part = poisoned((T, H), torch.float32)
    moe.moe_stage2_w4a8_pq(h.to(torch.int8), torch.ones(sid.numel()), W.w2, torch.ones(E, H), sid, bexp,
                           torch.ones(T), torch.empty(0, H), part, K,
                           config={"REDUCE": "partial", "W_ROWS": w_rows, "BLOCK_N": 32, "BLOCK_K": 32})
    from ops.packing import unpack_int4

    q2 = unpack_int4(W.w2, "quark_reorder").long()
    for s, t in enumerate(sid.tolist()):
        if t < T:
            assert torch.equal(part[t].long(), q2[ids.reshape(-1)[t]] @ h[s])


# ----------------------------------------------------------------------------------------------
# routed experts, all formats, vs the torch reference

@pytest.mark.parametrize("fmt", ["w4a8", "w4a16", "bf16"])
@pytest.mark.parametrize("M,shape,reduce", [(1, KIMI_SMALL, "atomic"), (4, KIMI_SMALL, "partial"),
                                            (16, SMALL, "atomic"), (7, SMALL, "partial")])
def test_experts_formats(fmt, M, shape, reduce):
    W = make_weights(fmt, shape["E"], shape["H"], shape["I"])
    x, wg, bias = make_inputs(M, shape["E"], shape["H"], seed=10 + M)
    ids, wts = moe.route(x, wg, bias, shape["top_k"], backend="torch", routed_scaling_factor=2.827)
    cfg = {**FAST, "stage2": {**FAST["stage2"], "REDUCE": reduce}}
    if M == 16:
        cfg = {"stage2": {"REDUCE": reduce}, "quant": FAST["quant"]}  # one run at the GEMM kernel defaults
    if M == 7:
        cfg["stage2_quant"] = "fused"  # W4A8: stage 2 quantizes its own A tiles
    if M == 4 and fmt == "w4a8":  # the other int4 unpack lowering than the default (W4A16 has one)
        cfg = {**cfg, "stage1": {**cfg["stage1"], "INT4_UNPACK": "shift"}, "stage2": {**cfg["stage2"], "INT4_UNPACK": "shift"}}
    y = moe.fused_experts(x, ids, wts, W, config=cfg)
    ref = moe.fused_experts(x, ids, wts, W, backend="torch")
    assert y.shape == (M, shape["H"]) and torch.isfinite(y).all()
    torch.testing.assert_close(y, ref, atol=1e-2 * ref.abs().max().item(), rtol=0)


@settings(max_examples=3)
@given(M=st.integers(1, 9), bm=st.sampled_from([16, 32]))
def test_experts_ragged_w4a8(M, bm):
    W = make_weights("w4a8", 16, 64, 32, seed=M)
    x, wg, bias = make_inputs(M, 16, 64, seed=M)
    ids, wts = moe.route(x, wg, bias, 4, backend="torch")
    y = moe.fused_experts(x, ids, wts, W, config={**FAST, "stage1": {**FAST["stage1"], "BLOCK_M": bm}})
    ref = moe.fused_experts(x, ids, wts, W, backend="torch")
    torch.testing.assert_close(y, ref, atol=1e-2 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("fmt", ["w4a8", "bf16"])
def test_fused_moe_layer(fmt):
    E, H, I, M = 16, 64, 32, 4
    W = make_weights(fmt, E, H, I)
    x, wg, bias = make_inputs(M, E, H, seed=7)
    g = torch.Generator().manual_seed(8)
    shared = tuple((torch.randn(*s, generator=g) * 0.1).bfloat16() for s in ((48, H), (48, H), (H, 48)))
    cfg = moe.MoEConfig(top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.827)
    y = moe.fused_moe(x, wg, bias, W, shared, cfg, config=FAST)
    ref = moe.fused_moe(x, wg, bias, W, shared, cfg, backend="torch")
    assert y.dtype == torch.bfloat16 and y.shape == (M, H)
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2 * ref.float().abs().max().item(), rtol=0)


# ----------------------------------------------------------------------------------------------
# errors

def test_errors_name_the_problem():
    W = make_weights("w4a8", 16, 64, 32)
    x, wg, bias = make_inputs(2, 16, 64)
    ids = torch.tensor([[0, 1, 2, 16], [0, 1, 2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="expert ids out of range"):
        moe.fused_experts(x, ids, torch.ones(2, 4), W)
    with pytest.raises(ValueError, match="top_k=17 exceeds the number of experts 16"):
        moe.fused_moe(x, wg, bias, W, cfg=moe.MoEConfig(top_k=17))
    bad = moe.MoEWeights("w4a8", W.w13, W.w2, W.s13[:, :10], W.s2)
    with pytest.raises(ValueError, match="s13 must be per-channel f32 scales of shape"):
        moe.fused_moe(x, wg, bias, bad)
    W16 = make_weights("w4a16", 16, 64, 32)
    with pytest.raises(ValueError, match="s2 must be group-32 bf16 scales"):
        moe.MoEWeights("w4a16", W16.w13, W16.w2, W16.s13, W16.s2[..., :0]).dims()
    with pytest.raises(ValueError, match="hidden size H=40 must be a multiple of the group size 32"):
        moe.MoEWeights("w4a16", torch.zeros(2, 64, 5, dtype=torch.int32), torch.zeros(2, 40, 4, dtype=torch.int32),
                       torch.zeros(2, 64, 1).bfloat16(), torch.zeros(2, 40, 1).bfloat16()).dims()
    with pytest.raises(ValueError, match="I=12 must be a multiple of the pack factor 8"):
        moe.MoEWeights("w4a8", torch.zeros(2, 24, 8, dtype=torch.int32), torch.zeros(2, 64, 1, dtype=torch.int32),
                       torch.ones(2, 24), torch.ones(2, 64)).dims()
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 16\)"):
        moe.moe_align(ids, 16, 16)
    with pytest.raises(ValueError, match="must be 'triton' or 'torch'"):
        moe.fused_moe(x, wg, bias, W, backend="cuda")


# ----------------------------------------------------------------------------------------------
# AOT: int8 MFMA, no spills, LDS within the limit, at the M=1 and M=4 configs

@pytest.mark.aot
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_aot_routing_and_align(arch):
    from kdsl import aot

    for k in (moe.moe_gate_gemm, moe.moe_route, moe.moe_align_one, moe.moe_align_blocks, moe.moe_align_scatter,
              moe.moe_sum, moe.moe_route_align, moe.moe_route_align_local):
        r = aot.check(k, arch, {})
        assert r.spills == 0 and r.lds_bytes <= r.lds_limit, k.name

KIMI_STAGE1 = {"E": 384, "K": 7168, "I": 2048, "TOPK": 8}
KIMI_STAGE2 = {"E": 384, "H": 7168, "I": 2048, "TOPK": 8}


@pytest.mark.aot
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("stage", [1, 2, 3, 4, 5])  # 3: stage 2 on a pre-quantized intermediate; 4, 5: "amax"
@pytest.mark.parametrize("M", [1, 4])
def test_aot_w4a8_stages(arch, stage, M):
    from autotune import lookup_config
    from kdsl import aot

    from autotune.problems import full_dims

    k = {1: moe.moe_stage1_w4a8, 2: moe.moe_stage2_w4a8, 3: moe.moe_stage2_w4a8_pq, 4: moe.moe_stage1_w4a8_amax,
         5: moe.moe_stage2_w4a8_aq}[stage]
    key = KIMI_STAGE1 if stage in (1, 4) else KIMI_STAGE2
    # the default pipelines' kernels ("separate", "amax") must have tuned files
    cfg = lookup_config(k, arch, key, M, strict=stage != 2)
    prob = full_dims(k, key, M, cfg)  # the launch dims fused_experts uses (worst-case aligned blocks)
    r = aot.check(k, arch, cfg, prob)
    assert any(mn.startswith("v_mfma_i32_") for mn in r.matrix_instructions), r.matrix_instructions
    assert r.matrix_in_main_loop > 0
    assert r.spills == 0 and r.scratch_bytes == 0
    assert r.lds_bytes <= r.lds_limit


# ----------------------------------------------------------------------------------------------
# stage 1 emitting int8 + group scales (stage2_quant="stage1"): exact to the reference of that math

@pytest.mark.parametrize("bn,w_rows", [(32, 1), (16, 0)])
def test_stage1_w4a8_q_matches_stage1_then_group_quant(bn, w_rows):
    """moe_stage1_w4a8_q == group-quant (group BLOCK_N) of moe_stage1_w4a8's bf16 rows, bit for bit."""
    E, H, I, K, M = 16, 64, 64, 4, 5
    W = make_weights("w4a8", E, H, I, seed=11)
    g = torch.Generator().manual_seed(12 + bn)
    x8 = torch.randint(-127, 128, (M, H), generator=g, dtype=torch.int8)
    xs = torch.rand(M, generator=g) * 0.02 + 1e-3
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    sid, bexp = moe.moe_align(ids, E, 16)
    S = sid.numel()
    cfg = {"BLOCK_N": bn, "BLOCK_K": 32, "W_ROWS": w_rows}
    hb = poisoned((S, I), torch.bfloat16)
    moe.moe_stage1_w4a8(x8, xs, W.w13, W.s13, sid, bexp, hb, K, config=cfg)
    q, s = poisoned((S, I), torch.int8), poisoned((S, I // bn), torch.float32)
    moe.moe_stage1_w4a8_q(x8, xs, W.w13, W.s13, sid, bexp, q, s, K, config=cfg)
    real = sid < M * K
    q_ref, s_ref = moe.quant_groups_int8_ref(hb[real], bn)
    assert torch.equal(q[real], q_ref) and torch.equal(s[real], s_ref)


@pytest.mark.parametrize("w_rows", [0, 1])
def test_stage2_w4a8_gq_exact(w_rows):
    """Random int8 rows and group scales: the partial rows equal the reference's K-ordered f32 sum."""
    E, H, I, K, M, G = 16, 64, 64, 4, 3, 32
    W = make_weights("w4a8", E, H, I, seed=13)
    g = torch.Generator().manual_seed(14 + w_rows)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    wts = torch.rand(M, K, generator=g)
    sid, bexp = moe.moe_align(ids, E, 16)
    S, T = sid.numel(), M * K
    hq = torch.randint(-127, 128, (S, I), generator=g).to(torch.int8)
    hs = torch.rand(S, I // G, generator=g) * 0.01 + 1e-4
    part = poisoned((T, H), torch.float32)
    moe.moe_stage2_w4a8_gq(hq, hs, W.w2, W.s2, sid, bexp, wts.reshape(-1), torch.empty(0, H), part, K,
                           config={"REDUCE": "partial", "BLOCK_K": G, "BLOCK_N": 32, "W_ROWS": w_rows})
    from ops.packing import unpack_int4

    w2 = unpack_int4(W.w2, "quark_reorder").double()
    for srow, t in enumerate(sid.tolist()):
        if t < T:
            e = int(ids.reshape(-1)[t])
            acc = torch.zeros(H)
            for j in range(I // G):
                c = slice(j * G, (j + 1) * G)
                acc = acc + (w2[e][:, c] @ hq[srow, c].double()).float() * hs[srow, j]
            assert torch.equal(part[t], acc * W.s2[e] * wts.reshape(-1)[t]), f"row {t}"


@pytest.mark.parametrize("M,reduce", [(1, "atomic"), (4, "partial")])
def test_experts_w4a8_stage1_quant(M, reduce):
    W = make_weights("w4a8", KIMI_SMALL["E"], KIMI_SMALL["H"], KIMI_SMALL["I"], seed=20 + M)
    x, wg, bias = make_inputs(M, KIMI_SMALL["E"], KIMI_SMALL["H"], seed=21 + M)
    ids, wts = moe.route(x, wg, bias, KIMI_SMALL["top_k"], backend="torch", routed_scaling_factor=2.827)
    cfg = {"stage2_quant": "stage1", "stage1": {"BLOCK_N": 32, "BLOCK_K": 64},
           "stage2": {"BLOCK_N": 64, "REDUCE": reduce}}
    y = moe.fused_experts(x, ids, wts, W, config=cfg)
    ref = moe.experts_ref_gq(x, ids, wts, W, 32)
    assert y.shape == (M, KIMI_SMALL["H"]) and torch.isfinite(y).all()
    torch.testing.assert_close(y, ref, atol=1e-2 * ref.abs().max().item(), rtol=0)
    old = moe.fused_experts(x, ids, wts, W, backend="torch")  # per-row quant: close, not equal
    torch.testing.assert_close(y, old, atol=5e-2 * old.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="BLOCK_N"):
        moe.fused_experts(x, ids, wts, W, config={**cfg, "stage1": {"BLOCK_N": 16}})


def test_experts_w4a16_w_rows():
    """W4A16 stages with the weight rows on the dot's M side (W_ROWS 1) vs the torch reference."""
    W = make_weights("w4a16", KIMI_SMALL["E"], KIMI_SMALL["H"], KIMI_SMALL["I"], seed=31)
    x, wg, bias = make_inputs(3, KIMI_SMALL["E"], KIMI_SMALL["H"], seed=32)
    ids, wts = moe.route(x, wg, bias, KIMI_SMALL["top_k"], backend="torch", routed_scaling_factor=2.827)
    cfg = {"stage1": {**FAST["stage1"], "W_ROWS": 1}, "stage2": {**FAST["stage2"], "W_ROWS": 1, "REDUCE": "partial"}}
    y = moe.fused_experts(x, ids, wts, W, config=cfg)
    ref = moe.fused_experts(x, ids, wts, W, backend="torch")
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, ref, atol=1e-2 * ref.abs().max().item(), rtol=0)
