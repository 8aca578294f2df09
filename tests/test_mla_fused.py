"""The fused MLA steps (ops.mla_fused) on the interpreter against their torch references, on fresh
random data, outputs poisoned first, ragged sizes (small latent dims, H 1..5).

Tolerances:
- mla_prep (norms, k rope, cache append): bit-identical to the unfused ops (rmsnorm, rope_interleaved,
  append_latent), which the reference mirrors: the same f32 expressions, rounded to bf16 where those
  kernels store.
- mla_q_absorb: the roped q_pe part bit-identical to rope_interleaved; the absorbed part is an f32
  accumulated product rounded once to bf16: against the f32 reference, within one bf16 ulp
  (rtol 2^-7 relative to the row scale, atol 1e-2 on O(10) values).
- mla_q_absorb_kv (q_absorb_append): the absorbed query bit-identical to mla_q_absorb at the same
  tiles, the cache rows bit-identical to mla_prep's (the same f32 expressions over the same row);
  given the kv part as split-K partials [S, T, DL + R] f32 (S 1, 3, 4), bit-identical to feeding the
  bf16 row of their sum in split order (ops.gemm.splitk_sum_ref).
- mla_combine_uv: with W_UV = identity and BLOCK_S 1 it returns mla_decode_combine's bf16 output bit
  for bit (the same split merge); with a random W_UV it matches bf16(combine) @ W_UV in f32 within one
  bf16 ulp. At any BLOCK_S (S not a multiple of it included) against mla_combine_uv_ref (f64 merge):
  the merged latent may round to the neighbouring bf16 (the tile sums in another order), so
  rtol 2^-7 with atol 1e-2 on O(1) outputs; empty splits appended to a launch change no bit.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ops import gemm as G, mla, mla_fused as F, norm, rope
from tests.conftest import poisoned


def _rand(*shape, g, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _prep_case(T, q_lora, C, R, NP, PS, seed, pad_cols=5):
    g = torch.Generator().manual_seed(seed)
    # the GEMM output as a strided view of a wider buffer: the kernel reads rows in place
    buf = _rand(T, q_lora + C + R + pad_cols, g=g, scale=3.0)
    qkv = buf[:, :q_lora + C + R]
    wq = _rand(q_lora, g=g) if q_lora else None
    wkv = _rand(C, g=g)
    ang = torch.rand(T, R // 2, generator=g) * 6.0
    kv = _rand(NP, PS, C + R, g=g)
    slots = torch.randperm(NP * PS, generator=g)[:T]
    return qkv, wq, wkv, ang.cos(), ang.sin(), kv, slots


def _unfused(qkv, wq, wkv, cos, sin, kv, slots, q_lora, C):
    """The old model path through the triton ops: rmsnorm x2, rope on k_pe, cat, append_latent."""
    T = qkv.shape[0]
    qc = norm.rms_norm(qkv[:, :q_lora].contiguous(), wq, 1e-6) if q_lora else None
    lat = norm.rms_norm(qkv[:, q_lora:q_lora + C].contiguous(), wkv, 1e-6)
    pe = rope.apply_rope(qkv[:, q_lora + C:].reshape(T, 1, -1).contiguous(), cos, sin, "interleaved")
    mla.append_latent(kv, torch.cat([lat, pe.reshape(T, -1)], -1), slots)
    return qc


@settings(max_examples=6)
@given(T=st.integers(1, 9), q_lora=st.sampled_from([0, 24, 48]), C=st.sampled_from([16, 32, 40]),
       R=st.sampled_from([8, 16]), seed=st.integers(0, 2**16))
def test_prep_matches_unfused_ops_bit_for_bit(T, q_lora, C, R, seed):
    qkv, wq, wkv, cos, sin, kv, slots = _prep_case(T, q_lora, C, R, NP=5, PS=4, seed=seed)
    kv_ref, kv_old, kv_new = kv.clone(), kv.clone(), kv.clone()
    kv_new[:] = float("nan")                 # poisoned: every untouched slot must still be NaN after
    kv_ref[:] = float("nan")
    qc = F.mla_prep(qkv, wq, wkv, cos, sin, slots, kv_new, 1e-6, q_lora=q_lora)
    qc_ref = F.mla_prep(qkv, wq, wkv, cos, sin, slots, kv_ref, 1e-6, q_lora=q_lora, backend="torch")
    qc_old = _unfused(qkv, wq, wkv, cos, sin, kv_old, slots, q_lora, C)
    written = torch.zeros(5 * 4, dtype=torch.bool)
    written[slots] = True
    flat_new, flat_ref = kv_new.view(-1, kv.shape[-1]), kv_ref.view(-1, kv.shape[-1])
    assert torch.equal(flat_new[written], flat_ref[written])
    assert torch.equal(flat_new[written], kv_old.view(-1, kv.shape[-1])[written])
    assert flat_new[~written].isnan().all()  # nothing else of the cache was written
    if q_lora:
        assert torch.equal(qc, qc_ref) and torch.equal(qc, qc_old)
    else:
        assert qc is None and qc_ref is None


def test_prep_skips_padding_and_slots_past_the_cache():
    """slot -1 (padding) and slots >= the capacity store nothing: the cache is read back through a
    view of a bigger buffer whose poisoned guard pages must stay untouched (bounded gathers)."""
    NP, PS, C, R, QL = 3, 4, 16, 8, 24
    qkv, wq, wkv, cos, sin, _, _ = _prep_case(4, QL, C, R, NP, PS, seed=3)
    for backend in ("triton", "torch"):
        buf = torch.full((NP + 4, PS, C + R), 7.0, dtype=torch.bfloat16)
        kv = buf[2:2 + NP]
        kv.copy_(_rand(NP, PS, C + R, g=torch.Generator().manual_seed(1)))
        b0 = buf.clone()
        slots = torch.tensor([NP * PS, 5, -1, NP * PS + 3 * PS + 1])
        qc = F.mla_prep(qkv, wq, wkv, cos, sin, slots, kv, 1e-6, q_lora=QL, backend=backend)
        assert torch.equal(buf[:2], b0[:2]) and torch.equal(buf[2 + NP:], b0[2 + NP:]), backend
        changed = (buf != b0).any(-1).nonzero().tolist()
        assert changed == [[2 + 1, 1]], (backend, changed)   # only slot 5 = page 1, offset 1
        assert qc.shape == (4, QL) and not qc.isnan().any()
        with pytest.raises(ValueError, match="beyond the cache"):
            F.mla_prep(qkv, wq, wkv, cos, sin, slots, kv, 1e-6, q_lora=QL, backend=backend, validate=True)


def test_prep_cache_stores_are_bounded():
    """The page index is computed from a loaded slot: the DSL bounds every cache store by NP."""
    for k in (F.mla_prep_qkv, F.mla_prep_kv):
        src = k.source({}, "gfx942")
        assert "bounded gather: kv index 0 (dim NP)" in src and "gathers_bounded" in src


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_prep_argument_checks(backend):
    qkv, wq, wkv, cos, sin, kv, slots = _prep_case(3, 24, 16, 8, 4, 4, seed=2)
    with pytest.raises(ValueError, match="qkv must be"):
        F.mla_prep(qkv[:, 1:], wq, wkv, cos, sin, slots, kv, 1e-6, q_lora=24, backend=backend)
    with pytest.raises(ValueError, match="slots must be"):
        F.mla_prep(qkv, wq, wkv, cos, sin, slots[:2], kv, 1e-6, q_lora=24, backend=backend)
    with pytest.raises(ValueError, match="cos must be"):
        F.mla_prep(qkv, wq, wkv, cos[:, :2], sin, slots, kv, 1e-6, q_lora=24, backend=backend)
    with pytest.raises(TypeError, match="qkv must be bfloat16"):
        F.mla_prep(qkv.float(), wq, wkv, cos, sin, slots, kv, 1e-6, q_lora=24, backend=backend)


def _absorb_case(T, H, nope, R, C, seed):
    g = torch.Generator().manual_seed(seed)
    buf = _rand(T, H * (nope + R), g=g, scale=2.0)          # the q_b GEMM output, viewed per head
    ang = torch.rand(T, R // 2, generator=g) * 6.0
    return buf.view(T, H, nope + R), _rand(H, nope, C, g=g, scale=0.3), ang.cos(), ang.sin()


@settings(max_examples=6)
@given(T=st.integers(1, 21), H=st.integers(1, 5), nope=st.sampled_from([16, 24, 32]), C=st.sampled_from([16, 40, 64]),
       R=st.sampled_from([8, 16]), cfg=st.sampled_from([None, {"BLOCK_T": 16, "BLOCK_C": 32, "BLOCK_K": 16},
                                                        {"BLOCK_T": 2, "BLOCK_C": 64, "BLOCK_K": 32}]),
       seed=st.integers(0, 2**16))
def test_q_absorb_matches_reference(T, H, nope, C, R, cfg, seed):
    q, wuk, cos, sin = _absorb_case(T, H, nope, R, C, seed)
    out = F.q_absorb(q, wuk, cos, sin, config=cfg)
    ref = F.mla_q_absorb_ref(q, wuk, cos, sin)
    exact = torch.einsum("thn,hnc->thc", q[..., :nope].float(), wuk.float())
    assert out.shape == (T, H, C + R) and not out.isnan().any()
    # q_pe: exactly the rope kernel's output
    assert torch.equal(out[..., C:], rope.apply_rope(q[..., nope:], cos, sin, "interleaved"))
    assert torch.equal(out[..., C:], ref[..., C:])
    torch.testing.assert_close(out[..., :C].float(), exact, rtol=2 ** -7, atol=1e-2)


def test_q_absorb_writes_every_element():
    """Output poisoned first (the op allocates with torch.empty: run the kernel into a NaN buffer)."""
    q, wuk, cos, sin = _absorb_case(5, 3, 16, 8, 48, seed=9)
    out = poisoned((5, 3, 56), torch.bfloat16)
    F.mla_q_absorb(q, wuk, cos, sin, out, config={"BLOCK_T": 4, "BLOCK_C": 32, "BLOCK_K": 16})
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), F.mla_q_absorb_ref(q, wuk, cos, sin).float(), rtol=2 ** -7, atol=1e-2)


def _append_case(T, H, nope, R, C, NP, PS, seed, q_lora=24):
    q, wuk, cos, sin = _absorb_case(T, H, nope, R, C, seed)
    qkv, _, wkv, _, _, _, slots = _prep_case(T, q_lora, C, R, NP, PS, seed + 1)
    return q, wuk, cos, sin, qkv, wkv, slots


@settings(max_examples=6)
@given(T=st.integers(1, 19), H=st.integers(1, 4), nope=st.sampled_from([16, 32]), C=st.sampled_from([16, 40]),
       R=st.sampled_from([8, 16]), cfg=st.sampled_from([None, {"BLOCK_T": 16, "BLOCK_C": 32, "BLOCK_K": 16},
                                                        {"BLOCK_T": 2, "BLOCK_C": 64, "BLOCK_K": 32}]),
       seed=st.integers(0, 2**16))
def test_q_absorb_append_equals_prep_and_absorb_bit_for_bit(T, H, nope, C, R, cfg, seed):
    """One launch = mla_prep's cache append (its kv part) + mla_q_absorb, bit for bit; every untouched
    cache row keeps its poison."""
    NP, PS, QL = 6, 4, 24
    q, wuk, cos, sin, qkv, wkv, slots = _append_case(T, H, nope, R, C, NP, PS, seed, QL)
    kv_new = torch.full((NP, PS, C + R), float("nan"), dtype=torch.bfloat16)
    kv_old, kv_ref = kv_new.clone(), kv_new.clone()
    out = F.q_absorb_append(q, wuk, cos, sin, qkv[:, QL:], wkv, slots, kv_new, 1e-6, config=cfg)
    F.mla_prep(qkv, torch.ones(QL, dtype=torch.bfloat16), wkv, cos, sin, slots, kv_old, 1e-6, q_lora=QL)
    ref = F.q_absorb_append(q, wuk, cos, sin, qkv[:, QL:], wkv, slots, kv_ref, 1e-6, backend="torch")
    assert torch.equal(out, F.q_absorb(q, wuk, cos, sin, config=cfg))
    assert torch.equal(out[..., C:], ref[..., C:])
    torch.testing.assert_close(out[..., :C].float(), ref[..., :C].float(), rtol=2 ** -7, atol=1e-2)
    written = torch.zeros(NP * PS, dtype=torch.bool)
    written[slots] = True
    flat = lambda kv: kv.view(-1, C + R)  # noqa: E731
    assert torch.equal(flat(kv_new)[written], flat(kv_old)[written])
    assert torch.equal(flat(kv_new)[written], flat(kv_ref)[written])
    assert flat(kv_new)[~written].isnan().all()


def _partials_of(rows: torch.Tensor, S: int, seed: int, pad: int = 3) -> torch.Tensor:
    """Random f32 split-K partials [S, T, W] (a strided view of a wider buffer, as the kv columns of
    the q_a|kv_a partials) whose sum is near `rows`."""
    g = torch.Generator().manual_seed(seed)
    T, W = rows.shape
    buf = torch.randn(S, T, W + pad, generator=g)
    part = buf[:, :, pad:]
    part[0] = rows.float() - part[1:].sum(0)
    return part


@pytest.mark.parametrize("S", [1, 3, 4])
def test_q_absorb_append_reads_split_partials(S):
    """kva as split-K partials: the cache rows equal those from the bf16 row of their split-order sum
    bit for bit, and the torch backend's; the query is untouched by the split."""
    NP, PS, QL, T, H, C, R = 4, 4, 24, 5, 2, 40, 8
    q, wuk, cos, sin, qkv, wkv, slots = _append_case(T, H, 16, R, C, NP, PS, seed=20 + S, q_lora=QL)
    part = _partials_of(qkv[:, QL:], S, seed=S)
    kv_split, kv_sum, kv_ref = (torch.full((NP, PS, C + R), float("nan"), dtype=torch.bfloat16) for _ in range(3))
    cfg = {"BLOCK_T": 2, "BLOCK_C": 32, "BLOCK_K": 16}
    out = F.q_absorb_append(q, wuk, cos, sin, part, wkv, slots, kv_split, 1e-6, config=cfg)
    F.q_absorb_append(q, wuk, cos, sin, G.splitk_sum_ref(part), wkv, slots, kv_sum, 1e-6, config=cfg)
    F.q_absorb_append(q, wuk, cos, sin, part, wkv, slots, kv_ref, 1e-6, backend="torch")
    assert torch.equal(out, F.q_absorb(q, wuk, cos, sin, config=cfg))
    flat = lambda kv: kv.view(-1, C + R)  # noqa: E731
    assert not flat(kv_split)[slots].isnan().any()
    assert torch.equal(flat(kv_split)[slots], flat(kv_sum)[slots])
    assert torch.equal(flat(kv_split)[slots], flat(kv_ref)[slots])
    assert flat(kv_split).isnan().all(-1).sum() == NP * PS - T
    with pytest.raises(ValueError, match="kva must be"):
        F.q_absorb_append(q, wuk, cos, sin, part[:, :, 1:], wkv, slots, kv_split, 1e-6)
    with pytest.raises(ValueError, match="kva must be"):
        F.q_absorb_append(q, wuk, cos, sin, part[:0], wkv, slots, kv_split, 1e-6)


