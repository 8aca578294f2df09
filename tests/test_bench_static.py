"""The static bench path (bench/roofline.py, `python -m bench.gemm`) gives sane figures: a positive
floor, a prediction at or above it, a roofline fraction in (0, 1], and the ISA counts it reports."""
from __future__ import annotations

import json
import math

import pytest

from bench import roofline as R

KERNEL, ARCH, SHAPE, M = "gemm_w4a8", "gfx942", "expert_down", 1


def _kernel():
    ks = R.gemm_kernels([KERNEL])
    if KERNEL not in ks:
        pytest.skip(f"{KERNEL} is not registered (ops/gemm.py)")
    return ks[KERNEL]


def test_floors_by_hand() -> None:
    """Unique bytes and flops of W4A8 at a Kimi shape, counted by hand: int4 weights at 4 bits,
    int8 activations, f32 scales, bf16 output; the HBM floor is bytes / 5.3 TB/s on gfx942."""
    k = _kernel()
    n, kk = R.KIMI_SHAPES[SHAPE]
    prob = R.problem_for(k, M, n, kk)
    want = n * kk // 2 + M * kk + 4 * M + 4 * n + 2 * M * n
    assert R.unique_bytes(k, prob, ARCH) == want
    fl = R.floors(k, prob, ARCH)
    assert fl.flops == 2 * M * n * kk
    assert fl.hbm_us == pytest.approx(want / 5300e3)
    assert fl.compute_us == pytest.approx(2 * M * n * kk / 2615e6)  # int8 peak on gfx942
    assert fl.bound == "HBM"


def test_group_dim_follows_k() -> None:
    ks = R.gemm_kernels(["gemm_w4a16"])
    if not ks:
        pytest.skip("gemm_w4a16 is not registered")
    assert R.problem_for(ks["gemm_w4a16"], 4, 7168, 2048)["G"] == 2048 // 32


