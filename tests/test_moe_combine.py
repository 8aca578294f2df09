"""The end of a MoE layer in one launch (ops.moe.moe_combine_norm / combine_norm), the id-reading
top-k sum (moe_sum_ids), the align kernels' own sentinel fill, fused_experts' partial rows and
pre-quantized input, and the unfilled intermediate (padding rows never reach an output).

Tolerances: the top-k sum, the shared add and the residual are bit-exact against the torch reference
(the same f32 adds in the same k order, the same bf16 roundings); the normed row is within one bf16
ulp of the reference (rtol 2^-7: the f32 sum of squares may be reduced in another order) and
bit-equal to the unfused kernel chain moe_sum_ids -> f32 shared add -> bf16 -> rmsnorm_add, which
reduces the same way. Routed-expert partial rows: 1e-2 x max|ref| abs (as tests/test_moe.py).
"""
from __future__ import annotations

import pytest
import torch

from ops import moe, norm
from tests.conftest import poisoned
from tests.test_moe import FAST, make_weights

BF16_TOL = dict(atol=1e-2, rtol=2 ** -7)
GUARD = 3


def _case(M: int, D: int, K: int, E: int, seed: int, bad: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    for n, b in enumerate(bad):                    # bad ids spread over the tokens
        ids[n % M, (n * 3 + 1) % K] = b
    part = torch.randn(M * K, D, generator=g) * 2
    okf = ((ids >= 0) & (ids < E)).reshape(-1)
    part[~okf] = float("nan")                       # rows of bad ids were never written: must not be read
    shared = torch.randn(M, D, generator=g).bfloat16()
    res = (torch.randn(M, D, generator=g) * 4).bfloat16()
    w = (torch.rand(D, generator=g) + 0.5).bfloat16()
    return ids, part, shared, res, w


@pytest.mark.parametrize("M,D,K,E,shared,bad", [
    (1, 7168, 8, 384, True, ()), (3, 130, 4, 16, True, (-1,)), (5, 96, 3, 8, False, (8, -2**31)),
    (2, 48, 1, 4, True, (10**6,)), (7, 200, 8, 64, True, (-1, 64, 10**6))])
def test_combine_norm_kernel_matches_reference(M, D, K, E, shared, bad):
    ids, part, sh, res, w = _case(M, D, K, E, seed=M * 100 + D, bad=bad)
    y_ref, r_ref = moe.moe_combine_norm_ref(part, ids, sh if shared else None, res, w, 1e-6, E)
    r = res.clone()
    out = poisoned((M, D), torch.bfloat16)
    moe.moe_combine_norm(part, ids.reshape(-1), sh if shared else r, r, w, out, K, E, int(shared), 1e-6)
    assert torch.equal(r, r_ref)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), y_ref.float(), **BF16_TOL)
    assert (out == y_ref).float().mean() > 0.95


@pytest.mark.parametrize("M,D,K,E", [(1, 7168, 8, 384), (4, 160, 4, 16), (3, 64, 2, 6)])
def test_combine_norm_equals_unfused_chain(M, D, K, E):
    """One launch gives the bits of moe_sum_ids -> + shared (f32) -> bf16 -> rmsnorm_add."""
    ids, part, sh, res, w = _case(M, D, K, E, seed=7 + M, bad=(-1,) if M > 1 else ())
    r1 = res.clone()
    y1 = moe.combine_norm(part, ids, sh, r1, w, 1e-6, E)
    s = poisoned((M, D), torch.float32)
    moe.moe_sum_ids(part, ids.reshape(-1), s, K, E, config={"BLOCK_N": 64})
    y2, r2 = norm.rms_norm((s + sh.float()).bfloat16(), w, 1e-6, residual=res.clone())
    assert torch.equal(r1, r2) and torch.equal(y1, y2)