@pytest.mark.parametrize("P", [1, 2, 3])
def test_q_absorb_append_reads_q_partials(P):
    """q as the q_b GEMM's f32 split-K partials [P, T, H, nope + R] (a strided view of a wider
    buffer): the absorbed query and the cache rows equal those from the bf16 q of their split-order
    sum bit for bit, and the torch backend's query within its bound; every untouched cache row keeps
    its poison. A q that is neither bf16 [T, H, D] nor f32 [P >= 1, T, H, D] is refused."""
    NP, PS, QL, T, H, nope, C, R = 4, 4, 24, 5, 3, 16, 40, 8
    q, wuk, cos, sin, qkv, wkv, slots = _append_case(T, H, nope, R, C, NP, PS, seed=30 + P, q_lora=QL)
    qp = _partials_of(q.reshape(T, -1), P, seed=40 + P).view(P, T, H, nope + R) if P > 1 else None
    if qp is None:  # one split: a strided f32 view of the bf16 rows (exact)
        buf = torch.full((1, T, H, nope + R + 4), float("nan"))
        buf[0, :, :, :nope + R] = q.float()
        qp = buf[..., :nope + R]
    qb = G.splitk_sum_ref(qp)
    kv_p, kv_b, kv_ref = (torch.full((NP, PS, C + R), float("nan"), dtype=torch.bfloat16) for _ in range(3))
    cfg = {"BLOCK_T": 2, "BLOCK_C": 32, "BLOCK_K": 16}
    kva = qkv[:, QL:]
    out = F.q_absorb_append(qp, wuk, cos, sin, kva, wkv, slots, kv_p, 1e-6, config=cfg)
    assert torch.equal(out, F.q_absorb_append(qb, wuk, cos, sin, kva, wkv, slots, kv_b, 1e-6, config=cfg))
    assert torch.equal(kv_p.view(torch.int16), kv_b.view(torch.int16))  # the poison too: same rows written
    ref = F.q_absorb_append(qp, wuk, cos, sin, kva, wkv, slots, kv_ref, 1e-6, backend="torch")
    assert torch.equal(out[..., C:], ref[..., C:])
    torch.testing.assert_close(out[..., :C].float(), ref[..., :C].float(), rtol=2 ** -7, atol=1e-2)
    flat = lambda kv: kv.view(-1, C + R)  # noqa: E731
    assert flat(kv_p).isnan().all(-1).sum() == NP * PS - T
    for bad in (qp[:0], qp.double(), qp[0].float(), qp.to(torch.bfloat16)):
        with pytest.raises((ValueError, TypeError), match="q must be"):
            F.q_absorb_append(bad, wuk, cos, sin, kva, wkv, slots, kv_p, 1e-6)


