"""gemm_bf16_swiglu_combine and gemm_bf16_swiglu_rank (ops/swiglu.py): a MoE layer's shared-expert
down GEMM with the layer's end in its epilogue (ops.moe.combine_add at world size 1, a rank's
ops.moe.combine_rank at world size > 1).

Tolerances: none. Each must give the bits of the two-launch chain it replaces, gemm_bf16_swiglu (same
config) then moe_combine_add (the residual updated in place and the f32 rows) or moe_combine_rank
(the rank's bf16 rows), with ids outside [0, E) counting 0 (their partial rows are NaN: never read),
on fresh random data, outputs poisoned.
"""
from __future__ import annotations

import pytest
import torch

from ops import moe
from ops import swiglu as W
from tests.conftest import poisoned

GUARD = 3


def _case(S: int, M: int, I: int, N: int, K: int, E: int, seed: int, bad: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    part = torch.randn(S, M, 2 * I, generator=g)
    w = (torch.randn(N, I, generator=g) * 0.2).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    for n, b in enumerate(bad):                    # bad ids spread over the tokens
        ids[n % M, (n * 3 + 1) % K] = b
    partial = torch.randn(M * K, N, generator=g) * 2
    partial[~((ids >= 0) & (ids < E)).reshape(-1)] = float("nan")   # never written: must not be read
    res = (torch.randn(M, N, generator=g) * 4).bfloat16()
    return part, w, ids, partial, res


def _chain(part, w, ids, partial, res, E, cfg):
    """gemm_bf16_swiglu -> moe_combine_add (the two launches the fused kernel replaces)."""
    M, N = res.shape
    shared = poisoned((M, N), torch.bfloat16)
    W.gemm_bf16_swiglu_kernel(part, w, shared, config=cfg)
    r = res.clone()
    rows = poisoned((M, N), torch.float32)
    moe.moe_combine_add(partial, ids.reshape(-1), shared, r, rows, ids.shape[1], E, 1, config={"BLOCK_N": 64})
    return r, rows


@pytest.mark.parametrize("S,M,I,N,K,E,cfg,bad", [
    (4, 1, 64, 96, 8, 32, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32}, ()),
    (2, 3, 40, 48, 4, 16, {"BLOCK_M": 2, "BLOCK_N": 16, "BLOCK_K": 32, "N_TILES": 2}, (-1, 16)),
    (3, 5, 48, 80, 3, 8, {"BLOCK_M": 4, "BLOCK_N": 32, "BLOCK_K": 32}, (8, -2**31, 10**6)),
    (1, 18, 32, 48, 2, 6, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}, (-1, 6, 2**30)),
])
def test_equals_the_two_launch_chain(S, M, I, N, K, E, cfg, bad):
    part, w, ids, partial, res, = _case(S, M, I, N, K, E, seed=S * 100 + M * 10 + I, bad=bad)
    r_ref, rows_ref = _chain(part, w, ids, partial, res, E, cfg)
    r = res.clone()
    rows = poisoned((M, N), torch.float32)
    W.gemm_bf16_swiglu_combine_kernel(part, w, partial, ids.reshape(-1), r, rows, K, E, config=cfg)
    assert torch.equal(r, r_ref) and torch.equal(rows, rows_ref)
    assert not rows.isnan().any()
    r_t = res.clone()                             # the torch backend: the chain's references
    assert torch.equal(W.gemm_bf16_swiglu_combine(part, w, partial, ids, r_t, E, backend="torch"), rows_ref)
    assert torch.equal(r_t, r_ref)