@pytest.mark.aot
def test_static_record_is_sane(tmp_path) -> None:
    k = _kernel()
    n, kk = R.KIMI_SHAPES[SHAPE]
    rec = R.static_record(k, ARCH, M, n, kk, shape=SHAPE)
    assert rec.ok, rec.errors
    assert rec.hbm_floor_us > 0 and rec.compute_floor_us > 0
    assert rec.floor_us == max(rec.hbm_floor_us, rec.compute_floor_us)
    assert rec.predicted_us >= rec.floor_us
    assert 0 < rec.roofline_fraction <= 1
    # the tuned M=1 tile may be the VALU (BLOCK_M < 16) form: matrix instructions only with MFMA tiles
    if rec.config["BLOCK_M"] >= 16:
        assert rec.mfma_main_loop > 0
    else:
        assert rec.mfma_main_loop == 0 and rec.valu_main_loop > 0
    assert rec.occupancy >= 1 and rec.spills == 0 and rec.programs > 0
    assert "gemm_w4a8" in R.static_table([rec])

    # the CLI writes the same record to the JSON path it is given (the report is memoized: no recompile)
    from bench.gemm import main

    out = tmp_path / "static.json"
    assert main(["--kernels", KERNEL, "--arch", ARCH, "--m", str(M), "--shapes", SHAPE, "--static",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == "static" and len(doc["rows"]) == 1
    assert doc["rows"][0]["predicted_us"] == pytest.approx(rec.predicted_us)


def test_measured_record_dry_run(monkeypatch) -> None:
    """The GPU record, assembled on the CPU with a stub timer (no timing is taken or shown): the
    torch op is chosen, the kdsl output agrees with it, and the derived figures follow from the
    times. A real GPU run goes through the same code with CUDA events."""
    from bench import gemm as G, timing

    k = _kernel()
    monkeypatch.setattr(timing, "time_interleaved", lambda fns, reps=50: {"kdsl": 2.0, "torch": 3.0})
    row = G.gpu_record(k, 1, 32, 64, shape="tiny", device="cpu")
    assert "reference path" in row["torch_op"]
    assert row["max_rel_err_vs_torch"] < 2e-2  # bf16 rounding of the torch side
    assert row["speedup_vs_torch"] == pytest.approx(1.5)
    assert row["tflops"] == pytest.approx(2 * 32 * 64 / 2e6)
    assert "gemm_w4a8" in G.gpu_table([row])


def test_timer_refuses_cpu() -> None:
    import torch

    from bench.timing import time_interleaved

    if torch.cuda.is_available():
        pytest.skip("GPU present")
    with pytest.raises(RuntimeError, match="needs a GPU"):
        time_interleaved({"a": lambda: None})


# ---- MoE layer suite (bench/moe.py) ----------------------------------------------------------------

def test_moe_touched_bytes_by_hand() -> None:
    """At M=1 exactly top-k experts are read; W4A8 counts int4 weights at 4 bits plus f32
    per-channel scales, and the bf16 router weight is read whatever M is."""
    from ops.problems import experts_touched
    from bench import moe as B

    s = B.KIMI_MOE
    assert experts_touched(s, 1) == pytest.approx(8)
    assert 8 < experts_touched(s, 4) < 32 and experts_touched(s, 10_000) == pytest.approx(384)
    E, H, I = s["E"], s["H"], s["I"]
    want = 8 * (3 * I * H / 2 + (2 * I + H) * 4) + E * H * 2
    assert B.weight_bytes("w4a8", s, 8) == pytest.approx(want)


@pytest.mark.aot
def test_moe_static_rows_are_sane() -> None:
    """Each modelled launch is compiled with the config the op would use; the layer's predicted
    time is at or above the touched-weights floor, and the M=4 ratio comes from the two rows."""
    from bench import moe as B
    from ops import moe

    rows = B.with_ratios([B.static_row("w4a8", ARCH, m) for m in (1, 4)], "predicted_us")
    for r in rows:
        names = [k["kernel"] for k in r.kernels]
        # the stage2_quant mode fused_experts picks from the tuned files: "amax" has no quant between the stages
        sq = moe.stage2_quant_mode(None, B.KIMI_MOE["E"], B.KIMI_MOE["H"], B.KIMI_MOE["I"], B.KIMI_MOE["TOPK"], r.M, ARCH)
        assert names == (["moe_gate_gemm", "quant_per_token_int8", "moe_stage1_w4a8_amax", "moe_stage2_w4a8_aq"]
                         if sq == "amax" else ["moe_gate_gemm", "quant_per_token_int8", "moe_stage1_w4a8",
                                               "quant_per_token_int8", "moe_stage2_w4a8_pq"])
        assert all(math.isfinite(k["predicted_us"]) and k["resources"]["spills"] == 0 for k in r.kernels)
        assert r.predicted_us == pytest.approx(sum(k["predicted_us"] for k in r.kernels))
        assert r.predicted_us >= r.floor_us > 0 and 0 < r.roofline_fraction <= 1
    assert rows[0].ratio_vs_m1 == 1.0
    assert rows[1].ratio_vs_m1 == pytest.approx(rows[1].predicted_us / rows[0].predicted_us)
    assert rows[1].experts_touched > rows[0].experts_touched
    assert "w4a8" in B.static_table(rows)


def test_moe_measured_record_dry_run(monkeypatch) -> None:
    """The GPU record assembled on the CPU at a small shape with a stub timer (no timing is taken):
    kdsl's fused_moe agrees with the torch path, and the figures follow from the times."""
    from bench import moe as B, timing

    monkeypatch.setattr(timing, "time_interleaved", lambda fns, reps=30: {"kdsl": 4.0, "torch": 10.0})
    shape = {"E": 16, "H": 64, "I": 32, "TOPK": 4}
    rows = [B.gpu_record(fmt, m, shape=shape, device="cpu") for fmt in ("w4a8", "w4a16") for m in (1, 2)]
    for r in rows:
        assert r["max_rel_err_vs_torch"] < 3e-2  # W4A8: int8 activations vs the torch path's bf16
        assert r["speedup_vs_torch"] == pytest.approx(2.5)
        assert r["gbps"] == pytest.approx(B.weight_bytes(r["fmt"], shape, r["experts_touched"]) / 4e3)
    assert rows[0]["experts_touched"] == 4
    assert "w4a16" in B.gpu_table(rows) and rows[1]["ratio_vs_m1"] == 1.0


@pytest.mark.aot
def test_moe_static_mxfp4_row() -> None:
    """The MXFP4 (W4A4) row next to W4A8: its own quantizer and stages, E2M1 + E8M0 bytes in the floor."""
    from bench import moe as B

    s = B.KIMI_MOE
    E, H, I = s["E"], s["H"], s["I"]
    assert B.weight_bytes("mxfp4", s, 8) == pytest.approx(8 * (3 * I * H / 2 + 3 * I * H / 32) + E * H * 2)
    r = B.static_row("mxfp4", "gfx950", 1)
    assert [k["kernel"] for k in r.kernels] == ["moe_gate_gemm", "quant_mxfp4", "moe_stage1_mxfp4", "quant_mxfp4",
                                                "moe_stage2_mxfp4"]
    assert r.predicted_us >= r.floor_us > 0 and all(k["resources"]["spills"] == 0 for k in r.kernels)
