"""The MLA bench (`python -m bench.mla`): its static figures agree with each other (KV floor =
bytes / bandwidth, the model floor from the problem model, fraction = floor / prediction <= 1,
q4/q1 = the ratio of the two predictions), and the GPU row is assembled right (dry run on the
CPU with a stub timer: no timing is taken or shown)."""
from __future__ import annotations

import json

import pytest

from bench import mla as BM
from kdsl.targets import get_target

ARCH, CTX, BATCH = "gfx942", 8192, 4


def test_kv_bytes_and_floor_by_hand() -> None:
    assert BM.kv_bytes(BATCH, CTX) == BATCH * CTX * 576 * 2
    assert BM.key_problem(4) == {"QL": 4, "H": 64, "DL": 512, "DR": 64, "PS": 64}
    rows = [{"arch": "a", "ctx": 1, "batch": 2, "q_len": 1, "t": 2.0}, {"arch": "a", "ctx": 1, "batch": 2, "q_len": 4, "t": 3.0}]
    BM.with_ratios(rows, "t")
    assert rows[1]["q4_over_q1"] == pytest.approx(1.5) and "q4_over_q1" not in rows[0]


@pytest.mark.aot
def test_static_rows_are_consistent(tmp_path) -> None:
    from autotune.problems import model_for

    import triton

    from autotune.store import file_path, load_file

    t = get_target(ARCH)
    rows = BM.with_ratios([BM.static_row(ARCH, CTX, BATCH, q) for q in (1, 4)], "predicted_us")
    pm = model_for(BM.KERNEL)
    # "no spills" is a fact about the tuned configs at the Triton version their files record (another
    # version compiles other ISA: Triton 3.8 spills one register at some of them); the rest holds anyway
    tuned_with = {load_file(file_path(BM.KERNEL, ARCH, BM.key_problem(q)))["target"]["triton_version"] for q in (1, 4)}
    for r in rows:
        assert r.ok and r.lds_bytes <= t.lds_bytes, r.errors
        if tuned_with == {triton.__version__}:
            assert r.spills == 0, r.errors
        prob = {**BM.key_problem(r.q_len), "CTX": CTX}
        m = BATCH * r.q_len
        want = max(pm.bytes_fn(prob, m) / (t.hbm_gbps * 1e3), pm.flops_fn(prob, m) / (t.peak_tflops["bf16"] * 1e6))
        assert r.floor_us == pytest.approx(want, rel=1e-3)
        assert r.kv_floor_us == pytest.approx(BM.kv_bytes(BATCH, CTX) / (t.hbm_gbps * 1e3))
        assert r.kv_floor_us <= r.floor_us <= r.predicted_us
        assert 0 < r.roofline_fraction <= 1
        assert r.roofline_fraction == pytest.approx(r.floor_us / r.predicted_us, rel=1e-3)
        assert r.splits >= 1 and r.programs > 0 and r.mfma_main_loop > 0
    assert rows[1].q4_over_q1 == pytest.approx(rows[1].predicted_us / rows[0].predicted_us)
    assert "q4/q1" in BM.static_table(rows)

    out = tmp_path / "mla.json"  # the CLI writes the same rows (the compile is memoized)
    assert BM.main(["--static", "--arch", ARCH, "--ctx", str(CTX), "--batch", str(BATCH), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == "static" and len(doc["rows"]) == 2
    assert doc["rows"][1]["q4_over_q1"] == pytest.approx(rows[1].q4_over_q1)


def test_gpu_row_dry_run(monkeypatch) -> None:
    """The measured row at a tiny shape through the interpreter: kdsl agrees with the torch side,
    and the bandwidth, %HBM and speed-up follow from the (stub) times."""
    from bench import timing

    monkeypatch.setattr(timing, "time_interleaved", lambda fns, reps=50: {"kdsl": 2.0, "torch": 3.0})
    kw = dict(heads=2, latent=32, rope=16, page=8, device="cpu")
    rows = [BM.gpu_row(2, 40, q, **kw) for q in (1, 4)]
    for r in rows:
        assert r["max_rel_err_vs_torch"] < 2e-2  # bf16 output and bf16 probabilities on both sides
        assert r["speedup_vs_torch"] == pytest.approx(1.5)
        assert r["kv_bytes"] == 2 * 40 * 48 * 2 and r["kv_gbps"] == pytest.approx(r["kv_bytes"] / 2e3)
    BM.with_ratios(rows, "kdsl_us")
    assert rows[1]["q4_over_q1"] == pytest.approx(1.0)
    assert "q4/q1" in BM.gpu_table(rows)
