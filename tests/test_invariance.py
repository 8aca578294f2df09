"""Batch-invariant numerics (issue 14.5): a row's result depends neither on the batch it runs in nor
on q_len, bit for bit, on the interpreter.

The split plans of a 304-CU gfx942, a 256-CU gfx950 and a 132-SM sm90 are passed explicitly
(`cu_count`): in invariant mode (the default) they change nothing; the tuned configs of gfx942 and
gfx950 at the Kimi shapes are reduced by `invariant_config` to one numerics choice for every M
and q_len, then run on small shapes. `invariant=False` shows what the split count would depend on.
"""
from __future__ import annotations

import pytest
import torch

from ops import gemm, mha, mla, moe
from autotune.problems import launch_only_keys
from ops._common import invariant_config
from ops.packing import pack_int4

PLANS = {"gfx942": 304, "gfx950": 256, "sm90": 132}
DL, DR, H, PS = 32, 16, 4, 8
CTX = 200  # two 128-token splits (SPLIT_TOKENS 128 keeps the interpreter runs short)
ST = {"SPLIT_TOKENS": 128}


def _numerics(cfg: dict, kernel) -> dict:
    """The keys that set the kernel's bits (num_warps too where it sums floats across lanes)."""
    keys = launch_only_keys(kernel, cfg)
    return {k: v for k, v in cfg.items() if k not in keys}


