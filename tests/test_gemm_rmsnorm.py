"""gemm_bf16_rmsnorm (ops/gemm.py): the q_b GEMM with the q_a RMSNorm in its prologue, reading the
raw rows through a strided view (the q_a columns of the q_a|kv_a output), as bf16 rows or as the f32
split-K partials of gemm_bf16_splitk (S = 1, 3, 4): with partials, bit-identical to feeding the bf16
row of their split-order sum (ops.gemm.splitk_sum_ref), and within the bounds below of the reference.

Tolerances: with NORM_K >= K (one sum-of-squares reduction, the order of mla_prep_qkv) bit-exact
against the two-launch path mla_prep's q_c + gemm_bf16 on the interpreter (gemm_bf16's 16-row tile:
the fused kernel places its BLOCK_M rows at their own rows of the aligned 16, zeros around them, so
BLOCK_M changes no bit: test_block_m_changes_no_bit); with a
smaller NORM_K the sum order differs, so a normed element may move by one bf16 ulp: against the
float64 reference over rmsnorm_ref, |err| <= 2 bf16 ulp of the output + 2^-7 x (|q_c| @ |w|^T)."""
from __future__ import annotations

import pytest
import torch

from ops import gemm as G
from ops import mla_fused as F
from tests.conftest import poisoned


def _ulp(y: torch.Tensor) -> torch.Tensor:
    a = y.float().abs().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def _case(M, N, K, seed, pad=7):
    g = torch.Generator().manual_seed(seed)
    buf = (torch.randn(M, K + pad, generator=g) * 3.0).bfloat16()   # raw rows inside a wider GEMM output
    return buf[:, :K], torch.randn(K, generator=g).bfloat16(), (torch.randn(N, K, generator=g) * 0.2).bfloat16()


def _one_split(x, pad=5):
    """x [M, K] as f32 partials [1, M, K]: a strided view of a wider buffer (the kernel's operand)."""
    buf = torch.full((1, x.shape[0], x.shape[1] + pad), float("nan"))
    buf[0, :, :x.shape[1]] = x.float()
    return buf[:, :, :x.shape[1]]


def _launch(x, xw, w, cfg, M, N):
    """The kernel at one output split (P = 1) into a poisoned f32 [1, M, N] -> its bf16 rows (the
    rounding of the op's bf16 result and of every consumer)."""
    out = poisoned((1, M, N), torch.float32)
    G.gemm_bf16_rmsnorm_kernel(x, xw, w, out, 1e-6, config=cfg)
    assert not out.isnan().any()
    return out[0].to(torch.bfloat16)


def _bound(x, xw, w, ref):
    from ops.norm import rmsnorm_ref

    qc = rmsnorm_ref(x, xw, 1e-6).double()
    return 2 * _ulp(ref).double() + 2.0 ** -7 * (qc.abs() @ w.double().abs().T)


