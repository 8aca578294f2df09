"""The decode step as a unit (bench.step, bench.meta_model) and the cost-model pieces it relies on:
loop detection, LDS time, overlap by occupancy, split traffic, helper hashes, config lookup order,
temp-file cleanup, and the autotune CLI's one-line errors."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from autotune import costmodel, store
from kdsl import aot
from kdsl.targets import get_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# An LLVM AMDGPU listing with a persistent tile loop around a K loop; the IR names of both headers
# take the label line, so the loop notes sit on the line after the label (the case that was missed).
NESTED_ASM = """
k:
\ts_load_dwordx2 s[0:1], s[4:5], 0x0
.LBB0_1:                                ; %tile.loop
                                        ; =>This Loop Header: Depth=1
\tv_mov_b32 v1, 0
\tglobal_store_dword v0, v1, s[0:1]
.LBB0_2:                                ; %k.loop
                                        ;   Parent Loop BB0_1 Depth=1
                                        ; =>  This Inner Loop Header: Depth=2
\tds_read_b128 v[4:7], v2
\tds_write_b8 v3, v9
\tv_mfma_f32_16x16x32_bf16 a[0:3], v[4:5], v[6:7], a[0:3]
\tv_mfma_f32_16x16x32_bf16 a[0:3], v[4:5], v[6:7], a[0:3]
\tv_add_u32 v2, 64, v2
\ts_cbranch_scc1 .LBB0_2
.LBB0_3:                                ; %tile.latch
                                        ;   in Loop: Header=BB0_1 Depth=1