def _mla_case(lens, seed=0, mp=None):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    mp = mp or max(-(-n // PS) for n in lens) + 1
    npages = B * mp + 2
    kv = torch.randn(npages, PS, DL + DR, generator=g).bfloat16()
    bt = torch.randperm(npages, generator=g)[: B * mp].view(B, mp).to(torch.int32)
    return kv, bt


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_tuned_configs_reduce_to_one_numerics_choice(arch: str) -> None:
    """Decode (q_len 1) and verify (q_len 4) at every batch get the same numerics keys, those of the
    q_len-1, M=1 entry; the tuned files agree with it (the tuner picks one tile per problem and takes
    the verify problem's from the decode file), so no bucket runs a tile it was not tuned with."""
    from autotune import lookup_config

    p1 = {"QL": 1, "H": 64, "DL": 512, "DR": 64, "PS": 64}
    p4 = {**p1, "QL": 4}
    seen = {str(_numerics(invariant_config(mla.mla_decode_split, p, m, None, p1, arch=arch), mla.mla_decode_split))
            for p in (p1, p4) for m in (1, 4, 8, 32, 256)}
    assert len(seen) == 1
    for h in (8, 64):
        raw = {str(_numerics(lookup_config(mla.mla_decode_split, arch, {**p, "H": h}, m), mla.mla_decode_split))
               for p in (p1, p4) for m in (1, 4, 32, 128)}
        assert raw == seen if h == 64 else len(raw) == 1
    g = {"N": 1536, "K": 7168}  # a float-accumulating GEMM: one choice
    assert len({str(_numerics(invariant_config(gemm.gemm_bf16_kernel, g, m, None, arch=arch), gemm.gemm_bf16_kernel))
                for m in (1, 8, 64, 256)}) == 1
    g4 = {"N": 4096, "K": 7168}  # integer accumulation is exact: the tuned per-bucket configs stay
    for m in (1, 64):
        assert invariant_config(gemm.gemm_w4a8_kernel, g4, m, None, arch=arch) == lookup_config(
            gemm.gemm_w4a8_kernel, arch, g4, m)
    s2 = {"E": 384, "H": 7168, "I": 2048, "TOPK": 8}
    c2 = [moe._stage_configs(None, "w4a8", 384, 7168, 2048, 8, m, True)[1] for m in (1, 64)] if arch == "gfx942" else []
    assert all(c["REDUCE"] == "partial" for c in c2)
    assert len({str(_numerics(invariant_config(moe.moe_stage2_w4a16, s2, m, None, arch=arch), moe.moe_stage2_w4a16)) for m in (1, 64)}) == 1


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_combine_uv_tuned_files_share_one_split_tile(arch: str) -> None:
    """mla_combine_uv's launches take BLOCK_S (and every other numerics key) from the M=1 entry at
    any M; the tuner picks that tile jointly (shared numerics), so every bucket of a file has it."""
    from autotune import lookup_config
    from ops.mla_fused import mla_combine_uv

    for h in (8, 64):
        p = {"H": h, "DL": 512, "V": 128}
        ms = (1, 2, 8, 64, 128)
        raw = {str(_numerics(lookup_config(mla_combine_uv, arch, p, m), mla_combine_uv)) for m in ms}
        inv = {str(_numerics(invariant_config(mla_combine_uv, p, m, None, arch=arch), mla_combine_uv)) for m in ms}
        assert len(raw) == 1 and raw == inv and "BLOCK_S" in raw.pop()


def _kimi_cfg(kern, arch, problem, m, ref):
    """The invariant config tuned at the Kimi shape, minus the keys that only size GPU launches."""
    return invariant_config(kern, problem, m, None, ref, arch=arch)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_mla_verify_row0_equals_decode_and_batch1_equals_batch8(arch: str) -> None:
    cu = PLANS[arch]
    lens8 = [CTX, 37, 260, 5, 129, 9, 64, 20]
    kv, bt = _mla_case([n + 3 for n in lens8], seed=1)
    g = torch.Generator().manual_seed(2)
    q4 = torch.randn(8, 4, H, DL + DR, generator=g).bfloat16()
    p1 = {"QL": 1, "H": 64, "DL": 512, "DR": 64, "PS": 64}
    if arch in ("gfx942", "gfx950"):  # the tuned numerics choice of that arch, on these small shapes
        cfg = {k: v for k, v in _kimi_cfg(mla.mla_decode_split, arch, p1, 1, p1).items()
               if k not in ("matrix_instr_nonkdim", "kpack", "waves_per_eu", "DL_SPLIT")}  # DL_SPLIT: DL 512 blocks
    else:
        cfg = {}
    cfg = {**cfg, **ST}
    run = lambda q, lens, bt_, **kw: mla.mla_decode(q, kv, bt_, torch.tensor(lens, dtype=torch.int32), 0.3,  # noqa: E731
                                                    latent_dim=DL, out_dtype=torch.float32, cu_count=cu,
                                                    config=cfg, **kw)
    verify = run(q4, [n + 3 for n in lens8], bt)
    decode = run(q4[:, :1].contiguous(), lens8, bt)
    assert torch.equal(verify[:, 0], decode[:, 0])  # q_len 4 row 0 == q_len 1, every sequence
    # batch 1, a narrower table, the sm90 split plan
    one = mla.mla_decode(q4[:1, :1].contiguous(), kv, bt[:1, : -(-CTX // PS)], torch.tensor([CTX], dtype=torch.int32),
                         0.3, latent_dim=DL, out_dtype=torch.float32, cu_count=PLANS["sm90"], config=cfg)
    assert torch.equal(one[0], decode[0])
    b16 = mla.mla_decode(q4[:1, :1].contiguous(), kv, bt[:1], torch.tensor([CTX], dtype=torch.int32), 0.3,
                         latent_dim=DL, cu_count=PLANS["gfx950"], config=cfg)  # bf16 output too
    assert torch.equal(b16.float()[0], decode[0].bfloat16().float())
    # what invariance replaces: the CU-sized split count depends on the batch
    # (Kimi: 64 heads, 8k context: 32 splits at batch 1, 2-3 at batch 64); the invariant plan is fixed
    assert mla.num_splits([8192], 1, 64, cu_count=cu) == 32 and mla.num_splits([8192] * 64, 1, 64, cu_count=cu) <= 3
    assert mla.invariant_splits(8192) == 32


def test_mha_verify_and_tree_row0_equal_decode_and_batch1_equals_batch8() -> None:
    """Decode, verify and tree verify (whose kernel defaults to a smaller BLOCK_N) reduce alike."""
    cu = PLANS["gfx942"]
    g = torch.Generator().manual_seed(3)
    lens8 = [CTX, 20, 260, 9, 129, 13, 64, 30]
    mp = max(-(-(n + 3) // PS) for n in lens8) + 1
    NP, KVH, D, HQ = 8 * mp + 2, 2, 16, 4
    kc = torch.randn(NP, PS, KVH, D, generator=g).bfloat16()
    vc = torch.randn(NP, PS, KVH, D, generator=g).bfloat16()
    bt = torch.randperm(NP, generator=g)[: 8 * mp].view(8, mp).to(torch.int32)
    q4 = torch.randn(8, 4, HQ, D, generator=g).bfloat16()
    L = lambda ls: torch.tensor(ls, dtype=torch.int32)  # noqa: E731
    run = lambda q, lens, bt_, **kw: mha.paged_mha_decode(q, kc, vc, bt_, L(lens), 0.25, cu_count=cu,  # noqa: E731
                                                          config=dict(ST), **kw)
    decode = run(q4[:, :1].contiguous(), lens8, bt)
    verify = run(q4, [n + 3 for n in lens8], bt)
    tree = run(q4, [n + 3 for n in lens8], bt, tree_mask=torch.ones(8, 4, 4, dtype=torch.int8).tril())
    assert torch.equal(verify[:, 0], decode[:, 0]) and torch.equal(tree[:, 0], decode[:, 0])
    one = mha.paged_mha_decode(q4[:1, :1].contiguous(), kc, vc, bt[:1, : -(-CTX // PS)], L(lens8[:1]), 0.25,
                               cu_count=PLANS["sm90"], config=dict(ST))
    assert torch.equal(one[0], decode[0])


def _moe_weights(fmt: str, E: int, Hd: int, I: int, seed: int) -> moe.MoEWeights:
    g = torch.Generator().manual_seed(seed)
    if fmt == "bf16":
        return moe.MoEWeights("bf16", (torch.randn(E, 2 * I, Hd, generator=g) * 0.2).bfloat16(),
                              (torch.randn(E, Hd, I, generator=g) * 0.2).bfloat16())
    q13 = torch.randint(-8, 8, (E, 2 * I, Hd), generator=g, dtype=torch.int32)
    q2 = torch.randint(-8, 8, (E, Hd, I), generator=g, dtype=torch.int32)
    return moe.MoEWeights("w4a8", pack_int4(q13, "quark_reorder"), pack_int4(q2, "quark_reorder"),
                          torch.rand(E, 2 * I, generator=g) * 0.01, torch.rand(E, Hd, generator=g) * 0.01)


@pytest.mark.parametrize("fmt", ["bf16"])  # w4a8 adds only row-wise (invariant) quantization; slow here
def test_moe_batch1_equals_batch8(fmt: str) -> None:
    E, Hd, I = 8, 64, 32
    w = _moe_weights(fmt, E, Hd, I, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, Hd, generator=g).bfloat16()
    wg = (torch.randn(E, Hd, generator=g) * 0.2).bfloat16()
    bias = torch.randn(E, generator=g) * 0.01
    cfg = moe.MoEConfig(top_k=3, routed_scaling_factor=1.7)
    eight = moe.fused_moe(x, wg, bias, w, cfg=cfg)
    for i in (0, 5):
        one = moe.fused_moe(x[i:i + 1].contiguous(), wg, bias, w, cfg=cfg)
        assert torch.equal(one[0], eight[i])
    ids8, w8 = moe.route(x, wg, bias, 3)
    ids1, w1 = moe.route(x[:1].contiguous(), wg, bias, 3)
    assert torch.equal(ids1[0], ids8[0]) and torch.equal(w1[0], w8[0])


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_gemm_rows_batch1_equals_batch8(arch: str) -> None:
    """A GEMM row is the same alone and in a batch of 8 with the arch's invariant W4A8 / bf16 tiles."""
    g = torch.Generator().manual_seed(6)
    M, N, K = 8, 64, 512
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.1).bfloat16()
    w4 = pack_int4(torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int32), "quark_reorder")
    ws = torch.rand(N, generator=g) * 0.01
    from autotune import lookup_config

    trim = lambda c: {k: v for k, v in c.items() if k not in ("matrix_instr_nonkdim", "kpack", "waves_per_eu")}  # noqa: E731
    # W4A8 (exact i32 accumulation): batch 8 with the bucket-64 tiles == batch 1 with the bucket-1 tiles
    c64 = trim(lookup_config(gemm.gemm_w4a8_kernel, arch, {"N": 4096, "K": 7168}, 64))
    c1 = trim(lookup_config(gemm.gemm_w4a8_kernel, arch, {"N": 4096, "K": 7168}, 1))
    assert c64 != c1
    a8 = gemm.linear_w4a8(x, w4, ws, config=c64)
    a1 = gemm.linear_w4a8(x[:1].contiguous(), w4, ws, config=c1)
    assert torch.equal(a1[0], a8[0])
    # bf16 (f32 accumulation): the one invariant choice at both batch sizes
    cb = trim(invariant_config(gemm.gemm_bf16_kernel, {"N": 1536, "K": 7168}, M, None, arch=arch))
    b8 = gemm.gemm_bf16(x, w, config=cb)
    b1 = gemm.gemm_bf16(x[3:4].contiguous(), w, config=cb)
    assert torch.equal(b1[0], b8[3])


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_mla_front_split_k_rows_batch1_equal_batch8(arch: str) -> None:
    """The MLA front's q_a|kv_a GEMM split along K (one tuned SPLIT_K and tile for every M) and its two
    consumers (q_b GEMM with the q_a norm, the kv cache append) with the arch's invariant configs: a
    row alone gives the bits it gives in a batch of 8 (partials, the q_b GEMM's own split-K partials,
    the absorbed query and its cache row)."""
    trim = lambda c: {k: v for k, v in c.items() if k not in ("matrix_instr_nonkdim", "kpack", "waves_per_eu")}  # noqa: E731
    from ops import mla_fused

    cs = [trim(invariant_config(gemm.gemm_bf16_splitk_kernel, {"N": 2112, "K": 7168}, m, None, arch=arch))
          for m in (1, 2, 8, 32, 128)]
    assert all(_numerics(c, gemm.gemm_bf16_splitk_kernel) == _numerics(cs[0], gemm.gemm_bf16_splitk_kernel) for c in cs) and cs[0]["SPLIT_K"] > 1
    cfg = cs[0]
    g = torch.Generator().manual_seed(7)
    M, QL, C, R, HQ, NOPE = 8, 32, 32, 8, 2, 16
    K = cfg["BLOCK_K"] * cfg["SPLIT_K"] - 40  # a short last split
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(QL + C + R, K, generator=g) * 0.1).bfloat16()
    wqn, wkv = torch.randn(QL, generator=g).bfloat16(), torch.randn(C, generator=g).bfloat16()
    wqb = (torch.randn(HQ * (NOPE + R), QL, generator=g) * 0.2).bfloat16()
    wuk = (torch.randn(HQ, NOPE, C, generator=g) * 0.3).bfloat16()
    ang = torch.rand(M, R // 2, generator=g) * 6.0
    cq = trim(invariant_config(gemm.gemm_bf16_rmsnorm_kernel, {"N": 1536, "K": 1536}, M, None, arch=arch))
    ca = trim(invariant_config(mla_fused.mla_q_absorb_kv, {"H": 8, "NOPE": 128, "DL": 512, "R2": 32}, M, None,
                               arch=arch))

    def front(rows: slice):
        part = gemm.gemm_bf16_splitk(x[rows], w, config=cfg)
        q = gemm.gemm_bf16_rmsnorm(part[:, :, :QL], wqn, wqb, 1e-6, config=cq, partials=True)
        kv = torch.full((2, 8, C + R), float("nan"), dtype=torch.bfloat16)
        n = q.shape[1]
        qf = mla_fused.q_absorb_append(q.view(q.shape[0], n, HQ, NOPE + R), wuk, ang[rows].cos(), ang[rows].sin(),
                                       part[:, :, QL:], wkv, torch.arange(n), kv, 1e-6, config=ca)
        return part, q, qf, kv.view(-1, C + R)[:n]

    p8, q8, f8, kv8 = front(slice(0, 8))
    p1, q1, f1, kv1 = front(slice(0, 1))
    assert p8.shape[0] == cfg["SPLIT_K"] and q8.shape[0] == cq.get("SPLIT_K", 1)
    assert torch.equal(p1[:, 0], p8[:, 0]) and torch.equal(q1[:, 0], q8[:, 0]) and torch.equal(kv1[0], kv8[0])
    assert torch.equal(f1[0], f8[0])
    assert not kv8.isnan().any()


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_residual_chain_rows_batch1_equal_batch8(arch: str) -> None:
    """The world-size-1 residual chain with the arch's invariant configs: o_proj split along K (one
    tuned SPLIT_K and tile at every M), the residual-add norms summing its partials, and the next
    q_a|kv_a GEMM norming the f32 residual rows in its prologue: a row alone gives the bits it gives
    in a batch of 8 (BLOCK_D is launch-only and left at the row-wide default on these short rows)."""
    from ops import norm

    trim = lambda c: {k: v for k, v in c.items() if k not in ("matrix_instr_nonkdim", "kpack", "waves_per_eu")}  # noqa: E731
    cs = [trim(invariant_config(gemm.gemm_bf16_splitk_kernel, {"N": 7168, "K": 8192}, m, None, arch=arch))
          for m in (1, 8, 128)]
    assert all(_numerics(c, gemm.gemm_bf16_splitk_kernel) == _numerics(cs[0], gemm.gemm_bf16_splitk_kernel) for c in cs)
    cfg = cs[0]
    S = cfg["SPLIT_K"]
    g = torch.Generator().manual_seed(9)
    M, D, N = 8, 96, 40
    K = cfg["BLOCK_K"] * S - 24  # a short last split
    o = torch.randn(M, K, generator=g).bfloat16()
    wo = (torch.randn(D, K, generator=g) * 0.1).bfloat16()
    res = torch.randn(M, D, generator=g).bfloat16()
    wn = (torch.rand(D, generator=g) + 0.5).bfloat16()
    wq = (torch.randn(N, D, generator=g) * 0.1).bfloat16()

    def norm_cfg(kernel):
        c = trim(invariant_config(kernel, {"D": 7168, "S": S}, M, None, arch=arch))
        c.pop("BLOCK_D", None)
        return c

    cn, cnq = norm_cfg(norm.rmsnorm_add_splitk), norm_cfg(norm.rmsnorm_add_quant_splitk)
    cr = trim(invariant_config(gemm.gemm_bf16_rmsnorm_kernel, {"N": 2112, "K": 7168}, M, None, arch=arch))

    def chain(rows: slice):
        part = gemm.gemm_bf16_splitk(o[rows], wo, config=cfg)
        y, r = norm.rms_norm(part, wn, 1e-6, residual=res[rows], config=cn)
        q8, sc, yq, rq = norm.rms_norm_quant(part, wn, 1e-6, residual=res[rows], config=cnq)
        front = gemm.gemm_bf16_rmsnorm(r.float().unsqueeze(0), wn, wq, 1e-6, config=cr, partials=True)
        return part.transpose(0, 1), y, r, q8, sc, yq, rq, front.transpose(0, 1)

    a8, a1 = chain(slice(0, 8)), chain(slice(3, 4))
    assert a8[0].shape[1] == S
    for t8, t1 in zip(a8, a1):
        assert torch.equal(t1[0], t8[3])
    assert not any(t.float().isnan().any() for t in a8)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("quant", [False, True])
def test_o_proj_norm_tail_rows_batch1_equal_batch8(arch: str, quant: bool) -> None:
    """o_proj with the residual-add norm in its last programs (ops.splitk_norm) at the arch's
    invariant config (one numerics choice at every M): a row alone gives the bits it gives in a batch
    of 8, and the bits of the two-launch chain at that split and tile."""
    from ops import norm, splitk_norm as sn

    trim = lambda c: {k: v for k, v in c.items() if k not in ("matrix_instr_nonkdim", "kpack", "waves_per_eu")}  # noqa: E731
    kern = sn.KERNELS[quant]
    cs = [trim(invariant_config(kern, {"D": 7168, "K": 8192}, m, None, arch=arch)) for m in (1, 8, 128)]
    assert all(_numerics(c, kern) == _numerics(cs[0], kern) for c in cs)
    cfg = cs[0]
    S = cfg["SPLIT_K"]
    g = torch.Generator().manual_seed(11)
    M, D = 8, 96
    K = cfg["BLOCK_K"] * S - 24  # a short last split
    o = torch.randn(M, K, generator=g).bfloat16()
    wo = (torch.randn(D, K, generator=g) * 0.1).bfloat16()
    res = torch.randn(M, D, generator=g).bfloat16()
    wn = (torch.rand(D, generator=g) + 0.5).bfloat16()
    counters = sn.counters_for(M, D, "cpu")

    def fused(rows: slice):
        return sn.gemm_splitk_add_norm(o[rows], wo, res[rows], wn, 1e-6, counters, quant, config=cfg)

    a8, a1 = fused(slice(0, 8)), fused(slice(3, 4))
    for t8, t1 in zip(a8, a1):
        assert torch.equal(t1[0], t8[3])
    part = gemm.gemm_bf16_splitk(o, wo, config=cfg)
    chain = (norm.rms_norm_quant if quant else norm.rms_norm)(part, wn, 1e-6, residual=res)
    for a, b in zip(a8, chain):
        assert torch.equal(a, b)
    assert not counters.any()


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_swiglu_rows_batch1_equal_batch8(arch: str) -> None:
    """The shared expert's down GEMM over split-K partials: each batch size runs its own bucket's
    BLOCK_M and N_TILES (launch-only) with the M=1 entry's numerics tile, and a row's bits are the
    same alone and in a batch of 8 (with 64 and 128 rows' configs too)."""
    from ops import swiglu

    g = torch.Generator().manual_seed(9)
    S, M, I, N = 8, 8, 32, 96
    part = torch.randn(S, M, 2 * I, generator=g)
    w = (torch.randn(N, I, generator=g) * 0.2).bfloat16()
    prob = {"N": 7168, "I": 256, "S": 8}
    cfg = {m: invariant_config(swiglu.gemm_bf16_swiglu_kernel, prob, m, None, arch=arch) for m in (1, 8, 128)}
    assert len({str(_numerics(c, swiglu.gemm_bf16_swiglu_kernel)) for c in cfg.values()}) == 1
    assert len({(c.get("BLOCK_M"), c.get("N_TILES")) for c in cfg.values()}) > 1   # the launch keys do vary
    one = swiglu.gemm_bf16_swiglu(part[:, 3:4], w, config=cfg[1])
    for m in (8, 128):
        assert torch.equal(swiglu.gemm_bf16_swiglu(part, w, config=cfg[m])[3], one[0])


@pytest.mark.parametrize("arch,S", [("gfx942", 4), ("gfx950", 8)])
def test_swiglu_combine_rows_batch1_equal_batch8(arch: str, S: int) -> None:
    """The shared expert's down GEMM ending a MoE layer (the top-k sum and the residual add in its
    epilogue) at the Kimi TP1 problem's tuned configs: one numerics choice for every M, and a token's
    new residual row has the same bits alone and in a batch of 8 (with 64 and 128 rows' configs too)."""
    from ops import swiglu

    g = torch.Generator().manual_seed(10)
    M, I, N, K, E = 8, 32, 96, 4, 16
    part = torch.randn(S, M, 2 * I, generator=g)
    w = (torch.randn(N, I, generator=g) * 0.2).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    partial = torch.randn(M * K, N, generator=g)
    res = torch.randn(M, N, generator=g).bfloat16()
    kern = swiglu.gemm_bf16_swiglu_combine_kernel
    prob = {"N": 7168, "I": 2048, "S": S, "TOPK": 8}
    cfg = {m: invariant_config(kern, prob, m, None, arch=arch) for m in (1, 8, 128)}
    assert len({str(_numerics(c, kern)) for c in cfg.values()}) == 1
    r1 = res[3:4].clone()
    one = swiglu.gemm_bf16_swiglu_combine(part[:, 3:4], w, partial[3 * K:4 * K], ids[3:4], r1, E, config=cfg[1])
    for m in (8, 128):
        r = res.clone()
        rows = swiglu.gemm_bf16_swiglu_combine(part, w, partial, ids, r, E, config=cfg[m])
        assert torch.equal(rows[3], one[0]) and torch.equal(r[3], r1[0])


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("kind,n_kimi", [(0, 2112), (1, 896), (1, 1408), (2, 896), (2, 1408), (3, 4480), (4, 4480)])
def test_addnorm_rows_batch1_equal_batch8(arch: str, kind: int, n_kimi: int) -> None:
    """The residual add and norm (after a world-size > 1 all-reduce, or world size 1's o_proj) in the
    prologue of the GEMM that reads the normed rows (ops.gemm_addnorm: the q_a|kv_a GEMM; the shared
    gate|up + router at TP8 and TP4, storing the normed rows too, W4A8: and their int8 quant; at TP1
    over o_proj's split-K partials, S of the arch) at the Kimi shapes' tuned configs: one numerics
    choice for every M, and a token's partials, new residual (normed row, codes and scale) have the
    same bits alone and in a batch of 8 (with 64 and 128 rows' launch keys too)."""
    from ops import gemm_addnorm

    g = torch.Generator().manual_seed(12)
    M, N, K = 8, 48, 160
    x, res = torch.randn(M, K, generator=g).bfloat16(), (torch.randn(M, K, generator=g) * 4).bfloat16()
    xw, w = torch.randn(K, generator=g).bfloat16(), (torch.randn(N, K, generator=g) * 0.2).bfloat16()
    kern = gemm_addnorm.KERNELS[kind]
    flags = {"normed": kind in (1, 3), "quant": kind in (2, 4)}
    prob = {"N": n_kimi, "K": 7168}
    if kind >= 3:                                        # o_proj's S split-K partials in (S of the arch's files)
        prob["S"] = {"gfx942": 4, "gfx950": 2}[arch]
        x = torch.randn(prob["S"], M, K, generator=g)
    trim = lambda c: {k: v for k, v in c.items() if k not in ("matrix_instr_nonkdim", "kpack", "waves_per_eu")}  # noqa: E731
    cfg = {m: trim(invariant_config(kern, prob, m, None, arch=arch)) for m in (1, 8, 64, 128)}
    assert len({str(_numerics(c, kern)) for c in cfg.values()}) == 1
    for t in (0, 5):
        one = gemm_addnorm.gemm_bf16_addnorm(x[..., t:t + 1, :], res[t:t + 1], xw, w, 1e-6, config=cfg[1],
                                             partials=True, **flags)
        for m in (8, 64, 128):
            many = gemm_addnorm.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg[m], partials=True, **flags)
            assert torch.equal(many[0][:, t], one[0][:, 0])
            assert all(torch.equal(a[t], b[0]) for a, b in zip(many[1:], one[1:]))


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_swiglu_rank_rows_batch1_equal_batch8(arch: str) -> None:
    """A rank's MoE layer end at world size > 1 (the shared down GEMM with the rank's top-k sum in its
    epilogue) at the Kimi TP8 problem's tuned configs: one numerics choice for every M, and a token's
    row has the same bits alone and in a batch of 8 (with 64 and 128 rows' configs too)."""
    from ops import swiglu

    g = torch.Generator().manual_seed(11)
    S, M, I, N, K, E = 8, 8, 32, 96, 4, 16
    part = torch.randn(S, M, 2 * I, generator=g)
    w = (torch.randn(N, I, generator=g) * 0.2).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    ids[2, 1] = -1                                   # another expert-parallel rank's expert
    partial = torch.randn(M * K, N, generator=g)
    kern = swiglu.gemm_bf16_swiglu_rank_kernel
    prob = {"N": 7168, "I": 256, "S": S, "TOPK": 8}
    cfg = {m: invariant_config(kern, prob, m, None, arch=arch) for m in (1, 8, 128)}
    assert len({str(_numerics(c, kern)) for c in cfg.values()}) == 1
    for t in (2, 3):
        one = swiglu.gemm_bf16_swiglu_rank(part[:, t:t + 1], w, partial[t * K:(t + 1) * K], ids[t:t + 1], E,
                                           config=cfg[1])
        for m in (8, 128):
            assert torch.equal(swiglu.gemm_bf16_swiglu_rank(part, w, partial, ids, E, config=cfg[m])[t], one[0])