@pytest.mark.parametrize("M,N,K,cfg", [
    (1, 40, 96, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 128}),
    (3, 48, 64, {"BLOCK_M": 4, "BLOCK_N": 32, "BLOCK_K": 64, "NORM_K": 64}),
    (5, 32, 96, {"BLOCK_M": 8, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 128}),
    (18, 72, 160, {"BLOCK_M": 8, "BLOCK_N": 32, "BLOCK_K": 64, "NORM_K": 256}),
    (7, 40, 96, {"BLOCK_M": 2, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 128}),
    (18, 40, 96, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 128}),
])
def test_equals_prep_then_gemm_bit_for_bit(M, N, K, cfg):
    """NORM_K >= K: q_c as mla_prep_qkv computes it, then each BLOCK_M-row block through the same
    GEMM tile (under 16 rows: the fused kernel's zero-padded 16-row dot): identical bits."""
    x, xw, w = _case(M, N, K, seed=M * 100 + N)
    out = _launch(_one_split(x), xw, w, cfg, M, N)
    # the two-launch path: mla_prep's q_c (its kv part written into a scratch cache) and gemm_bf16
    C, R = 16, 8
    qkv = torch.cat([x, torch.randn(M, C + R).bfloat16()], 1)
    ang = torch.rand(M, R // 2)
    qc = F.mla_prep(qkv, xw, torch.ones(C).bfloat16(), ang.cos(), ang.sin(), torch.full((M,), -1),
                    torch.zeros(1, 4, C + R).bfloat16(), 1e-6, q_lora=K)
    tile = {**{k: v for k, v in cfg.items() if k != "NORM_K"}, "BLOCK_M": 16}
    two = G.gemm_bf16(qc, w, config=tile)   # each row at its own place (row mod 16) of a 16-row tile
    assert torch.equal(out, two)
    ref = G.gemm_bf16_rmsnorm_ref(x, xw, w, 1e-6)
    assert ((out.double() - ref.double()).abs() <= _bound(x, xw, w, ref)).all()


@pytest.mark.parametrize("cfg", [{"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 64},
                                 {"BLOCK_M": 8, "BLOCK_N": 32, "BLOCK_K": 64, "NORM_K": 64}])
def test_split_norm_sum_within_bound(cfg):
    """NORM_K < K: the row sums in several tiles (another f32 order): within the stated bound."""
    x, xw, w = _case(6, 40, 200, seed=11)
    out = _launch(_one_split(x), xw, w, cfg, 6, 40)
    ref = G.gemm_bf16_rmsnorm_ref(x, xw, w, 1e-6)
    assert ((out.double() - ref.double()).abs() <= _bound(x, xw, w, ref)).all()


def test_wrapper_backends_and_checks():
    x, xw, w = _case(3, 24, 64, seed=5)
    cfg = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 64}
    y = G.gemm_bf16_rmsnorm(x, xw, w, 1e-6, config=cfg)
    ref = G.gemm_bf16_rmsnorm_ref(x, xw, w, 1e-6)
    assert y.shape == (3, 24) and ((y.double() - ref.double()).abs() <= _bound(x, xw, w, ref)).all()
    assert torch.equal(G.gemm_bf16_rmsnorm(x, xw, w, 1e-6, backend="torch"), ref)
    assert G.gemm_bf16_rmsnorm(x[:0], xw, w, 1e-6).shape == (0, 24)
    with pytest.raises(ValueError, match="x_norm_w must be"):
        G.gemm_bf16_rmsnorm(x, xw[:32], w, 1e-6)
    with pytest.raises(ValueError, match="K mismatch"):
        G.gemm_bf16_rmsnorm(x, xw, w[:, :32], 1e-6)
    with pytest.raises(ValueError, match="eps must be"):
        G.gemm_bf16_rmsnorm(x, xw, w, -1.0, backend="torch")
    with pytest.raises(TypeError, match="x must be bfloat16"):
        G.gemm_bf16_rmsnorm(x.float(), xw, w, 1e-6)


@pytest.mark.parametrize("S,cfg", [(3, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 64}),
                                   (4, {"BLOCK_M": 8, "BLOCK_N": 32, "BLOCK_K": 64, "NORM_K": 256})])
def test_split_partials_equal_their_bf16_sum(S, cfg):
    """x as split-K partials [S, M, K] f32 (a strided view: the q columns of a wider q|kv buffer):
    both the sum-of-squares pass and the A tiles read bf16(sum in split order), bit for bit what the
    bf16 row gives; the torch backend reduces the same way."""
    M, N, K, kv = 5, 40, 96, 9
    g = torch.Generator().manual_seed(S)
    buf = torch.randn(S, M, K + kv, generator=g) * 2.0
    part = buf[:, :, :K]
    xw, w = torch.randn(K, generator=g).bfloat16(), (torch.randn(N, K, generator=g) * 0.2).bfloat16()
    xr = G.splitk_sum_ref(part)
    out = _launch(part, xw, w, cfg, M, N)
    assert torch.equal(out, G.gemm_bf16_rmsnorm(xr, xw, w, 1e-6, config=cfg))
    ref = G.gemm_bf16_rmsnorm(part, xw, w, 1e-6, backend="torch")
    assert torch.equal(ref, G.gemm_bf16_rmsnorm_ref(xr, xw, w, 1e-6))
    assert ((out.double() - ref.double()).abs() <= _bound(xr, xw, w, ref)).all()
    with pytest.raises(ValueError, match="K mismatch"):
        G.gemm_bf16_rmsnorm(buf[:, :, :K - 1], xw, w, 1e-6)
    with pytest.raises(ValueError, match="at least one split"):
        G.gemm_bf16_rmsnorm(part[:0], xw, w, 1e-6)
    with pytest.raises(TypeError, match="split-K partials"):
        G.gemm_bf16_rmsnorm(part.double(), xw, w, 1e-6)


