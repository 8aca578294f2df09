"""The static bench path (bench/roofline.py, `python -m bench.gemm`) gives sane figures: a positive
floor, a prediction at or above it, a roofline fraction in (0, 1], and the ISA counts it reports."""
from __future__ import annotations

import json

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
