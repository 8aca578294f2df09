"""Causal varlen FMHA prefill (interpreter; qk dims 16+16 as two dots, v dim 16).

Tolerance vs float64: atol 1e-2 (bf16 probabilities in PV, bf16 output). RTZ output is never
larger in magnitude than the RNE output and within one bf16 ulp of it."""
from __future__ import annotations

import pytest
import torch

from ops import fmha
from tests.conftest import poisoned

TOL = dict(atol=1e-2, rtol=0)
CFG = {"BLOCK_M": 16, "BLOCK_N": 16}


def _setup(lens, h, kvh, da, db, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    q = torch.randn(T, h, da + db, generator=g).bfloat16()
    k = torch.randn(T, kvh, da + db, generator=g).bfloat16()
    v = torch.randn(T, kvh, dv, generator=g).bfloat16()
    return q, k, v, cu


@pytest.mark.parametrize("lens,h,kvh,db", [([5, 0, 35, 17], 2, 1, 16), ([20], 2, 2, 0)])
def test_fmha_matches_reference(lens, h, kvh, db) -> None:
    q, k, v, cu = _setup(lens, h, kvh, 16, db, 16, seed=len(lens))
    out = fmha.fmha_prefill_varlen(q, k, v, cu, 0.2, rope_dim=db, config=CFG)
    torch.testing.assert_close(out.double(), fmha.fmha_ref(q, k, v, cu, 0.2), **TOL)


def test_rtz_rounding() -> None:
    q, k, v, cu = _setup([9, 23], 2, 2, 16, 16, 16, seed=3)
    rne = fmha.fmha_prefill_varlen(q, k, v, cu, 0.2, rope_dim=16, config=CFG)
    rtz = fmha.fmha_prefill_varlen(q, k, v, cu, 0.2, rope_dim=16, config={**CFG, "RTZ": 1})
    assert (rtz.float().abs() <= rne.float().abs()).all()
    assert (rtz != rne).any()
    ulp = rne.float().abs() * 2 ** -7 + 1e-30
    assert ((rtz.float() - rne.float()).abs() <= ulp).all()
    torch.testing.assert_close(rtz.double(), fmha.fmha_ref(q, k, v, cu, 0.2), atol=2e-2, rtol=0)


def test_kernel_writes_every_row() -> None:
    q, k, v, cu = _setup([7, 19], 2, 1, 16, 16, 16, seed=5)
    out = poisoned((26, 2, 16), torch.bfloat16)
    fmha.fmha_prefill(q, k, v, cu, out, 0.2, 2, 19, 16, 16, config=CFG)
    assert not out.isnan().any()


def test_bad_inputs() -> None:
    q, k, v, cu = _setup([5, 6], 2, 1, 16, 16, 16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        fmha.fmha_prefill_varlen(q, k, v, torch.tensor([0, 5, 10], dtype=torch.int32), 0.2)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        fmha.fmha_prefill_varlen(torch.randn(11, 3, 32).bfloat16(), torch.randn(11, 2, 32).bfloat16(),
                                  torch.randn(11, 2, 16).bfloat16(), cu, 0.2)


@pytest.mark.aot
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm90"])
def test_aot_mla_prefill_shape(arch: str) -> None:
    """MLA prefill shape (64 heads, qk 128+64, v 128) at defaults: compiles, no spills, LDS fits."""
    from kdsl import aot

    r = aot.check(fmha.fmha_prefill, arch)
    assert r.spills == 0 and r.lds_bytes <= r.lds_limit and r.matrix_instructions
    if arch.startswith("gfx"):  # the report finds the main loop in AMD ISA only
        assert r.matrix_in_main_loop > 0