\tv_add_u32 v0, 4, v0
\ts_cbranch_scc1 .LBB0_1
\ts_endpgm
"""


def test_loop_note_on_the_line_after_the_label_nested_loops():
    blocks = aot._blocks(NESTED_ASM, r"^(\.LBB\S+?):")
    depth, loop = aot._main_loop_depth(blocks, lambda i: i.startswith("v_mfma"))
    assert depth == 2
    assert sum(i.startswith("v_mfma") for i in loop) == 2
    assert "ds_read_b128" in loop and "global_store_dword" not in loop
    assert aot.lds_bytes_per_lane("ds_read_b128") == ("read", 16, 16)
    assert aot.lds_bytes_per_lane("ds_write_b8") == ("write", 1, 4)
    assert aot.lds_bytes_per_lane("ds_read2_b64") == ("read", 16, 16)


@pytest.mark.slow
@pytest.mark.aot
def test_gfx950_moe_stage1_w4a16_main_loop_is_found():
    """The committed gfx950 W4A16 stage-1 config: its K loop has MFMA and LDS work (was 0)."""
    from autotune.problems import full_dims
    from ops.moe import moe_stage1_w4a16

    cfg = {"BLOCK_N": 16, "BLOCK_M": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    prob = {"E": 384, "K": 7168, "I": 2048, "TOPK": 8}
    dims = full_dims(moe_stage1_w4a16, prob, 16, cfg, get_target("gfx950"))
    r = aot.report(moe_stage1_w4a16, "gfx950", cfg, dims)
    assert r.ok and r.matrix_in_main_loop > 0 and r.valu_in_main_loop > 0
    assert r.lds_slot_bytes_in_main_loop > 0 and r.main_loop_depth >= 1


@pytest.mark.slow
@pytest.mark.aot
def test_gfx950_w4a16_and_mla_split_without_converts_or_divisions():
    """The VALU the step's W4A16 stages and MLA split kernel were bound by, gone from the gfx950 ISA:
    stage 1's K loop makes bf16 weights with no int->float convert or bit-field extract (kd.group_dot's
    biased pairs, one v_and_or_b32 per two: 213 -> 136 VALU for 64 weights a lane), and the split kernel normalizes its partial
    by one reciprocal per row (no IEEE division per element: 1428 -> 827 VALU at q_len 4)."""
    from autotune.problems import full_dims
    from ops.mla import mla_decode_split
    from ops.moe import moe_stage1_w4a16

    t = get_target("gfx950")
    cfg = {"BLOCK_N": 64, "BLOCK_M": 16, "W_ROWS": 1, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1}
    dims = full_dims(moe_stage1_w4a16, {"E": 384, "K": 7168, "I": 2048, "TOPK": 8}, 1, cfg, t)
    code = aot.asm(moe_stage1_w4a16, t, cfg, dims)
    loop = aot._main_loop(aot._blocks(code, r"^(\.LBB\S+?):"), lambda i: i.startswith("v_mfma"))
    valu = [i for i in loop if i.startswith("v_") and not i.startswith("v_mfma")]
    assert loop and not any(i.startswith(("v_cvt_f32_i32", "v_bfe_")) for i in valu)
    assert len(valu) <= 2.2 * 64  # weights a lane per K step: 2 x 64 x 128 / 256 (136 VALU; 213 before)
    assert sum(i.startswith("v_and_or_b32") for i in valu) == 32  # one per two weights
    mcfg = {"BLOCK_M": 64, "BLOCK_N": 32, "PV_T": 1, "KV_ROWS": 0, "QK_BLOCK": 64, "num_warps": 8,
            "matrix_instr_nonkdim": 16}
    mdims = full_dims(mla_decode_split, {"QL": 4, "H": 64, "DL": 512, "DR": 64, "PS": 64}, 1, mcfg, t)
    # one division per row for its reciprocal (2 scale steps each), not one per element (128 before)
    assert aot.asm(mla_decode_split, t, mcfg, mdims).count("v_div_scale_f32") <= 4


def test_gfx942_w4a8_swar_unpack_cuts_the_stage1_loop():
    """INT4_UNPACK "swar" (four nibbles per word operation) against one bit-field extract per weight
    in the step's TP8 W4A8 stage 1 tile on gfx942: no v_bfe, and the K loop's VALU 77 -> 57 for 32
    weights a lane (~1.25 per weight for the unpack instead of ~2.4)."""
    from autotune.problems import full_dims
    from ops.moe import moe_stage1_w4a8_amax

    t = get_target("gfx942")
    counts = {}
    for how in ("bfe", "swar"):
        cfg = {"BLOCK_N": 16, "BLOCK_M": 16, "INT4_UNPACK": how, "W_ROWS": 0, "BLOCK_K": 256, "num_warps": 4,
               "num_stages": 2, "kpack": 2}
        dims = full_dims(moe_stage1_w4a8_amax, {"E": 384, "K": 7168, "I": 256, "TOPK": 8}, 1, cfg, t)
        loop = aot._main_loop(aot._blocks(aot.asm(moe_stage1_w4a8_amax, t, cfg, dims), r"^(\.LBB\S+?):"),
                              lambda i: i.startswith("v_mfma"))
        counts[how] = [i for i in loop if i.startswith("v_") and not i.startswith("v_mfma")]
    assert any(i.startswith("v_bfe_i32") for i in counts["bfe"])
    assert not any(i.startswith("v_bfe_") for i in counts["swar"])
    assert len(counts["swar"]) <= len(counts["bfe"]) - 16  # 57 vs 77


def test_report_cache_key_follows_the_kdsl_code(monkeypatch):
    """A lowering change (same kernel source, other generated code) must not reuse cached reports."""
    import types

    import bench.step as st
    from ops.moe import moe_stage1_w4a16

    r = types.SimpleNamespace(kernel=moe_stage1_w4a16, config={"BLOCK_N": 64}, dims={"M": 1})
    before = st._report_key(r, "gfx950")
    monkeypatch.setattr(st, "_kdsl_hash", lambda: "another lowering")
    assert st._report_key(r, "gfx950") != before


def _rep(**kw):
    base = {"ok": True, "matrix_instructions": {"v_mfma_f32_16x16x16_bf16": 8}, "matrix_in_main_loop": 8,
            "valu_instructions": 100, "valu_in_main_loop": 40, "num_warps": 4, "occupancy": 8, "spills": 0}
    base.update(kw)
    return base


def test_costmodel_charges_lds_per_cu():
    t = get_target("gfx942")
    no = costmodel.predict(_rep(), t, 304, 56, 1e6, 1e6, "bf16")
    yes = costmodel.predict(_rep(lds_slot_bytes_in_main_loop=18 * 1024 // 64 + 32 * 4), t, 304, 56, 1e6, 1e6, "bf16")
    assert yes["terms"]["lds_us"] > 0 and no["terms"]["lds_us"] == 0
    assert yes["predicted_us"] > no["predicted_us"]
    # the LDS time: bytes per lane x 64 lanes x iterations x waves per CU / 128 B per clock
    lane = 18 * 1024 // 64 + 32 * 4
    want = lane * 64 * 56 * 4 / 128 / (t.clock_ghz * 1e3)
    assert yes["terms"]["lds_us"] == pytest.approx(want, rel=1e-3)


def test_costmodel_overlap_only_when_waves_share_a_simd():
    t = get_target("gfx942")
    one = costmodel.predict(_rep(), t, 304, 10, 1.0, 1.0, "bf16")  # 1 program of 4 warps per CU: 1 wave/SIMD
    many = costmodel.predict(_rep(), t, 304 * 4, 10, 1.0, 1.0, "bf16")  # 4 programs per CU
    assert one["terms"]["waves_sharing_simd"] == 1 and many["terms"]["waves_sharing_simd"] >= 2
    r = one["terms"]
    assert r["compute_us"] * t.clock_ghz * 1e3 == pytest.approx(r["matrix_cycles_per_wave"] + r["valu_cycles_per_wave"], rel=1e-3)


def test_costmodel_extra_bytes_count_in_time_not_floor():
    t = get_target("gfx942")
    a = costmodel.predict(_rep(), t, 304, 1, 5.3e6, 0.0, "bf16")
    b = costmodel.predict(_rep(), t, 304, 1, 5.3e6, 0.0, "bf16", extra_bytes=5.3e6)
    assert a["floor_us"] == b["floor_us"] and b["terms"]["memory_us"] == pytest.approx(2 * a["terms"]["memory_us"])
    assert costmodel.launch_gap_us(t, "graph") < costmodel.launch_gap_us(t, "eager")


def test_mla_split_partials_are_extra_traffic():
    from autotune.problems import extra_bytes, full_dims
    from ops.mla import mla_decode_split

    p = {"QL": 1, "H": 64, "DL": 512, "DR": 64, "PS": 64}
    d = full_dims(mla_decode_split, p, 32, {"BLOCK_M": 16, "BLOCK_N": 64}, get_target("gfx942"))
    assert extra_bytes(mla_decode_split, p, 32, d) == 32 * 64 * d["S"] * 513 * 4


def test_problem_models_live_with_the_kernels():
    code = "import autotune.problems, autotune.store, autotune.search, autotune.costmodel, sys; " \
           "print([m for m in sys.modules if m == 'ops' or m.startswith('ops.')])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from autotune.problems import model_for

    assert model_for("moe_stage1_w4a8").key_dims == ("E", "K", "I", "TOPK")


def test_helper_hash_covers_helpers_not_just_the_kernel():
    """kernel_helpers: the functions and classes a kernel reaches in its package, so that a change to
    any of them marks its tuned files stale."""
    from ops.moe import moe_stage1_w4a8

    h = store.kernel_helpers(moe_stage1_w4a8)
    assert any(n.endswith("_w4a8_gate_up") for n in h) and any(n.endswith("_block_rows") for n in h)
    assert len(store.helpers_hash(moe_stage1_w4a8)) == 16
    # classes the kernel's helpers use (views, packed-operand wrappers) and what their methods reach;
    # a base kernel that is passed a tail reaches none of it
    from ops.gemm_addnorm import kernel_for

    route = store.kernel_helpers(kernel_for(True, True, True, route=True))
    for name in ("ops.gemm_addnorm._Segment", "ops.gemm_addnorm._RouterColumns", "ops.gemm_addnorm._route_tail",
                 "ops.moe.route_and_align", "ops.moe.split_sum"):
        assert name in route, name
    base = store.kernel_helpers(kernel_for(True, True, True))
    assert "ops.gemm_addnorm._addnorm_gemm" in base and not any("route" in n for n in base)


def _doc(arch="gfx942", cu=304, cfg=None, triton_version=None):
    import triton

    return {"schema_version": 1, "kernel": "gemm_bf16", "arch": arch, "problem": {"N": 64, "K": 64},
            "target": {"arch": arch, "cu_count": cu, "triton_version": triton_version or triton.__version__},
            "entries": [{"bucket": 1, "config": cfg or {"BLOCK_N": 16}, "figures": {}}],
            "provenance": {"kernel_source_hash": "x", "mode": "static"}}


def test_lookup_override_dir_then_cu_folder_then_arch(tmp_path, monkeypatch):
    import kdsl as kd
    from ops.gemm import gemm_bf16_kernel as K

    root, over = tmp_path / "root", tmp_path / "over"
    store.save_file(_doc(cfg={"BLOCK_N": 16}), str(root / "gfx942" / store.file_name(K, {"N": 64, "K": 64})))
    store.save_file(_doc(cu=80, cfg={"BLOCK_N": 32}), str(root / "gfx942" / "cu80" / store.file_name(K, {"N": 64, "K": 64})))
    store.clear_cache()
    assert store.lookup_config(K, "gfx942", {"N": 64, "K": 64}, 1, root=str(root))["BLOCK_N"] == 16
    import dataclasses

    mi308 = dataclasses.replace(get_target("gfx942"), cu_count=80)
    with kd.recording(mi308):
        assert store.lookup_config(K, "gfx942", {"N": 64, "K": 64}, 1, root=str(root))["BLOCK_N"] == 32
    with kd.recording(dataclasses.replace(get_target("gfx942"), cu_count=120)):  # no cu120/: the arch folder
        assert store.lookup_config(K, "gfx942", {"N": 64, "K": 64}, 1, root=str(root))["BLOCK_N"] == 16
    store.save_file(_doc(cfg={"BLOCK_N": 64}), str(over / "gfx942" / store.file_name(K, {"N": 64, "K": 64})))
    monkeypatch.setenv(store.OVERRIDE_ENV, str(over))
    store.clear_cache()
    assert store.lookup_config(K, "gfx942", {"N": 64, "K": 64}, 1, root=str(root))["BLOCK_N"] == 64
    store.clear_cache()


def test_lookup_warns_on_another_triton_version(tmp_path):
    from ops.gemm import gemm_bf16_kernel as K

    store.save_file(_doc(triton_version="2.0.0"), str(tmp_path / "gfx942" / store.file_name(K, {"N": 64, "K": 64})))
    store.clear_cache()
    with pytest.warns(UserWarning, match="Triton 2.0.0"):
        store.lookup_config(K, "gfx942", {"N": 64, "K": 64}, 1, root=str(tmp_path))
    store.clear_cache()


def test_killed_writer_leaves_no_temp_file(tmp_path):
    from ops.gemm import gemm_bf16_kernel as K

    d = tmp_path / "gfx942"
    d.mkdir()
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    p.kill()
    p.wait()
    dead = d / f".tmp-{p.pid}-abc.json"
    dead.write_text("{partial")
    live = d / f".tmp-{os.getpid()}-xyz.json"
    live.write_text("{")
    store.save_file(_doc(), str(d / store.file_name(K, {"N": 64, "K": 64})))
    assert not dead.exists() and live.exists()
    assert store.iter_files(str(tmp_path)) == [str(d / store.file_name(K, {"N": 64, "K": 64}))]


@pytest.mark.parametrize("argv, needle", [
    (["tune", "gemm_bf16", "--problem", "N=0,K=64", "--arch", "gfx942", "--out", "OUT"], "N=0"),
    (["tune", "gemm_bf16", "--problem", "N=-4,K=64", "--arch", "gfx942", "--out", "OUT"], "N=-4"),
    (["tune", "gemm_bf16", "--problem", "N=64,K=64", "--arch", "gfx942"], "--out"),
    (["tune", "gemm_bf16", "--problem", "N=64,K=64", "--arch", "gfx942", "--out", "OUT", "--m", "0"], "--m"),
    (["tune", "gemm_bf16", "--problem", "N=64,Q=64", "--arch", "gfx942", "--out", "OUT"], "Q"),
    (["tune", "gemm_bf16", "--problem", "N=64,K=64", "--arch", "gfx000", "--out", "OUT"], "--arch"),
    (["tune", "nope", "--problem", "N=64", "--arch", "gfx942", "--out", "OUT"], "nope"),
    (["tune", "gemm_bf16", "--problem", "N=64,K=64", "--arch", "gfx942", "--out", "OUT", "--budget-s", "nan"], "--budget-s"),
    (["show", "/nonexistent.json"], "nonexistent"),
    (["check", "/nonexistent-dir"], "nonexistent"),
    (["frobnicate"], "frobnicate"),
    (["tune-model", "--config", "/nonexistent.json", "--arch", "gfx942", "--dry-run"], "--config"),
    (["tune-model", "--config", "kimi-k2.5", "--arch", "gfx942", "--tp", "0", "--dry-run"], "--tp"),
])
def test_autotune_cli_bad_input_is_one_line_exit_2(argv, needle, tmp_path, capsys):
    from autotune.__main__ import main

    argv = [str(tmp_path / "o") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and needle in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "o" / "gfx942")


@pytest.mark.aot
def test_tune_writes_only_where_asked(tmp_path, capsys):
    from autotune.__main__ import main

    before = set(store.iter_files())
    assert main(["tune", "rmsnorm", "--problem", "D=512", "--arch", "gfx942", "--m", "1", "--max-candidates", "2",
                 "--workers", "1", "--quiet", "--out", str(tmp_path)]) == 0
    assert os.path.exists(tmp_path / "gfx942" / "rmsnorm__D512.json")
    assert set(store.iter_files()) == before
    assert "M<=1: config=" in capsys.readouterr().out


# ---- the step recorded from the real forward on meta tensors

def _w4a8_stage1(arch: str, E: int, I: int, m: int) -> str:
    """The W4A8 stage-1 kernel fused_experts launches there (its stage2_quant mode, from the tuned files)."""
    from ops import moe

    return moe.W4A8_STAGES[moe.stage2_quant_mode(None, E, 7168, I, 8, m, arch)][0].name


def test_meta_forward_records_the_step():
    from bench.meta_model import HostShadowMode, build_model
    from bench.step import launch_layers, load_model_config, record_step

    cfg = load_model_config("kimi-k2.5", layers=2)
    assert cfg.num_hidden_layers == 2 and cfg.hidden_size == 7168
    mode = HostShadowMode()
    model = build_model(cfg, "w4a8", mode)
    model.add_norm_in_gemm = False                      # the chain: o_proj's partials, their norm, the GEMM
    rec = record_step(cfg, "w4a8", "gfx942", 1, 8192, 1, model, mode)
    names = [r.kernel.name for r in rec.launches]
    s1 = _w4a8_stage1("gfx942", 384, 2048, 1)          # the stage2_quant mode's stage 1 (tuned files' choice)
    assert names.count("mla_decode_split") == 2 and names.count(s1) == 1
    # the router rows ride the shared expert's split-K gate|up GEMM: no gate GEMM of its own
    assert "moe_gate_gemm" not in names
    both = [r.dims["N"] for r in rec.launches if r.kernel.name == "gemm_bf16_splitk" and r.dims["K"] == 7168]
    assert 2 * cfg.moe_intermediate_size * cfg.n_shared_experts + cfg.n_routed_experts in both
    assert names[-1] == "gemm_bf16" and rec.launches[-1].dims["N"] == 163840  # lm_head
    mla = next(r for r in rec.launches if r.kernel.name == "mla_decode_split")
    assert mla.dims["B"] == 1 and mla.dims["QL"] == 1 and mla.dims["MP"] >= 8192 // 64
    assert len(rec.mode.ops) > 0 and rec.mode.device_reads == []
    layers = launch_layers(rec)
    # the step's bookkeeping, embeddings and first norm: one launch before layer 0 (ops.step_prologue)
    assert names[0] == "step_prologue" and layers[0] is None and layers[1] == 0 and layers[-1] is None and 1 in layers
    assert names.count("rmsnorm") == 0 and sorted(o.name for o in rec.mode.ops) == ["_to_copy", "copy_"]
    assert any(e["hit"] for e in rec.lookups)
    assert model.embed.device.type == "meta" and model.lm_head.dense.device.type == "meta"  # no weight memory
    # o_proj with the residual-add norm (+ int8 quant) in its last programs: one launch fewer per layer
    model.o_proj_norm = True
    fused = [r.kernel.name for r in record_step(cfg, "w4a8", "gfx942", 1, 8192, 1, model, mode).launches]
    assert fused.count("gemm_bf16_splitk_norm_quant") == 1 and fused.count("gemm_bf16_splitk_norm") == 1
    assert "rmsnorm_add_quant_splitk" not in fused and "rmsnorm_add_splitk" not in fused
    assert len(fused) == len(names) - 2
    # the default ("auto", the tuned files: it pays for a batch-1 cache on gfx942): the post-attention add,
    # norm and quant in the prologue of the shared gate|up + router GEMM, over o_proj's 4 partials,
    model.o_proj_norm, model.add_norm_in_gemm = "auto", "auto"
    rec = record_step(cfg, "w4a8", "gfx942", 1, 8192, 1, model, mode)
    first = [(r.kernel.name, r.dims.get("S")) for r in rec.launches]
    assert ("gemm_bf16_addnorm_splitk_yq_route", 4) in first and len(first) == len(names) - 2
    assert not {"rmsnorm_add_quant_splitk", "gemm_bf16_splitk_norm_quant"} & {n for n, _ in first}
    # ... and its last program routes the token (route_tail_pays at 1 row): no moe_route_align launch
    assert "moe_route_align" not in {n for n, _ in first}


def test_meta_forward_mxfp4_experts():
    """The MXFP4 (W4A4) checkpoint layout runs its own MoE kernels in the recorded step."""
    from bench.meta_model import HostShadowMode, build_model
    from bench.step import load_model_config, record_step

    cfg = load_model_config("kimi-k2.5", layers=2)
    mode = HostShadowMode()
    rec = record_step(cfg, "mxfp4", "gfx950", 1, 8192, 1, build_model(cfg, "mxfp4", mode), mode)
    names = [r.kernel.name for r in rec.launches]
    assert names.count("moe_stage1_mxfp4") == 1 and names.count("moe_stage2_mxfp4") == 1
    assert "quant_mxfp4" in names and not any(n.startswith("moe_stage1_w4a") for n in names)
    assert rec.mode.device_reads == []


def test_tp_step_is_rank0_of_the_parallel_model():
    """--tp builds rank 0 of the real tensor-parallel model: per-GPU kernel shapes and the forward's
    own collectives (two all-reduces per layer, the logits' all-gather), costed."""
    from bench.meta_model import HostShadowMode, build_model
    from bench.step import cost_step, launch_layers, load_model_config, record_step

    cfg = load_model_config("kimi-k2.5", tp=8, moe_parallel="ep", layers=2)
    assert cfg.num_attention_heads == 64                      # the full config; the plan splits it
    for moe, want in (("ep", {"E": 48, "I": 2048}), ("tp", {"E": 384, "I": 256})):
        mode = HostShadowMode()
        model = build_model(cfg, "w4a8", mode, 8, moe)
        model.route_in_gemm = False          # the route's own launch (test_route_tail_where_it_pays: in the GEMM)
        rec = record_step(cfg, "w4a8", "gfx942", 1, 8192, 1, model, mode)
        by = {}
        for r in rec.launches:
            by.setdefault(r.kernel.name, []).append(r.dims)
        assert {d["H"] for d in by["mla_decode_split"]} == {8}
        fused = "moe_route_align_local" if moe == "ep" else "moe_route_align"  # one token: route + align, one launch
        route = by[fused]
        assert route[0]["E"] == 384                           # the router stays replicated
        s1 = by[_w4a8_stage1("gfx942", want["E"], want["I"], 1)][0]
        assert (s1["E"], s1["I"]) == (want["E"], want["I"])
        assert by["gemm_bf16"][-1]["N"] == 163840 // 8        # vocab-parallel lm_head
        kinds = [(c.kind, c.layer) for c in rec.mode.collectives]
        assert kinds == [("all_reduce", 0), ("all_reduce", 0), ("all_reduce", 1), ("all_reduce", 1), ("all_gather", None)]
        # the fused path at world 8: no torch op in a layer (the all-reduces are the only non-kdsl work);
        # EP local ids come out of the route kernel, the rank's share out of the shared expert's down
        # GEMM's epilogue (gemm_bf16_swiglu_rank: no moe_combine_rank launch)
        assert [op.name for op in rec.mode.ops if op.layer is not None] == []
        moe_layer = [r.kernel.name for r, l in zip(rec.launches, launch_layers(rec)) if l == 1]
        assert moe_layer[-2:] == ["gemm_bf16_swiglu_rank", "rmsnorm_add"]   # the all-reduce runs between them
        assert fused in moe_layer and not {"moe_route", "moe_route_local", "moe_align_one"} & set(moe_layer)
        assert not {"moe_sum_ids", "moe_combine_norm", "moe_combine_rank", "gemm_bf16_swiglu", "rmsnorm"} \
            & set(moe_layer)
        assert rec.mode.collectives[0].nbytes == 7168 * 2 and rec.mode.collectives[-1].nbytes == 163840 // 8 * 4
        items = cost_step(dataclasses.replace(rec, launches=[]), cfg, "gfx942", 8192, tp=8)   # no AOT compiles
        links = [it for it in items if it.kind == "allreduce"]
        assert len(links) == 5 and all(it.predicted_us > it.floor_us > 0 for it in links)
    with pytest.raises(ValueError, match="--tp 5"):
        load_model_config("kimi-k2.5", tp=5)


def test_tp_layer_starts_with_the_add_norm_gemm_where_it_pays():
    """World size > 1: a MoE layer followed by another ends at its all-reduce, and the next layer's
    q_a|kv_a GEMM adds the residual and norms (gemm_bf16_addnorm: no rmsnorm_add launch) where the
    tuned files say it pays for every size up to the cache's slots x MAX_Q_LEN rows (batch 1 on
    gfx942), not for a batch-32 cache (128 rows: the chain), nor with add_norm_in_gemm False."""
    from bench.meta_model import HostShadowMode, build_model
    from bench.step import launch_layers, load_model_config, record_step

    cfg = load_model_config("kimi-k2.5", tp=8, layers=3)

    def layer_kernels(batch: int, fold: bool | str) -> dict[int, list[str]]:
        mode = HostShadowMode()
        model = build_model(cfg, "w4a8", mode, 8, "tp")
        model.add_norm_in_gemm = fold
        rec = record_step(cfg, "w4a8", "gfx942", batch, 8192, 4, model, mode)
        out: dict[int, list[str]] = {}
        for r, layer in zip(rec.launches, launch_layers(rec)):
            out.setdefault(layer, []).append(r.kernel.name)
        return out

    fold = layer_kernels(1, "auto")      # after the dense layer 0 and after the MoE layer 1
    assert fold[0][-1] == "gemm_bf16_swiglu" and fold[1][0] == "gemm_bf16_addnorm"
    assert fold[1][-1] == "gemm_bf16_swiglu_rank" and fold[2][0] == "gemm_bf16_addnorm"
    assert "rmsnorm_add" not in fold[1] and fold[2][-1] == "rmsnorm_add"   # the last layer: the final norm
    chain = layer_kernels(1, False)
    assert chain[1][:2] == chain[2][:2] == ["rmsnorm_add", "gemm_bf16_splitk"]
    halves = sum("gemm_bf16_addnorm_yq" in fold[layer] for layer in (1, 2))   # where the MoE half's pays too
    assert sum(map(len, chain.values())) == sum(map(len, fold.values())) + 2 + halves
    wide = layer_kernels(32, "auto")
    assert wide[1][0] == wide[2][0] == "rmsnorm_add"
    assert not any(name.startswith("gemm_bf16_addnorm") for names in wide.values() for name in names)
    # tune-model tunes both paths whichever the recorded step took (the chain's kernels launch elsewhere too)
    from bench.step import _with_add_norm_paths

    assert [(k.name, p) for k, p, _ in _with_add_norm_paths([], cfg, 8, "w4a8", "gfx942")] == [
        ("gemm_bf16_addnorm", {"N": 2112, "K": 7168}), ("gemm_bf16_addnorm_yq", {"N": 896, "K": 7168})]
    assert [(k.name, p) for k, p, _ in _with_add_norm_paths([], cfg, 4, "w4a16", "gfx942")] == [
        ("gemm_bf16_addnorm", {"N": 2112, "K": 7168}), ("gemm_bf16_addnorm_y", {"N": 1408, "K": 7168})]
    for arch, s in (("gfx942", 4), ("gfx950", 2)):       # world size 1: o_proj's S partials in
        assert [(k.name, p) for k, p, _ in _with_add_norm_paths([], cfg, 1, "w4a8", arch)] == [
            ("rmsnorm_add_quant_splitk", {"D": 7168, "S": s}), ("gemm_bf16_addnorm_splitk_yq", {"N": 4480, "K": 7168, "S": s})]


@pytest.mark.parametrize("experts,fused,norm", [("w4a16", "gemm_bf16_addnorm_y", "rmsnorm_add"),
                                                ("w4a8", "gemm_bf16_addnorm_yq", "rmsnorm_add_quant")])
def test_tp_moe_half_starts_with_the_add_norm_gemm(experts, fused, norm):
    """World size > 1: the post-attention residual add and norm run in the shared gate|up + router
    GEMM's prologue too (gemm_bf16_addnorm_y storing the normed rows stage 1 reads; W4A8: _yq, with
    their per-token int8 quant): a MoE layer between two others has no rmsnorm_add(_quant) launch at
    all, two launches fewer than the chains (TP8 and EP8)."""
    from bench.meta_model import HostShadowMode, build_model
    from bench.step import launch_layers, load_model_config, record_step

    for moe in ("tp", "ep"):
        cfg = load_model_config("kimi-k2.5", tp=8, moe_parallel=moe, layers=3)
        got = {}
        for fold in (True, False):
            mode = HostShadowMode()
            model = build_model(cfg, experts, mode, 8, moe)
            model.add_norm_in_gemm, model.route_in_gemm = fold, False
            rec = record_step(cfg, experts, "gfx950", 1, 8192, 1, model, mode)
            got[fold] = [(r.kernel.name, r.dims.get("N")) for r, layer in zip(rec.launches, launch_layers(rec))
                         if layer == 1]
        names = [n for n, _ in got[True]]
        assert (fused, 896) in got[True] and not {"rmsnorm_add", "rmsnorm_add_quant"} & set(names)
        assert names.index(fused) + 1 == names.index("moe_route_align" + ("_local" if moe == "ep" else ""))
        assert len(got[False]) == len(got[True]) + 2 and ("gemm_bf16_splitk", 896) in got[False]
        assert norm in [n for n, _ in got[False]]


def test_bench_step_cli_bad_input(capsys):
    from bench.step import main

    for argv in (["--batch", "0"], ["--arch", "gfx1"], ["--experts", "fp4"], ["--q-lens", "x"], ["--config", "/nope.json"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("bench.step:")


def test_bench_step_json_and_plot(monkeypatch, capsys, tmp_path):
    """The whole CLI on a 2-layer record, with AOT reports stubbed (the compile is covered above)."""
    import bench.step as st

    fake = {"ok": True, "matrix_instructions": {"v_mfma_f32_16x16x16_bf16": 4}, "matrix_in_main_loop": 4,
            "valu_instructions": 50, "valu_in_main_loop": 10, "num_warps": 4, "occupancy": 4, "spills": 0,
            "lds_slot_bytes_in_main_loop": 64}
    monkeypatch.setattr(st, "compile_reports",
                        lambda launches, arch, workers=None, log=None: {st._report_key(r, arch): fake for r in launches})
    png = tmp_path / "step.png"
    argv = ["--layers", "2", "--arch", "gfx942", "--experts", "w4a8", "--q-lens", "1,4", "--json", "--no-measure"]
    try:
        import matplotlib  # noqa: F401
        argv += ["--plot", str(png)]
    except ImportError:
        pass
    assert st.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layers"] == 61 and doc["layers_recorded"] == 2 and doc["assumptions"]["launch_gap_us"]
    d1, d4 = doc["steps"]
    assert (d1["q_len"], d4["q_len"]) == (1, 4)
    for s in (d1, d4):
        assert s["kdsl_launches"] > 61 * 10 and s["torch_launches"] > 0
        assert s["predicted_us"] > s["floor_us"] > 0 and s["gaps_us"] == pytest.approx(2.0 * s["launches"], rel=0.02)
        # kernels at their floor plus the same gaps (no collectives at TP1): between the floor and the prediction
        assert s["launch_bound_ratio"] == pytest.approx((s["kernels_floor_us"] + s["gaps_us"]) / s["floor_us"])
        assert 1.0 < s["launch_bound_ratio"] < s["ratio"]
        # W4A8 MoE layer: the shared gate|up + router GEMM with the post-attention norm+quant in its
        # prologue (gemm_bf16_addnorm_splitk_yq: it pays for a batch-1 cache on gfx942) and route+align
        # in its last program (_route: it pays at 1 and 4 rows), stage 1, quant (not with stage2_quant
        # "amax", the tuned files' choice on gfx942 at q_len 1 and 4), stage 2, shared down,
        # combine+norm, and the 6 MLA launches; the only MoE layer of this record also holds the dense
        # layer's closing rmsnorm_add: 11 + 1
        assert s["launches_per_layer"]["moe"]["kdsl"] == 12 and len(s["top"]) == 10
        assert all(f["why"] in ("fallback", "no lookup") for f in s["fallbacks"])
        # the MoE half looks up and finds tuned configs for every launch (align kernels included)
        assert not {"moe_align_one", "moe_combine_norm", "rmsnorm_add_quant",
                    "gemm_bf16_splitk", "gemm_bf16_swiglu"} & {f["name"] for f in s["fallbacks"]}
    if "--plot" in argv:
        assert png.stat().st_size > 10000


def test_tune_model_dry_run_lists_the_step_problems(capsys):
    from autotune.__main__ import main

    assert main(["tune-model", "--config", "kimi-k2.5", "--arch", "gfx942", "--dry-run", "--q-lens", "1"]) == 0
    out = capsys.readouterr().out
    # N=4480: the shared expert's gate|up rows and the router's rows as one split-K GEMM, then SiLU*up
    # and down over its 4 splits; N=2112: q_a|kv_a as one split-K GEMM (after a MoE layer with the input
    # norm in its prologue, the layer before ending in its shared expert's down GEMM with moe_combine_add's
    # work in the epilogue: gemm_bf16_swiglu_combine; the last MoE layer keeps gemm_bf16_swiglu and
    # moe_combine_norm); o_proj split along K, its
    # partials summed by the residual norm (the tuned split count in the key)
    for want in ("gemm_bf16_splitk N=4480,K=7168", "gemm_bf16_swiglu N=7168,I=2048,S=4", "gemm_bf16_splitk N=2112,K=7168",
                 "gemm_bf16_rmsnorm N=2112,K=7168", "gemm_bf16_splitk N=7168,K=8192",
                 "mla_decode_split QL=1,H=64,DL=512,DR=64,PS=64",
                 f"{_w4a8_stage1('gfx942', 384, 2048, 1)} E=384,K=7168,I=2048,TOPK=8",
                 "rmsnorm_add_quant_splitk D=7168,S=4", "gemm_bf16_swiglu_combine N=7168,I=2048,S=4,TOPK=8",
                 "moe_combine_norm D=7168,TOPK=8",
                 "moe_route_align E=384,TOPK=8,NG=1,EA=384,BM=16", "gemm_bf16 N=163840,K=7168"):
        assert want in out
    # both W4A8 stage-2 quant paths are tuned, whichever the recorded step took: the model picks the
    # faster from the files of both (ops.moe.amax_pays), so an arch with no files must get both
    for want in ("moe_stage1_w4a8_amax E=384,K=7168,I=2048,TOPK=8", "moe_stage2_w4a8_aq E=384,H=7168,I=2048,TOPK=8",
                 "moe_stage1_w4a8 E=384,K=7168,I=2048,TOPK=8", "moe_stage2_w4a8_pq E=384,H=7168,I=2048,TOPK=8",
                 "quant_per_token_int8 K=2048"):
        assert f"  {want}\n" in out
    # both paths of o_proj's residual-add norm too (ops.splitk_norm.fused_pays reads both)
    assert "  gemm_bf16_splitk_norm_quant D=7168,K=8192\n" in out and "  gemm_bf16_splitk_norm D=7168,K=8192\n" in out
    # the step is recorded at 128 tokens too: from 8 tokens routing and aligning run apart, and the
    # align kernels' M counts routed pairs (top-8: 1024 at 128 tokens), so they get buckets past 128
    assert "  moe_route E=384,TOPK=8\n" in out
    for k in ("moe_align_blocks E=384,BM=16", "moe_align_scatter E=384"):
        assert f"  {k}  (+ buckets 256,512,1024: up to 1024 rows)\n" in out
    assert "  gemm_bf16_splitk N=4480,K=7168\n" in out          # a token-M launch: buckets up to 128 only


def test_ep_tuning_scores_the_ranks_share(capsys, tmp_path):
    """tune-model --moe-parallel ep hands the routed-expert stages EALL (the experts of all ranks), so
    they are tuned for the rank's expected share of the rows, keyed and filed as before; `tune`
    accepts it as a model-only dim, scores with it and records it in the file."""
    from autotune import search
    from autotune.__main__ import main
    from autotune.store import file_name
    from ops import moe

    s1 = _w4a8_stage1("gfx942", 48, 2048, 1)
    assert main(["tune-model", "--config", "kimi-k2.5", "--arch", "gfx942", "--tp", "8", "--moe-parallel", "ep",
                 "--dry-run", "--q-lens", "1", "--only", f"{s1},moe_route_align_local"]) == 0
    out = capsys.readouterr().out
    assert f"{s1} E=48,K=7168,I=2048,TOPK=8,EALL=384" in out and "moe_route_align_local E=384,TOPK=8,NG=1,EA=48,BM=16,EALL=384\n" in out
    prob = {"E": 48, "K": 7168, "I": 2048, "TOPK": 8}
    assert file_name(moe.moe_stage1_w4a8, {**prob, "EALL": 384}) == file_name(moe.moe_stage1_w4a8, prob)
    rows = {}
    for extra in ({}, {"EALL": 384}):
        _, doc = search.tune(moe.moe_stage1_w4a8, "gfx942", {**prob, **extra}, [2], max_candidates=2, workers=1,
                             progress=False, write=False, out=str(tmp_path))
        assert doc["problem"] == prob and doc["provenance"].get("model_dims", {}) == extra
        rows[bool(extra)] = doc["entries"][0]["figures"]
    assert rows[True]["floor_us"] < rows[False]["floor_us"] / 4     # 2 of 16 rows' experts on this rank


# ---- the EAGLE-3 draft step (bench.step --model draft|both, tune-model --model draft)

def test_draft_step_records_on_meta():
    """The real Eagle3Draft.step on meta: the extend (q_len 4, aux rows: fc runs) and the single-row
    step (carried state: no fc), at the Kimi-K2.5 draft's shapes, 0 device reads, every lookup tuned."""
    from bench.meta_model import build_draft
    from bench.step import load_draft_config, record_draft_step

    dcfg = load_draft_config("kimi-k2.5-eagle3")
    assert (dcfg.hidden_size, dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim) == (7168, 64, 64, 128)
    draft = build_draft(dcfg)
    assert draft.embed.device.type == "meta" and draft.lm_head.dense.device.type == "meta"   # no weight memory
    for ql, arch in ((4, "gfx942"), (1, "gfx950")):
        rec = record_draft_step(dcfg, arch, 1, 8192, ql, draft)
        names = [r.kernel.name for r in rec.launches]
        gemms = [(r.dims["N"], r.dims["K"], r.dims["M"]) for r in rec.launches if r.kernel.name == "gemm_bf16"]
        fc = [(7168, 3 * 7168, ql)] if ql > 1 else []
        assert gemms == fc + [(8192, 14336, ql)] * 3 + [(7168, 8192, ql), (163840, 7168, ql)]
        # the MLP: its gate|up split along K, then SiLU*up and the down GEMM over the splits
        gu = [(r.dims["N"], r.dims["K"]) for r in rec.launches if r.kernel.name == "gemm_bf16_splitk"]
        down = [(r.dims["N"], r.dims["I"]) for r in rec.launches if r.kernel.name == "gemm_bf16_swiglu"]
        assert gu == [(24576, 7168)] and down == [(7168, 12288)]
        assert names.count("rope_neox") == 2 and names.count("mha_cache_append") == 1 and "silu_mul" not in names
        att = next(r for r in rec.launches if r.kernel.name == "mha_decode")
        assert (att.dims["QL"], att.dims["HQ"], att.dims["KVH"], att.dims["D"], att.dims["PS"]) == (ql, 64, 64, 128, 64)
        assert att.dims["MP"] >= 8192 // 64
        assert rec.mode.device_reads == [] and len(rec.mode.ops) > 0
        # both norms write their half of the attention's input row: no concatenation launch
        assert [o.name for o in rec.mode.ops] == ["copy_", "_to_copy"]
        assert rec.lookups and all(e["hit"] for e in rec.lookups), [e for e in rec.lookups if not e["hit"]]


def test_bench_step_both_has_the_spec_step(monkeypatch, capsys):
    """--model both: target rows, draft rows and one spec-step line per arch and format (AOT reports
    stubbed as in test_bench_step_json_and_plot)."""
    import bench.step as st

    fake = {"ok": True, "matrix_instructions": {"v_mfma_f32_16x16x16_bf16": 4}, "matrix_in_main_loop": 4,
            "valu_instructions": 50, "valu_in_main_loop": 10, "num_warps": 4, "occupancy": 4, "spills": 0,
            "lds_slot_bytes_in_main_loop": 64}
    monkeypatch.setattr(st, "compile_reports",
                        lambda launches, arch, workers=None, log=None: {st._report_key(r, arch): fake for r in launches})
    argv = ["--model", "both", "--layers", "2", "--arch", "gfx942", "--experts", "w4a8", "--q-lens", "1", "--json",
            "--no-measure"]
    assert st.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "both" and doc["draft_steps"] == 3
    rows = {(s["model"], s["q_len"]): s for s in doc["steps"]}
    assert set(rows) == {("target", 1), ("target", 4), ("draft", 1), ("draft", 4)}   # q_len k+1 added for the spec step
    d1, d4 = rows[("draft", 1)], rows[("draft", 4)]
    assert d1["kdsl_launches"] == 16 and d4["kdsl_launches"] == 17 and d1["device_reads"] == 0
    assert d1["launches_per_layer"]["draft"]["kdsl"] == 16 and d4["hidden"] == "aux"
    (sp,) = doc["spec_steps"]
    assert (sp["arch"], sp["experts"], sp["k"]) == ("gfx942", "w4a8", 3)
    assert [(p["what"], p["q_len"], p["count"]) for p in sp["parts"]] == [
        ("target verify", 4, 1), ("draft", 1, 2), ("draft extend", 4, 1)]
    want = rows[("target", 4)]["predicted_us"] + 2 * d1["predicted_us"] + d4["predicted_us"]
    assert sp["predicted_us"] == pytest.approx(want) and sp["predicted_us"] > sp["floor_us"] > 0
    assert sp["plain_decode_us"] == rows[("target", 1)]["predicted_us"]
    assert all(v == pytest.approx(sp["predicted_us"] / float(n.split("accept ")[1].rstrip(")")))
               for n, v in sp["per_token_us"].items())


def test_draft_flags_bad_input_is_one_line_exit_2(capsys, tmp_path):
    from autotune.__main__ import main as autotune_main
    from bench.meta_model import KIMI_K25_CONFIG
    from bench.step import main

    target_json = tmp_path / "target.json"
    target_json.write_text(json.dumps(KIMI_K25_CONFIG))
    for argv, needle in ((["--model", "drafts"], "--model"), (["--model", "both", "--draft-steps", "0"], "--draft-steps"),
                         (["--model", "draft", "--draft-config", "/nope.json"], "--draft-config"),
                         (["--model", "draft", "--draft-config", str(target_json)], "--draft-config"),
                         (["--model", "draft", "--tp", "8"], "--tp")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("bench.step:") and needle in err, err
    for argv, needle in ((["tune-model", "--arch", "gfx942", "--dry-run"], "--config"),
                         (["tune-model", "--model", "draft", "--tp", "2", "--arch", "gfx942", "--dry-run"], "--tp"),
                         (["tune-model", "--model", "draft", "--draft-config", "/nope.json", "--arch", "gfx942",
                           "--dry-run"], "--draft-config")):
        assert autotune_main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and needle in err, err


def test_tune_model_draft_dry_run_lists_the_draft_problems(capsys, tmp_path):
    """tune-model --model draft lists the draft's own problems and leaves the ones the target's step
    launches too (lm_head) to --model target; its o_proj (gemm_bf16 N=7168 K=8192) is its own (the
    target's TP1 o_proj is split along K), and so are its norms and its step prologue (the target's first
    norm runs in its own prologue, at another rope width); a draft config.json path works too."""
    from autotune.__main__ import main
    from bench.meta_model import KIMI_K25_EAGLE3_CONFIG

    path = tmp_path / "config.json"
    path.write_text(json.dumps(KIMI_K25_EAGLE3_CONFIG))
    assert main(["tune-model", "--model", "draft", "--draft-config", str(path), "--arch", "gfx942", "--dry-run",
                 "--q-lens", "1"]) == 0
    out = capsys.readouterr().out
    for want in ("gemm_bf16 N=8192,K=14336", "gemm_bf16_splitk N=24576,K=7168", "gemm_bf16_swiglu N=7168,I=12288,S=4",
                 "mha_decode QL=1,HQ=64,KVH=64,D=128,PS=64", "rope_neox H=64,R=128", "gemm_bf16 N=7168,K=8192",
                 "rmsnorm D=7168", "step_prologue H=7168,R2=64"):
        assert f"  {want}\n" in out
    for shared in ("gemm_bf16 N=163840,K=7168",):
        assert f"left to --model target: {shared}" in out


def test_layer_weights_stand_for_every_layer_once():
    """Recorded layers scale to the config's count: the weights add up to it; with 3+ MoE layers
    recorded the first MoE layer and the last (final norm) count once, the middle ones the rest."""
    from bench.step import layer_weights

    w = layer_weights(4, 1, 61)
    assert [w(i) for i in range(4)] == [1.0, 1.0, 58.0, 1.0] and w(None) == 1.0
    w = layer_weights(6, 1, 61)
    assert sum(w(i) for i in range(6)) == 61 and w(1) == w(5) == 1.0 and w(2) == w(3) == w(4)
    w = layer_weights(3, 1, 61)  # too few to tell the middle apart: an equal share each
    assert [w(i) for i in range(3)] == [1.0, 30.0, 30.0]
    w = layer_weights(4, 1, 4)  # nothing to scale
    assert [w(i) for i in range(4)] == [1.0] * 4


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("batch, q_len", [(1, 1), (2, 4)])
def test_mla_split_launch_the_step_records_is_the_one_the_tuner_scores(arch, batch, q_len):
    """The tuner scores mla_decode_split at the nominal context; the step at that context launches
    over a table that also holds its q_len new tokens (8192 + q_len -> 129 pages -> 33 splits of
    256, not 32). The problem model's split count, table width and grid must be the recorded ones,
    both as the tuner sees the problem (no CTX) and as bench.step scores it (CTX = ctx + q_len)."""
    from autotune.problems import NOMINAL_CTX, full_dims, m_of, strip_m
    from bench.meta_model import HostShadowMode
    from bench.step import load_model_config, record_step

    cfg = load_model_config("kimi-k2.5", layers=1)
    rec = record_step(cfg, "w4a8", arch, batch, NOMINAL_CTX, q_len, mode=HostShadowMode())
    r = next(r for r in rec.launches if r.kernel.name == "mla_decode_split")
    k, t = r.kernel, get_target(arch)
    m = m_of(k, r.dims)
    assert m == batch * q_len and r.dims["S"] == 33
    for prob in (strip_m(k, r.dims), {**strip_m(k, r.dims), "CTX": NOMINAL_CTX + q_len}):
        static = {d: v for d, v in full_dims(k, prob, m, None, t).items() if d in k.static}
        sp = k.specialize(dict(r.config), t, static)
        d = full_dims(k, prob, m, sp.config, t)
        assert {x: d[x] for x in ("B", "QL", "H", "MP", "S")} == {x: r.dims[x] for x in ("B", "QL", "H", "MP", "S")}
        assert sp.grid_size(d) == tuple(r.grid)
