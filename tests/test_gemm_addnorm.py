"""gemm_bf16_addnorm (ops/gemm_addnorm.py): a layer's q_a|kv_a GEMM at world size > 1 with the
residual add (bf16(x + res), stored as res_out) and the input RMSNorm in its prologue.

Tolerances: res_out is rmsnorm_add's bit for bit; with NORM_K >= K (one sum-of-squares reduction,
rmsnorm_add's) the partials are bit for bit those of rmsnorm_add then gemm_bf16_rmsnorm's GEMM over
the normed rows (the interpreter); with a smaller NORM_K the sum order differs, so a normed element
may move by one bf16 ulp: against the float64 reference, |err| <= 2^-7 x (|y| @ |w|^T) per partial."""
from __future__ import annotations

import pytest
import torch

from ops import gemm as G
from ops import gemm_addnorm as A
from ops.norm import rms_norm, rms_norm_quant, rmsnorm_ref
from tests.conftest import poisoned


def _case(M, N, K, seed, pad=6):
    """x and res as row views of wider buffers (the kernel's operands may be strided)."""
    g = torch.Generator().manual_seed(seed)
    xb = (torch.randn(M, K + pad, generator=g) * 2.0).bfloat16()
    rb = (torch.randn(M, K + pad, generator=g) * 3.0).bfloat16()
    xw = torch.randn(K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.2).bfloat16()
    return xb[:, :K], rb[:, pad:], xw, w


def _launch(x, res, xw, w, cfg):
    """The kernel into views of bigger poisoned buffers -> (partials, res_out); checks that nothing
    around them was written."""
    M, K = x.shape
    P, N = cfg.get("SPLIT_K", 1), w.shape[0]
    pbuf = poisoned((P + 1, M + 2, N + 8), torch.float32)
    rbuf = poisoned((M + 2, K + 8), torch.bfloat16)
    part, r_out = pbuf[:P, :M, :N], rbuf[:M, :K]
    A.gemm_bf16_addnorm_kernel(x, res, xw, w, part, r_out, 1e-6, config=cfg)
    assert not part.isnan().any() and not r_out.isnan().any()
    assert pbuf[P:].isnan().all() and pbuf[:, M:].isnan().all() and pbuf[:, :, N:].isnan().all()
    assert rbuf[M:].isnan().all() and rbuf[:, K:].isnan().all()
    return part, r_out


@pytest.mark.parametrize("M,N,K,cfg", [
    (1, 40, 96, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 128, "SPLIT_K": 1}),
    (3, 48, 160, {"BLOCK_M": 2, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 256, "SPLIT_K": 3}),
    (5, 32, 96, {"BLOCK_M": 8, "BLOCK_N": 32, "BLOCK_K": 64, "NORM_K": 128, "SPLIT_K": 2}),
    (18, 40, 96, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 128, "SPLIT_K": 4}),
])
def test_equals_rmsnorm_add_then_gemm_bit_for_bit(M, N, K, cfg):
    """NORM_K >= K: res_out is rmsnorm_add's residual and the partials are gemm_bf16_rmsnorm's over
    that residual (whose prologue norms as rmsnorm_add does), bit for bit, at any output split;
    within the bound of the float64 reference."""
    x, res, xw, w = _case(M, N, K, seed=M * 10 + N)
    part, r_out = _launch(x, res, xw, w, cfg)
    y, r_chain = rms_norm(x, xw, 1e-6, residual=res, backend="triton")
    assert torch.equal(r_out.view(torch.int16), r_chain.view(torch.int16))
    chain = G.gemm_bf16_rmsnorm(r_chain, xw, w, 1e-6, config={**cfg, "ROW_SQUARES": 1}, partials=True)
    assert torch.equal(part, chain)
    yr = rmsnorm_ref(A.residual_sum_ref(x, res), xw, 1e-6).double()
    assert torch.equal(y, yr.bfloat16())
    for p, (a, b) in enumerate(G.splitk_bounds(K, cfg["SPLIT_K"], cfg["BLOCK_K"])):
        ref = yr[:, a:b] @ w[:, a:b].double().T
        assert ((part[p].double() - ref).abs() <= 2.0 ** -7 * (yr[:, a:b].abs() @ w[:, a:b].double().abs().T)).all()


@pytest.mark.parametrize("M,cfg", [(1, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 128, "SPLIT_K": 2}),
                                   (7, {"BLOCK_M": 4, "BLOCK_N": 32, "BLOCK_K": 64, "NORM_K": 64, "SPLIT_K": 3}),
                                   (17, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 256, "SPLIT_K": 1})])
