"""Bad inputs to the ops (issue 11, items 3, 4, 10): argument checks by name, the same rules on both
backends, out-of-range values as defined no-ops, routing that cannot produce an invalid id.

Out-of-range page-table entries and slots are read back through views of a bigger buffer whose
guard regions are poisoned (NaN / a sentinel), so a stray read or write shows in the result."""
from __future__ import annotations

import math

import pytest
import torch

from ops import fmha, gemm, mha, mla, moe, norm, quant, rope
from ops._common import set_validate

DL, DR, H, PS = 32, 16, 4, 8
BACKENDS = ["triton", "torch"]
# Loads and stores through an out-of-range table entry or slot are bounded by the DSL (bounded
# gathers: such a load reads 0, such a store is dropped), so both backends leave the guard regions alone.
TRITON_BOUNDED = "triton"


def _rand(*shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _guarded(inner: torch.Tensor, guard_pages: int = 2, fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, buffer): `inner` copied into the middle of a bigger buffer along dim 0, poisoned around it."""
    n = inner.shape[0]
    buf = torch.full((n + 2 * guard_pages, *inner.shape[1:]), fill, dtype=inner.dtype)
    buf[guard_pages:guard_pages + n] = inner
    return buf[guard_pages:guard_pages + n], buf


def _mla_setup(lens, q_len, seed=0, mp=None):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    mp = mp or max(-(-n // PS) for n in lens) + 1
    npages = B * mp + 1
    kv = torch.randn(npages, PS, DL + DR, generator=g).bfloat16()
    bt = torch.randperm(npages, generator=g)[: B * mp].view(B, mp).to(torch.int32)
    q = torch.randn(B, q_len, H, DL + DR, generator=g).bfloat16()
    return q, kv, bt, torch.tensor(lens, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# paged attention: lengths, table entries, slots

@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_length_past_table_is_clamped(backend: str) -> None:
    """A length the table cannot hold attends over the table's capacity (both backends agree)."""
    q, kv, bt, lens = _mla_setup([9, 20], 1, seed=1)
    cap = bt.shape[1] * PS
    view, buf = _guarded(kv)
    big = torch.tensor([9, cap + 50], dtype=torch.int32)
    out = mla.mla_decode(q, view, bt, big, 0.3, latent_dim=DL, backend=backend)
    want = mla.mla_decode(q, view, bt, torch.tensor([9, cap], dtype=torch.int32), 0.3, latent_dim=DL, backend="torch")
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_zero_and_negative_lengths_give_zero_rows(backend: str) -> None:
    q, kv, bt, _ = _mla_setup([9, 20], 1, seed=2)
    out = mla.mla_decode(q, kv, bt, torch.tensor([0, -5], dtype=torch.int32), 0.3, latent_dim=DL, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("backend", ["torch", TRITON_BOUNDED])
@pytest.mark.parametrize("bad", [-1, "NP"])
def test_mla_out_of_range_page_reads_zero(backend: str, bad) -> None:
    """A table entry outside [0, num_pages) is never wrapped: its tokens read as zeros (K = V = 0),
    on both backends, and nothing of the poisoned guard pages around the cache reaches the output."""
    q, kv, bt, lens = _mla_setup([12, 20], 1, seed=3)
    view, _ = _guarded(kv)
    bad_bt = bt.clone()
    bad_bt[1, 1] = kv.shape[0] if bad == "NP" else bad
    out = mla.mla_decode(q, view, bad_bt, lens, 0.3, latent_dim=DL, backend=backend)
    assert not out.isnan().any()
    # the same as a cache whose page there holds zeros
    zkv = torch.cat([kv, torch.zeros(1, PS, DL + DR, dtype=kv.dtype)])
    zbt = bt.clone()
    zbt[1, 1] = kv.shape[0]
    want = mla.mla_decode_ref(q, zkv, zbt, lens, 0.3, DL)
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=0)
    # and -1 is not the last page (the torch backend used to wrap it)
    wrap = bt.clone()
    wrap[1, 1] = kv.shape[0] - 1
    assert (out.double() - mla.mla_decode_ref(q, kv, wrap, lens, 0.3, DL)).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["torch", TRITON_BOUNDED])
