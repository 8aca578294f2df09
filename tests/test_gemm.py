"""GEMM kernels (interpreter) against float64 torch references.

Tolerances: the int paths (W8A8, W4A8) accumulate exactly in int32 (checked bit-exactly through
gemm_w4a8_i32acc) and the scaled result may differ from float64 rounded to bf16 by 1 bf16 ulp (the
f32 epilogue rounds twice before the bf16 store). fp8 products are exact, so fp8 gets the same 1-ulp
bound. bf16 / W4A16 accumulate in f32: |err| <= 1 bf16 ulp of the result + 1e-5 * sum|x||w|.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kdsl as kd
from ops import gemm as G
from ops import quant as Q
from ops.packing import pack_int4, unpack_int4
from tests.conftest import poisoned

SHAPES = st.tuples(st.sampled_from([1, 4, 16, 7]), st.integers(1, 40), st.sampled_from([32, 96]))
FEW = settings(max_examples=5)
CONFIGS = st.sampled_from([{"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32}, {"BLOCK_M": 4, "BLOCK_N": 16, "BLOCK_K": 64},
                           {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}])
UNPACK = st.sampled_from(["shift", "bfe", "swar"])  # kdsl int4 lowerings (tunable INT4_UNPACK of the int4 kernels)


def _ulp_bf16(y: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at |y| (the spacing above it), at least the smallest normal's."""
    a = y.float().abs().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def _assert_within_ulp(y: torch.Tensor, ref64: torch.Tensor, extra: torch.Tensor | float = 0.0) -> None:
    assert not torch.isnan(y).any(), "unwritten (poisoned) outputs"
    err = (y.double() - ref64).abs()
    bound = _ulp_bf16(ref64).double() + extra
    assert bool((err <= bound).all()), f"max err {err.max().item()} (bound at worst {(err - bound).max().item()})"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@FEW
@given(shape=SHAPES, cfg=CONFIGS, pack=st.sampled_from(["quark_reorder", "quark_order"]), unpack=UNPACK,
       seed=st.integers(0, 999))
def test_w4a8(shape, cfg, pack, unpack, seed):
    M, N, K = shape
    cfg = {**cfg, "INT4_UNPACK": unpack}
    g = _gen(seed)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    q = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
    ws = torch.rand(N, generator=g) * 0.01 + 1e-3
    xq, xs = Q.quantize_int8(x)
    kern = G.W4A8_KERNELS[pack]
    out = poisoned((M, N), torch.bfloat16)
    kern(xq, xs, pack_int4(q, pack), ws, out, config=cfg)
    acc = xq.double() @ q.double().T
    _assert_within_ulp(out, acc * xs.double()[:, None] * ws.double()[None, :])


@FEW
@given(shape=SHAPES, cfg=CONFIGS, unpack=UNPACK, seed=st.integers(0, 999))
def test_w4a8_i32_accumulator_exact(shape, cfg, unpack, seed):
    M, N, K = shape
    cfg = {**cfg, "INT4_UNPACK": unpack}
    g = _gen(seed)
    xq = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
    q = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
    acc = poisoned((M, N), torch.int32)
    G.gemm_w4a8_i32acc_kernel(xq, pack_int4(q, "quark_reorder"), acc, config=cfg)
    assert torch.equal(acc, xq.int() @ q.int().T)


@FEW
@given(shape=SHAPES, cfg=CONFIGS, seed=st.integers(0, 999))
def test_w8a8(shape, cfg, seed):
    M, N, K = shape
    g = _gen(seed)
    xq = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    xs, ws = torch.rand(M, generator=g) * 0.1, torch.rand(N, generator=g) * 0.01
    out = G.gemm_w8a8(xq, xs, wq, ws, config=cfg)
    _assert_within_ulp(out, (xq.double() @ wq.double().T) * xs.double()[:, None] * ws.double()[None, :])


@FEW
@given(shape=SHAPES, cfg=CONFIGS, seed=st.integers(0, 999))
def test_fp8(shape, cfg, seed):
    M, N, K = shape
    g = _gen(seed)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn)
    ws = torch.rand(N, generator=g) * 0.01
    xq, xs = Q.quantize_fp8(x)
    out = G.gemm_fp8(xq, xs, w, ws, config=cfg)
    _assert_within_ulp(out, (xq.double() @ w.double().T) * xs.double()[:, None] * ws.double()[None, :])


@FEW
@given(shape=SHAPES, cfg=CONFIGS, seed=st.integers(0, 999))
def test_bf16(shape, cfg, seed):
    M, N, K = shape
    g = _gen(seed)
    x, w = torch.randn(M, K, generator=g).to(torch.bfloat16), torch.randn(N, K, generator=g).to(torch.bfloat16)
    out = G.gemm_bf16(x, w, config=cfg)
    ref = x.double() @ w.double().T
    _assert_within_ulp(out, ref, 1e-5 * (x.double().abs() @ w.double().abs().T))


