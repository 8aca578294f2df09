"""Route and align in one launch (ops.moe.moe_route_align / moe_route_align_local / route_align).

Tolerance: none. The fused kernel must give the bits of moe_route (or moe_route_local) followed by
moe_align_one: ids, weights (compared as raw f32 bits, NaN included), block map and sorted slots,
on fresh random SPLIT partial logits with NaN / +-inf entries and exact ties. Every output is read
back through a view into a larger buffer filled with a sentinel, so a stray write shows."""
from __future__ import annotations

import pytest
import torch

import kdsl as kd
from ops import moe

PAD = 40
SENT = -777


def _logits(split: int, M: int, E: int, seed: int, ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    part = torch.randn(split, M, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.05
    if ties:  # exact ties among the chosen (equal logits and biases): the lower id wins
        part[:, :, 1::3] = part[:, :, 0:1]
        bias[1::3] = bias[0]
    flat = part.view(-1)
    pos = torch.randperm(flat.numel(), generator=g)[:6]
    flat[pos[:2]] = float("nan")
    flat[pos[2:4]] = float("inf")
    flat[pos[4:]] = float("-inf")
    if M > 2:
        part[:, 2, :] = float("nan")  # a whole token of NaN logits: ids still distinct and valid
    return part, bias


def _guarded(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    buf = torch.full((n + 2 * PAD,), float("nan") if dtype.is_floating_point else SENT, dtype=dtype)
    return buf, buf[PAD:PAD + n]


def _guards_intact(buf: torch.Tensor, n: int) -> bool:
    ends = torch.cat([buf[:PAD], buf[PAD + n:]])
    return bool(ends.isnan().all()) if buf.dtype.is_floating_point else bool((ends == SENT).all())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("M,E,K,ng,tkg,soft,bm,split,local", [
    (1, 384, 8, 1, 1, 0, 16, 14, None),        # Kimi decode
    (4, 384, 8, 1, 1, 0, 32, 14, None),        # Kimi verify
    (5, 64, 6, 8, 3, 0, 16, 3, None),          # group-limited
    (3, 32, 4, 1, 1, 1, 16, 2, None),          # softmax scoring
    (6, 48, 5, 4, 2, 1, 64, 1, None),          # softmax + groups, one split
    (7, 64, 6, 4, 2, 0, 16, 3, (16, 16)),      # expert parallel: a middle rank
    (4, 384, 8, 1, 1, 0, 16, 14, (336, 48)),   # Kimi EP8, the last rank
    (2, 24, 3, 1, 1, 0, 16, 2, (0, 5)),        # EP, ragged local range
    (20, 4, 1, 1, 1, 0, 16, 2, None),          # row x row align: experts of more rows than BM
    (20, 16, 4, 1, 1, 0, 16, 2, (4, 8)),       # above ALIGN_ROWS_MAX_T rows: the per-expert align
])
@pytest.mark.parametrize("ties", [False, True])
def test_route_align_equals_route_then_align(M, E, K, ng, tkg, soft, bm, split, local, ties):
    part, bias = _logits(split, M, E, seed=M * 1000 + E + K + ties, ties=ties)
    EA = E if local is None else local[1]
    T = M * K
    nb = moe.aligned_blocks(T, EA, bm)
    bufs = [_guarded(M * K, torch.int32), _guarded(M * K, torch.float32), _guarded(nb, torch.int32),
            _guarded(nb * bm, torch.int32)]
    ids, wts, bexp, sid = (b[1] for b in bufs)
    ids, wts = ids.view(M, K), wts.view(M, K)
    args = (part, bias, ids, wts, bexp, sid, ng, tkg, 1, soft, EA, bm, moe._p2(M), 2.5)
    if local is None:
        moe.moe_route_align(*args)
    else:
        moe.moe_route_align_local(*args, local[0])
    for (buf, _), n in zip(bufs, (M * K, M * K, nb, nb * bm)):
        assert _guards_intact(buf, n)
    rids, rwts = (torch.full((M, K), SENT, dtype=torch.int32), torch.full((M, K), float("nan")))
    if local is None:
        moe.moe_route(part, bias, rids, rwts, ng, tkg, 1, soft, 2.5)
    else:
        moe.moe_route_local(part, bias, rids, rwts, ng, tkg, 1, soft, 2.5, local[0], local[1])
    rbexp, rsid = torch.full((nb,), SENT, dtype=torch.int32), torch.full((nb * bm,), SENT, dtype=torch.int32)
    moe.moe_align_one(rids.view(-1), rbexp, rsid, EA, bm)
    assert torch.equal(ids, rids) and torch.equal(_bits(wts), _bits(rwts))
    assert torch.equal(bexp, rbexp) and torch.equal(sid, rsid)
    lo = -1 if local is not None else 0
    assert ((ids >= lo) & (ids < EA)).all()
    if local is not None:
        assert (ids == -1).any() or EA == E           # other ranks' experts are there, as -1
    tsid, tbexp = moe.moe_align(rids, EA, bm, backend="torch", check=False)
    assert torch.equal(sid, tsid) and torch.equal(bexp, tbexp)


def test_route_align_op_one_launch_and_fallback(monkeypatch):
    """route_align: the gate GEMM + ONE launch for decode / verify, the same arrays as route +
    moe_align; above the fused limit route + moe_align (and the torch backend) give them too."""
    g = torch.Generator().manual_seed(5)
    M, E, H, K = 3, 32, 96, 4
    x = torch.randn(M, H, generator=g).bfloat16()
    wg = (torch.randn(E, H, generator=g) * 0.2).bfloat16()
    bias = torch.randn(E, generator=g) * 0.05
    for local in (None, (8, 12)):
        with kd.recording("gfx942") as rec:  # records the launches (nothing runs)
            moe.route_align(x, wg, bias, K, 4, 2, True, 2.0, block_m=16, local=local)
        out = moe.route_align(x, wg, bias, K, 4, 2, True, 2.0, block_m=16, local=local)
        kname = "moe_route_align" if local is None else "moe_route_align_local"
        assert [r.kernel.name for r in rec.launches] == ["moe_gate_gemm", kname]
        ids, w = moe.route(x, wg, bias, K, 4, 2, True, 2.0, local=local)
        n = E if local is None else local[1]
        sid, bexp = moe.moe_align(ids, n, 16, check=False)
        assert all(torch.equal(a, b) for a, b in zip(out, (ids, w, sid, bexp)))
        ref = moe.route_align(x, wg, bias, K, 4, 2, True, 2.0, block_m=16, local=local, backend="torch")
        assert torch.equal(out[0], ref[0]) and torch.equal(out[2], ref[2]) and torch.equal(out[3], ref[3])
        torch.testing.assert_close(out[1], ref[1], atol=1e-6, rtol=1e-6)
        monkeypatch.setattr(moe, "ALIGN_ONE_MAX_T", M * K - 1)
        with kd.recording("gfx942") as rec:
            moe.route_align(x, wg, bias, K, 4, 2, True, 2.0, block_m=16, local=local)
        assert kname not in [r.kernel.name for r in rec.launches]
        two = moe.route_align(x, wg, bias, K, 4, 2, True, 2.0, block_m=16, local=local)
        assert all(torch.equal(a, b) for a, b in zip(out, two))
        monkeypatch.undo()


def test_fused_experts_takes_the_alignment():
    """fused_experts(aligned=...) gives the rows of its own align and refuses a wrong BLOCK_M."""
    from tests.test_moe import make_weights

    g = torch.Generator().manual_seed(9)
    M, E, H, I, K = 2, 8, 64, 32, 2
    w = make_weights("w4a16", E, H, I, seed=3)
    x = torch.randn(M, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    wts = torch.rand(M, K, generator=g)
    bm = moe.expert_block_m(w, K, M)
    al = moe.moe_align(ids, E, bm, check=False)
    a = moe.fused_experts(x, ids, wts, w, check_ids=False, partials=True, aligned=al)
    b = moe.fused_experts(x, ids, wts, w, check_ids=False, partials=True)
    assert torch.equal(a, b)
    other = moe.moe_align(ids, E, bm * 2, check=False)
    with pytest.raises(ValueError, match="BLOCK_M"):
        moe.fused_experts(x, ids, wts, w, check_ids=False, aligned=other)


def test_route_align_launch_checks():
    part = torch.randn(1, 5, 16)
    ids, wts = torch.empty(5, 2, dtype=torch.int32), torch.empty(5, 2)
    bexp, sid = torch.empty(7, dtype=torch.int32), torch.empty(7 * 16, dtype=torch.int32)
    with pytest.raises(kd.LaunchError, match="MB"):  # a token tile that does not cover M
        moe.moe_route_align(part, torch.zeros(16), ids, wts, bexp, sid, 1, 1, 1, 0, 16, 16, 4, 1.0)
    with pytest.raises(ValueError, match="block_m"):
        moe.route_align(torch.randn(1, 8).bfloat16(), torch.randn(16, 8).bfloat16(), torch.zeros(16), 2, block_m=0)


def test_route_takes_the_logits_of_a_wider_split_k_gemm():
    """`logits=`: the router columns of a split-K GEMM that also holds other rows (the shared
    expert's gate|up in models.kimi), read as a strided view: no gate GEMM launch, the ids and
    weights of routing those partials, the same from route and route_align; bad shapes refused."""
    from ops.gemm import gemm_bf16_splitk

    g = torch.Generator().manual_seed(11)
    M, E, H, K, N2 = 2, 32, 96, 4, 48
    x = torch.randn(M, H, generator=g).bfloat16()
    wg = (torch.randn(E, H, generator=g) * 0.2).bfloat16()
    both = torch.cat([(torch.randn(N2, H, generator=g) * 0.2).bfloat16(), wg], 0)
    bias = torch.randn(E, generator=g) * 0.05
    part = gemm_bf16_splitk(x, both, config={"SPLIT_K": 4})
    logits = part[..., N2:]
    assert logits.stride(1) == N2 + E                     # a view, not a copy
    with kd.recording("gfx942") as rec:
        moe.route_align(x, wg, bias, K, 4, 2, True, 2.0, block_m=16, logits=logits)
    assert [r.kernel.name for r in rec.launches] == ["moe_route_align"]
    ids, w = moe.route(x, wg, bias, K, 4, 2, True, 2.0, logits=logits)
    rids = torch.full((M, K), SENT, dtype=torch.int32)
    rw = torch.full((M, K), float("nan"))
    moe.moe_route(logits.contiguous(), bias, rids, rw, 4, 2, 1, 0, 2.0)
    assert torch.equal(ids, rids) and torch.equal(_bits(w), _bits(rw))
    out = moe.route_align(x, wg, bias, K, 4, 2, True, 2.0, block_m=16, logits=logits)
    assert torch.equal(out[0], ids) and torch.equal(_bits(out[1]), _bits(w))
    ref = moe.route(x, wg, bias, K, 4, 2, True, 2.0, backend="torch")   # the same choice as x @ wg^T
    assert torch.equal(ids.long(), ref[0].long())
    torch.testing.assert_close(w, ref[1], atol=1e-5, rtol=1e-5)
    for bad in (part[..., N2 + 1:], part[:, :1, N2:], logits.double()):
        with pytest.raises((ValueError, TypeError), match="logits"):
            moe.route(x, wg, bias, K, 4, 2, True, 2.0, logits=bad)
