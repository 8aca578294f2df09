"""o_proj's split-K GEMM with the residual-add RMSNorm (+ int8 quant) tail in its last programs
(ops/splitk_norm.py, kd.atomic_ticket) on the interpreter.

Reference: the two-launch chain it replaces, gemm_bf16_splitk then rmsnorm_add(_quant)_splitk, at
the same split and tiles: every output equal bit for bit (programs run one after another on the
interpreter, so this proves the tail's bits, not the ordering). Outputs are poisoned views of larger
buffers whose guard rows must stay poisoned; the ticket counters are a view of a larger buffer whose
guards must stay put and whose tickets must be back at 0 after every launch (graph replay)."""
from __future__ import annotations

import pytest
import torch

import kdsl as kd
from kdsl.errors import TraceError
from ops import gemm, norm, splitk_norm as sn
from tests.conftest import poisoned

GUARD = 77


def _data(m: int, d: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(d, k, generator=g) * 0.1).bfloat16()
    res = torch.randn(m, d, generator=g).bfloat16()
    nw = (torch.rand(d, generator=g) + 0.5).bfloat16()
    return x, w, res, nw


def _guarded(shape, dtype):
    """A poisoned view of rows 1..n of a poisoned buffer one row longer on each side."""
    big = poisoned((shape[0] + 2, *shape[1:]), dtype)
    return big, big[1:-1]


def _guards_intact(big: torch.Tensor) -> bool:
    ends = torch.stack([big[0], big[-1]])
    return bool(ends.isnan().all()) if ends.is_floating_point() else bool((ends == -123).all())


def _fused(quant: bool, x, w, res, nw, cfg, counters):
    m, d = res.shape
    bufs = [_guarded((m, d), torch.bfloat16), _guarded((m, d), torch.bfloat16)]
    part = poisoned((cfg["SPLIT_K"], m, d), torch.float32)
    if quant:
        bufs += [_guarded((m, d), torch.int8), _guarded((m,), torch.float32)]
        (_, y), (_, r), (_, q), (_, s) = bufs
        sn.gemm_bf16_splitk_norm_quant_kernel(x, w, res, nw, part, y, q, s, r, counters, 1e-6, config=cfg)
        outs = [q, s, y, r]
    else:
        (_, y), (_, r) = bufs
        sn.gemm_bf16_splitk_norm_kernel(x, w, res, nw, part, y, r, counters, 1e-6, config=cfg)
        outs = [y, r]
    assert all(_guards_intact(big) for big, _ in bufs)
    return outs


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("m,d,k,cfg", [
    (3, 80, 96, {"SPLIT_K": 3, "BLOCK_M": 2, "BLOCK_N": 32, "BLOCK_K": 32}),     # tails in M, D and the last split
    (1, 64, 128, {"SPLIT_K": 2, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64}),   # decode: one row in a 16-row tile
])
def test_fused_equals_the_two_launch_chain_and_resets_its_counters(quant, m, d, k, cfg) -> None:
    x, w, res, nw = _data(m, d, k, seed=m * 1000 + d)
    need = sn.counters_needed(m, d, cfg)
    cbuf = torch.full((need + 6,), GUARD, dtype=torch.int32)
    counters = cbuf[3:3 + need]
    counters.zero_()
    part = gemm.gemm_bf16_splitk(x, w, config=cfg)
    chain = (norm.rms_norm_quant if quant else norm.rms_norm)(part, nw, 1e-6, residual=res)
    for _ in range(2):                      # a second launch finds its counters at 0 again
        got = _fused(quant, x, w, res, nw, cfg, counters)
        for a, b in zip(got, chain):
            assert torch.equal(a, b)
        assert not counters.any()
        assert (cbuf[:3] == GUARD).all() and (cbuf[3 + need:] == GUARD).all()


def test_op_matches_torch_backend_and_checks_its_counters() -> None:
    x, w, res, nw = _data(2, 48, 64, seed=5)
    cfg = {"SPLIT_K": 2, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}
    counters = sn.counters_for(4, 48, "cpu")
    got = sn.gemm_splitk_add_norm(x, w, res, nw, 1e-6, counters, True, config=cfg)
    ref = sn.gemm_splitk_add_norm(x, w, res, nw, 1e-6, counters, True, backend="torch", config=cfg)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[3], ref[3])     # q and the residual sum: exact
    torch.testing.assert_close(got[2].float(), ref[2].float(), atol=1e-2, rtol=2 ** -7)
    with pytest.raises(ValueError, match="counters"):
        sn.gemm_splitk_add_norm(x, w, res, nw, 1e-6, counters[:3], True, config=cfg)
    with pytest.raises(TypeError, match="counters"):
        sn.gemm_splitk_add_norm(x, w, res, nw, 1e-6, counters.long(), True, config=cfg)


def test_ticket_is_checked_by_the_verifier() -> None:
    @kd.kernel(example={"N": 16, "C": 2})
    def a_ticket_on_f32(x: kd.In["N", kd.f32], counters: kd.InOut["C", kd.f32]):
        kd.atomic_ticket(counters, [0])

    with pytest.raises(TraceError, match="i32"):
        a_ticket_on_f32(torch.zeros(16), torch.zeros(2))


def test_fused_path_needs_tuned_figures() -> None:
    """No tuned files on the interpreter: the model keeps the chain there by default."""
    assert not sn.fused_pays("interpret", 7168, 8192, True, 1)