def test_normed_rows_variant(M, cfg):
    """gemm_bf16_addnorm_y (the MoE half's first GEMM): the partials and res_out of gemm_bf16_addnorm
    at the same config, bit for bit, and the normed rows y: rmsnorm_add's `out` bit for bit when
    NORM_K >= K, else within one bf16 ulp of it; y is a view of a bigger poisoned buffer (only its
    rows and columns written, by the first column tile's programs)."""
    N, K = 40, 96
    x, res, xw, w = _case(M, N, K, seed=90 + M)
    part, r_out = _launch(x, res, xw, w, cfg)
    P = cfg["SPLIT_K"]
    p2 = poisoned((P, M, N), torch.float32)
    r2 = poisoned((M, K), torch.bfloat16)
    ybuf = poisoned((M + 3, K + 5), torch.bfloat16)
    A.gemm_bf16_addnorm_y_kernel(x, res, xw, w, p2, r2, ybuf[:M, :K], 1e-6, config=cfg)
    assert torch.equal(p2, part) and torch.equal(r2, r_out)
    assert ybuf[M:].isnan().all() and ybuf[:, K:].isnan().all()
    y = ybuf[:M, :K]
    want, _ = rms_norm(x, xw, 1e-6, residual=res, backend="triton")
    if cfg["NORM_K"] >= K:
        assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    else:
        ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(2.0 ** -126))) - 7)
        assert ((y.float() - want.float()).abs() <= ulp).all()
    gemm, r3, y3 = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, partials=True, normed=True)
    assert torch.equal(gemm, part) and torch.equal(r3, r_out) and torch.equal(y3, y)
    tg, tr, ty = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, partials=True, normed=True, backend="torch")
    assert torch.equal(tr, r_out) and torch.equal(ty, rmsnorm_ref(r_out, xw, 1e-6)) and tg.shape == part.shape


@pytest.mark.parametrize("M,cfg", [(1, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 128, "SPLIT_K": 2}),
                                   (6, {"BLOCK_M": 4, "BLOCK_N": 32, "BLOCK_K": 64, "NORM_K": 128, "SPLIT_K": 3}),
                                   (17, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 256, "SPLIT_K": 1})])
def test_quant_variant_equals_rmsnorm_add_quant(M, cfg):
    """gemm_bf16_addnorm_yq (W4A8 experts' MoE half): with NORM_K >= K the new residual, the normed
    rows and their per-token int8 codes and scales are rms_norm_quant's (rmsnorm_add_quant) bit for
    bit, the partials gemm_bf16_addnorm's; every output a view of a bigger poisoned buffer, nothing
    around it written (the scales once per row, by one program); the torch backend agrees."""
    N, K = 40, 96
    x, res, xw, w = _case(M, N, K, seed=110 + M)
    part, r_out = _launch(x, res, xw, w, cfg)
    P = cfg["SPLIT_K"]
    p2, r2 = poisoned((P, M, N), torch.float32), poisoned((M, K), torch.bfloat16)
    ybuf, qbuf, sbuf = poisoned((M + 2, K + 4), torch.bfloat16), poisoned((M + 2, K + 4), torch.int8), \
        poisoned((M + 3,), torch.float32)
    A.gemm_bf16_addnorm_yq_kernel(x, res, xw, w, p2, r2, ybuf[:M, :K], qbuf[:M, :K], sbuf[:M], 1e-6, config=cfg)
    assert torch.equal(p2, part) and torch.equal(r2, r_out)
    assert ybuf[M:].isnan().all() and ybuf[:, K:].isnan().all() and sbuf[M:].isnan().all()
    assert (qbuf[M:] == -123).all() and (qbuf[:, K:] == -123).all()
    q8, sc, y, r = rms_norm_quant(x, xw, 1e-6, residual=res, backend="triton")
    assert torch.equal(r, r_out) and torch.equal(ybuf[:M, :K].view(torch.int16), y.view(torch.int16))
    assert torch.equal(qbuf[:M, :K], q8) and torch.equal(sbuf[:M], sc)
    got = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, partials=True, quant=True)
    assert len(got) == 5 and all(torch.equal(a, b) for a, b in zip(got, (part, r_out, y, q8, sc)))
    ref = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, partials=True, quant=True, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(ref[1:], got[1:])) and ref[0].shape == part.shape


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("S,M,cfg", [(2, 1, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 128, "SPLIT_K": 2}),
                                     (4, 6, {"BLOCK_M": 4, "BLOCK_N": 32, "BLOCK_K": 64, "NORM_K": 128, "SPLIT_K": 3}),
                                     (3, 17, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 256,
                                              "SPLIT_K": 1})])