def test_mha_out_of_range_page_reads_zero(backend: str) -> None:
    g = torch.Generator().manual_seed(4)
    NP, D = 7, 16
    kc, vc = torch.randn(NP, PS, 2, D, generator=g).bfloat16(), torch.randn(NP, PS, 2, D, generator=g).bfloat16()
    kv_, _ = _guarded(kc)
    vv_, _ = _guarded(vc)
    bt = torch.tensor([[0, 3, 5], [1, -1, 6]], dtype=torch.int32)
    lens = torch.tensor([17, 20], dtype=torch.int32)
    q = torch.randn(2, 1, 4, D, generator=g).bfloat16()
    out = mha.paged_mha_decode(q, kv_, vv_, bt, lens, 0.25, backend=backend)
    assert not out.isnan().any()
    zk = torch.cat([kc, torch.zeros(1, PS, 2, D, dtype=kc.dtype)])
    zv = torch.cat([vc, torch.zeros(1, PS, 2, D, dtype=vc.dtype)])
    zbt = bt.clone()
    zbt[1, 1] = NP
    torch.testing.assert_close(out.double(), mha.mha_decode_ref(q, zk, zv, zbt, lens, 0.25), atol=1e-2, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mha_length_past_table_is_clamped(backend: str) -> None:
    g = torch.Generator().manual_seed(5)
    NP, D = 7, 16
    kc, vc = torch.randn(NP, PS, 2, D, generator=g).bfloat16(), torch.randn(NP, PS, 2, D, generator=g).bfloat16()
    bt = torch.tensor([[0, 3], [1, 6]], dtype=torch.int32)
    q = torch.randn(2, 1, 4, D, generator=g).bfloat16()
    out = mha.paged_mha_decode(q, kc, vc, bt, torch.tensor([9, 1000], dtype=torch.int32), 0.25, backend=backend)
    want = mha.mha_decode_ref(q, kc, vc, bt, torch.tensor([9, 16], dtype=torch.int32), 0.25)
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=0)


@pytest.mark.parametrize("backend", ["torch", TRITON_BOUNDED])
def test_append_kv_skips_slots_past_the_cache(backend: str) -> None:
    """append_kv now follows append_latent: a slot >= capacity is dropped (no write past the
    cache: the poisoned guard pages stay untouched), -1 is padding; validate=True refuses it."""
    NP, D = 3, 16
    kc, kbuf = _guarded(_rand(NP, PS, 2, D, seed=6), fill=7.0)
    vc, vbuf = _guarded(_rand(NP, PS, 2, D, seed=7), fill=7.0)
    k0, v0 = kbuf.clone(), vbuf.clone()
    kn, vn = _rand(4, 2, D, seed=8), _rand(4, 2, D, seed=9)
    cap = NP * PS
    slots = torch.tensor([3, cap, -1, cap + PS])
    mha.append_kv(kc, vc, kn, vn, slots, backend=backend)
    assert torch.equal(kbuf[:2], k0[:2]) and torch.equal(kbuf[2 + NP:], k0[2 + NP:])
    assert torch.equal(vbuf[:2], v0[:2]) and torch.equal(vbuf[2 + NP:], v0[2 + NP:])
    assert torch.equal(kc[0, 3], kn[0]) and torch.equal(vc[0, 3], vn[0])
    changed = (kbuf != k0).any(dim=(1, 2, 3)).nonzero().flatten().tolist()
    assert changed == [2]  # only page 0 of the cache
    with pytest.raises(ValueError, match="beyond the cache"):
        mha.append_kv(kc, vc, kn, vn, slots, backend=backend, validate=True)


@pytest.mark.parametrize("backend", ["torch", TRITON_BOUNDED])
def test_append_latent_skips_slots_past_the_cache(backend: str) -> None:
    NP = 3
    kv, buf = _guarded(_rand(NP, PS, DL + DR, seed=10), fill=7.0)
    b0 = buf.clone()
    new = _rand(3, DL + DR, seed=11)
    mla.append_latent(kv, new, torch.tensor([NP * PS, 5, -1]), backend=backend)
    assert torch.equal(buf[:2], b0[:2]) and torch.equal(buf[2 + NP:], b0[2 + NP:])
    assert torch.equal(kv[0, 5], new[1])
    with pytest.raises(ValueError, match="beyond the cache"):
        mla.append_latent(kv, new, torch.tensor([NP * PS, 5, -1]), backend=backend, validate=True)


