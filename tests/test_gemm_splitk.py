"""gemm_bf16_splitk (ops/gemm.py): split-K f32 partial sums of a bf16 GEMM, on the interpreter against
a float64 reference of the same K ranges, fresh random data, the output poisoned first.

Tolerance: each partial is an f32 accumulation of at most KS products of bf16 values (exact in f32)
and the reference is rounded once to f32, so |part - ref| <= (KS + 1) * 2^-24 * (|x| @ |w|^T) over
that split's K range (the standard bound of a recursive sum; KS the split's length)."""
from __future__ import annotations

import pytest
import torch

from ops import gemm as G
from tests.conftest import poisoned


def _case(M, N, K, seed, pad=3):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(M, K + pad, generator=g).bfloat16()     # x as a row-strided view
    return buf[:, pad:], (torch.randn(N, K, generator=g) * 0.3).bfloat16()


def _within(part, x, w, splits, block_k):
    for s, (a, b) in enumerate(G.splitk_bounds(x.shape[1], splits, block_k)):
        ref = x[:, a:b].double() @ w[:, a:b].double().T
        bound = (b - a + 1) * 2.0 ** -24 * (x[:, a:b].double().abs() @ w[:, a:b].double().abs().T)
        assert ((part[s].double() - ref).abs() <= bound).all(), s


@pytest.mark.parametrize("M,N,K,S,cfg", [
    (1, 40, 200, 1, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32}),
    (3, 40, 200, 3, {"BLOCK_M": 4, "BLOCK_N": 16, "BLOCK_K": 32}),     # KS 96: 96 + 96 + 8
    (5, 48, 320, 4, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}),    # KS 128: the last split is 64
    (18, 24, 100, 8, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64}),   # KS 64: splits 2..7 are empty
])
def test_partials_match_float64_reference(M, N, K, S, cfg):
    x, w = _case(M, N, K, seed=M * 1000 + K)
    part = poisoned((S, M, N), torch.float32)
    G.gemm_bf16_splitk_kernel(x, w, part, config={**cfg, "SPLIT_K": S})
    assert not part.isnan().any()
    _within(part, x, w, S, cfg["BLOCK_K"])
    ranges = G.splitk_bounds(K, S, cfg["BLOCK_K"])
    assert ranges[0][0] == 0 and ranges[-1][1] == K and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    empty = [s for s, (a, b) in enumerate(ranges) if a == b]
    assert (part[empty] == 0).all()
    if K == 100:
        assert empty == list(range(2, 8))
    # the split-order sum rounded to bf16 is the GEMM within one bf16 ulp of the exact product
    exact = x.double() @ w.double().T
    y = G.splitk_sum_ref(part).double()
    assert ((y - exact).abs() <= 2.0 ** -8 * exact.abs() + 2.0 ** -20 * (x.double().abs() @ w.double().abs().T)).all()


def test_op_allocates_the_tuned_split_count_and_checks_arguments():
    x, w = _case(3, 40, 200, seed=4)
    cfg = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3}
    part = G.gemm_bf16_splitk(x, w, config=cfg)
    assert part.shape == (3, 3, 40) and part.dtype == torch.float32
    ref = G.gemm_bf16_splitk(x, w, backend="torch", config=cfg)
    assert torch.equal(ref, G.gemm_bf16_splitk_ref(x, w, 3, 32))
    _within(part, x, w, 3, 32)
    assert G.gemm_bf16_splitk(x[:0], w, config=cfg).shape == (3, 0, 40)
    with pytest.raises(ValueError, match="K mismatch"):
        G.gemm_bf16_splitk(x, w[:, :64], config=cfg)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        G.gemm_bf16_splitk(x.float(), w, config=cfg)
    with pytest.raises(ValueError, match="SPLIT_K must be"):
        G.gemm_bf16_splitk(x, w, config={**cfg, "SPLIT_K": 16})
    with pytest.raises(ValueError, match="backend"):
        G.gemm_bf16_splitk(x, w, backend="cuda")