@pytest.mark.parametrize("T", [1, 3, 6, 16])
def test_q_absorb_append_block_t_changes_no_bit(T):
    """BLOCK_T and BLOCK_C are launch-only keys (each M bucket takes its own): a tile under 16 rows
    meets the 16-row dot padded with zeros, each row at its own place (row mod 16), and a column's
    sum over NOPE runs in BLOCK_K steps whatever the column tile, so every row's absorbed query has
    the same bits at BLOCK_T 1, 2, 4, 8, 16 and BLOCK_C 32, 64. The output is a view of a bigger poisoned
    buffer: no row past T (nor of another program's part of the 16) is written."""
    NP, PS, QL, H, nope, C, R = 8, 4, 24, 2, 16, 64, 8
    q, wuk, cos, sin, qkv, wkv, slots = _append_case(T, H, nope, R, C, NP, PS, seed=50 + T, q_lora=QL)
    qp = _partials_of(q.reshape(T, -1), 2, seed=T).view(2, T, H, nope + R)
    outs = []
    for bt, bc in ((1, 32), (2, 64), (4, 32), (8, 64), (16, 32), (16, 64)):
        buf = poisoned((T + 16, H, C + R), torch.bfloat16)
        kv = torch.full((NP, PS, C + R), float("nan"), dtype=torch.bfloat16)
        F.mla_q_absorb_kv(qp, wuk, cos, sin, qkv[:, QL:].float()[None], wkv, slots, buf[:T], kv, 1e-6,
                          config={"BLOCK_T": bt, "BLOCK_C": bc, "BLOCK_K": 16})
        assert buf[T:].isnan().all() and not buf[:T].isnan().any()
        outs.append(buf[:T].clone())
    for o in outs[1:]:
        assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16))
    ref = F.mla_q_absorb_ref(G.splitk_sum_ref(qp), wuk, cos, sin)
    torch.testing.assert_close(outs[0].float(), ref.float(), rtol=2 ** -7, atol=1e-2)