def test_validate_switch_turns_value_checks_on() -> None:
    q, kv, bt, lens = _mla_setup([20], 1)
    set_validate(True)
    try:
        with pytest.raises(ValueError, match="block table too short"):
            mla.mla_decode(q, kv, bt[:, :2], lens, 0.3, latent_dim=DL)
        bad = bt.clone()
        bad[0, 0] = -1
        with pytest.raises(ValueError, match="outside the cache"):
            mla.mla_decode(q, kv, bad, lens, 0.3, latent_dim=DL)
    finally:
        set_validate(False)
    mla.mla_decode(q, kv, bt[:, :2], lens, 0.3, latent_dim=DL)  # default: the defined no-op


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_argument_checks_name_the_argument(backend: str) -> None:
    q, kv, bt, lens = _mla_setup([20], 1)
    meta = torch.empty(bt.shape, dtype=torch.int32, device="meta")
    cases = [
        (dict(q=q.float()), TypeError, "q must be bfloat16"),
        (dict(kv=kv.float()), TypeError, "kv_cache must be bfloat16"),
        (dict(bt=bt.float()), TypeError, "block_table must be int32 or int64"),
        (dict(lens=lens.view(1, 1)), ValueError, "seq_lens must be 1-D"),
        (dict(bt=meta), ValueError, "block_table is on meta"),
        (dict(q=q.transpose(-1, -2).contiguous().transpose(-1, -2)), ValueError, "contiguous along its last dim"),
        (dict(bt=bt[:, :0]), ValueError, "at least one page column"),
    ]
    for change, exc, msg in cases:
        a = {**dict(q=q, kv=kv, bt=bt, lens=lens), **change}
        with pytest.raises(exc, match=msg):
            mla.mla_decode(a["q"], a["kv"], a["bt"], a["lens"], 0.3, latent_dim=DL, backend=backend)
    with pytest.raises(ValueError, match="splits must be an int"):
        mla.mla_decode(q, kv, bt, lens, 0.3, latent_dim=DL, splits=0, backend="triton")
    kc = _rand(4, PS, 2, 16)
    with pytest.raises(ValueError, match="head dims do not match"):
        mha.paged_mha_decode(_rand(1, 1, 4, 8), kc, kc, bt, lens, 0.3, backend=backend)
    with pytest.raises(ValueError, match="q_len must be 1..8"):
        mha.paged_mha_decode(_rand(1, 0, 4, 16), kc, kc, bt, lens, 0.3, backend=backend)
    with pytest.raises(TypeError, match="slots must be int32 or int64"):
        mha.append_kv(kc, kc, _rand(2, 2, 16), _rand(2, 2, 16), torch.zeros(2), backend=backend)


# ----------------------------------------------------------------------------------------------
# fmha prefill: rope_dim and max_seqlen

@pytest.mark.parametrize("backend", BACKENDS)
def test_fmha_rope_dim_and_max_seqlen(backend: str) -> None:
    g = torch.Generator().manual_seed(12)
    T, Hh = 10, 2
    q, k = torch.randn(T, Hh, 48, generator=g).bfloat16(), torch.randn(T, Hh, 48, generator=g).bfloat16()
    v = torch.randn(T, Hh, 16, generator=g).bfloat16()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    for rd in (-1, 48, 100):
        with pytest.raises(ValueError, match="rope_dim must be an int in"):
            fmha.fmha_prefill_varlen(q, k, v, cu, 0.2, rope_dim=rd, backend=backend)
    with pytest.raises(ValueError, match="pass rope_dim explicitly"):  # 48: not a power of two, <= 64
        fmha.fmha_prefill_varlen(q, k, v, cu, 0.2, backend=backend)
    ref = fmha.fmha_ref(q, k, v, cu, 0.2)
    huge = fmha.fmha_prefill_varlen(q, k, v, cu, 0.2, rope_dim=16, max_seqlen=1 << 40, backend=backend)
    torch.testing.assert_close(huge.double(), ref, atol=1e-2, rtol=0)  # clamped to T, no hang
    small = fmha.fmha_prefill_varlen(q, k, v, cu, 0.2, rope_dim=16, max_seqlen=3, backend=backend)
    assert not small.isnan().any()
    assert torch.equal(small[3:4], torch.zeros_like(small[3:4])) and torch.equal(small[7:], torch.zeros_like(small[7:]))
    torch.testing.assert_close(small[:3].double(), ref[:3], atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match="below the longest sequence"):
        fmha.fmha_prefill_varlen(q, k, v, cu, 0.2, rope_dim=16, max_seqlen=3, backend=backend, validate=True)
    with pytest.raises(ValueError, match="non-negative int"):
        fmha.fmha_prefill_varlen(q, k, v, cu, 0.2, rope_dim=16, max_seqlen=-2, backend=backend)