def test_splitk_partials_variants(S, M, cfg, quant):
    """World size 1 (gemm_bf16_addnorm_splitk_y / _yq): x as o_proj's S split-K f32 partials (a
    strided view of a wider buffer). With NORM_K >= K every output is rmsnorm_add(_quant)_splitk's
    bit for bit and the GEMM partials are those of the bf16 path over the rounded split sum; outputs
    are views of bigger poisoned buffers; the torch backend agrees."""
    from ops.gemm import splitk_sum_ref

    N, K = 40, 96
    g = torch.Generator().manual_seed(130 + S * M)
    x = (torch.randn(S, M, K + 7, generator=g) * 2.0)[:, :, :K]
    res = (torch.randn(M, K, generator=g) * 3.0).bfloat16()
    xw, w = torch.randn(K, generator=g).bfloat16(), (torch.randn(N, K, generator=g) * 0.2).bfloat16()
    P = cfg["SPLIT_K"]
    pbuf, rbuf, ybuf = poisoned((P + 1, M, N), torch.float32), poisoned((M + 1, K), torch.bfloat16), \
        poisoned((M + 1, K + 3), torch.bfloat16)
    outs = [pbuf[:P], rbuf[:M], ybuf[:M, :K]]
    if quant:
        qbuf, sbuf = poisoned((M + 1, K), torch.int8), poisoned((M + 2,), torch.float32)
        outs += [qbuf[:M], sbuf[:M]]
        A.gemm_bf16_addnorm_splitk_yq_kernel(x, res, xw, w, *outs, 1e-6, config=cfg)
        assert (qbuf[M:] == -123).all() and sbuf[M:].isnan().all()
        want = rms_norm_quant(x, xw, 1e-6, residual=res, backend="triton")       # (q, scale, y, residual)
        want = (want[3], want[2], want[0], want[1])
    else:
        A.gemm_bf16_addnorm_splitk_y_kernel(x, res, xw, w, *outs, 1e-6, config=cfg)
        y, r = rms_norm(x, xw, 1e-6, residual=res, backend="triton")
        want = (r, y)
    assert pbuf[P:].isnan().all() and rbuf[M:].isnan().all() and ybuf[M:].isnan().all() and ybuf[:, K:].isnan().all()
    for got, exp in zip(outs[1:], want):
        assert torch.equal(got, exp)
    flat = A.gemm_bf16_addnorm(splitk_sum_ref(x), res, xw, w, 1e-6, config=cfg, partials=True, quant=quant,
                               normed=True)
    assert torch.equal(outs[0], flat[0])
    got = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, partials=True, quant=quant, normed=True)
    assert all(torch.equal(a, b) for a, b in zip(got, outs))
    ref = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, partials=True, quant=quant, normed=True,
                              backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(ref[1:], got[1:])) and ref[0].shape == got[0].shape