def test_q_absorb_append_skips_padding_and_slots_past_the_cache():
    """slot -1 and slots past the capacity store nothing: the cache is a view of a bigger buffer whose
    guard pages must stay untouched; several programs per row (heads x DL tiles), one writer each."""
    NP, PS, C, R, T, H = 3, 4, 64, 8, 5, 3
    q, wuk, cos, sin, qkv, wkv, _ = _append_case(T, H, 16, R, C, NP, PS, seed=7)
    slots = torch.tensor([NP * PS, 5, -1, NP * PS + 3 * PS + 1, 10])
    for backend in ("triton", "torch"):
        buf = torch.full((NP + 4, PS, C + R), 7.0, dtype=torch.bfloat16)
        kv = buf[2:2 + NP]
        kv.copy_(_rand(NP, PS, C + R, g=torch.Generator().manual_seed(1)))
        b0 = buf.clone()
        out = poisoned((T, H, C + R), torch.bfloat16)
        if backend == "triton":
            F.mla_q_absorb_kv(q.float()[None], wuk, cos, sin, qkv[:, 24:].float()[None], wkv, slots, out, kv, 1e-6,
                              config={"BLOCK_T": 2, "BLOCK_C": 32, "BLOCK_K": 16})
        else:
            out = F.q_absorb_append(q, wuk, cos, sin, qkv[:, 24:], wkv, slots, kv, 1e-6, backend="torch")
        assert not out.isnan().any()
        assert torch.equal(buf[:2], b0[:2]) and torch.equal(buf[2 + NP:], b0[2 + NP:]), backend
        changed = (buf != b0).any(-1).nonzero().tolist()
        assert changed == [[2 + 1, 1], [2 + 2, 2]], (backend, changed)   # slots 5 and 10 only
        with pytest.raises(ValueError, match="beyond the cache"):
            F.q_absorb_append(q, wuk, cos, sin, qkv[:, 24:], wkv, slots, kv, 1e-6, backend=backend, validate=True)


