"""Autotune: buckets, the config store (lookup order, warnings, strict mode, schema errors, atomic
writes), search-space pruning and reproducibility, the static cost model's rooflines, and
`check` over the committed configs."""
from __future__ import annotations

import json
import math
import os
import warnings

import pytest

import kdsl as kd
from autotune import buckets, costmodel, store
from autotune.problems import full_dims, model_for, parse_problem, problem_key
from autotune.space import build
from kdsl.targets import get_target


@kd.kernel(name="at_test_gemm_i8", example={"M": 16, "N": 256, "K": 512})
def at_test_gemm_i8(x: kd.In["M", "K", kd.i8], w: kd.In["N", "K", kd.i8], out: kd.Out["M", "N", kd.i32]):
    """int8 GEMM used by the autotune tests (a BLOCK_K rule to prune by)."""
    m, n = kd.grid(kd.tile("M", "BLOCK_M", domain=(16, 32, 64, 128, 256), default=16),
                   kd.tile("N", "BLOCK_N", domain=(16, 32, 64, 128, 256), default=64))
    bk = kd.tunable("BLOCK_K", (16, 32, 64, 128, 256), 64)
    kd.require(bk % 32 == 0, "BLOCK_K must be a multiple of 32", "BLOCK_K")
    acc = kd.fold(kd.tiles("K", block="BLOCK_K"), kd.zeros((m, n), kd.i32), lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))
    out[m, n] = acc


K = at_test_gemm_i8
PROB = {"N": 256, "K": 512}


def _doc(entries, arch="gfx942", kernel="at_test_gemm_i8", problem=None):
    return {"schema_version": store.SCHEMA_VERSION, "kernel": kernel, "arch": arch,
            "problem": dict(problem or PROB),
            "target": {"arch": arch, "device_name": "x", "cu_count": 304, "triton_version": "3.9"},
            "entries": [{"bucket": b, "config": c, "figures": {"predicted_us": 1.0}} for b, c in entries],
            "provenance": {"kernel_source_hash": store.kernel_source_hash(K), "mode": "static", "seed": 0}}


def _write(root, doc, name=None):
    arch = "gfx942" if isinstance(doc, str) else doc["arch"]
    path = os.path.join(root, arch, name or store.file_name(K, doc["problem"]))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    return path


# ---- buckets -----------------------------------------------------------------------------------

def test_bucket_ladder():
    assert buckets.LADDER[0] == 1 and buckets.LADDER[-1] == 8192 and buckets.BUCKETS[-1] == "any"
    assert [buckets.bucket_for(m) for m in (1, 2, 3, 4, 5, 16, 17, 8192, 8193)] == [1, 2, 4, 4, 8, 16, 32, 8192, "any"]
    with pytest.raises(ValueError):
        buckets.bucket_for(0)
    with pytest.raises(ValueError):
        buckets.parse_bucket(3)


def test_problem_key_and_parse():
    assert parse_problem("N=2048,K=7168") == {"N": 2048, "K": 7168}
    assert problem_key("gemm_w4a8", {"K": 7168, "N": 2048, "M": 3}) == "N2048_K7168"
    assert full_dims("gemm_w4a16", {"N": 64, "K": 256}, 4) == {"N": 64, "K": 256, "G": 8, "M": 4}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_problem("N2048")


def test_moe_problem_model_keys_on_expert_shapes():
    """MoE stages key on (E, K|H, I, TOPK): the M-dependent block dims are derived from M and the
    config's BLOCK_M exactly as fused_experts launches, and only the touched experts' weights count."""
    from autotune.problems import model_for
    from ops.problems import experts_touched

    p1 = {"E": 384, "K": 7168, "I": 2048, "TOPK": 8}
    launch = {**p1, "M": 4, "N2": 4096, "S": 999, "NB": 9}  # what an op might pass: extra dims are ignored
    assert problem_key("moe_stage1_w4a8", launch) == "E384_K7168_I2048_TOPK8"
    assert problem_key("moe_stage2_w4a8_pq", {"E": 384, "H": 7168, "I": 2048, "TOPK": 8, "T": 8}) == \
        "E384_H7168_I2048_TOPK8"
    d = full_dims("moe_stage1_w4a8", p1, 4, {"BLOCK_M": 32})
    # the most blocks T rows can fill, K + (T - K) // BLOCK_M with K = min(E, T) (ops.moe.aligned_blocks)
    assert (d["T"], d["NB"], d["S"], d["N2"]) == (32, 32 + 0, 32 * 32, 4096)
    d2 = full_dims("moe_stage2_w4a8_pq", {"E": 16, "H": 64, "I": 32, "TOPK": 4}, 10, {"BLOCK_M": 16})
    assert (d2["T"], d2["NB"], d2["MO"], d2["P"]) == (40, 16 + 24 // 16, 10, 40)
    pm = model_for("moe_stage1_w4a8")
    assert experts_touched(p1, 1) == pytest.approx(8)
    weights = 8 * (4096 * 7168 / 2 + 4096 * 4)
    assert pm.bytes_fn(p1, 1) == pytest.approx(weights + 7168 + 4 + 8 * 2048 * 2)
    assert pm.flops_fn(p1, 1) == 2.0 * 8 * 4096 * 7168 and pm.peak_dtype == "i8"


# ---- lookup ------------------------------------------------------------------------------------

def test_lookup_order_smallest_bucket_then_any(tmp_path):
    store.clear_cache()
    root = str(tmp_path)
    _write(root, _doc([(1, {"BLOCK_N": 16}), (4, {"BLOCK_N": 32}), (64, {"BLOCK_N": 64}), ("any", {"BLOCK_N": 128})]))
    look = lambda m: store.lookup_config(K, "gfx942", {**PROB, "M": m}, m, root=root)  # noqa: E731
    assert look(1) == {"BLOCK_N": 16}
    assert look(2) == {"BLOCK_N": 32}  # bucket 2 not tuned: next bucket up
    assert look(4) == {"BLOCK_N": 32}
    assert look(5) == {"BLOCK_N": 64}
    assert look(65) == {"BLOCK_N": 128}  # past the largest tuned bucket: "any"
    assert look(100000) == {"BLOCK_N": 128}
    # by name as well as by Kernel; the result is a copy
    cfg = store.lookup_config("at_test_gemm_i8", "gfx942", PROB, 1, root=root)
    cfg["BLOCK_N"] = 0
    assert store.lookup_config("at_test_gemm_i8", "gfx942", PROB, 1, root=root) == {"BLOCK_N": 16}


def test_lookup_default_warns_once_and_strict_raises(tmp_path):
    store.clear_cache()
    root = str(tmp_path)
    with pytest.warns(UserWarning, match=store.file_name(K, PROB)):
        assert store.lookup_config(K, "gfx950", PROB, 4, root=root) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.lookup_config(K, "gfx950", PROB, 8, root=root) == {}  # no second warning
    with pytest.raises(store.NoTunedConfig, match="searched .*gfx950"):
        store.lookup_config(K, "gfx950", PROB, 4, strict=True, root=root)
    # a file without a bucket >= M and without "any": defaults (strict raises)
    _write(root, _doc([(1, {"BLOCK_N": 16})], arch="gfx942"))
    with pytest.warns(UserWarning, match="no bucket >= M"):
        assert store.lookup_config(K, "gfx942", PROB, 4, root=root) == {}
    with pytest.raises(store.NoTunedConfig):
        store.lookup_config(K, "gfx942", PROB, 4, strict=True, root=root)
    assert store.lookup_config(K, "interpret", PROB, 4, root=root) == {}  # CPU interpreter: silent defaults


# ---- schema errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("mutate,field", [
    (lambda d: "{not json", "<json>"),
    (lambda d: {**d, "schema_version": 99}, "schema_version"),
    (lambda d: {**d, "arch": "gfx1100"}, "arch"),
    (lambda d: {**d, "kernel": "no_such_kernel"}, "kernel"),
    (lambda d: {**d, "problem": {"N": 256}}, "problem.K"),
    (lambda d: {k: v for k, v in d.items() if k != "problem"}, "problem"),
    (lambda d: {**d, "entries": [{"bucket": 3, "config": {}, "figures": {}}]}, "entries[0].bucket"),
])
def test_schema_errors_name_file_and_field(tmp_path, mutate, field):
    d = mutate(_doc([(1, {})]))
    path = _write(str(tmp_path), d if isinstance(d, str) else d, name="f.json")
    with pytest.raises(store.ConfigFileError) as ei:
        store.load_file(path, known_kernels={"at_test_gemm_i8": K})
    msg = str(ei.value)
    assert path in msg and repr(field) in msg, msg
    assert ei.value.field == field


