"""Tier 2: every GEMM and quant kernel's default config compiles ahead of time for gfx942, gfx950
and sm90 with zero spills and LDS within the limit; the int paths use v_mfma_i32_* and bf16 uses
v_mfma_f32_*bf16 on both AMD arches; config errors name what is wrong."""
from __future__ import annotations

import pytest

import kdsl as kd
from kdsl import aot
from ops import gemm as G
from ops import quant as Q

pytestmark = pytest.mark.aot

ALL = [*G.KERNELS, Q.quant_per_token_int8, Q.quant_per_token_fp8]
ARCHS = ("gfx942", "gfx950", "sm90")


@pytest.mark.parametrize("kernel", ALL, ids=lambda k: k.name)
def test_default_config_compiles_everywhere(kernel):
    for arch in ARCHS:
        r = aot.report(kernel, arch)
        assert r.ok, r.text()
        assert r.spills == 0 and r.scratch_bytes == 0, r.text()
        assert r.lds_bytes <= r.lds_limit, r.text()


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_matrix_instructions(arch):
    for kernel, prefix in [(G.gemm_w4a8_kernel, "v_mfma_i32_"), (G.gemm_w8a8_kernel, "v_mfma_i32_"),
                           (G.gemm_w4a8_order_kernel, "v_mfma_i32_"), (G.gemm_bf16_kernel, "v_mfma_f32_"),
                           (G.gemm_w4a16_kernel, "v_mfma_f32_")]:
        r = aot.report(kernel, arch)  # default BLOCK_M=16: the matrix path
        mm = [k for k in r.matrix_instructions if k.startswith(prefix)]
        assert mm and r.matrix_in_main_loop > 0, r.text()
        if prefix == "v_mfma_f32_":
            assert all("bf16" in k for k in mm), r.matrix_instructions


def test_decode_tile_takes_valu_path():
    r = aot.report(G.gemm_w4a8_kernel, "gfx942", {"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 128})
    assert r.ok and r.spills == 0 and not r.matrix_instructions, r.text()


def test_fp8_flavour_not_native():
    with pytest.raises(kd.ConfigError, match="not native to gfx942"):
        aot.report(FP8FN_GEMM, "gfx942")
    assert aot.report(G.gemm_fp8_kernel, "gfx942").ok  # kd.fp8 resolves to e4m3fnuz there


def test_config_errors():
    with pytest.raises(kd.ConfigError, match="gemm_w4a16.*BLOCK_K.*multiple of the quant group 32"):
        G.gemm_w4a16_kernel.specialize({"BLOCK_K": 16}, "gfx942")
    with pytest.raises(kd.ConfigError, match="kpack"):
        aot.report(G.gemm_w4a8_kernel, "gfx950", {"kpack": 2})
    with pytest.raises(kd.ConfigError, match="unknown option 'num_wraps'"):
        aot.report(G.gemm_w4a8_kernel, "gfx942", {"num_wraps": 4})


def test_lds_over_limit_reports_not_ok():
    r = aot.report(G.gemm_bf16_kernel, "gfx942", {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_stages": 4})
    assert not r.ok
    assert r.lds_bytes > r.lds_limit and any("LDS" in e and "gfx942" in e for e in r.errors), r.text()


@kd.kernel(name="gemm_fp8fn_test", example={"M": 16, "N": 64, "K": 128})
def FP8FN_GEMM(x: kd.In["M", "K", kd.fp8e4m3fn], w: kd.In["N", "K", kd.fp8e4m3fn], out: kd.Out["M", "N", kd.bf16]):
    m, n = kd.grid(kd.tile("M", "BLOCK_M", domain=(16,), default=16), kd.tile("N", "BLOCK_N", domain=(64,), default=64))
    out[m, n] = kd.fold("K", kd.zeros((m, n), kd.f32), lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))