def test_q_absorb_append_stores_are_bounded_and_only_writers_append():
    """The page index comes from a loaded slot: the DSL bounds the cache stores by NP. The append
    (every load of the kv partials and every cache store) comes after the early return of the
    programs that own no row, and its split sum is unrolled (no loop the ISA report would count once)."""
    src = F.mla_q_absorb_kv.source({"BLOCK_T": 16, "BLOCK_C": 64}, "gfx942", {"S": 4, "H": 8})
    assert "bounded gather: kv index 0 (dim NP)" in src and "gathers_bounded" in src
    lines = src.splitlines()
    exit_at = next(i for i, ln in enumerate(lines) if ln.strip() == "return")
    kva = [i for i, ln in enumerate(lines) if "tl.load(kva_ptr" in ln]
    stores = [i for i, ln in enumerate(lines) if "tl.store(kv_ptr" in ln]
    # three column groups (latent, the two rope halves): the first split and the unrolled rest each
    assert len(kva) == 3 * 2 and len(stores) == 3 and min(kva + stores) > exit_at
    assert not [ln for ln in lines[exit_at:] if ln.strip().startswith("for ") and "static_range" not in ln]


@pytest.mark.parametrize("H,C,cfg", [(1, 40, {"BLOCK_T": 16, "BLOCK_C": 64, "BLOCK_K": 16}),
                                     (3, 64, {"BLOCK_T": 16, "BLOCK_C": 32, "BLOCK_K": 16}),
                                     (2, 64, {"BLOCK_T": 4, "BLOCK_C": 32, "BLOCK_K": 16})])