def test_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch):
    path = os.path.join(str(tmp_path), "gfx942", "x.json")
    store.save_file(_doc([(1, {"BLOCK_N": 16})]), path)
    before = open(path).read()

    def boom(*a, **k):
        raise KeyboardInterrupt  # Ctrl-C in the middle of a write

    monkeypatch.setattr(store.json, "dump", boom)
    with pytest.raises(KeyboardInterrupt):
        store.save_file(_doc([(1, {"BLOCK_N": 32})]), path)
    assert open(path).read() == before
    assert os.listdir(os.path.dirname(path)) == ["x.json"]
    new = os.path.join(str(tmp_path), "gfx942", "new.json")
    with pytest.raises(KeyboardInterrupt):
        store.save_file(_doc([(1, {})]), new)
    assert not os.path.exists(new)


# ---- search space ------------------------------------------------------------------------------

def test_space_prunes_invalid_configs_before_compile_and_is_seeded():
    t = get_target("gfx942")
    s1 = build(K, t, {}, 64, seed=3, max_candidates=12)
    s2 = build(K, t, {}, 64, seed=3, max_candidates=12)
    s3 = build(K, t, {}, 64, seed=4, max_candidates=12)
    assert s1.candidates == s2.candidates and s1.hash == s2.hash
    assert s1.candidates != s3.candidates
    full = build(K, t, {}, 64, seed=0, max_candidates=40)
    assert all(c["BLOCK_K"] != 16 for c in full.candidates)
    assert any("multiple of 32" in r for r in full.pruned)
    assert all(c["BLOCK_M"] <= 64 for c in full.candidates)  # the M tile is capped at the bucket
    assert set(full.domains["num_stages"]) == {1, 2} and set(full.domains["kpack"]) == {1, 2}
    assert set(build(K, get_target("gfx950"), {}, 64, seed=0, max_candidates=4).domains["kpack"]) == {1}
    assert set(build(K, t, {}, 1, seed=0, max_candidates=4).domains["BLOCK_M"]) == {16}


@pytest.mark.aot
def test_search_reproducible_and_never_compiles_pruned(tmp_path, monkeypatch):
    from autotune import search

    seen = []
    real = search._worker_report

    def spy(name, arch, cfg, problem):  # runs in the forked workers: record through a file
        with open(os.path.join(str(tmp_path), "compiled.txt"), "a") as f:
            f.write(json.dumps(cfg) + "\n")
        return real(name, arch, cfg, problem)

    monkeypatch.setattr(search, "_worker_report", spy)
    out = str(tmp_path / "out")
    p1, d1 = search.tune(K, "gfx942", PROB, [1, 4], seed=7, out=out, max_candidates=3, workers=2, progress=False)
    p2, d2 = search.tune(K, "gfx942", PROB, [1, 4], seed=7, out=str(tmp_path / "out2"), max_candidates=3, workers=2,
                         progress=False)
    assert [e["config"] for e in d1["entries"]] == [e["config"] for e in d2["entries"]]
    assert [e["bucket"] for e in d1["entries"]] == [1, 4]
    for line in open(os.path.join(str(tmp_path), "compiled.txt")):
        seen.append(json.loads(line))
    assert seen and all(c["BLOCK_K"] % 32 == 0 for c in seen)
    doc = store.load_file(p1, known_kernels={K.name: K})
    f = doc["entries"][0]["figures"]
    assert f["predicted_us"] > 0 and 0 < f["roofline_fraction"] <= 1
    assert doc["provenance"]["seed"] == 7 and doc["provenance"]["kernel_source_hash"] == store.kernel_source_hash(K)
    assert doc["target"]["cu_count"] == 304


def test_measured_mode_needs_a_gpu():
    import torch

    from autotune import search

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a GPU"):
        search.tune(K, "gfx942", PROB, [1], mode="measured", write=False, progress=False)


# ---- cost model --------------------------------------------------------------------------------

def test_mfma_cycle_table_matches_data_sheet_peak():
    t = get_target("gfx942")
    assert costmodel.matrix_cycles("v_mfma_i32_32x32x16_i8", t) == pytest.approx(32, rel=0.02)
    assert costmodel.matrix_cycles("v_mfma_i32_16x16x32_i8", t) == pytest.approx(16, rel=0.02)
    assert costmodel.matrix_cycles("v_mfma_f32_32x32x8_bf16", t) == pytest.approx(32, rel=0.02)
    assert costmodel.matrix_cycles("v_mfma_f32_16x16x32_fp8_fp8", t) == pytest.approx(16, rel=0.02)