# ----------------------------------------------------------------------------------------------
# routing: NaN / Inf never give an invalid id; softmax scoring honoured

def _route_inputs(M=4, E=16, Hd=64, seed=13):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, Hd, generator=g).bfloat16()
    wg = torch.randn(E, Hd, generator=g) * 0.1
    bias = torch.randn(E, generator=g) * 0.01
    return x, wg, bias


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("poison", ["nan_row", "inf_weight", "nan_bias", "inf_bias"])
@pytest.mark.parametrize("ng,tkg", [(1, 1), (4, 2)])
def test_route_ids_always_valid(backend: str, poison: str, ng: int, tkg: int) -> None:
    x, wg, bias = _route_inputs()
    E, K = wg.shape[0], 4
    if poison == "nan_row":
        x[1] = float("nan")
    elif poison == "inf_weight":
        wg[3] = float("inf")
    elif poison == "nan_bias":
        bias[:] = float("nan")
    else:
        bias[5] = float("inf")
        bias[6] = float("-inf")
    ids, w = moe.route(x, wg, bias, K, ng, tkg, True, 2.0, backend=backend)
    assert ids.dtype == torch.int32 and ((ids >= 0) & (ids < E)).all()
    assert all(len(set(r)) == K for r in ids.tolist())  # distinct per token
    rids, _ = moe.moe_route_ref(x, wg, bias, K, ng, tkg, True, 2.0)
    assert torch.equal(ids, rids)  # both backends pick the same ids
    if poison == "nan_row":
        assert ids[1].tolist() == sorted(ids[1].tolist())  # all -inf: the lowest ids, in order
    ok = torch.ones(x.shape[0], dtype=torch.bool)
    ok[1] = poison != "nan_row"
    if poison in ("nan_bias", "inf_bias"):
        assert torch.isfinite(w).all()  # the bias selects, never weights


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_experts_invalid_ids(backend: str) -> None:
    """check_ids (default) refuses ids outside [0, E); unchecked, such an id adds nothing."""
    E, Hd, I = 8, 32, 16
    g = torch.Generator().manual_seed(14)
    w = moe.MoEWeights("bf16", (torch.randn(E, 2 * I, Hd, generator=g) * 0.2).bfloat16(),
                       (torch.randn(E, Hd, I, generator=g) * 0.2).bfloat16())
    x = torch.randn(3, Hd, generator=g).bfloat16()
    ids = torch.tensor([[0, 3], [E, 2], [-1, 5]], dtype=torch.int32)
    wts = torch.rand(3, 2, generator=g)
    with pytest.raises(ValueError, match="out of range"):
        moe.fused_experts(x, ids, wts, w, backend=backend)
    out = moe.fused_experts(x, ids, wts, w, backend=backend, check_ids=False)
    keep = wts.clone()
    keep[1, 0] = 0.0
    keep[2, 0] = 0.0
    want = moe.experts_ref(x, ids.clamp(0, E - 1), keep, w)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


def _model_softmax_route(x, wg, bias, k, norm_p, scale):
    """The model layer's torch routing with scoring_func softmax (models/kimi.py)."""
    scores = (x.float() @ wg.float().T).softmax(-1)
    ids = (scores + bias).topk(k, -1).indices
    w = scores.gather(1, ids)
    if norm_p:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scale


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_p", [True, False])
def test_route_softmax_scoring(backend: str, norm_p: bool) -> None:
    x, wg, bias = _route_inputs(M=5, E=16, seed=15)
    wg = wg.bfloat16()  # the gate GEMM runs in bf16 with an f32 accumulator
    ids, w = moe.route(x, wg, bias, 4, 1, 1, norm_p, 1.5, backend=backend, scoring_func="softmax")
    mids, mw = _model_softmax_route(x, wg, bias, 4, norm_p, 1.5)
    assert torch.equal(ids.long(), mids)
    torch.testing.assert_close(w, mw, atol=1e-6, rtol=1e-5)
    _, sig = moe.route(x, wg, bias, 4, 1, 1, norm_p, 1.5, backend=backend)
    assert (sig - w).abs().max() > 1e-3  # not the sigmoid weights
    with pytest.raises(ValueError, match="scoring_func"):
        moe.route(x, wg, bias, 4, backend=backend, scoring_func="tanh")


