"""gemm_bf16_swiglu (ops/swiglu.py): the MLP down GEMM over split-K gate|up partial sums.

Tolerances: bit-exact against the two-launch path (the partials summed in split order and the
SwiGLU rows rounded to bf16 by the reference, then gemm_bf16 at the same BLOCK_N/BLOCK_K with its
16-row tile: the fused kernel places its BLOCK_M rows at their own rows of the aligned 16, zeros
around them, so BLOCK_M changes no bit: test_block_m_changes_no_bit); against the float64 GEMM over those rows: one bf16 rounding of the output plus
f32 accumulation, |err| <= 2 bf16 ulp of |y| + 1e-5 * sum|a||w|."""
from __future__ import annotations

import pytest
import torch

from ops import gemm as G
from ops import swiglu as W
from tests.conftest import poisoned


def _ulp(y: torch.Tensor) -> torch.Tensor:
    a = y.float().abs().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


@pytest.mark.parametrize("S,M,I,N,cfg", [
    (1, 1, 40, 48, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32}),
    (3, 3, 40, 48, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}),
    (4, 5, 64, 80, {"BLOCK_M": 4, "BLOCK_N": 32, "BLOCK_K": 64}),
    (2, 17, 48, 32, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}),
    (8, 19, 48, 32, {"BLOCK_M": 8, "BLOCK_N": 16, "BLOCK_K": 32}),
])
def test_gemm_bf16_swiglu(S, M, I, N, cfg):
    g = torch.Generator().manual_seed(S * 1000 + M * 10 + I)
    part = torch.randn(S, M, 2 * I, generator=g)
    w = (torch.randn(N, I, generator=g) * 0.2).bfloat16()
    out = poisoned((M, N), torch.bfloat16)
    W.gemm_bf16_swiglu_kernel(part, w, out, config=cfg)
    assert not out.isnan().any()
    h = W.swiglu_of_partials_ref(part)
    assert torch.equal(out, G.gemm_bf16(h, w, config={**cfg, "BLOCK_M": 16}))   # each row at row mod 16
    ref = h.double() @ w.double().T
    bound = 2 * _ulp(ref).double() + 1e-5 * (h.double().abs() @ w.double().abs().T)
    assert ((out.double() - ref).abs() <= bound).all()


def test_split_partials_equal_the_fused_epilogue():
    """Partials of x @ w13^T that sum (in f32) to the unsplit product give gemm_bf16_silu_mul's rows:
    with S=1 the 'partial' is the whole f32 product, so the rows are bit-identical."""
    g = torch.Generator().manual_seed(7)
    M, I, K, N = 3, 32, 64, 48
    x = torch.randn(M, K, generator=g).bfloat16()
    w13 = (torch.randn(2 * I, K, generator=g) * 0.2).bfloat16()
    w = (torch.randn(N, I, generator=g) * 0.2).bfloat16()
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}
    full = (x.double() @ w13.double().T).float()[None]          # one split holding the exact f32 sum
    h = W.swiglu_of_partials_ref(full)
    assert torch.equal(h, G.gemm_bf16_silu_mul_ref(x, w13))
    out = poisoned((M, N), torch.bfloat16)
    W.gemm_bf16_swiglu_kernel(full, w, out, config=cfg)
    assert torch.equal(out, G.gemm_bf16(h, w, config=cfg))


def test_strided_partials_and_row_invariance():
    """A strided view of a bigger buffer reads only its own elements, and row 0's bits do not depend
    on how many rows the launch has (one tile config for every M)."""
    g = torch.Generator().manual_seed(3)
    S, M, I, N = 3, 9, 32, 48
    big = torch.full((S, M + 2, 2 * I + 16), float("nan"))
    big[:, :M, :2 * I] = torch.randn(S, M, 2 * I, generator=g)
    part = big[:, :M, :2 * I]
    w = (torch.randn(N, I, generator=g) * 0.2).bfloat16()
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}
    out = poisoned((M, N), torch.bfloat16)
    W.gemm_bf16_swiglu_kernel(part, w, out, config=cfg)
    assert not out.isnan().any()
    one = poisoned((1, N), torch.bfloat16)
    W.gemm_bf16_swiglu_kernel(part[:, :1], w, one, config=cfg)
    assert torch.equal(one[0], out[0])


def test_gemm_bf16_swiglu_wrapper_checks():
    part = torch.randn(2, 3, 64)
    w = torch.randn(16, 32).bfloat16()
    y = W.gemm_bf16_swiglu(part, w, config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32})
    assert y.shape == (3, 16)
    assert torch.equal(W.gemm_bf16_swiglu(part, w, backend="torch"), W.gemm_bf16_swiglu_ref(part, w))
    with pytest.raises(ValueError, match="2\\*I"):
        W.gemm_bf16_swiglu(torch.randn(2, 3, 62), w)
    with pytest.raises(TypeError):
        W.gemm_bf16_swiglu(part.bfloat16(), w)
    with pytest.raises(ValueError, match="backend"):
        W.gemm_bf16_swiglu(part, w, backend="cuda")
    with pytest.raises(ValueError, match="at least one split"):
        W.gemm_bf16_swiglu(torch.randn(0, 3, 64), w)


@pytest.mark.parametrize("M", [1, 5, 19])
def test_block_m_changes_no_bit(M):
    """BLOCK_M and N_TILES are launch-only keys (each M bucket takes its own): every row's bits are
    the same at BLOCK_M 1, 2, 4, 8, 16, at 1, 2 or 4 BLOCK_N tiles per program and at any M, since a
    row meets the 16-row dot at its own place (row mod 16) whatever the tile and each N tile is its
    own BLOCK_N dot; within the stated bound of the reference. The output is a view of a bigger
    poisoned buffer: no row past M (nor of another program's part of the 16) nor column past N is
    ever written."""
    S, I, N = 4, 32, 48   # 48: the last of 4 N tiles lies past N
    g = torch.Generator().manual_seed(60 + M)
    part = torch.randn(S, 20, 2 * I, generator=g)
    w = (torch.randn(N, I, generator=g) * 0.2).bfloat16()
    cfg = {"BLOCK_N": 16, "BLOCK_K": 32}
    outs = []
    for bm, tiles in ((1, 1), (2, 2), (4, 1), (8, 4), (16, 2)):
        buf = poisoned((M + 16, N + 16), torch.bfloat16)
        W.gemm_bf16_swiglu_kernel(part[:, :M], w, buf[:M, :N], config={**cfg, "BLOCK_M": bm, "N_TILES": tiles})
        assert buf[M:].isnan().all() and buf[:, N:].isnan().all() and not buf[:M, :N].isnan().any()
        outs.append(buf[:M, :N].clone())
    full = poisoned((20, N), torch.bfloat16)
    W.gemm_bf16_swiglu_kernel(part, w, full, config={**cfg, "BLOCK_M": 4})
    for o in outs[1:] + [full[:M]]:
        assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16))
    h = W.swiglu_of_partials_ref(part[:, :M])
    ref = h.double() @ w.double().T
    bound = 2 * _ulp(ref).double() + 1e-5 * (h.double().abs() @ w.double().abs().T)
    assert ((outs[0].double() - ref).abs() <= bound).all()
