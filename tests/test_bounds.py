"""Bounded gathers: an index read from a tensor (page table entry, slot, expert id, sorted token id)
never makes a kdsl kernel touch memory outside the operand it indexes (interpreter).

The kernels are called directly (the op wrappers reject some of these inputs before the kernel),
with every cache, weight and output a view into a larger buffer whose guard regions are poisoned
(NaN for floats, a sentinel for ints): a stray read shows as a NaN in the results, a stray write as a
changed guard. Results of the in-range rows must still equal the reference (same tolerances as
tests/test_mha.py and tests/test_mla.py: atol 1e-2 vs float64; MoE stages: exactly equal to a run on
clean inputs, same kernel and summation order)."""
from __future__ import annotations

import pytest
import torch

import kdsl as kd
from ops import mha, mla, moe
from tests.test_moe import make_weights

SCALE = 0.25
TOL = dict(atol=1e-2, rtol=0)
GUARD = 2  # guard rows before and after each view


def guarded(t: torch.Tensor, fill: float | int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, whole buffer): `t`'s values in a buffer with GUARD poisoned rows on each side of dim 0."""
    if fill is None:
        fill = float("nan") if t.dtype.is_floating_point else -123
    buf = torch.full((t.shape[0] + 2 * GUARD, *t.shape[1:]), fill, dtype=t.dtype)
    view = buf[GUARD:GUARD + t.shape[0]]
    view.copy_(t)
    return view, buf


def guards_intact(buf: torch.Tensor, n: int, fill: float | int | None = None) -> bool:
    g = torch.cat([buf[:GUARD], buf[GUARD + n:]])
    if fill is None and g.dtype.is_floating_point:
        return bool(g.isnan().all())
    return bool((g == (-123 if fill is None else fill)).all())


# ----------------------------------------------------------------------------------------------
# paged decode: block table entries == page count, -1, 1000

BAD_PAGES = [("page_count", None), ("minus_one", -1), ("thousand", 1000), ("int_min", -2**31)]


def _bad_table(bt: torch.Tensor, npages: int, bad: int | None) -> torch.Tensor:
    bt = bt.clone()
    bt[1, :] = npages if bad is None else bad  # sequence 1 reads only bad pages
    bt[2, 1] = npages if bad is None else bad  # sequence 2: one bad page among good ones
    return bt