def _guarded(t: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """t copied into the middle of a bigger buffer with GUARD rows of `fill` on each side: (view, buffer)."""
    buf = torch.full((t.shape[0] + 2 * GUARD, *t.shape[1:]), fill, dtype=t.dtype)
    buf[GUARD:GUARD + t.shape[0]] = t
    return buf[GUARD:GUARD + t.shape[0]], buf


def test_bad_ids_stay_inside_guards_and_checks():
    """Views into bigger buffers with poisoned guard rows: ids outside [0, E) touch nothing, only the
    token rows are written (a 2-row tile in the aligned 16 reads and writes its own rows). The
    wrapper refuses mismatched shapes."""
    S, M, I, N, K, E = 2, 3, 32, 64, 4, 8
    cfg = {"BLOCK_M": 2, "BLOCK_N": 32, "BLOCK_K": 32}
    part, w, ids, partial, res = _case(S, M, I, N, K, E, seed=12, bad=(-1, E, 10**6, -2**31))
    r_ref, rows_ref = _chain(part, w, ids, partial, res, E, cfg)
    nan = float("nan")
    pv, pbuf = _guarded(partial, nan)
    iv, ibuf = _guarded(ids.reshape(-1), -123)
    rv, rbuf = _guarded(res, nan)
    ov, obuf = _guarded(torch.full((M, N), nan), nan)
    W.gemm_bf16_swiglu_combine_kernel(part, w, pv, iv, rv, ov, K, E, config=cfg)
    for buf, n in ((pbuf, M * K), (rbuf, M), (obuf, M)):
        assert torch.cat([buf[:GUARD], buf[GUARD + n:]]).float().isnan().all()
    assert (torch.cat([ibuf[:GUARD], ibuf[GUARD + M * K:]]) == -123).all()
    assert torch.equal(rv, r_ref) and torch.equal(ov, rows_ref)
    op = W.gemm_bf16_swiglu_combine
    with pytest.raises(ValueError, match="partial"):
        op(part, w, partial[:3], ids, res.clone(), E)
    with pytest.raises(ValueError, match="part"):
        op(part[:, :2], w, partial, ids, res.clone(), E)
    with pytest.raises(ValueError, match="w"):
        op(part, w[:, :16], partial, ids, res.clone(), E)


def test_kernel_refuses_partials_of_another_row_count():
    """The partial rows and ids are read at m*TOPK + k from the row tile (no loaded index bounds them):
    the launch itself refuses P != M*TOPK, naming the rule, whatever the wrapper checks."""
    import kdsl as kd

    S, M, I, N, K, E = 1, 2, 32, 32, 2, 4
    part, w, ids, partial, res = _case(S, M, I, N, K, E, seed=5)
    rows = poisoned((M, N), torch.float32)
    with pytest.raises(kd.LaunchError, match="M\\*TOPK"):
        W.gemm_bf16_swiglu_combine_kernel(part, w, partial[:3], ids.reshape(-1)[:3], res.clone(), rows, K, E)


def _rank_chain(part, w, ids, partial, E, cfg):
    """gemm_bf16_swiglu -> moe_combine_rank (the two launches gemm_bf16_swiglu_rank replaces)."""
    M, N = ids.shape[0], w.shape[0]
    shared = poisoned((M, N), torch.bfloat16)
    W.gemm_bf16_swiglu_kernel(part, w, shared, config=cfg)
    out = poisoned((M, N), torch.bfloat16)
    moe.moe_combine_rank(partial, ids.reshape(-1), shared, out, ids.shape[1], E, 1, config={"BLOCK_N": 64})
    return out


@pytest.mark.parametrize("S,M,I,N,K,E,cfg,bad", [
    (8, 1, 64, 96, 8, 32, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32}, (-1,)),
    (2, 3, 40, 48, 4, 16, {"BLOCK_M": 2, "BLOCK_N": 16, "BLOCK_K": 32, "N_TILES": 2}, (-1, 16)),
    (1, 18, 32, 48, 2, 6, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}, (-1, 6, 2**30)),
])
def test_rank_equals_the_two_launch_chain(S, M, I, N, K, E, cfg, bad):
    """-1 is another expert-parallel rank's expert (moe_route_local): it adds nothing."""
    part, w, ids, partial, _ = _case(S, M, I, N, K, E, seed=S * 100 + M * 10 + I + 1, bad=bad)
    ref = _rank_chain(part, w, ids, partial, E, cfg)
    out = poisoned((M, N), torch.bfloat16)
    W.gemm_bf16_swiglu_rank_kernel(part, w, partial, ids.reshape(-1), out, K, E, config=cfg)
    assert torch.equal(out, ref) and not out.isnan().any()
    assert torch.equal(W.gemm_bf16_swiglu_rank(part, w, partial, ids, E, config=cfg), ref)
    assert torch.equal(W.gemm_bf16_swiglu_rank(part, w, partial, ids, E, backend="torch"),
                       moe.moe_combine_rank_ref(partial, ids, W.gemm_bf16_swiglu_ref(part, w), E))


def test_rank_bad_ids_stay_inside_guards_and_checks():
    """As for the combine: views into bigger poisoned buffers, ids outside [0, E) touch nothing, only
    the token rows are written; the wrapper and the launch refuse mismatched shapes."""
    import kdsl as kd

    S, M, I, N, K, E = 2, 3, 32, 64, 4, 8
    cfg = {"BLOCK_M": 2, "BLOCK_N": 32, "BLOCK_K": 32}
    part, w, ids, partial, _ = _case(S, M, I, N, K, E, seed=13, bad=(-1, E, 10**6, -2**31))
    ref = _rank_chain(part, w, ids, partial, E, cfg)
    nan = float("nan")
    pv, pbuf = _guarded(partial, nan)
    iv, ibuf = _guarded(ids.reshape(-1), -123)
    ov, obuf = _guarded(torch.full((M, N), nan).bfloat16(), nan)
    W.gemm_bf16_swiglu_rank_kernel(part, w, pv, iv, ov, K, E, config=cfg)
    for buf, n in ((pbuf, M * K), (obuf, M)):
        assert torch.cat([buf[:GUARD], buf[GUARD + n:]]).float().isnan().all()
    assert (torch.cat([ibuf[:GUARD], ibuf[GUARD + M * K:]]) == -123).all()
    assert torch.equal(ov, ref)
    op = W.gemm_bf16_swiglu_rank
    with pytest.raises(ValueError, match="partial"):
        op(part, w, partial[:3], ids, E)
    with pytest.raises(ValueError, match="part"):
        op(part[:, :2], w, partial, ids, E)
    with pytest.raises(ValueError, match="w"):
        op(part, w[:, :16], partial, ids, E)
    with pytest.raises(kd.LaunchError, match="M\\*TOPK"):
        W.gemm_bf16_swiglu_rank_kernel(part, w, partial[:3], ids.reshape(-1)[:3], poisoned((M, N), torch.bfloat16),
                                       K, E)