def test_fused_moe_honours_softmax_config() -> None:
    """MoEConfig.scoring_func reaches the triton route kernel (it used to route with sigmoid)."""
    x, wg, bias = _route_inputs(M=2, E=8, Hd=32, seed=16)
    g = torch.Generator().manual_seed(17)
    w = moe.MoEWeights("bf16", (torch.randn(8, 32, 32, generator=g) * 0.2).bfloat16(),
                       (torch.randn(8, 32, 16, generator=g) * 0.2).bfloat16())
    cfg = moe.MoEConfig(top_k=2, scoring_func="softmax", routed_scaling_factor=1.0, norm_topk_prob=False)
    y = moe.fused_moe(x, wg.bfloat16(), bias, w, cfg=cfg)
    ids, wts = _model_softmax_route(x, wg.bfloat16(), bias, 2, False, 1.0)
    want = moe.experts_ref(x, ids.to(torch.int32), wts, w).bfloat16()
    torch.testing.assert_close(y.float(), want.float(), atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------
# M = 0 and the small ops' checks

@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches(backend: str) -> None:
    K, N = 64, 32
    x = torch.empty(0, K, dtype=torch.bfloat16)
    assert gemm.gemm_bf16(x, _rand(N, K), backend=backend).shape == (0, N)
    q, s = quant.quantize_int8(x, backend=backend)
    assert q.shape == (0, K) and s.shape == (0,)
    assert norm.rms_norm(x, _rand(K), 1e-6, backend=backend).shape == (0, K)
    xr = torch.empty(0, 2, 16, dtype=torch.bfloat16)
    assert rope.apply_rope(xr, torch.empty(0, 8), torch.empty(0, 8), backend=backend).shape == (0, 2, 16)
    wg, bias = torch.randn(8, K), torch.zeros(8)
    ids, w = moe.route(x, wg, bias, 2, backend=backend)
    assert ids.shape == (0, 2) and w.shape == (0, 2)
    mw = moe.MoEWeights("bf16", _rand(8, 32, K), _rand(8, K, 16))
    assert moe.fused_experts(x, ids, w, mw, backend=backend).shape == (0, K)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_op_checks(backend: str) -> None:
    x = _rand(3, 64)
    with pytest.raises(ValueError, match="eps must be a finite number"):
        norm.rms_norm(x, _rand(64), math.nan, backend=backend)
    with pytest.raises(TypeError, match="weight must be bfloat16"):
        norm.rms_norm(x, _rand(64).float(), 1e-6, backend=backend)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        gemm.gemm_bf16(x.float(), _rand(8, 64), backend=backend)
    with pytest.raises(ValueError, match="w is on meta"):
        gemm.gemm_bf16(x, torch.empty(8, 64, dtype=torch.bfloat16, device="meta"), backend=backend)
    with pytest.raises(ValueError, match="scales must be"):
        gemm.gemm_w4a8(torch.zeros(3, 64, dtype=torch.int8), torch.ones(2), torch.zeros(8, 8, dtype=torch.int32),
                       torch.ones(8), backend=backend)
    with pytest.raises(ValueError, match="contiguous along K"):
        quant.quantize_int8(_rand(64, 3).t(), backend=backend)
    with pytest.raises(ValueError, match="rope dim of x must be even"):
        rope.apply_rope(_rand(2, 2, 5), torch.zeros(2, 2), torch.zeros(2, 2), backend=backend)
    with pytest.raises(ValueError, match="cos/sin must be"):
        rope.apply_rope(_rand(2, 2, 8), torch.zeros(3, 4), torch.zeros(3, 4), backend=backend)


def test_constant_index_into_an_empty_dim_is_refused_at_launch() -> None:
    """A split-K consumer reads split 0 at a constant index, which no mask guards: the launch
    refuses a partials tensor with no split (kernel-level, whatever the wrapper checks), naming the
    operand and the dim, on the interpreter as in record mode."""
    import kdsl as kd
    from ops.swiglu import gemm_bf16_swiglu_kernel

    w = _rand(32, 16)
    for part in (torch.empty(0, 2, 32), torch.empty(0, 2, 32, device="meta")):
        out = torch.empty(2, 32, dtype=torch.bfloat16, device=part.device)
        with pytest.raises(kd.LaunchError, match=r"'part'.*constant index 0 along S, but S = 0"):
            if part.is_meta:
                with kd.recording("gfx942"):
                    gemm_bf16_swiglu_kernel(part, w.to("meta"), out)
            else:
                gemm_bf16_swiglu_kernel(part, w, out)
    part = torch.randn(1, 2, 32)
    gemm_bf16_swiglu_kernel(part, w, torch.empty(2, 32, dtype=torch.bfloat16))   # one split: fine