@pytest.mark.parametrize("name,bad", BAD_PAGES)
def test_paged_mha_decode_bad_block_table(name: str, bad: int | None) -> None:
    g = torch.Generator().manual_seed(1)
    B, QL, HQ, KVH, D, PS, S = 3, 1, 2, 1, 16, 4, 2
    lens = [7, 9, 11]
    mp = 3
    npages = 10
    kc, kbuf = guarded(torch.randn(npages, PS, KVH, D, generator=g).bfloat16())
    vc, vbuf = guarded(torch.randn(npages, PS, KVH, D, generator=g).bfloat16())
    good = torch.randperm(npages, generator=g)[: B * mp].view(B, mp).to(torch.int32)
    bt = _bad_table(good, npages, bad)
    q = torch.randn(B, QL, HQ, D, generator=g).bfloat16()
    sl = torch.tensor(lens, dtype=torch.int32)
    part, pbuf = guarded(torch.full((B, QL, HQ, S, D), float("nan")))
    lse, lbuf = guarded(torch.full((B, QL, HQ, S), float("nan")))
    mha.mha_decode(q, kc, vc, bt, sl, part, lse, SCALE, QL * (HQ // KVH), B * S, config={"BLOCK_N": 16})
    assert guards_intact(pbuf, B) and guards_intact(lbuf, B)
    assert guards_intact(kbuf, npages) and guards_intact(vbuf, npages)
    assert part.isfinite().all() and not lse.isnan().any(), "a stray read of a poisoned page reached the output"
    out = torch.empty(B, QL, HQ, D, dtype=torch.bfloat16)
    mha.mha_decode_combine(part, lse, out, QL * HQ)
    ref = mha.mha_decode_ref(q[:1], kc, vc, good[:1], sl[:1], SCALE)
    torch.testing.assert_close(out[:1].double(), ref, **TOL)


@pytest.mark.parametrize("cfg", [{"BLOCK_N": 16}, {"BLOCK_N": 16, "PV_T": 1, "QK_BLOCK": 16}])
@pytest.mark.parametrize("name,bad", BAD_PAGES)
def test_mla_decode_bad_block_table(name: str, bad: int | None, cfg: dict) -> None:
    g = torch.Generator().manual_seed(2)
    B, QL, H, DL, DR, PS, S = 3, 1, 4, 32, 16, 8, 2
    lens = [9, 17, 20]
    mp, npages = 3, 10
    kv, kvbuf = guarded(torch.randn(npages, PS, DL + DR, generator=g).bfloat16())
    good = torch.randperm(npages, generator=g)[: B * mp].view(B, mp).to(torch.int32)
    bt = _bad_table(good, npages, bad)
    q = torch.randn(B, QL, H, DL + DR, generator=g).bfloat16()
    sl = torch.tensor(lens, dtype=torch.int32)
    part, pbuf = guarded(torch.full((B, QL, H, S, DL), float("nan")))
    lse, lbuf = guarded(torch.full((B, QL, H, S), float("nan")))
    mla.mla_decode_split(q, kv, bt, sl, part, lse, SCALE, QL * H, DR, config=cfg)
    assert guards_intact(pbuf, B) and guards_intact(lbuf, B) and guards_intact(kvbuf, npages)
    assert part.isfinite().all() and not lse.isnan().any(), "a stray read of a poisoned page reached the output"
    out = torch.empty(B, QL, H, DL, dtype=torch.bfloat16)
    mla.mla_decode_combine(part, lse, out, QL * H)
    ref = mla.mla_decode_ref(q[:1], kv, good[:1], sl[:1], SCALE, DL)
    torch.testing.assert_close(out[:1].double(), ref, **TOL)


def test_decode_lengths_past_the_block_table() -> None:
    """A sequence length longer than the table covers reads table entries past the row: bounded too."""
    g = torch.Generator().manual_seed(3)
    B, QL, H, DL, DR, PS, S, mp, npages = 2, 1, 4, 32, 16, 8, 1, 2, 6
    kv, kvbuf = guarded(torch.randn(npages, PS, DL + DR, generator=g).bfloat16())
    bt, btbuf = guarded(torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), fill=-1)  # -1 -> a NaN page
    q = torch.randn(B, QL, H, DL + DR, generator=g).bfloat16()
    sl = torch.tensor([9, mp * PS + 40], dtype=torch.int32)
    part = torch.full((B, QL, H, S, DL), float("nan"))
    lse = torch.full((B, QL, H, S), float("nan"))
    mla.mla_decode_split(q, kv, bt, sl, part, lse, SCALE, QL * H, DR, config={"BLOCK_N": 16})
    assert part.isfinite().all() and guards_intact(kvbuf, npages)
    out = torch.empty(B, QL, H, DL, dtype=torch.bfloat16)
    mla.mla_decode_combine(part, lse, out, QL * H)
    torch.testing.assert_close(out[:1].double(), mla.mla_decode_ref(q[:1], kv, bt[:1], sl[:1], SCALE, DL), **TOL)


# ----------------------------------------------------------------------------------------------
# cache appends: slots past the cache, negative slots

SENT = 7.0  # bf16-exact sentinel of the guard pages


def _slots(npages: int, ps: int) -> tuple[torch.Tensor, list[bool]]:
    cap = npages * ps
    slots = [3, cap, cap + 3, 10**6, 2**40, -1, -ps - 1, -2**40, cap - 1]
    return torch.tensor(slots, dtype=torch.int64), [0 <= s < cap for s in slots]


def test_mha_cache_append_out_of_range_slots() -> None:
    g = torch.Generator().manual_seed(4)
    NP, PS, KVH, D = 4, 4, 2, 16
    kc, kbuf = guarded(torch.randn(NP, PS, KVH, D, generator=g).bfloat16(), fill=SENT)
    vc, vbuf = guarded(torch.randn(NP, PS, KVH, D, generator=g).bfloat16(), fill=SENT)
    k0, v0 = kc.clone(), vc.clone()
    slots, ok = _slots(NP, PS)
    kn = torch.randn(len(slots), KVH, D, generator=g).bfloat16()
    vn = torch.randn(len(slots), KVH, D, generator=g).bfloat16()
    mha.mha_cache_append(kn, vn, slots, kc, vc, config={"BLOCK_H": 2})
    assert guards_intact(kbuf, NP, SENT) and guards_intact(vbuf, NP, SENT)
    for t, good in enumerate(ok):
        if good:
            s = int(slots[t])
            k0[s // PS, s % PS], v0[s // PS, s % PS] = kn[t], vn[t]
    assert torch.equal(kc, k0) and torch.equal(vc, v0)


def test_mla_cache_append_out_of_range_slots() -> None:
    g = torch.Generator().manual_seed(5)
    NP, PS, DQ = 4, 8, 48
    kv, buf = guarded(torch.randn(NP, PS, DQ, generator=g).bfloat16(), fill=SENT)
    want = kv.clone()
    slots, ok = _slots(NP, PS)
    new = torch.randn(len(slots), DQ, generator=g).bfloat16()
    mla.mla_cache_append(new, slots, kv, config={"BLOCK_D": 64})
    assert guards_intact(buf, NP, SENT)
    for t, good in enumerate(ok):
        if good:
            s = int(slots[t])
            want[s // PS, s % PS] = new[t]
    assert torch.equal(kv, want)


# ----------------------------------------------------------------------------------------------
# MoE stages: expert ids >= E, sorted token ids out of range

E, H, I, TOPK, M, BM = 16, 64, 32, 4, 3, 16
BAD_IDS = [-17, M * TOPK + 5, 10**6, -2**31]


def _routing(real_rows: bool = True, seed: int = 6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(M)]).to(torch.int32)
    sid, bexp = moe.moe_align(ids, E, BM)
    # one more block for a bad expert id, one with 2^30 (what a NaN router gave); their rows are
    # real tokens or padding (a partial store of a real token would overwrite that token's row)
    extra_rows = torch.arange(2 * BM, dtype=torch.int32) % (M * TOPK) if real_rows else \
        torch.full((2 * BM,), M * TOPK, dtype=torch.int32)
    sid_bad = torch.cat([sid, extra_rows])
    bexp_bad = torch.cat([bexp, torch.tensor([E, 2**30], dtype=torch.int32)])
    # bad sorted ids in the padding rows of the first block (valid = id < M*TOPK is true for negatives)
    used = int((sid[:BM] < M * TOPK).sum())
    sid_bad[used:used + len(BAD_IDS)] = torch.tensor(BAD_IDS, dtype=torch.int32)
    sid_clean = torch.cat([sid, torch.full((2 * BM,), M * TOPK, dtype=torch.int32)])
    bexp_clean = torch.cat([bexp, torch.tensor([-1, -1], dtype=torch.int32)])
    return sid_clean, bexp_clean, sid_bad, bexp_bad, used


@pytest.mark.parametrize("fmt", ["bf16", "w4a8", "w4a8_amax", "w4a16"])
def test_moe_stage1_bad_expert_and_token_ids(fmt: str) -> None:
    amax = fmt == "w4a8_amax"              # moe_stage1_w4a8_amax: its tile maxima too (NT = I / 32)
    fmt = "w4a8" if amax else fmt
    W = make_weights(fmt, E, H, I)
    g = torch.Generator().manual_seed(7)
    sid, bexp, sid_bad, bexp_bad, used = _routing()
    S = sid.numel()
    fill = float("nan") if fmt == "bf16" else 0x77777777
    w13, wbuf = guarded(W.w13, fill)
    if fmt == "bf16":
        x, xbuf = guarded(torch.randn(M, H, generator=g).bfloat16())
        args = lambda s, b, out: (x, w13, s, b, out, TOPK)  # noqa: E731
        kern, cfg = moe.moe_stage1_bf16, {"BLOCK_N": 32, "BLOCK_K": 64}
    elif fmt == "w4a16":  # NaN-guarded bf16 group scales: a stray scale read reaches the output
        s13, sbuf = guarded(W.s13)
        x, xbuf = guarded(torch.randn(M, H, generator=g).bfloat16())
        args = lambda s, b, out: (x, w13, s13, s, b, out, TOPK)  # noqa: E731
        kern, cfg = moe.moe_stage1_w4a16, {"BLOCK_N": 32, "BLOCK_K": 64}
    else:
        s13, sbuf = guarded(W.s13)
        x, xbuf = guarded(torch.randint(-127, 128, (M, H), generator=g, dtype=torch.int8))
        xs, xsbuf = guarded(torch.rand(M, generator=g) + 0.5)
        args = lambda s, b, out: (x, xs, w13, s13, s, b, out, TOPK)  # noqa: E731
        kern, cfg = moe.moe_stage1_w4a8, {"BLOCK_N": 32, "BLOCK_K": 64}
    if amax:
        am_clean, am = torch.zeros(S, I // 32), guarded(torch.zeros(S, I // 32))
        args = lambda s, b, out: (x, xs, w13, s13, s, b, out, am_clean if out is clean else am[0], TOPK)  # noqa: E731
        kern = moe.moe_stage1_w4a8_amax
    clean = torch.zeros(S, I, dtype=torch.bfloat16)
    kern(*args(sid, bexp, clean), config=cfg)
    inter, ibuf = guarded(torch.zeros(S, I, dtype=torch.bfloat16))
    kern(*args(sid_bad, bexp_bad, inter), config=cfg)
    assert guards_intact(ibuf, S) and guards_intact(xbuf, M) and guards_intact(wbuf, E, None if fmt == "bf16" else fill)
    assert inter.isfinite().all(), "a stray read of a poisoned expert or token row reached the output"
    good = torch.ones(S, dtype=torch.bool)
    good[used:used + len(BAD_IDS)] = False
    good[-2 * BM:] = False
    assert torch.equal(inter[good], clean[good])
    if amax:
        assert guards_intact(am[1], S) and am[0].isfinite().all() and torch.equal(am[0][good], am_clean[good])


@pytest.mark.parametrize("fmt", ["bf16", "w4a16"])
@pytest.mark.parametrize("reduce", ["atomic", "partial"])
def test_moe_stage2_bad_expert_and_token_ids(reduce: str, fmt: str) -> None:
    W = make_weights(fmt, E, H, I)
    g = torch.Generator().manual_seed(8)
    atomic = reduce == "atomic"
    sid, bexp, sid_bad, bexp_bad, used = _routing(real_rows=atomic)
    S, T = sid.numel(), M * TOPK
    inter = torch.randn(S, I, generator=g).bfloat16()
    fill = float("nan") if fmt == "bf16" else 0x77777777
    w2, wbuf = guarded(W.w2, fill)
    s2, sbuf = guarded(W.s2) if fmt == "w4a16" else (None, None)  # NaN guards: a stray scale read shows
    tw, twbuf = guarded(torch.rand(T, generator=g))
    cfg = {"BLOCK_N": 64, "BLOCK_K": 32, "REDUCE": reduce}

    def run(s, b):
        out, obuf = guarded(torch.zeros(M if atomic else 0, H))
        part, pbuf = guarded(torch.zeros(0 if atomic else T, H))
        if fmt == "w4a16":
            moe.moe_stage2_w4a16(inter, w2, s2, s, b, tw, out, part, TOPK, config=cfg)
        else:
            moe.moe_stage2_bf16(inter, w2, s, b, tw, out, part, TOPK, config=cfg)
        assert guards_intact(obuf, out.shape[0]) and guards_intact(pbuf, part.shape[0])
        return out if atomic else part

    clean = run(sid, bexp)
    bad = run(sid_bad, bexp_bad)
    assert guards_intact(wbuf, E, None if fmt == "bf16" else fill) and guards_intact(twbuf, T)
    assert sbuf is None or guards_intact(sbuf, E)
    assert bad.isfinite().all()
    # atomic: the bad-expert blocks add exact zeros (their weight loads are masked to 0)
    torch.testing.assert_close(bad, clean, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# what the bound looks like in the generated code

def test_generated_source_names_the_bound() -> None:
    src = mla.mla_decode_split.source({}, "gfx942")
    assert "bounded gather: kv index 0 (dim NP)" in src
    assert "bounded gather: block_table index 1 (dim MP)" in src
    assert "gathers_bounded" in src


def test_plain_tile_kernels_have_no_bound() -> None:
    """Kernels indexed only by tiles of their dims keep their masks and their code."""
    from ops import gemm, norm

    for k in (gemm.gemm_w4a8_kernel, gemm.gemm_bf16_kernel, norm.rmsnorm):
        src = k.source({}, "gfx942")
        assert "bounded gather" not in src and "gathers_bounded" not in src


def test_taint_through_arithmetic_only() -> None:
    """An index computed from a load is bounded; one computed from program ids and dims is not."""

    @kd.kernel(name="_bounds_probe")
    def probe(idx: kd.In["N", kd.i32], src: kd.In["R", "C", kd.f32], out: kd.Out["N", "C", kd.f32]):
        n, c = kd.grid(kd.each("N"), kd.tile("C", block=16))
        row = idx[n] * 2 + 1
        out[n, c] = src[row, c] + src[n, c]

    text = probe.source({}, "interpret")
    assert text.count("bounded gather") == 1 and "src index 0 (dim R)" in text
    src, buf = guarded(torch.randn(5, 16))
    idx = torch.tensor([0, 1, 2, -1, 100], dtype=torch.int32)
    out = torch.full((5, 16), float("nan"))
    probe(idx, src, out)
    for n, i in enumerate(idx.tolist()):
        r = i * 2 + 1
        torch.testing.assert_close(out[n], (src[r] if 0 <= r < 5 else 0) + src[n])


def test_moe_stage2_w4a8_aq_bad_expert_and_token_ids() -> None:
    """moe_stage2_w4a8_aq (stage2_quant "amax") on the corrupted routing: its tile-maxima loads and
    everything else stay inside the views; the good rows are the clean run's, bit for bit."""
    W = make_weights("w4a8", E, H, I)
    g = torch.Generator().manual_seed(9)
    sid, bexp, sid_bad, bexp_bad, used = _routing(real_rows=False)
    S, T = sid.numel(), M * TOPK
    inter, ibuf = guarded(torch.randn(S, I, generator=g).bfloat16())
    am, abuf = guarded(inter.float().abs().view(S, I // 32, 32).amax(-1))
    w2, wbuf = guarded(W.w2, 0x77777777)
    tw, twbuf = guarded(torch.rand(T, generator=g))

    def run(s, b):
        part, pbuf = guarded(torch.zeros(T, H))
        moe.moe_stage2_w4a8_aq(inter, am, w2, W.s2, s, b, tw, torch.zeros(0, H), part, TOPK,
                               config={"BLOCK_N": 64, "BLOCK_K": 32, "REDUCE": "partial"})
        assert guards_intact(pbuf, T)
        return part

    clean, bad = run(sid, bexp), run(sid_bad, bexp_bad)
    assert guards_intact(ibuf, S) and guards_intact(abuf, S) and guards_intact(wbuf, E, 0x77777777)
    assert guards_intact(twbuf, T) and bad.isfinite().all()
    torch.testing.assert_close(bad, clean, atol=0, rtol=0)