def test_q_absorb_append_rows_past_the_programs_of_a_tile(H, C, cfg):
    """A row tile with more rows than programs (heads x DL tiles) appends its later rows in the
    later unrolled trips: every row of a ragged batch reaches its slot bit for bit as on the torch
    backend (S 2 partials), padding stores nothing, every other cache row keeps its poison."""
    NP, PS, QL, T, R = 6, 4, 24, 19, 8
    q, wuk, cos, sin, qkv, wkv, slots = _append_case(T, H, 16, R, C, NP, PS, seed=31 + H, q_lora=QL)
    slots[5] = -1
    part = _partials_of(qkv[:, QL:], 2, seed=H)
    kv_new, kv_ref = (torch.full((NP, PS, C + R), float("nan"), dtype=torch.bfloat16) for _ in range(2))
    out = F.q_absorb_append(q, wuk, cos, sin, part, wkv, slots, kv_new, 1e-6, config=cfg)
    F.q_absorb_append(q, wuk, cos, sin, part, wkv, slots, kv_ref, 1e-6, backend="torch")
    assert torch.equal(out, F.q_absorb(q, wuk, cos, sin, config=cfg))
    flat = lambda kv: kv.view(-1, C + R)  # noqa: E731
    written = torch.zeros(NP * PS, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert not flat(kv_new)[written].isnan().any()
    assert torch.equal(flat(kv_new)[written], flat(kv_ref)[written])
    assert flat(kv_new)[~written].isnan().all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_q_absorb_append_argument_checks(backend):
    q, wuk, cos, sin, qkv, wkv, slots = _append_case(3, 2, 16, 8, 16, 4, 4, seed=2)
    kv = _rand(4, 4, 24, g=torch.Generator().manual_seed(0))
    args = (q, wuk, cos, sin, qkv[:, 24:], wkv, slots, kv, 1e-6)
    with pytest.raises(ValueError, match="kva must be"):
        F.q_absorb_append(*args[:4], qkv[:, 23:], *args[5:], backend=backend)
    with pytest.raises(ValueError, match="slots must be"):
        F.q_absorb_append(*args[:6], slots[:2], *args[7:], backend=backend)
    with pytest.raises(ValueError, match="kv_norm_w must be"):
        F.q_absorb_append(*args[:5], wkv[:8], *args[6:], backend=backend)
    with pytest.raises(ValueError, match="eps must be"):
        F.q_absorb_append(*args[:8], float("nan"), backend=backend)


def _decode_case(lens, q_len, H, C, R, seed, ps=8):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    mp = max(-(-n // ps) for n in lens) + 1
    npages = B * mp + 2
    kv = _rand(npages, ps, C + R, g=g)
    bt = torch.randperm(npages, generator=g)[:B * mp].view(B, mp).to(torch.int32)
    q = _rand(B, q_len, H, C + R, g=g)
    return q, kv, bt, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("splits", [1, 3])
def test_combine_uv_identity_equals_combine_bit_for_bit(splits):
    """W_UV = I: the fused kernel's output is mla_decode_combine's bf16 output, bit for bit."""
    C, R, H = 32, 16, 3
    q, kv, bt, lens = _decode_case([9, 26], 2, H, C, R, seed=4)
    eye = torch.eye(C, dtype=torch.bfloat16).expand(H, C, C).contiguous()
    base = mla.mla_decode(q, kv, bt, lens, 0.3, latent_dim=C, splits=splits, config={"BLOCK_N": 16})
    fused = mla.mla_decode(q, kv, bt, lens, 0.3, latent_dim=C, splits=splits, config={"BLOCK_N": 16}, w_uv=eye)
    assert torch.equal(fused, base)
    # the kernel alone at other tiles (VALU and matrix-core products), poisoned output
    S = 3
    g = torch.Generator().manual_seed(5)
    part = torch.randn(4, H, S, C, generator=g)
    lse = torch.randn(4, H, S, generator=g) * 3
    lse[1, :, 1] = float("-inf")                                     # an empty split
    lse[2] = float("-inf")                                           # a row that saw nothing: 0
    want = poisoned((4, H, C), torch.bfloat16)
    mla.mla_decode_combine(part.view(1, 4, H, S, C), lse.view(1, 4, H, S), want.view(1, 4, H, C), 4 * H)
    for cfg in ({"BLOCK_M": 1, "BLOCK_V": 32, "BLOCK_C": 16}, {"BLOCK_M": 16, "BLOCK_V": 32, "BLOCK_C": 32}):
        out = poisoned((4, H, C), torch.bfloat16)
        F.mla_combine_uv(part, lse, eye, out, config=cfg)
        assert torch.equal(out, want) and (out[2] == 0).all()


def _combine_case(BQ, H, S, C, V, seed):
    """Partials, log2-sum-exps (an empty split, a row with none) and W_UV, fresh random."""
    g = torch.Generator().manual_seed(seed)
    part = torch.randn(BQ, H, S, C, generator=g)
    lse = torch.randn(BQ, H, S, generator=g) * 4
    part[0, 0, 1], lse[0, 0, 1] = 0.0, float("-inf")                # an empty split
    part[-1, -1], lse[-1, -1] = 0.0, float("-inf")                  # a (row, head) that saw nothing: 0
    return part, lse, _rand(H, C, V, g=g, scale=0.5)


@pytest.mark.parametrize("block_s,S", [(1, 5), (2, 5), (4, 5), (8, 5), (4, 8), (16, 9)])
def test_combine_uv_block_s_matches_reference(block_s, S):
    """BLOCK_S splits a step, S a multiple of it or not, against the plain-torch merge."""
    BQ, H, C, V = 3, 2, 32, 24
    part, lse, w = _combine_case(BQ, H, S, C, V, seed=10 + S + block_s)
    # the last: one DL tile wider than the latent and V in 16-column programs (the decode step's shape)
    for cfg in ({"BLOCK_M": 1, "BLOCK_V": 32, "BLOCK_C": 16}, {"BLOCK_M": 4, "BLOCK_V": 32, "BLOCK_C": 32},
                {"BLOCK_M": 1, "BLOCK_V": 16, "BLOCK_C": 256}):
        out = poisoned((BQ, H, V), torch.bfloat16)
        F.mla_combine_uv(part, lse, w, out, config={**cfg, "BLOCK_S": block_s})
        assert not out.isnan().any() and (out[-1, -1] == 0).all()
        torch.testing.assert_close(out.float(), F.mla_combine_uv_ref(part, lse, w).float(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("block_s", [1, 2, 4, 8])
def test_combine_uv_empty_splits_change_no_bit(block_s):
    """A launch with more splits than a row's own (lse -inf, partial 0 beyond them, as the split
    kernel writes past a short sequence) returns the same bits: tiles start at multiples of BLOCK_S."""
    BQ, H, S, C, V = 2, 3, 5, 32, 16
    part, lse, w = _combine_case(BQ, H, S, C, V, seed=20 + block_s)
    cfg = {"BLOCK_M": 2, "BLOCK_V": 32, "BLOCK_C": 16, "BLOCK_S": block_s}
    base = poisoned((BQ, H, V), torch.bfloat16)
    F.mla_combine_uv(part, lse, w, base, config=cfg)
    for extra in (1, 3, 11):
        p2 = torch.cat([part, torch.zeros(BQ, H, extra, C)], 2)
        l2 = torch.cat([lse, torch.full((BQ, H, extra), float("-inf"))], 2)
        out = poisoned((BQ, H, V), torch.bfloat16)
        F.mla_combine_uv(p2, l2, w, out, config=cfg)
        assert torch.equal(out, base)
    one = poisoned((1, H, V), torch.bfloat16)                       # row 0 alone: the batch changes no bit
    F.mla_combine_uv(part[:1].contiguous(), lse[:1].contiguous(), w, one, config=cfg)
    assert torch.equal(one, base[:1])


@settings(max_examples=5)
@given(lens=st.lists(st.integers(4, 40), min_size=1, max_size=3), q_len=st.sampled_from([1, 3]),
       H=st.integers(1, 4), V=st.sampled_from([8, 24, 32]), splits=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_decode_with_w_uv_matches_reference(lens, q_len, H, V, splits, seed):
    C, R = 32, 16
    q, kv, bt, sl = _decode_case(lens, q_len, H, C, R, seed)
    w = _rand(H, C, V, g=torch.Generator().manual_seed(seed + 1), scale=0.5)
    out = mla.mla_decode(q, kv, bt, sl, 0.3, latent_dim=C, splits=splits, w_uv=w)
    lat = mla.mla_decode(q, kv, bt, sl, 0.3, latent_dim=C, splits=splits)
    assert out.shape == (len(lens), q_len, H, V) and not out.isnan().any()
    torch.testing.assert_close(out.float(), torch.einsum("bqhc,hcv->bqhv", lat.float(), w.float()),
                               rtol=2 ** -7, atol=1e-2)
    ref = mla.mla_decode(q, kv, bt, sl, 0.3, latent_dim=C, w_uv=w, backend="torch")
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.05, atol=0.05)  # bf16 attention vs f64


def test_decode_w_uv_row_does_not_depend_on_batch():
    """Batch-invariant default: row 0 of a batch-8 launch equals the batch-1 launch bit for bit."""
    C, R, H, V = 32, 16, 2, 16
    q, kv, bt, sl = _decode_case([30, 9, 17, 25, 5, 12, 40, 8], 1, H, C, R, seed=8)
    w = _rand(H, C, V, g=torch.Generator().manual_seed(2), scale=0.5)
    all8 = mla.mla_decode(q, kv, bt, sl, 0.3, latent_dim=C, w_uv=w)
    one = mla.mla_decode(q[:1], kv, bt[:1], sl[:1], 0.3, latent_dim=C, w_uv=w)
    assert torch.equal(all8[:1], one)


def test_decode_w_uv_checks():
    q, kv, bt, sl = _decode_case([9], 1, 2, 32, 16, seed=1)
    with pytest.raises(ValueError, match="w_uv must be"):
        mla.mla_decode(q, kv, bt, sl, 0.3, latent_dim=32, w_uv=torch.zeros(3, 32, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="w_uv must be"):
        mla.mla_decode(q, kv, bt, sl, 0.3, latent_dim=32, out_dtype=torch.float32,
                       w_uv=torch.zeros(2, 32, 8, dtype=torch.bfloat16))


@pytest.mark.slow
@pytest.mark.xdist_group("triton_greedy")      # with tests/test_triton_backend.py: one greedy run
def test_model_fused_mla_matches_unfused_ops(tmp_path_factory):
    """KimiModel on the kernels: the fused MLA path against the unfused ops (`_MLA.fused = False`).
    Layer 0's cache rows are bit-identical (mla_prep equals the norms + rope + append it replaces, on
    the same input); later layers and the logits differ only by the bf16 rounding order of the W_UK /
    W_UV products: logits within 0.1 absolute (~5 in size), routing replayed from the fused run.
    The fused run (prefill + one greedy decode step on a NaN-poisoned cache, the routing recorded) is
    the one tests/test_triton_backend.py checks against torch, computed once per process
    (tests/_model_fixtures.triton_greedy: it decodes one step more, whose row is not compared here)."""
    from models.kimi import RoutingTrace
    from tests._model_fixtures import one_thread, triton_greedy

    n = one_thread()
    toks = [11, 42, 7, 300, 5]
    m = None
    try:
        g = triton_greedy(tmp_path_factory.getbasetemp() / "models_fx", toks)
        m = g.model
        for _, attn, _, _ in m.layers:
            assert attn.fused
            attn.fused = False
        m.routing = RoutingTrace("replay", g.routing)
        c = m.new_cache(1, 16)
        for kv in c.kv:
            kv.fill_(float("nan"))                 # poisoned: every row the step reads must have been written
        a = m.forward(c, [(0, toks)])
        b = m.forward(c, [(0, [int(a.logits[0][-1].argmax())])])
        outs, caches = [tuple(g.outputs[:2]), (a, b)], [g.cache, c]
        m.routing = None
        n_rows = len(toks) + 1
        rows = lambda c, i: c.kv[i].view(-1, c.kv[i].shape[-1])  # noqa: E731
        ps = caches[0].table.page_size
        flat = torch.cat([torch.arange(p * ps, p * ps + ps) for p in caches[0].table.bt[0].tolist()])[:n_rows]
        assert torch.equal(rows(caches[0], 0)[flat], rows(caches[1], 0)[flat])
        assert not rows(caches[0], 0)[flat].isnan().any()
        for i in range(1, len(caches[0].kv)):
            torch.testing.assert_close(rows(caches[0], i)[flat].float(), rows(caches[1], i)[flat].float(),
                                       atol=0.1, rtol=0.05)
        (fa, fb), (ua, ub) = outs
        torch.testing.assert_close(fa.logits[0], ua.logits[0], atol=0.1, rtol=0)
        torch.testing.assert_close(fb.logits[0], ub.logits[0], atol=0.1, rtol=0)
    finally:
        if m is not None:
            for _, attn, _, _ in m.layers:
                attn.fused = True
            m.routing = None
        torch.set_num_threads(n)


@pytest.mark.aot
@pytest.mark.parametrize("kernel", [F.mla_prep_qkv, F.mla_prep_kv, F.mla_q_absorb, F.mla_q_absorb_kv, F.mla_combine_uv],
                         ids=lambda k: k.name)
def test_default_config_compiles_everywhere(kernel):
    """Tier 2: the default config compiles for gfx942, gfx950 and sm90 (Kimi shapes, the kernels'
    examples) with no spills and LDS within the limit."""
    from kdsl import aot

    for arch in ("gfx942", "gfx950", "sm90"):
        r = aot.report(kernel, arch)
        assert r.ok, r.text()
        assert r.spills == 0 and r.scratch_bytes == 0, r.text()
        assert r.lds_bytes <= r.lds_limit, r.text()