@pytest.mark.parametrize("M", [1, 5, 16])
def test_block_m_changes_no_bit(M):
    """BLOCK_M and BLOCK_N are launch-only keys: the same bits at 1, 2, 4, 8, 16 rows a tile and at
    16, 32, 64 columns (NORM_K < K: several tiles per row's squares; the first column tile's programs,
    which store the residual, cover other columns at each width), within the bound of the float64
    reference."""
    N, K = 48, 200
    x, res, xw, w = _case(M, N, K, seed=70 + M)
    base = {"BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 64, "SPLIT_K": 2}
    outs = [_launch(x, res, xw, w, {**base, "BLOCK_M": bm}) for bm in (1, 2, 4, 8, 16)]
    outs += [_launch(x, res, xw, w, {**base, "BLOCK_M": 1, "BLOCK_N": bn}) for bn in (32, 64)]
    for part, r_out in outs[1:]:
        assert torch.equal(part, outs[0][0]) and torch.equal(r_out, outs[0][1])
    yr = rmsnorm_ref(A.residual_sum_ref(x, res), xw, 1e-6).double()
    for p, (a, b) in enumerate(G.splitk_bounds(K, 2, 32)):
        ref = yr[:, a:b] @ w[:, a:b].double().T
        assert ((outs[0][0][p].double() - ref).abs() <= 2.0 ** -7 * (yr[:, a:b].abs() @ w[:, a:b].double().abs().T)).all()


def test_wrapper_backends_and_checks():
    M, N, K = 3, 24, 64
    x, res, xw, w = _case(M, N, K, seed=5)
    cfg = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "NORM_K": 64, "SPLIT_K": 2}
    y, r = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg)
    part, r2 = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, partials=True)
    assert y.shape == (M, N) and torch.equal(y, G.splitk_sum_ref(part)) and torch.equal(r, r2)
    assert torch.equal(r, A.residual_sum_ref(x, res))
    tp, tr = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, partials=True, backend="torch")
    assert tp.shape == part.shape and torch.equal(tr, r)
    ref = G.gemm_bf16_rmsnorm_ref(A.residual_sum_ref(x, res), xw, w, 1e-6)
    assert torch.equal(A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, backend="torch")[0], ref)
    out = torch.empty(M, K, dtype=torch.bfloat16)
    assert A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, res_out=out)[1] is out and torch.equal(out, r)
    e = A.gemm_bf16_addnorm(x[:0], res[:0], xw, w, 1e-6, config=cfg)
    assert e[0].shape == (0, N) and e[1].shape == (0, K)
    buf = res.contiguous()
    with pytest.raises(ValueError, match="must not overlap res"):
        A.gemm_bf16_addnorm(x, buf, xw, w, 1e-6, config=cfg, res_out=buf)
    with pytest.raises(ValueError, match="res must have x's rows' shape"):
        A.gemm_bf16_addnorm(x, res[:2], xw, w, 1e-6)
    with pytest.raises(ValueError, match="need normed=True or quant=True"):
        A.gemm_bf16_addnorm(x.float().unsqueeze(0), res, xw, w, 1e-6)
    with pytest.raises(TypeError, match="split-K partials"):
        A.gemm_bf16_addnorm(x.double().unsqueeze(0), res, xw, w, 1e-6, normed=True)
    with pytest.raises(ValueError, match="x_norm_w must be"):
        A.gemm_bf16_addnorm(x, res, xw[:32], w, 1e-6)
    with pytest.raises(ValueError, match="w must be"):
        A.gemm_bf16_addnorm(x, res, xw, w[:, :32], 1e-6)
    with pytest.raises(ValueError, match="eps must be"):
        A.gemm_bf16_addnorm(x, res, xw, w, float("nan"))
    with pytest.raises(ValueError, match="res_out must be"):
        A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, res_out=torch.empty(M, K + 1, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="res must be bfloat16"):
        A.gemm_bf16_addnorm(x, res.float(), xw, w, 1e-6)
    with pytest.raises(ValueError, match="backend"):
        A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, backend="cuda")


def test_pays_only_where_every_bucket_pays():
    """The model's rule (addnorm_pays): by the tuned files, one answer for every size up to a
    deployment's rows; False past FUSED_SPAN, for no rows, and without files."""
    from ops.splitk_norm import FUSED_SPAN

    for arch in ("gfx942", "gfx950"):
        assert A.addnorm_pays(arch, 2112, 7168, 8)                       # batch 2 verify: it pays
        assert not A.addnorm_pays(arch, 2112, 7168, 0)
        assert not A.addnorm_pays(arch, 2112, 7168, FUSED_SPAN + 1)
        # the answer for r rows is the AND of the per-bucket answers up to r's bucket
        for r in (1, 3, 16, 48, 128):
            top = 1 << (r - 1).bit_length()
            assert A.addnorm_pays(arch, 2112, 7168, r) == all(A._pays_at(arch, 2112, 7168, b)
                                                              for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= top)
    assert not A.addnorm_pays("gfx942", 2112, 7168 + 1, 8)               # no file for the shape


def test_gate_up_forms_pay_only_at_the_chain_split(monkeypatch):
    """A gate|up + router form tuned at another split count than the chain's gemm_bf16_splitk would
    hand the shared down GEMM partials its files are not keyed by: the rule refuses it."""
    from ops.gemm import gemm_bf16_splitk_kernel

    assert A.addnorm_pays("gfx950", 896, 7168, 8, normed=True, quant=True)
    real = A._split_count
    monkeypatch.setattr(A, "_split_count", lambda k, a, p: 2 * real(k, a, p) if k is not gemm_bf16_splitk_kernel
                        else real(k, a, p))
    A._pays_at.cache_clear()
    try:
        assert not A.addnorm_pays("gfx950", 896, 7168, 8, normed=True, quant=True)
        assert A.addnorm_pays("gfx950", 2112, 7168, 8)          # q_a|kv_a: its consumers take any split
    finally:
        A._pays_at.cache_clear()