BM_INVARIANT = {"BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 64, "ROW_SQUARES": 1}


@pytest.mark.parametrize("M", [1, 2, 5, 8, 16])
def test_block_m_changes_no_bit(M):
    """BLOCK_M is a launch-only key (each M bucket takes its own): every row's bits are the same at
    BLOCK_M 1, 2, 4, 8, 16, since a row meets the 16-row dot at its own place (row mod 16) whatever
    the tile; within the stated bound of the reference. The output is a view of a bigger poisoned
    buffer: no row past M (nor of another program's part of the 16) is ever written."""
    N, K, S = 32, 96, 2
    g = torch.Generator().manual_seed(40 + M)
    x = torch.randn(S, M, K, generator=g) * 3.0
    xw, w = torch.randn(K, generator=g).bfloat16(), (torch.randn(N, K, generator=g) * 0.2).bfloat16()
    outs = []
    for bm in (1, 2, 4, 8, 16):
        buf = poisoned((1, M + 16, N), torch.float32)
        G.gemm_bf16_rmsnorm_kernel(x, xw, w, buf[:, :M], 1e-6, config={**BM_INVARIANT, "BLOCK_M": bm})
        assert buf[:, M:].isnan().all() and not buf[:, :M].isnan().any()
        outs.append(buf[0, :M].to(torch.bfloat16))
    for o in outs[1:]:
        assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16))
    xr = G.splitk_sum_ref(x)
    ref = G.gemm_bf16_rmsnorm_ref(xr, xw, w, 1e-6)
    assert ((outs[0].double() - ref.double()).abs() <= _bound(xr, xw, w, ref)).all()


@pytest.mark.parametrize("M", [1, 5, 16])
def test_block_n_changes_no_bit(M):
    """BLOCK_N is a launch-only key too (each M bucket takes its own): every element's bits are the
    same at BLOCK_N 16, 32, 64 (the last tile past N masked), with 1 or 2 output splits; the output is
    a view of a bigger poisoned buffer: no column past N is written."""
    N, K, S = 48, 96, 2
    g = torch.Generator().manual_seed(70 + M)
    x = torch.randn(S, M, K, generator=g) * 3.0
    xw, w = torch.randn(K, generator=g).bfloat16(), (torch.randn(N, K, generator=g) * 0.2).bfloat16()
    for p in (1, 2):
        outs = []
        for bn in (16, 32, 64):
            buf = poisoned((p, M, N + 16), torch.float32)
            G.gemm_bf16_rmsnorm_kernel(x, xw, w, buf[:, :, :N], 1e-6,
                                       config={**BM_INVARIANT, "BLOCK_M": 16 if M == 16 else 1, "BLOCK_N": bn})
            assert buf[:, :, N:].isnan().all() and not buf[:, :, :N].isnan().any()
            outs.append(buf[:, :, :N].clone())
        for o in outs[1:]:
            assert torch.equal(o.view(torch.int32), outs[0].view(torch.int32))


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm90"])
def test_block_n_keeps_the_matrix_instruction(arch):
    """Why BLOCK_N changes no bit on the GPU: the dot of the aligned 16 rows (ops.gemm.output_split_gemm,
    also gemm_bf16_addnorm's main loop) compiles to one and the same matrix instruction at every
    BLOCK_N of the domain, at 1 or 16 rows a tile (a 32-wide instruction would sum K in another
    order), so each output's K order is the BLOCK_K loop's."""
    from kdsl import aot
    from ops.gemm_addnorm import gemm_bf16_addnorm_kernel as Q

    cfg = {"SPLIT_K": 2, "NORM_K": 64, "BLOCK_K": 64, "num_warps": 8}
    seen = set()
    for bm in (1, 16):
        for bn in (min(G.BN_DOMAIN), 64, max(G.BN_DOMAIN)):
            c = {**cfg, "BLOCK_M": bm, "BLOCK_N": bn}
            for kernel, cc, dims in ((G.gemm_bf16_rmsnorm_kernel, {**c, "ROW_SQUARES": int(bm < 16)},
                                      {"S": 2, "P": 2, "M": bm, "N": 2112, "K": 7168}),
                                     (Q, c, {"P": 2, "M": bm, "N": 2112, "K": 7168})):
                rep = aot.report(kernel, arch, cc, dims)
                assert rep.ok, rep.errors
                seen.add(tuple(sorted(rep.matrix_instructions)))
    assert len(seen) == 1 and len(next(iter(seen))) == 1, seen