def _guarded(t: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """t copied into the middle of a bigger buffer with GUARD rows of `fill` on each side: (view, buffer)."""
    buf = torch.full((t.shape[0] + 2 * GUARD, *t.shape[1:]), fill, dtype=t.dtype)
    buf[GUARD:GUARD + t.shape[0]] = t
    return buf[GUARD:GUARD + t.shape[0]], buf


def test_combine_norm_bad_ids_stay_inside_guards():
    """Views into bigger buffers with poisoned guard rows: ids outside [0, E) (and the NaN rows
    they name) touch nothing; only the token rows are written."""
    M, D, K, E = 3, 64, 4, 8
    ids, part, sh, res, w = _case(M, D, K, E, seed=11, bad=(-1, E, 10**6, -2**31))

    nan = float("nan")
    pv, pbuf = _guarded(part, nan)
    iv, ibuf = _guarded(ids.reshape(-1), -123)
    sv, sbuf = _guarded(sh, nan)
    rv, rbuf = _guarded(res, nan)
    ov, obuf = _guarded(torch.full((M, D), nan, dtype=torch.bfloat16), nan)
    y_ref, r_ref = moe.moe_combine_norm_ref(part, ids, sh, res, w, 1e-6, E)
    moe.moe_combine_norm(pv, iv, sv, rv, w, ov, K, E, 1, 1e-6)
    for buf, n in ((pbuf, M * K), (sbuf, M), (rbuf, M), (obuf, M)):
        assert torch.cat([buf[:GUARD], buf[GUARD + n:]]).float().isnan().all()
    assert (torch.cat([ibuf[:GUARD], ibuf[GUARD + M * K:]]) == -123).all()
    assert torch.equal(rv, r_ref) and not ov.isnan().any()
    torch.testing.assert_close(ov.float(), y_ref.float(), **BF16_TOL)


@pytest.mark.parametrize("M,D,K,E,shared", [(1, 7168, 8, 384, True), (3, 130, 4, 16, True), (2, 96, 3, 8, False)])
def test_combine_add_writes_combine_norms_residual(M, D, K, E, shared):
    """moe_combine_add (split over D, no norm) writes the residual combine_norm writes, bit for bit,
    and returns it as f32 rows; every BLOCK_N gives the same bits; the torch backend agrees."""
    ids, part, sh, res, w = _case(M, D, K, E, seed=M * 10 + D, bad=(-1, E) if M > 1 else ())
    s = sh if shared else None
    r_ref = res.clone()
    moe.combine_norm(part, ids, s, r_ref, w, 1e-6, E)
    for bn in (64, 256):
        r = res.clone()
        rows = poisoned((M, D), torch.float32)
        moe.moe_combine_add(part, ids.reshape(-1), sh if shared else r, r, rows, K, E, int(shared),
                            config={"BLOCK_N": bn})
        assert torch.equal(r, r_ref) and torch.equal(rows, r_ref.float())
    r_t = res.clone()
    assert torch.equal(moe.combine_add(part, ids, s, r_t, E, backend="torch"), r_ref.float())
    assert torch.equal(r_t, r_ref)


def test_combine_add_bad_ids_stay_inside_guards_and_checks():
    """Views into bigger buffers with poisoned guard rows: ids outside [0, E) touch nothing; only
    the token rows are written. The wrapper refuses mismatched shapes."""
    M, D, K, E = 3, 64, 4, 8
    ids, part, sh, res, w = _case(M, D, K, E, seed=12, bad=(-1, E, 10**6, -2**31))

    nan = float("nan")
    pv, pbuf = _guarded(part, nan)
    iv, ibuf = _guarded(ids.reshape(-1), -123)
    sv, sbuf = _guarded(sh, nan)
    rv, rbuf = _guarded(res, nan)
    ov, obuf = _guarded(torch.full((M, D), nan), nan)
    r_ref = res.clone()
    moe.combine_norm(part, ids, sh, r_ref, w, 1e-6, E)
    moe.moe_combine_add(pv, iv, sv, rv, ov, K, E, 1)
    for buf, n in ((pbuf, M * K), (sbuf, M), (rbuf, M), (obuf, M)):
        assert torch.cat([buf[:GUARD], buf[GUARD + n:]]).float().isnan().all()
    assert (torch.cat([ibuf[:GUARD], ibuf[GUARD + M * K:]]) == -123).all()
    assert torch.equal(rv, r_ref) and torch.equal(ov, r_ref.float())
    with pytest.raises(ValueError, match="partial"):
        moe.combine_add(part[:3], ids, sh, res.clone(), E)
    with pytest.raises(ValueError, match="shared"):
        moe.combine_add(part, ids, sh[:1], res.clone(), E)


def test_combine_norm_wrapper_checks_and_torch_backend():
    ids, part, sh, res, w = _case(2, 32, 2, 4, seed=3)
    r_t = res.clone()
    y_t = moe.combine_norm(part, ids, sh, r_t, w, 1e-6, 4, backend="torch")
    r_k = res.clone()
    y_k = moe.combine_norm(part, ids, sh, r_k, w, 1e-6, 4)
    assert torch.equal(r_t, r_k)
    torch.testing.assert_close(y_k.float(), y_t.float(), **BF16_TOL)
    with pytest.raises(ValueError, match="partial"):
        moe.combine_norm(part[:3], ids, sh, res.clone(), w, 1e-6, 4)
    with pytest.raises(TypeError, match="ids"):
        moe.combine_norm(part, ids.long(), sh, res.clone(), w, 1e-6, 4)
    with pytest.raises(ValueError, match="shared"):
        moe.combine_norm(part, ids, sh[:1], res.clone(), w, 1e-6, 4)


@pytest.mark.parametrize("M,H,K,E", [(1, 7168, 8, 384), (5, 96, 3, 8)])
def test_moe_sum_ids_skips_bad_ids(M, H, K, E):
    ids, part, _, _, _ = _case(M, H, K, E, seed=5, bad=(-1, E) if M > 1 else ())
    out = poisoned((M, H), torch.float32)
    moe.moe_sum_ids(part, ids.reshape(-1), out, K, E, config={"BLOCK_N": 64})
    ok = ((ids >= 0) & (ids < E)).reshape(M, K, 1)
    p = part.view(M, K, H)
    want = torch.where(ok[:, 0], p[:, 0], 0.0)
    for j in range(1, K):
        want = want + torch.where(ok[:, j], p[:, j], 0.0)
    assert torch.equal(out, want)


def test_aligned_blocks_is_the_worst_case():
    """aligned_blocks(T, E, BM) is the most blocks any split of T rows over E experts fills (every
    split of small T enumerated): the grid holds every used block and launches no block that
    no routing can use."""
    def splits(t, parts, top):  # non-increasing positive parts summing to t
        if t == 0:
            yield ()
            return
        if parts == 0:
            return
        for c in range(min(t, top), 0, -1):
            for rest in splits(t - c, parts - 1, c):
                yield (c,) + rest

    for T in range(1, 15):
        for E in (1, 2, 3, 5, 8, 20):
            for bm in (1, 2, 4, 16):
                most = max(sum(-(-c // bm) for c in s) for s in splits(T, E, T))
                assert moe.aligned_blocks(T, E, bm) == most, (T, E, bm)


@pytest.mark.parametrize("T,E,bm", [(8, 384, 16), (13, 8, 16), (40, 16, 32), (3, 64, 64)])
def test_align_blocks_fills_the_sentinel(T, E, bm):
    """moe_align_blocks writes T into every slot of a poisoned sorted_ids (no fill launch needed);
    after moe_align_scatter the result equals the torch backend's."""
    g = torch.Generator().manual_seed(T + E)
    ids = torch.randint(0, E, (T,), generator=g, dtype=torch.int32)
    nb = moe.aligned_blocks(T, E, bm)
    pstart = poisoned((E,), torch.int32)
    bexp = poisoned((nb,), torch.int32)
    sid = poisoned((nb * bm,), torch.int32)
    moe.moe_align_blocks(ids, pstart, bexp, sid, bm)
    assert (sid == T).all()
    moe.moe_align_scatter(ids, pstart, sid)
    tsid, tbexp = moe.moe_align(ids.view(1, T), E, bm, backend="torch")
    assert torch.equal(sid, tsid) and torch.equal(bexp, tbexp)


@pytest.mark.parametrize("fmt,M", [("w4a8", 3), ("w4a16", 2), ("w4a8", 1)])
def test_fused_experts_partials_and_prequantized(fmt, M):
    """partials=True: the [M*top_k, H] rows the reference gives per (token, k) (bad ids' rows are
    skipped by combine_norm); xq: the same bits as quantizing inside."""
    from ops.quant import quantize_int8

    E, H, I, K = 16, 64, 32, 4
    W = make_weights(fmt, E, H, I, seed=M)
    g = torch.Generator().manual_seed(40 + M)
    x = torch.randn(M, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    if M > 1:
        ids[1, 2] = -1
    wts = torch.rand(M, K, generator=g)
    p = moe.fused_experts(x, ids, wts, W, config=FAST, check_ids=False, partials=True)
    ref = moe.experts_ref_rows(x, ids, wts, W)
    ok = ((ids >= 0) & (ids < E)).reshape(-1)
    tol = 1e-2 * ref.abs().max().item()
    torch.testing.assert_close(p[ok], ref[ok], atol=tol, rtol=0)
    y = moe.fused_experts(x, ids, wts, W, config=FAST, check_ids=False)
    torch.testing.assert_close(y, moe.experts_ref(x, ids, wts, W), atol=tol, rtol=0)
    if fmt == "w4a8":
        pq = moe.fused_experts(x, ids, wts, W, config=FAST, check_ids=False, partials=True, xq=quantize_int8(x))
        assert torch.equal(pq[ok], p[ok])
        with pytest.raises(ValueError, match="xq"):
            moe.fused_experts(x, ids, wts, W, config=FAST, xq=(quantize_int8(x)[0], quantize_int8(x)[1][:0]))


@pytest.mark.parametrize("fmt,path", [("w4a8", "separate"), ("w4a8", "fused"), ("w4a16", None), ("bf16", None)])
def test_unfilled_intermediate_padding_rows_never_reach_outputs(fmt, path):
    """Stage 1 into a NaN-poisoned intermediate (what torch.empty may hold) gives the same stage-2
    partial rows, bit for bit, as into a zero-filled one: padding rows are never read."""
    from ops.quant import quant_per_token_int8, quantize_int8

    E, H, I, K, M = 16, 64, 32, 4, 3
    W = make_weights(fmt, E, H, I, seed=9)
    g = torch.Generator().manual_seed(21)
    x = torch.randn(M, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    tw = torch.rand(M * K, generator=g)
    sid, bexp = moe.moe_align(ids, E, 16)
    S = sid.numel()
    assert (sid == M * K).any()                    # there are padding rows
    c1, c2 = dict(FAST["stage1"], BLOCK_M=16), dict(FAST["stage2"], BLOCK_M=16, REDUCE="partial")
    outs = []
    for fill in (0.0, float("nan")):
        inter = torch.full((S, I), fill, dtype=torch.bfloat16)
        if fmt == "w4a8":
            moe.moe_stage1_w4a8(*quantize_int8(x), W.w13, W.s13, sid, bexp, inter, K, config=c1)
        elif fmt == "w4a16":
            moe.moe_stage1_w4a16(x, W.w13, W.s13, sid, bexp, inter, K, config=c1)
        else:
            moe.moe_stage1_bf16(x, W.w13, sid, bexp, inter, K, config=c1)
        out0 = torch.zeros(0, H)
        part = poisoned((M * K, H), torch.float32)
        if path == "separate":
            i8, i8s = torch.empty(S, I, dtype=torch.int8), torch.empty(S)
            quant_per_token_int8(inter, i8, i8s, config=FAST["quant"])
            moe.moe_stage2_w4a8_pq(i8, i8s, W.w2, W.s2, sid, bexp, tw, out0, part, K, config=c2)
        else:
            scales = (W.s2,) if fmt != "bf16" else ()
            moe.STAGE2[fmt](inter, W.w2, *scales, sid, bexp, tw, out0, part, K, config=c2)
        assert not part.isnan().any()
        outs.append(part)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.slow
def test_model_fused_moe_half_equals_unfused_chain(tmp_path_factory, monkeypatch):
    """KimiModel.step on triton (interpreter): the fused MoE half (rms_norm_quant in place ->
    experts with pre-quantized rows and partial rows -> combine_norm) against the same model
    forced onto the unfused chain (add_norm -> fused_experts -> moe_sum_ids -> + shared -> add_norm).
    The fused model also runs o_proj with the residual-add norm in its last programs
    (o_proj_norm=True), the chain gemm_bf16_splitk + rmsnorm_add_splitk.
    Logits and aux captures agree bit for bit (the fused kernels keep every rounding); the aux
    captures are the residual entering each layer, untouched by the in-place norms after them.
    The default model (MoE layers ending with combine_add's work in the shared expert's down GEMM,
    gemm_bf16_swiglu_combine, the next input norm in the q_a|kv_a GEMM's prologue) agrees within the
    triton-vs-torch tolerances; with the post-attention add + norm in the shared gate|up + router
    GEMM, the routing in that GEMM's last program (route_in_gemm) gives its bits without it.
    On the 4-layer tiny target (five forwards on the interpreter): the dense layer 0, MoE layers
    followed by MoE layers (the raw rows into the next q_a|kv_a GEMM) and the last MoE layer before
    the final norm are all there; each further layer repeats one of these."""
    from models.fixtures import write_fixture
    from models.kimi import KimiModel
    from models.loader import load_target
    from tests._model_fixtures import one_thread

    one_thread()
    root = tmp_path_factory.mktemp("combine_fx")
    write_fixture("kimi-k25", root, seed=0, layers=4)
    tk = load_target(root)
    assert tk.config.num_hidden_layers == 4 and tk.config.first_k_dense_replace == 1
    ids = tuple(i for i in tk.config.capture_layer_ids)
    fused = KimiModel(tk, backend="triton", capture_ids=ids)
    fused.norm_in_gemm = False                               # every MoE layer ends with combine_norm
    fused.o_proj_norm = True                                 # o_proj runs the norm after it (ops.splitk_norm)
    plain = KimiModel(tk, backend="triton", capture_ids=ids)
    plain.o_proj_norm = False                                # o_proj's partials, then the norm's launch
    for (_, _, _, mlp) in plain.layers:
        if hasattr(mlp, "fused_block"):
            mlp.fused_block = lambda *a, **k: None           # the unfused chain, same kernels otherwise
    raw = KimiModel(tk, backend="triton", capture_ids=ids)   # no norm at the MoE end: it is in the next q_a|kv_a GEMM
    assert any(attn.takes_raw_rows for (_, attn, _, _) in raw.layers[1:])
    first = KimiModel(tk, backend="triton", capture_ids=ids)  # and the post-attention add + norm in the shared
    first.add_norm_in_gemm = True                             # gate|up + router GEMM (gemm_bf16_addnorm_splitk_y)
    first.route_in_gemm = False
    routed = KimiModel(tk, backend="triton", capture_ids=ids)  # and the routing in that GEMM's last program
    routed.add_norm_in_gemm, routed.route_in_gemm = True, True
    import ops.gemm_addnorm as addnorm

    calls, run = [], addnorm.gemm_bf16_addnorm
    monkeypatch.setattr(addnorm, "gemm_bf16_addnorm",
                        lambda x, *a, **k: calls.append((x.dim(), k.get("route") is not None)) or run(x, *a, **k))
    toks = [[5, 9, 2, 7], [3, 1]]
    outs = []
    for m in (fused, plain, raw, first, routed):
        c = m.new_cache(2, 16)
        outs.append(m.forward(c, [(0, toks[0]), (1, toks[1])], keep_hidden=True))
    # `first` and `routed` only, each MoE layer, over o_proj's split-K partials; `routed` with the route tail
    assert calls == [(3, False)] * 3 + [(3, True)] * 3
    for got, want in ((outs[4].logits, outs[3].logits), (outs[4].aux, outs[3].aux)):   # the same bits
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(outs[4].hidden, outs[3].hidden)
    assert not fused.o_proj_counters.any()                  # every launch left its tickets at 0
    assert not routed.route_counter.any()
    for a, b in zip(outs[0].logits, outs[1].logits):
        assert torch.equal(a, b)
    for a, b in zip(outs[0].aux, outs[1].aux):
        assert torch.equal(a, b)
    # the last capture (id N = the final residual) is the returned hidden stream
    assert torch.equal(outs[0].hidden, outs[1].hidden)
    # the norm in the GEMM's prologue reduces its squares in another order and the q_a|kv_a GEMM
    # splits K otherwise: a bf16 rounding apart here and there (tests/test_triton_backend.py's tolerances)
    for a, b in zip(outs[2].logits, outs[0].logits):
        torch.testing.assert_close(a, b, atol=0.25, rtol=0)
    for a, b in zip(outs[2].aux, outs[0].aux):
        torch.testing.assert_close(a, b, atol=0.25, rtol=0.05)
    # the fixture's rows (64 wide) fit one NORM_K tile: the prologue's sums are the norm launch's, so the
    # fused gate|up + router GEMM gives the default path's bits
    for got, want in ((outs[3].logits, outs[2].logits), (outs[3].aux, outs[2].aux)):
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(outs[3].hidden, outs[2].hidden)


def test_align_ids_in_the_expert_tile_padding_are_in_no_block():
    """E=384 walks a 512-wide expert tile: an id in [384, 512) must be in no block (as every id
    outside [0, E)), its row never written, the block map equal to the torch backend's."""
    E, T = 384, 8
    ids = torch.tensor([[28, 75, -1, 94, 391, 19, 511, 76]], dtype=torch.int32)
    sid, bexp = moe.moe_align(ids, E, 16, check=False)
    tsid, tbexp = moe.moe_align(ids, E, 16, backend="torch", check=False)
    assert torch.equal(sid, tsid) and torch.equal(bexp, tbexp)
    assert not ((sid == 4) | (sid == 6)).any() and (bexp < E).all()


@pytest.mark.parametrize("T,E,bm", [(8, 384, 16), (13, 8, 16), (40, 16, 32), (3, 64, 64), (32, 48, 16)])
def test_align_one_launch_equals_the_two_kernel_path(T, E, bm):
    """moe_align_one (decode and verify: one launch) writes every slot of poisoned outputs and gives
    the arrays of moe_align_blocks + moe_align_scatter and of the torch backend, ids outside [0, E)
    (another rank's expert as -1, garbage) included; nothing is written outside its outputs."""
    g = torch.Generator().manual_seed(T * E + bm)
    ids = torch.randint(0, E, (T,), generator=g, dtype=torch.int32)
    ids[::5] = torch.tensor([-1, E, 2**30, -2**31], dtype=torch.int32).repeat(T)[: ids[::5].numel()]
    nb = moe.aligned_blocks(T, E, bm)
    pad = 64
    bbuf = torch.full((nb + 2 * pad,), -777, dtype=torch.int32)
    sbuf = torch.full((nb * bm + 2 * pad,), -777, dtype=torch.int32)
    bexp, sid = bbuf[pad:pad + nb], sbuf[pad:pad + nb * bm]
    moe.moe_align_one(ids, bexp, sid, E, bm)
    assert (bbuf[:pad] == -777).all() and (bbuf[pad + nb:] == -777).all()
    assert (sbuf[:pad] == -777).all() and (sbuf[pad + nb * bm:] == -777).all()
    pstart, bexp2, sid2 = (poisoned((n,), torch.int32) for n in (E, nb, nb * bm))
    moe.moe_align_blocks(ids, pstart, bexp2, sid2, bm)
    moe.moe_align_scatter(ids, pstart, sid2)
    tsid, tbexp = moe.moe_align(ids.view(1, T), E, bm, backend="torch", check=False)
    assert torch.equal(sid, sid2) and torch.equal(bexp, bexp2)
    assert torch.equal(sid, tsid) and torch.equal(bexp, tbexp)


def test_align_takes_one_launch_up_to_its_row_limit(monkeypatch):
    """moe_align launches moe_align_one up to ALIGN_ONE_MAX_T rows and the two kernels above it,
    with the same result."""
    import kdsl as kd

    ids = torch.randint(0, 16, (3, 4), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    with kd.recording("gfx942") as rec:
        moe.moe_align(ids, 16, 16, check=False)
    assert [r.kernel.name for r in rec.launches] == ["moe_align_one"]
    one = moe.moe_align(ids, 16, 16)
    monkeypatch.setattr(moe, "ALIGN_ONE_MAX_T", 11)
    with kd.recording("gfx942") as rec:
        moe.moe_align(ids, 16, 16, check=False)
    assert [r.kernel.name for r in rec.launches] == ["moe_align_blocks", "moe_align_scatter"]
    two = moe.moe_align(ids, 16, 16)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("M,H,I,K,E,bn1,bad", [(3, 64, 64, 4, 16, 32, (-1, 16, -2**31)), (1, 48, 96, 8, 12, 64, (10**6,))])
def test_amax_stages_equal_separate_quant_path(M, H, I, K, E, bn1, bad):
    """stage2_quant 'amax': stage 1 stores each (valid row, BLOCK_N tile)'s absmax of the bf16 it
    stores; stage 2 forms the row scale from them and quantizes its A tiles with ops.quant's exact
    division: the partial rows equal quant_per_token_int8 + moe_stage2_w4a8_pq's bit for bit. The
    intermediate and the tile maxima are NaN-poisoned views of bigger buffers (padding rows and
    guards never written, never read), ids outside [0, E) name no row; I = 96 leaves a part tile."""
    from ops.quant import quant_per_token_int8, quantize_int8

    W = make_weights("w4a8", E, H, I, seed=M + I)
    g = torch.Generator().manual_seed(70 + M)
    x = (torch.randn(M, H, generator=g) * 3).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    for n, b in enumerate(bad):
        ids[n % M, (n * 2 + 1) % K] = b
    tw = torch.rand(M * K, generator=g)
    sid, bexp = moe.moe_align(ids, E, 16, check=False)
    S, T, NT = sid.numel(), M * K, -(-I // bn1)
    valid = sid < T
    assert (~valid).any()                               # there are padding rows
    x8, xs = quantize_int8(x)
    c1, c2 = dict(BLOCK_N=bn1, BLOCK_K=64, BLOCK_M=16), dict(BLOCK_N=32, BLOCK_K=32, BLOCK_M=16, REDUCE="partial")
    nan = float("nan")
    inter, ibuf = _guarded(torch.full((S, I), nan, dtype=torch.bfloat16), nan)
    amax, abuf = _guarded(torch.full((S, NT), nan), nan)
    moe.moe_stage1_w4a8_amax(x8, xs, W.w13, W.s13, sid, bexp, inter, amax, K, config=c1)
    ref_inter = torch.full((S, I), nan, dtype=torch.bfloat16)
    moe.moe_stage1_w4a8(x8, xs, W.w13, W.s13, sid, bexp, ref_inter, K, config=c1)
    assert torch.equal(inter[valid], ref_inter[valid]) and inter[~valid].isnan().all()
    tiles = torch.nn.functional.pad(inter[valid].float().abs(), (0, NT * bn1 - I)).view(-1, NT, bn1).amax(-1)
    assert torch.equal(amax[valid], tiles) and amax[~valid].isnan().all()
    for buf, n in ((ibuf, S), (abuf, S)):
        assert torch.cat([buf[:GUARD], buf[GUARD + n:]]).float().isnan().all()
    out0 = torch.zeros(0, H)
    part, pbuf = _guarded(poisoned((T, H), torch.float32), nan)
    moe.moe_stage2_w4a8_aq(inter, amax, W.w2, W.s2, sid, bexp, tw, out0, part, K, config=c2)
    i8, i8s = torch.empty(S, I, dtype=torch.int8), torch.empty(S)
    quant_per_token_int8(ref_inter, i8, i8s, config=FAST["quant"])
    ref = poisoned((T, H), torch.float32)
    moe.moe_stage2_w4a8_pq(i8, i8s, W.w2, W.s2, sid, bexp, tw, out0, ref, K, config=c2)
    ok = ((ids >= 0) & (ids < E)).reshape(-1)
    assert torch.equal(part[ok], ref[ok]) and not part[ok].isnan().any()
    assert part[~ok].isnan().all() and torch.cat([pbuf[:GUARD], pbuf[GUARD + T:]]).isnan().all()
    sep = moe.fused_experts(x, ids, tw.view(M, K), W, config={**FAST, "stage2_quant": "separate"}, check_ids=False,
                            partials=True)
    amx = moe.fused_experts(x, ids, tw.view(M, K), W, config={**FAST, "stage2_quant": "amax"}, check_ids=False,
                            partials=True)
    assert torch.equal(amx[ok], sep[ok])


def test_stage2_quant_mode_choice():
    """An explicit mode wins (an unknown one is refused); by default the tuned files' faster of
    "amax" and "separate" (the same bits), "separate" where no file says (the interpreter); the
    choice follows the files' recorded times and the launch gap."""
    kimi = (384, 7168, 2048, 8)
    assert moe.stage2_quant_mode({"stage2_quant": "fused"}, *kimi, 1) == "fused"
    with pytest.raises(ValueError, match="stage2_quant"):
        moe.stage2_quant_mode({"stage2_quant": "nope"}, *kimi, 1)
    assert moe.stage2_quant_mode(None, *kimi, 1, arch="interpret") == "separate"
    assert moe.stage2_quant_mode(None, *kimi, 10**6, arch="gfx942") == "separate"   # no tuned bucket that large
    for m in (1, 4):                                         # the committed files: decode and verify on gfx942
        assert moe.stage2_quant_mode(None, *kimi, m, arch="gfx942") == "amax"
