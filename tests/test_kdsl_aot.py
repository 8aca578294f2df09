"""Tier 2: ahead-of-time compiles for gfx942 / gfx950 / sm90 on this CPU and the ISA report."""
from __future__ import annotations

import json

import pytest

import kdsl as kd
from kdsl import aot
from kdsl.errors import CompileError, ConfigError

pytestmark = pytest.mark.aot


@kd.kernel(example={"M": 16, "N": 256, "K": 512})
def a_gemm_i8(x: kd.In["M", "K", kd.i8], w: kd.In["N", "K", kd.i8], out: kd.Out["M", "N", kd.i32]):
    m, n = kd.grid(kd.tile("M", domain=(16, 32), default=16), kd.tile("N", domain=(16, 32, 64), default=32))
    acc = kd.fold(kd.tiles("K", block="BLOCK_K", domain=(32, 64, 128), default=64), kd.zeros((m, n), kd.i32),
                  lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))
    out[m, n] = acc


@kd.kernel(example={"M": 64, "N": 256, "K": 512})
def a_gemm_bf16(x: kd.In["M", "K", kd.bf16], w: kd.In["N", "K", kd.bf16], out: kd.Out["M", "N", kd.bf16]):
    m, n = kd.grid(kd.tile("M", domain=(16, 32, 64, 128, 256), default=32),
                   kd.tile("N", domain=(16, 32, 64, 128, 256), default=32))
    acc = kd.fold(kd.tiles("K", block="BLOCK_K", domain=(32, 64, 128, 256), default=64), kd.zeros((m, n), kd.f32),
                  lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))
    out[m, n] = acc


@kd.kernel(example={"M": 64, "K": 128})
def a_fp8_fn(x: kd.In["M", "K", kd.fp8e4m3fn], out: kd.Out["M", "K", kd.f32]):
    m, k = kd.grid("M", "K")
    out[m, k] = x[m, k].to(kd.f32)


@pytest.mark.parametrize("arch,mnemonic", [("gfx942", "v_mfma_i32_"), ("gfx950", "v_mfma_i32_")])
def test_int8_gemm_uses_int8_mfma(arch, mnemonic):
    r = aot.report(a_gemm_i8, arch)
    assert r.ok, r.errors
    mm = [k for k in r.matrix_instructions if k.startswith(mnemonic) and k.endswith("_i8")]
    assert mm, r.matrix_instructions
    assert r.matrix_in_main_loop > 0 and r.spills == 0 and 0 < r.lds_bytes <= r.lds_limit


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_bf16_gemm_uses_bf16_mfma(arch):
    r = aot.report(a_gemm_bf16, arch)
    assert r.ok, r.errors
    assert any(k.startswith("v_mfma_f32_") and "bf16" in k for k in r.matrix_instructions), r.matrix_instructions


def test_sm90_uses_mma_or_wgmma():
    r = aot.report(a_gemm_bf16, "sm90", {"BLOCK_M": 64, "BLOCK_N": 64})
    assert r.ok, r.errors
    assert any(k.startswith(("wgmma", "mma.")) for k in r.matrix_instructions), r.matrix_instructions


@kd.kernel(static=("N",), example={"N": 256})
def a_store_barrier_reload(x: kd.In["N", kd.f32], buf: kd.Out["N", kd.f32], out: kd.Out["N", kd.f32]):
    n, = kd.grid(kd.tile("N", block=256))
    buf[n] = x[n] + 1.0
    kd.barrier()
    out[n] = buf[(kd.static("N") - 1) - n]


@pytest.mark.parametrize("arch,mnemonic", [("gfx942", "s_barrier"), ("gfx950", "s_barrier"), ("sm90", "bar.sync")])
def test_barrier_compiles(arch, mnemonic):
    r = aot.report(a_store_barrier_reload, arch)
    assert r.ok, r.errors
    a = aot.asm(a_store_barrier_reload, arch)
    assert mnemonic in a
    if arch != "sm90":   # s_barrier waits for no memory operation: each wave first waits for its stores
        pos = a.index("s_waitcnt vmcnt(0)", a.index("_store_dword"))
        assert a.index("s_barrier", pos) < a.index("_load_dword", pos)


@kd.kernel(example={"N": 256, "C": 1})
def a_last_program_sum(x: kd.In["N", kd.f32], part: kd.Out["N", kd.f32], counters: kd.InOut["C", kd.i32],
                       out: kd.Out["N", kd.f32]):
    n, = kd.grid(kd.tile("N", block=64))
    part[n] = x[n] * 2.0
    t = kd.atomic_ticket(counters, [0])
    kd.exit_if(t != kd.cdiv(kd.dim("N"), 64) - 1)
    counters[0] = 0
    nn = kd.arange(64)
    out[nn] = part[nn]


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm90"])
def test_ticket_waits_for_every_waves_stores_then_releases_and_acquires(arch):
    """kd.atomic_ticket: each thread's own store wait, a workgroup barrier, then one acq_rel atomic at
    gpu (agent) scope: AMD writes L2 back before it and invalidates after it; NVIDIA atom.acq_rel.gpu."""
    a = aot.asm(a_last_program_sum, arch)
    if arch == "sm90":
        seq = ["st.global", "fence.acq_rel.gpu", "bar.sync", "atom.global.gpu.acq_rel.add"]
    else:
        seq = ["_store_dword", "s_waitcnt vmcnt(0)", "s_barrier", "buffer_wbl2", "global_atomic_add", "buffer_inv"]
    pos = 0
    for want in seq:
        pos = a.index(want, pos)


def test_lds_over_limit_is_not_ok():
    cfg = {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 256, "num_stages": 2, "num_warps": 8}   # 160 KiB of tiles
    r = aot.report(a_gemm_bf16, "gfx942", cfg, {"M": 512, "N": 512, "K": 1024})
    assert not r.ok
    assert r.lds_bytes > r.lds_limit == 65536
    assert any("LDS" in e and "over the gfx942 limit of 65536 B" in e for e in r.errors), r.errors
    with pytest.raises(CompileError, match="a_gemm_bf16.*gfx942"):
        aot.check(a_gemm_bf16, "gfx942", cfg, {"M": 512, "N": 512, "K": 1024})


def test_fp8_flavour_not_native_names_parameter():
    with pytest.raises(ConfigError) as e:
        aot.report(a_fp8_fn, "gfx942")
    assert e.value.param == "x" and "not native to gfx942" in str(e.value)
    assert aot.report(a_fp8_fn, "gfx950").ok     # e4m3fn is gfx950's native fp8


def test_report_json_keys():
    r = aot.report(a_gemm_i8, "gfx950", {"BLOCK_N": 64, "num_warps": 2})
    d = json.loads(json.dumps(r.to_dict()))
    for key in ("kernel", "arch", "config", "vgpr", "agpr", "sgpr", "spills", "scratch_bytes", "lds_bytes",
                "lds_limit", "occupancy", "matrix_instructions", "ok"):
        assert key in d, key
    assert d["kernel"] == "a_gemm_i8" and d["arch"] == "gfx950" and d["lds_limit"] == 163840
    assert d["config"]["BLOCK_N"] == 64 and d["config"]["num_warps"] == 2 and d["vgpr"] > 0
    assert 1 <= d["occupancy"] <= 8
