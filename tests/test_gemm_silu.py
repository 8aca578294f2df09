"""gemm_bf16_silu_mul (ops/gemm.py): the shared-expert gate|up GEMM with SiLU*up in the epilogue.

Tolerances: bit-exact against the two-launch path gemm_bf16 (same tile config) + silu_and_mul on the
interpreter (same f32 accumulation order, gate/up rounded to bf16 in both); against the float64
reference (gate/up rounded once to bf16, silu*up in f32): gate and up may each differ by one bf16
ulp from f32 accumulation, so |err| <= 3 bf16 ulp of |silu(g)*u| + 1e-5 * scale."""
from __future__ import annotations

import pytest
import torch

from ops import gemm as G
from ops import norm
from tests.conftest import poisoned


def _ulp(y: torch.Tensor) -> torch.Tensor:
    a = y.float().abs().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


@pytest.mark.parametrize("M,I,K,cfg", [
    (1, 40, 96, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32}),
    (2, 40, 64, {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 64}),
    (4, 48, 64, {"BLOCK_M": 4, "BLOCK_N": 32, "BLOCK_K": 64}),
    (5, 32, 96, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}),
    (3, 64, 64, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "W_ROWS": 1}),
])
def test_gemm_bf16_silu_mul(M, I, K, cfg):
    g = torch.Generator().manual_seed(M * 100 + I)
    x = torch.randn(M, K, generator=g).bfloat16()
    w13 = (torch.randn(2 * I, K, generator=g) * 0.2).bfloat16()
    out = poisoned((M, I), torch.bfloat16)
    G.gemm_bf16_silu_mul_kernel(x, w13, out, config=cfg)
    assert not out.isnan().any()
    if cfg["BLOCK_N"] >= 16:  # gemm_bf16 has no 8-wide tile
        two = norm.silu_and_mul(G.gemm_bf16(x, w13, config={k: v for k, v in cfg.items() if k != "W_ROWS"}),
                                config={"BLOCK_I": 256})
        assert torch.equal(out, two)
    ref = G.gemm_bf16_silu_mul_ref(x, w13)
    bound = 3 * _ulp(ref).double() + 1e-5 * (x.double().abs() @ w13.double().abs().T)[:, :I]
    assert ((out.double() - ref.double()).abs() <= bound).all()


def test_gemm_bf16_silu_mul_wrapper():
    x = torch.randn(2, 32).bfloat16()
    w13 = torch.randn(48, 32).bfloat16()
    y = G.gemm_bf16_silu_mul(x, w13, config={"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32})
    assert y.shape == (2, 24) and torch.equal(G.gemm_bf16_silu_mul(x, w13, backend="torch"), G.gemm_bf16_silu_mul_ref(x, w13))
    with pytest.raises(ValueError, match="2\\*I"):
        G.gemm_bf16_silu_mul(x, torch.randn(47, 32).bfloat16())
    with pytest.raises(ValueError, match="K mismatch"):
        G.gemm_bf16_silu_mul(x, torch.randn(48, 16).bfloat16())