def _predict(arch, cfg, m, prob, report=None):
    from kdsl import aot

    t = get_target(arch)
    r = report if report is not None else aot.report(K, arch, cfg, {**prob, "M": 16}).to_dict()
    sp = K.specialize(cfg, t)
    dims = {**prob, "M": m}
    nbytes = prob["N"] * prob["K"] + m * prob["K"] + 4 * m * prob["N"]
    return costmodel.predict(r, t, math.prod(sp.grid_size(dims)), math.ceil(prob["K"] / sp.config["BLOCK_K"]),
                             nbytes, 2.0 * m * prob["N"] * prob["K"], "i8")


@pytest.mark.aot
def test_costmodel_large_int8_gemm_near_mfma_peak():
    f = _predict("gfx942", {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8}, 8192,
                 {"N": 7168, "K": 7168})
    assert f["bound"] == "compute"
    assert f["roofline_fraction"] > 0.8, f


@pytest.mark.aot
def test_costmodel_m1_gemm_near_weight_bandwidth_floor():
    f = _predict("gfx942", {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256}, 1, {"N": 7168, "K": 7168})
    assert f["bound"] == "memory"
    weight_floor_us = 7168 * 7168 / (get_target("gfx942").hbm_gbps * 1e9) * 1e6
    assert f["floor_us"] == pytest.approx(weight_floor_us, rel=0.01)
    assert 0.5 < f["roofline_fraction"] <= 1.0, f


def test_costmodel_spills_and_failures_rank_last():
    base = {"ok": True, "matrix_instructions": {"v_mfma_i32_32x32x16_i8": 8}, "matrix_in_main_loop": 8,
            "valu_instructions": 50, "valu_in_main_loop": 10, "num_warps": 4, "occupancy": 4, "spills": 0}
    t = get_target("gfx942")
    args = (t, 256, 112, 1e8, 2e11, "i8")
    clean = costmodel.predict(base, *args)
    faster_but_spills = costmodel.predict({**base, "matrix_in_main_loop": 1, "spills": 40}, *args)
    over_lds = costmodel.predict({**base, "ok": False, "errors": ["LDS 131072 B is over the gfx942 limit"]}, *args)
    assert math.isinf(over_lds["predicted_us"]) and over_lds["roofline_fraction"] == 0.0
    ranked = sorted([over_lds, faster_but_spills, clean], key=costmodel.rank_key)
    assert ranked == [clean, faster_but_spills, over_lds]


def test_rank_ties_at_the_memory_time_go_to_least_compute():
    """Memory-bound configs often all sit at the HBM time; the one with more compute slack wins."""
    a = {"predicted_us": 10.0, "penalty": "", "terms": {"compute_us": 6.0}}
    b = {"predicted_us": 10.0, "penalty": "", "terms": {"compute_us": 2.0}}
    assert sorted([a, b], key=costmodel.rank_key) == [b, a]