def test_small_tile_needs_row_squares():
    """A tile under 16 rows sums its squares a row at a time: ROW_SQUARES=0 is rejected there."""
    import kdsl as kd

    with pytest.raises(kd.ConfigError, match="ROW_SQUARES"):
        G.gemm_bf16_rmsnorm_kernel.source({**BM_INVARIANT, "BLOCK_M": 4, "ROW_SQUARES": 0}, "gfx942")


@pytest.mark.parametrize("P,cfg", [(2, {"BLOCK_M": 2, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 64, "ROW_SQUARES": 1}),
                                   (3, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "NORM_K": 256,
                                        "ROW_SQUARES": 0}),
                                   (4, {"BLOCK_M": 4, "BLOCK_N": 16, "BLOCK_K": 64, "NORM_K": 64, "ROW_SQUARES": 1})])
def test_output_splits(P, cfg):
    """SPLIT_K output partials [P, M, N]: partial p is the GEMM of the normed rows over K range p
    (ops.gemm.splitk_bounds; with 4 splits of K=160 at BLOCK_K 64 the last range is empty: zeros),
    each within the module's bound (2^-7 x |q_c| @ |w|^T over its range) of its float64 reference; the op's `partials=True` returns them, its bf16
    result is their sum in split order, and the torch backend computes the same ranges. The
    partials are a view of a bigger poisoned buffer: nothing outside them is written."""
    M, N, K, S = 5, 48, 160, 2
    g = torch.Generator().manual_seed(60 + P)
    x = torch.randn(S, M, K, generator=g) * 3.0
    xw, w = torch.randn(K, generator=g).bfloat16(), (torch.randn(N, K, generator=g) * 0.2).bfloat16()
    cfg = {**cfg, "SPLIT_K": P}
    buf = poisoned((P + 1, M + 3, N + 8), torch.float32)
    part = buf[:P, :M, :N]
    G.gemm_bf16_rmsnorm_kernel(x, xw, w, part, 1e-6, config=cfg)
    assert not part.isnan().any()
    assert buf[P:].isnan().all() and buf[:, M:].isnan().all() and buf[:, :, N:].isnan().all()
    from ops.norm import rmsnorm_ref

    qc = rmsnorm_ref(G.splitk_sum_ref(x), xw, 1e-6).double()
    for p, (a, b) in enumerate(G.splitk_bounds(K, P, cfg["BLOCK_K"])):
        ref = qc[:, a:b] @ w[:, a:b].double().T
        bound = 2.0 ** -7 * (qc[:, a:b].abs() @ w[:, a:b].double().abs().T)  # a normed element may move 1 ulp
        assert ((part[p].double() - ref).abs() <= bound).all(), p
    got = G.gemm_bf16_rmsnorm(x, xw, w, 1e-6, config=cfg, partials=True)
    assert got.shape == (P, M, N) and torch.equal(got, part)
    assert torch.equal(G.gemm_bf16_rmsnorm(x, xw, w, 1e-6, config=cfg), G.splitk_sum_ref(part))
    torch_part = G.gemm_bf16_rmsnorm(x, xw, w, 1e-6, backend="torch", config=cfg, partials=True)
    assert torch_part.shape == (P, M, N)
    assert ((torch_part.double() - part.double()).abs() <= 2.0 ** -7 * (qc.abs() @ w.double().abs().T)).all()
    with pytest.raises(ValueError, match="SPLIT_K must be one of"):
        G.gemm_bf16_rmsnorm(x, xw, w, 1e-6, config={**cfg, "SPLIT_K": 0})