@FEW
@given(shape=SHAPES, cfg=CONFIGS, unpack=UNPACK, seed=st.integers(0, 999))
def test_w4a16(shape, cfg, unpack, seed):
    M, N, K = shape
    cfg = {**cfg, "INT4_UNPACK": unpack}
    g = _gen(seed)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    q = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
    sc = (torch.rand(N, K // 32, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    wp = pack_int4(q, "ct")
    out = G.gemm_w4a16(x, wp, sc, config=cfg)
    wd = G.dequant_w4a16_ref(wp, sc).double()  # the bf16 weight the kernel multiplies
    _assert_within_ulp(out, x.double() @ wd.T, 1e-5 * (x.double().abs() @ wd.abs().T))


def test_linear_w4a8_matches_torch_backend():
    g = _gen(5)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    q = torch.randint(-8, 8, (24, 64), generator=g, dtype=torch.int8)
    ws = torch.rand(24, generator=g) * 0.01
    wp = pack_int4(q, "quark_reorder")
    y = G.linear_w4a8(x, wp, ws)
    yt = G.linear_w4a8(x, wp, ws, backend="torch")
    assert (y.float() - yt.float()).abs().max() <= _ulp_bf16(yt).max()
    # and close to the unquantized product (int8 activation error only)
    full = x.float() @ (q.float() * ws[:, None]).T
    assert (y.float() - full).abs().max() <= 0.02 * full.abs().max() + 1e-3
    assert torch.equal(unpack_int4(wp, "quark_reorder"), q)


def test_launch_shape_errors():
    xq = torch.randint(-8, 8, (2, 64), dtype=torch.int8)
    wp = pack_int4(torch.randint(-8, 8, (16, 32), dtype=torch.int8), "quark_reorder")
    with pytest.raises(ValueError, match="K mismatch"):
        G.gemm_w4a8(xq, torch.ones(2), wp, torch.ones(16))
    with pytest.raises(kd.LaunchError, match="gemm_w4a8.*'w'.*shape mismatch on dim K"):  # the kernel checks too
        G.gemm_w4a8_kernel(xq, torch.ones(2), wp, torch.ones(16), torch.empty(2, 16, dtype=torch.bfloat16))
    x = torch.randn(2, 48, dtype=torch.bfloat16)
    wc = pack_int4(torch.randint(-8, 8, (8, 48), dtype=torch.int8), "ct")
    with pytest.raises(ValueError, match="multiple of the quant group 32"):
        G.gemm_w4a16(x, wc, torch.ones(8, 1, dtype=torch.bfloat16))
    with pytest.raises(kd.LaunchError, match="gemm_w4a16.*'K'.*multiple of the quant group 32"):
        G.gemm_w4a16_kernel(x, wc, torch.ones(8, 1, dtype=torch.bfloat16), torch.empty(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="pack"):
        G.gemm_w4a8(xq, torch.ones(2), wp, torch.ones(16), pack="ct")


def test_config_errors():
    with pytest.raises(kd.ConfigError, match="gemm_w4a16.*BLOCK_K.*multiple of the quant group 32"):
        G.gemm_w4a16_kernel.source({"BLOCK_K": 16}, "gfx942")
    with pytest.raises(kd.ConfigError, match="gemm_w4a8.*kpack.*gfx950 supports only kpack=1"):
        G.gemm_w4a8_kernel.source({"kpack": 2}, "gfx950")
    with pytest.raises(kd.ConfigError, match="unknown option"):
        G.gemm_w4a8_kernel.source({"BLOCK_Q": 2}, "gfx942")


def test_kdsl_int4_unpack_lowerings_agree():
    """kdsl extension: `h.load(..., unpack="bfe")` (constant-shift nibbles + tl.join) and "swar"
    (four nibbles per word operation) equal the default "shift" lowering for every packing; an
    unknown lowering is an error naming it."""
    g = _gen(3)
    for pack, kern in G.W4A8_KERNELS.items():
        xq = torch.randint(-127, 128, (2, 64), generator=g, dtype=torch.int8)
        q = torch.randint(-8, 8, (16, 64), generator=g, dtype=torch.int8)
        outs = []
        for how in ("shift", "bfe", "swar"):
            out = poisoned((2, 16), torch.bfloat16)
            kern(xq, torch.ones(2), pack_int4(q, pack), torch.ones(16), out,
                 config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "INT4_UNPACK": how})
            outs.append(out)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        assert "0x78787878" in kern.source({"INT4_UNPACK": "swar"}, "gfx942")
        assert "tl.join" in kern.source({"INT4_UNPACK": "bfe"}, "gfx942")
    with pytest.raises(kd.ConfigError, match="INT4_UNPACK"):
        G.gemm_w4a8_kernel.source({"INT4_UNPACK": "lut"}, "gfx942")