@pytest.mark.aot
@pytest.mark.slow
def test_costmodel_real_over_lds_config_ranks_last():
    ok = _predict("gfx942", {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, 256, {"N": 4096, "K": 4096})
    big = _predict("gfx942", {"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 256, "num_warps": 16, "num_stages": 2}, 256,
                   {"N": 4096, "K": 4096})
    assert sorted([big, ok], key=costmodel.rank_key)[0] is ok


# ---- committed configs ---------------------------------------------------------------------------

def test_check_committed_configs_parse_and_hash():
    from autotune.__main__ import check_files

    problems: list[str] = []
    n, bad, stale = check_files(None, compile=False, log=problems.append)
    assert bad == 0, problems
    # a kernel or helper edited without re-tuning its files (or a cost model change): the committed
    # figures and picks no longer describe the code; re-tune them in the same change
    assert stale == 0, problems
    for path in store.iter_files():
        doc = store.load_file(path)
        buckets_ = [e["bucket"] for e in doc["entries"]]
        assert buckets_ == sorted(buckets_, key=buckets.bucket_order)
        for e in doc["entries"]:
            assert "roofline_fraction" in e["figures"] and ("predicted_us" in e["figures"] or "measured_us" in e["figures"])


def test_check_flags_files_without_helper_hashes_or_from_another_cost_model(tmp_path):
    """A file tuned before helper hashes were recorded (a helper change would go unseen) or ranked
    by another cost model version is stale: `autotune check` says which and why."""
    from autotune.__main__ import check_files

    doc = _doc([(1, {"BLOCK_N": 16})])
    doc["provenance"].update(helpers_hash=store.helpers_hash(K), cost_model=costmodel.VERSION)
    for edit, why in ((lambda p: None, None), (lambda p: p.pop("helpers_hash"), "before helper hashes"),
                      (lambda p: p.update(cost_model="autotune.costmodel v2"), "ranked by 'autotune.costmodel v2'")):
        d = json.loads(json.dumps(doc))
        edit(d["provenance"])
        _write(str(tmp_path), d)
        problems: list[str] = []
        n, bad, stale = check_files(str(tmp_path), compile=False, log=problems.append)
        assert (n, bad, stale) == (1, 0, 0 if why is None else 1), problems
        assert why is None or why in problems[0], problems


@pytest.mark.aot
@pytest.mark.slow
def test_check_committed_configs_compile_sample():
    from autotune.__main__ import check_files

    files = store.iter_files()
    if not files:
        pytest.skip("no committed configs")
    problems: list[str] = []
    import tempfile
    import shutil

    with tempfile.TemporaryDirectory() as d:
        copies = []
        for p in files[:: max(1, len(files) // 3)][:3]:
            dst = os.path.join(d, os.path.basename(os.path.dirname(p)))
            os.makedirs(dst, exist_ok=True)
            copies.append(shutil.copy(p, dst))
        # one recorded figure that today's code does not give (as after a kdsl lowering change)
        doc = store.load_file(copies[0])
        doc["entries"][0]["figures"]["predicted_us"] *= 1.5
        with open(copies[0], "w") as f:
            json.dump(doc, f)
        n, bad, stale = check_files(d, compile=True, sample=2, log=problems.append)
    assert bad == 0, problems
    moved = [p for p in problems if "today's generated code scores" in p]
    assert len(moved) == 1 and f"bucket {doc['entries'][0]['bucket']}" in moved[0], problems  # the rest re-score


def test_cli_help_and_show(tmp_path, capsys):
    from autotune.__main__ import main

    with pytest.raises(SystemExit) as ei:
        main(["tune", "--help"])
    assert ei.value.code == 0
    assert "--budget-s" in capsys.readouterr().out
    path = os.path.join(str(tmp_path), "gfx942", store.file_name(K, PROB))
    d = _doc([(1, {"BLOCK_N": 16}), ("any", {"BLOCK_N": 64})])
    for e in d["entries"]:
        e["figures"].update(roofline_fraction=0.5, floor_us=0.5, bound="memory")
    store.save_file(d, path)
    assert main(["show", path]) == 0
    out = capsys.readouterr().out
    assert "BLOCK_N=16" in out and "any" in out and "50.0%" in out
    assert model_for("gemm_w4a8").peak_dtype == "i8"


def test_costmodel_splitting_m_does_not_buy_weight_bandwidth():
    """Programs that differ only in their M tile re-read the same weights: no extra HBM parallelism."""
    rep = {"ok": True, "matrix_instructions": {}, "matrix_in_main_loop": 0, "valu_instructions": 100,
           "valu_in_main_loop": 10, "num_warps": 4, "occupancy": 4, "spills": 0}
    t = get_target("gfx942")
    one = costmodel.predict(rep, t, 36, 28, 8e6, 1e7, "bf16", m_tiles=1, m_bytes_fraction=0.001)
    two = costmodel.predict(rep, t, 72, 28, 8e6, 2e7, "bf16", m_tiles=2, m_bytes_fraction=0.002)
    assert two["terms"]["memory_us"] == pytest.approx(one["terms"]["memory_us"], rel=0.01)


def test_costmodel_written_extra_bytes_stream_from_every_program():
    """Split partials are each program's own writes: where programs re-read shared bytes (64 row
    tiles of one KV stream here), the reads stream at the few distinct streams' saturation, the
    written extra bytes at every program's; unflagged extra bytes keep the shared saturation."""
    rep = {"ok": True, "matrix_instructions": {}, "matrix_in_main_loop": 0, "valu_instructions": 100,
           "valu_in_main_loop": 10, "num_warps": 4, "occupancy": 4, "spills": 0}
    t = get_target("gfx942")
    kw = dict(m_tiles=64, m_bytes_fraction=0.0, extra_bytes=4e6)
    shared = costmodel.predict(rep, t, 256, 28, 8e6, 1e7, "bf16", **kw)
    written = costmodel.predict(rep, t, 256, 28, 8e6, 1e7, "bf16", extra_written=True, **kw)
    bw = t.hbm_gbps * 1e3  # bytes per microsecond
    sat_reads = 4 * 4 / (t.cu_count * t.simd_per_cu)            # 256 / 64 = 4 streams of 4 warps
    sat_all = min(1.0, 256 * 4 / (t.cu_count * t.simd_per_cu))
    assert shared["terms"]["memory_us"] == pytest.approx(12e6 / (bw * sat_reads), rel=1e-3)
    assert written["terms"]["memory_us"] == pytest.approx(8e6 / (bw * sat_reads) + 4e6 / (bw * sat_all), rel=1e-3)


def test_costmodel_charges_a_serial_tail_after_the_grid():
    """A "last program finishes" tail runs once, after the grid, in one program: its tickets in
    sequence plus its bytes at one program's share of HBM (more warps, more bandwidth), added to the
    grid's time; no tail, no term."""
    rep = {"ok": True, "matrix_instructions": {}, "matrix_in_main_loop": 0, "valu_instructions": 100,
           "valu_in_main_loop": 10, "num_warps": 8, "occupancy": 4, "spills": 0}
    t = get_target("gfx942")
    plain = costmodel.predict(rep, t, 112, 28, 8e6, 1e7, "bf16")
    tail = costmodel.predict(rep, t, 112, 28, 8e6, 1e7, "bf16", tail_bytes=50e3, tail_tickets=2)
    one_program_gbps = t.hbm_gbps * 8 / (t.cu_count * t.simd_per_cu)
    want = 2 * costmodel.TICKET_US["gfx942"] + 50e3 / (one_program_gbps * 1e3)
    assert tail["terms"]["tail_us"] == pytest.approx(want, rel=1e-3)
    assert tail["predicted_us"] == pytest.approx(plain["predicted_us"] + want, rel=1e-3)
    assert "tail_us" not in plain["terms"]
    wide = costmodel.predict({**rep, "num_warps": 16}, t, 112, 28, 8e6, 1e7, "bf16", tail_bytes=50e3, tail_tickets=2)
    assert wide["terms"]["tail_us"] < tail["terms"]["tail_us"]


def test_shared_numerics_picks_one_tile_for_every_bucket(monkeypatch):
    """A kernel whose batch-invariant launches read their numerics keys from the M=1 entry gets one
    numerics tile, the one with the least summed slowdown over the buckets (not the M=1 favourite),
    and each bucket keeps its own launch-only keys."""
    from autotune import search

    small = {"BLOCK_M": 16, "BLOCK_K": 64}           # best at M=1, 4x slower at M=8 (re-reads per row)
    wide = {"BLOCK_M": 32, "BLOCK_K": 64}           # 10% slower at M=1, flat after
    times = {(16, 1): 10.0, (16, 8): 40.0, (32, 1): 11.0, (32, 8): 11.5}
    cfgs = [{**small, "num_warps": 4}, {**wide, "num_warps": 4}, {**wide, "num_warps": 8}]

    def fake_score(kernel, target, prob, m, c, rep):
        t = times[(c["BLOCK_M"], m)] + (0.5 if c["num_warps"] == 8 and m == 1 else 0.0) \
            - (0.5 if c["num_warps"] == 8 and m == 8 else 0.0)
        return {"predicted_us": t}

    monkeypatch.setattr(search, "score", fake_score)
    jobs = {(search._cfg_key(c), search.REPORT_M): (c, {}) for c in cfgs}
    reports = {k: {"ok": True} for k in jobs}
    nk = search._shared_numerics(K, get_target("gfx942"), PROB, [1, 8], jobs, reports)
    assert dict(nk) == wide                          # 10/10 + 40/11 loses to 11/10 + 11/11
    times[(16, 8)] = 12.0                             # now the small tile costs little at M=8: it wins
    assert dict(search._shared_numerics(K, get_target("gfx942"), PROB, [1, 8], jobs, reports)) == small
    assert search._numerics({"BLOCK_M": 16, "num_warps": 8, "num_stages": 2}) == (("BLOCK_M", 16),)


def test_launch_polish_compiles_every_option_combination_of_the_winning_tile(monkeypatch):
    """A sampled space holds few option combinations of any tile: after the first round the tuner
    compiles every combination of the target's launch-option domains for each bucket's best
    compiled config (with a shared numerics tile: that tile's, launch-only options only)."""
    from autotune import search
    from autotune.space import option_domains

    t = get_target("gfx942")
    fast = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "waves_per_eu": 0,
            "kpack": 1, "matrix_instr_nonkdim": 0}
    slow = {**fast, "BLOCK_N": 32}
    monkeypatch.setattr(search, "score", lambda kernel, target, prob, m, c, rep:
                        {"predicted_us": 1.0 if c["BLOCK_N"] == 64 else 2.0})
    jobs = {(search._cfg_key(c), search.REPORT_M): (c, {}) for c in (fast, slow)}
    reports = {k: {"ok": True} for k in jobs}
    spaces = {b: search.build(K, t, {}, b, seed=0, max_candidates=1) for b in (1, 8)}
    new = search._launch_polish(K, t, PROB, PROB, [1, 8], spaces, jobs, reports, None)
    opts = option_domains(t)
    assert 16 in opts["num_warps"]
    want = 1
    for v in opts.values():
        want *= len(v)
    assert len(new) == want - 1                       # every combination but the one compiled
    assert {c["BLOCK_N"] for c, _ in new.values()} == {64}
    assert {c["num_warps"] for c, _ in new.values()} == set(opts["num_warps"])
    shared = search._numerics(fast)
    new = search._launch_polish(K, t, PROB, PROB, [1, 8], spaces, jobs, reports, shared)
    assert {search._numerics(c) for c, _ in new.values()} == {shared}   # kpack is not varied
    assert len(new) == len(opts["num_warps"]) * len(opts["num_stages"]) * len(opts["waves_per_eu"]) - 1


def test_num_warps_is_a_numerics_key_where_floats_are_summed_across_lanes(tmp_path, monkeypatch):
    """A float sum over a tile axis reduces in the order of its layout, which num_warps sets: for
    such a config num_warps is no launch-only key, so a batch-invariant launch takes it from the
    reference entry with the tile; an int GEMM (exact) or an MFMA tile keeps its bucket's warps."""
    from autotune import search
    from autotune.problems import LAUNCH_ONLY_KEYS, lane_sums, launch_only_keys
    from ops import _common, norm
    from ops.gemm import gemm_bf16_kernel
    from ops.mla_fused import mla_combine_uv

    assert lane_sums(norm.rmsnorm_add, {}) and lane_sums(mla_combine_uv, {"BLOCK_S": 8})
    assert not lane_sums(K, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64})         # int: exact
    assert not lane_sums(gemm_bf16_kernel, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64})  # MFMA tile
    assert lane_sums(gemm_bf16_kernel, {"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 64})       # multiply + sum
    assert launch_only_keys(K, {}) >= LAUNCH_ONLY_KEYS
    assert "num_warps" not in launch_only_keys(norm.rmsnorm_add, {})
    assert "BLOCK_D" in launch_only_keys(norm.rmsnorm_add, {})                   # the model's own key
    assert search._numerics({"BLOCK_D": 256, "num_warps": 8}, norm.rmsnorm_add) == (("num_warps", 8),)
    entries = {1: {"BLOCK_D": 256, "num_warps": 4, "num_stages": 1}, 16: {"BLOCK_D": 1024, "num_warps": 8, "num_stages": 2}}
    monkeypatch.setattr("autotune.lookup_config", lambda k, a, p, m: dict(entries[1 if m < 16 else 16]))
    cfg = _common.invariant_config(norm.rmsnorm_add, {"D": 7168}, 16, None, arch="gfx942")
    assert cfg == {"BLOCK_D": 1024, "num_warps": 4, "num_stages": 2}


def test_candidates_compile_at_the_bucket_m_when_m_sets_a_static_dim():
    """Most kernels compile once at REPORT_M for every bucket; one whose static dims follow M (the
    token tile MB = p2(M) of moe_route_align) is compiled at each bucket's own M."""
    from autotune import search
    from ops import moe

    t = get_target("gfx942")
    assert search.compile_m(K, PROB, 1, t) == search.REPORT_M
    ra = {"E": 384, "TOPK": 8, "NG": 1, "EA": 384, "BM": 16}
    assert [search.compile_m(moe.moe_route_align, ra, m, t) for m in (1, 4, 16)] == [1, 4, search.REPORT_M]


def test_verify_problem_tunes_with_the_decode_files_numerics(tmp_path):
    """A q_len-4 MLA problem runs with the numerics keys of the q_len-1 file's M=1 entry
    (invariant_config): the tuner takes them as given and varies only the launch keys."""
    from autotune import search
    from ops import mla

    K_ = mla.mla_decode_split
    pm = model_for(K_)
    t = get_target("gfx942")
    p1 = {"QL": 1, "H": 8, "DL": 512, "DR": 64, "PS": 64}
    num = {"BLOCK_M": 16, "BLOCK_N": 64, "KV_ROWS": 1, "PV_F32": 0, "SPLIT_TOKENS": 128, "kpack": 1,
           "matrix_instr_nonkdim": 0}
    doc = _doc([(1, {**num, "num_warps": 8}), (8, {**num, "BLOCK_N": 32, "num_warps": 4})],
               kernel=K_.name, problem=p1)
    _write(str(tmp_path), doc, store.file_name(K_, p1))
    assert search._reference_numerics(K_, t, p1, pm, str(tmp_path)) is None        # its own reference
    forced = search._reference_numerics(K_, t, {**p1, "QL": 4}, pm, str(tmp_path))
    # the M=1 entry's keys, num_warps included: the split kernel's softmax sums follow the warps
    assert dict(forced) == {**num, "num_warps": 8}
    cands = [{**num, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}, {**num, "num_warps": 4, "num_stages": 2},
             {**num, "SPLIT_TOKENS": 256, "num_warps": 8, "num_stages": 1}]
    out = search.with_numerics(cands, forced, K_)
    assert out == [{**num, "num_warps": 8, "num_stages": 2}, {**num, "num_warps": 8, "num_stages": 1}]
    from autotune.__main__ import _takes_numerics_from_another as later  # tune-model tunes q_len 1 first
    probs = [{**p1, "QL": 4}, p1]
    assert sorted(probs, key=lambda p: later(K_, p)) == [p1, {**p1, "QL": 4}]
    with pytest.warns(UserWarning, match="tune it first"):
        assert search._reference_numerics(K_, t, {**p1, "QL": 4, "H": 16}, pm, str(tmp_path)) is None


def test_launch_polish_of_launch_only_tunables_skips_values_the_tile_refuses(monkeypatch):
    """The polish of a shared tile's launch-only tunables (gemm_bf16_rmsnorm's BLOCK_M) tries every
    value of the bucket's domain but drops those the tile's rules refuse (BLOCK_M under 16 with the
    2-D sum of squares, ROW_SQUARES=0), as the space's pruning does; so does the compile of the
    leading tiles' launch-only tunables before the joint pick."""
    from autotune import search
    from ops.gemm import gemm_bf16_rmsnorm_kernel as R

    t = get_target("gfx942")
    prob = {"N": 64, "K": 128}
    base = {"SPLIT_K": 1, "BLOCK_N": 16, "NORM_K": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1,
            "waves_per_eu": 0, "kpack": 1, "matrix_instr_nonkdim": 0}
    monkeypatch.setattr(search, "score", lambda kernel, target, p, m, c, rep: {"predicted_us": 1.0})
    spaces = {b: search.build(R, t, {"S": 1, "P": 1}, b, seed=0, max_candidates=1) for b in (1, 8)}
    for rs, want in ((0, set()), (1, {1, 2, 4, 8})):   # BLOCK_M=16 is compiled already
        c = {**base, "BLOCK_M": 16, "ROW_SQUARES": rs}
        jobs = {(search._cfg_key(c), search.REPORT_M): (c, {})}
        reports = {k: {"ok": True} for k in jobs}
        new = search._launch_polish(R, t, prob, prob, [1, 8], spaces, jobs, reports, search._numerics(c, R),
                                    ("BLOCK_M",))
        assert {x["BLOCK_M"] for x, _ in new.values()} == want, rs
        lead = search._launch_tunable_jobs(R, t, prob, prob, [1, 8], spaces, jobs, reports, ("BLOCK_M",))
        assert {x["BLOCK_M"] for x, _ in lead.values()} == want, rs


def test_launch_only_tunables_of_the_leading_tiles_are_compiled_before_the_joint_pick(monkeypatch):
    """gemm_bf16_swiglu's BLOCK_M and N_TILES change no bit (ProblemModel.launch_keys): a tile the
    sample held only at N_TILES=1 is slow at a large bucket there; before the joint pick the tuner
    compiles the leading tiles at every value of those tunables, and the narrow tile (best at M=1,
    as fast as the wide one at M=64 with 4 N tiles per program) then wins."""
    from autotune import search
    from ops.swiglu import gemm_bf16_swiglu_kernel as SW

    t = get_target("gfx942")
    base = {"BLOCK_K": 128, "BLOCK_M": 16, "num_warps": 4, "num_stages": 1, "waves_per_eu": 0, "kpack": 1,
            "matrix_instr_nonkdim": 0}
    narrow, wide = {**base, "BLOCK_N": 32, "N_TILES": 1}, {**base, "BLOCK_N": 128, "N_TILES": 1}

    def fake_score(kernel, target, prob, m, c, rep):
        if c["BLOCK_N"] == 128:
            return {"predicted_us": 2.0}
        return {"predicted_us": 1.0 if m == 1 else 2.0 if c["N_TILES"] == 4 else 6.0}

    monkeypatch.setattr(search, "score", fake_score)
    prob, buckets = {"N": 7168, "I": 256, "S": 8}, [1, 64]
    jobs = {(search._cfg_key(c), search.REPORT_M): (c, {}) for c in (narrow, wide)}
    reports = {k: {"ok": True} for k in jobs}
    assert dict(search._shared_numerics(SW, t, prob, buckets, jobs, reports))["BLOCK_N"] == 128
    spaces = {b: search.build(SW, t, {"S": 8}, b, seed=0, max_candidates=1) for b in buckets}
    new = search._launch_tunable_jobs(SW, t, prob, prob, buckets, spaces, jobs, reports, ("BLOCK_M", "N_TILES"))
    assert {(c["BLOCK_N"], c["BLOCK_M"], c["N_TILES"]) for c, _ in new.values()} >= {(32, 16, 4), (128, 1, 2)}
    assert {search._numerics(c, SW) for c, _ in new.values()} == {search._numerics(narrow, SW),
                                                                 search._numerics(wide, SW)}
    jobs.update(new)
    reports.update({k: {"ok": True} for k in new})
    assert dict(search._shared_numerics(SW, t, prob, buckets, jobs, reports))["BLOCK_N"] == 32


def test_numerics_neighbors_find_the_tile_one_key_away(monkeypatch):
    """The sample held only the picked tile and a far one; the tile that differs from the pick in
    one numerics key (BLOCK_K) is faster at every bucket: the one-key-away jobs hold it (and only
    tiles one key away, values the tile's rules refuse pruned), and the joint pick then takes it."""
    from autotune import search

    t = get_target("gfx942")
    base = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "waves_per_eu": 0,
            "kpack": 1, "matrix_instr_nonkdim": 0}
    far = {**base, "BLOCK_N": 128, "BLOCK_K": 128}

    def fake_score(kernel, target, prob, m, c, rep):
        return {"predicted_us": 1.0 if (c["BLOCK_N"], c["BLOCK_K"]) == (64, 128) else
                2.0 if c["BLOCK_N"] == 64 else 3.0}

    monkeypatch.setattr(search, "score", fake_score)
    buckets = [1, 8]
    jobs = {(search._cfg_key(c), search.REPORT_M): (c, {}) for c in (base, far)}
    reports = {k: {"ok": True} for k in jobs}
    shared = search._shared_numerics(K, t, PROB, buckets, jobs, reports)
    assert dict(shared)["BLOCK_K"] == 64
    spaces = {b: search.build(K, t, {}, b, seed=0, max_candidates=1) for b in buckets}
    new = search._numerics_neighbors(K, t, PROB, PROB, buckets, spaces, jobs, reports, shared, ())
    tiles = {search._numerics(c, K) for c, _ in new.values()}
    assert all(sum(a != b for a, b in zip(nk, shared)) == 1 for nk in tiles)
    assert {c["BLOCK_K"] for c, _ in new.values() if all(c[k] == v for k, v in base.items() if k != "BLOCK_K")} \
        == {32, 128, 256}
    jobs.update(new)
    reports.update({k: {"ok": True} for k in new})
    assert dict(search._shared_numerics(K, t, PROB, buckets, jobs, reports))["BLOCK_K"] == 128


def test_tune_tries_every_lowering_of_each_buckets_best(tmp_path, monkeypatch):
    """The exact W4A8 stages pick their tile per bucket (no shared numerics); the int4 unpack
    lowering changes no bit (ProblemModel.launch_keys), so each bucket's best tile is also compiled
    with every INT4_UNPACK value: a one-candidate sample (the default "bfe") still ends on the
    lowering the cost model prefers."""
    from autotune import search
    from autotune.problems import model_for
    from ops.moe import moe_stage1_w4a8_amax as S1

    assert "INT4_UNPACK" in model_for(S1).launch_keys and not model_for(S1).shared_numerics

    monkeypatch.setattr(search, "_compile", _compile_nothing)
    monkeypatch.setattr(search, "score", lambda kernel, target, p, m, c, rep:
                        {"predicted_us": 1.0 if c["INT4_UNPACK"] == "swar" else 2.0})
    _, doc = search.tune(S1, "gfx942", {"E": 384, "K": 7168, "I": 256, "TOPK": 8}, [1, 8], max_candidates=1,
                         out=str(tmp_path), write=False, progress=False)
    assert [e["config"]["INT4_UNPACK"] for e in doc["entries"]] == ["swar", "swar"]


def test_tune_warm_starts_from_the_files_of_other_arches(tmp_path, monkeypatch):
    """The same kernel and problem tuned for another arch: its configs join the warm start (a tile
    two keys away from every sampled one, which the one-key neighbor search cannot reach), their
    launch options mapped into this arch's domains (a recorded option the specialization applied,
    or another arch's, would otherwise keep the tile out of the space)."""
    from autotune import search
    from autotune.space import option_domains

    G, doc = _bf16_doc([(1, 128)])
    far = {**doc["entries"][0]["config"], "BLOCK_N": 32, "waves_per_eu": 3, "matrix_instr_nonkdim": 16}
    doc.update(arch="gfx950", entries=[{"bucket": 1, "config": far, "figures": {"predicted_us": 1.0}}])
    doc["target"]["arch"] = "gfx950"
    monkeypatch.setattr(search, "_compile", _compile_nothing)
    monkeypatch.setattr(search, "score", lambda kernel, target, p, m, c, rep:
                        {"predicted_us": 1.0 if (c["BLOCK_N"], c["BLOCK_K"]) == (32, 128) else 2.0})
    kw = dict(max_candidates=1, out=str(tmp_path), write=False, progress=False)
    _, alone = search.tune(G, "gfx942", doc["problem"], [1], **kw)
    assert (alone["entries"][0]["config"]["BLOCK_N"], alone["entries"][0]["config"]["BLOCK_K"]) != (32, 128)
    _write(str(tmp_path), doc, store.file_name(G, doc["problem"]))
    _, seeded = search.tune(G, "gfx942", doc["problem"], [1], **kw)
    got = seeded["entries"][0]["config"]
    assert (got["BLOCK_N"], got["BLOCK_K"]) == (32, 128)
    dom = option_domains(get_target("gfx942"))
    assert got["waves_per_eu"] in dom["waves_per_eu"] and got["matrix_instr_nonkdim"] in dom["matrix_instr_nonkdim"]


def _compile_nothing(kernel, target, jobs, reports, workers, deadline, progress):
    """search._compile for tests that fake the scores: every job 'compiles'."""
    for k in jobs:
        reports.setdefault(k, {"ok": True})
    return False


def _bf16_doc(tiles):
    from ops.gemm import gemm_bf16_kernel as G

    base = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1, "waves_per_eu": 0, "kpack": 1,
            "matrix_instr_nonkdim": 0}
    doc = _doc([(b, {**base, "BLOCK_K": bk}) for b, bk in tiles], kernel="gemm_bf16", problem={"N": 256, "K": 512})
    doc["provenance"].update(kernel_source_hash=store.kernel_source_hash(G), helpers_hash=store.helpers_hash(G),
                             cost_model=costmodel.VERSION)
    return G, doc


def test_check_fails_a_batch_invariant_file_with_entries_of_another_tile(tmp_path):
    """gemm_bf16's launches take every numerics key from the M=1 lookup at any M: an entry of
    another tile (a partial re-tune merged into the file) describes a launch that never runs."""
    from autotune.__main__ import check_files

    for tiles, bad_want in (([(1, 64), (256, 64)], 0), ([(1, 64), (256, 128)], 1)):
        G, doc = _bf16_doc(tiles)
        _write(str(tmp_path), doc, store.file_name(G, doc["problem"]))
        problems: list[str] = []
        _, bad, _ = check_files(str(tmp_path), compile=False, log=problems.append)
        assert bad == bad_want, problems
        assert not bad or ("[256]" in problems[0] and "--keep-numerics" in problems[0]), problems


def test_keep_numerics_tunes_launch_keys_of_the_files_tile(tmp_path, monkeypatch):
    """`tune --keep-numerics` re-tunes some buckets of a batch-invariant file under the tile its
    launches run (its M=1 entry's), however much faster another tile would score there."""
    from autotune import search
    from ops.gemm import gemm_bf16_kernel as G

    _, doc = _bf16_doc([(1, 64)])
    path = _write(str(tmp_path), doc, store.file_name(G, doc["problem"]))

    monkeypatch.setattr(search, "_compile", _compile_nothing)
    monkeypatch.setattr(search, "score", lambda kernel, target, p, m, c, rep:
                        {"predicted_us": 1.0 if c.get("BLOCK_K") == 128 else 2.0 + c.get("num_warps", 4) / 100})
    kw = dict(max_candidates=4, out=str(tmp_path), write=False, progress=False)
    _, free = search.tune(G, "gfx942", doc["problem"], [256], **kw)
    assert free["entries"][0]["config"]["BLOCK_K"] == 128          # on its own the bucket takes another tile
    _, kept = search.tune(G, "gfx942", doc["problem"], [256], keep_numerics=True, **kw)
    e = kept["entries"][0]["config"]
    assert search._numerics(e, G) == search._numerics(doc["entries"][0]["config"], G)
    from autotune.space import option_domains
    assert e["num_warps"] == min(option_domains(get_target("gfx942"))["num_warps"])  # launch keys still tuned
    with pytest.raises(ValueError, match="per bucket"):
        search.tune(K, "gfx942", PROB, [1], keep_numerics=True, **kw)
    with pytest.raises(ValueError, match="no tuned file"):
        search.tune(G, "gfx942", {"N": 512, "K": 512}, [1], keep_numerics=True, **kw)
    # an --out folder without the file: the package's file is the one being replaced (its tile kept)
    pkg = {"N": 7168, "K": 1024}
    want = search._numerics(store.load_file(store.file_path(G, "gfx942", pkg))["entries"][0]["config"], G)
    _, kept = search.tune(G, "gfx942", pkg, [256], keep_numerics=True, **{**kw, "out": str(tmp_path / "empty")})
    assert search._numerics(kept["entries"][0]["config"], G) == want


def test_forced_tile_keeps_only_the_launch_keys_its_rules_admit(tmp_path):
    """A kept numerics tile with ROW_SQUARES=0 (gemm_bf16_rmsnorm: a 2-D squares reduction, 16-row
    tiles only) admits no BLOCK_M under 16 (kd.require): those candidates are pruned before any
    compile instead of failing the tune (they once raised ConfigError when scored); the tile's
    numerics keys are kept, its launch-only BLOCK_N may move."""
    from autotune import search
    from autotune.problems import launch_only_keys
    from ops.gemm import gemm_bf16_rmsnorm_kernel as R

    tile = {"BLOCK_K": 64, "BLOCK_N": 64, "NORM_K": 256, "ROW_SQUARES": 0, "SPLIT_K": 2, "num_warps": 4}
    _, doc = search.tune(R, "gfx942", {"N": 256, "K": 512}, [1, 4], numerics=search._numerics(tile, R),
                         max_candidates=8, out=str(tmp_path), write=False, progress=False, workers=1)
    assert [e["config"]["BLOCK_M"] for e in doc["entries"]] == [16, 16]
    assert all(e["config"][k] == v for e in doc["entries"] for k, v in tile.items()
               if k not in launch_only_keys(R, e["config"]))
    assert "BLOCK_N" in launch_only_keys(R, tile)


def test_rewriting_some_buckets_retunes_the_others_under_the_new_tile(tmp_path, monkeypatch):
    """Re-tuning buckets 1..N of a batch-invariant file whose other buckets (256) hold the old tile:
    the new joint tile is what every launch runs, so the kept bucket is re-tuned under it instead of
    being merged back with a tile that never runs (what `autotune check` now fails)."""
    from autotune import search
    from autotune.__main__ import check_files

    G, doc = _bf16_doc([(1, 64), (256, 64)])
    path = _write(str(tmp_path), doc, store.file_name(G, doc["problem"]))

    monkeypatch.setattr(search, "_compile", _compile_nothing)
    monkeypatch.setattr(search, "score", lambda kernel, target, p, m, c, rep:
                        {"predicted_us": 1.0 if c.get("BLOCK_K") == 128 else 2.0})
    search.tune(G, "gfx942", doc["problem"], [1], max_candidates=4, out=str(tmp_path), progress=False)
    new = store.load_file(path)
    assert [e["bucket"] for e in new["entries"]] == [1, 256]
    assert {e["config"]["BLOCK_K"] for e in new["entries"]} == {128}
    problems: list[str] = []
    assert check_files(str(tmp_path), compile=False, log=problems.append)[1] == 0, problems


def test_check_fails_a_verify_file_whose_tile_is_not_the_decode_files(tmp_path):
    """A q_len-4 MLA split launch takes its numerics keys from the q_len-1 file's M=1 entry: a
    verify file tuned against another decode tile (consistent in itself) describes launches that
    never run."""
    from autotune.__main__ import check_files
    from ops.mla import mla_decode_split as D

    src = {q: store.file_path(D, "gfx950", {"QL": q, "H": 64, "DL": 512, "DR": 64, "PS": 64}) for q in (1, 4)}
    os.makedirs(tmp_path / "gfx950")
    for p in src.values():
        (tmp_path / "gfx950" / os.path.basename(p)).write_text(open(p).read())
    problems: list[str] = []
    assert check_files(str(tmp_path), compile=False, log=problems.append)[1] == 0, problems
    doc = store.load_file(src[1])
    for e in doc["entries"]:
        e["config"]["BLOCK_N"] = 64 if e["config"]["BLOCK_N"] != 64 else 32  # another decode tile
    (tmp_path / "gfx950" / os.path.basename(src[1])).write_text(json.dumps(doc))
    problems = []
    assert check_files(str(tmp_path), compile=False, log=problems.append)[1] == 1, problems
    assert "QL4" in problems[0] and "another numerics tile" in problems[0], problems


def test_tune_warm_starts_from_the_files_of_a_kernel_sharing_its_tiles(tmp_path, monkeypatch):
    """A kernel that runs another's program with a different epilogue (`ProblemModel.tiles_from`:
    gemm_bf16_swiglu_rank, gemm_bf16_swiglu's tiles ending in the rank's combine): that kernel's file
    at the problem's shared key dims, of any arch, joins the warm start (here a tile two keys away
    from the one-candidate sample, which the neighbor search cannot reach)."""
    from autotune import search
    from ops.swiglu import gemm_bf16_swiglu_rank_kernel as RK

    prob = {"N": 4096, "I": 1024, "S": 2, "TOPK": 4}
    monkeypatch.setattr(search, "_compile", _compile_nothing)
    kw = dict(max_candidates=1, out=str(tmp_path), write=False, progress=False)
    _, alone = search.tune(RK, "gfx942", prob, [1], **kw)
    base = alone["entries"][0]["config"]
    keys = ("BLOCK_N", "BLOCK_K")               # its numerics tile (BLOCK_M and N_TILES: launch keys)
    far = {**base, "BLOCK_N": 16 if base["BLOCK_N"] != 16 else 32, "BLOCK_K": 256 if base["BLOCK_K"] != 256 else 32}
    monkeypatch.setattr(search, "score", lambda kernel, target, p, m, c, rep:
                        {"predicted_us": 1.0 if all(c[k] == far[k] for k in keys) else 2.0})
    _, alone = search.tune(RK, "gfx942", prob, [1], **kw)
    assert any(alone["entries"][0]["config"][k] != far[k] for k in keys)
    sib = _doc([(1, far)], arch="gfx950", kernel="gemm_bf16_swiglu", problem={"N": 4096, "I": 1024, "S": 2})
    _write(str(tmp_path), sib, store.file_name("gemm_bf16_swiglu", sib["problem"]))
    _, seeded = search.tune(RK, "gfx942", prob, [1], **kw)
    got = seeded["entries"][0]["config"]
    assert all(got[k] == far[k] for k in keys)
