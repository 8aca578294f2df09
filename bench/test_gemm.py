"""GEMM suite. On a GPU: kdsl vs torch, measured (pytest-benchmark times the kdsl kernel; the
interleaved CUDA-event comparison goes into extra_info and the end table). Everywhere: the static
figures per arch from the AOT report (compile-only; interpreter timings are never reported)."""
from __future__ import annotations

import math

import pytest
import torch

from bench import roofline as R
from kdsl.registry import discover

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (static figures run instead)")


def test_gemm_static(gemm_kernel: str, arch: str, problem: tuple[str, int], static_records: list) -> None:
    shape, m = problem
    n, k = R.KIMI_SHAPES[shape]
    rec = R.static_record(discover()[gemm_kernel], arch, m, n, k, shape=shape)
    static_records.append(rec)
    assert rec.ok, f"{gemm_kernel} on {arch}: {rec.errors}"
    assert rec.floor_us > 0 and rec.predicted_us >= rec.floor_us
    assert 0 < rec.roofline_fraction <= 1 and not math.isnan(rec.roofline_fraction)


@gpu
@pytest.mark.gpu
def test_gemm_gpu(gemm_kernel: str, problem: tuple[str, int], benchmark, gpu_records: list) -> None:
    from bench.gemm import gpu_record, make_inputs

    shape, m = problem
    n, k = R.KIMI_SHAPES[shape]
    kernel = discover()[gemm_kernel]
    row = gpu_record(kernel, m, n, k, shape=shape)
    gpu_records.append(row)
    benchmark.extra_info.update(row)
    # pytest-benchmark's own (wall-clock, synchronized) statistics of the kdsl kernel alone
    target = __import__("kdsl").current_target()
    prob = R.problem_for(kernel, m, n, k)
    args = make_inputs(kernel, prob, target, "cuda")
    ordered = [args[p] for p in kernel.signature.order]

    def run():
        kernel(*ordered, config=row["config"])
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=20, warmup_rounds=3)
    assert row["kdsl_us"] > 0 and row["roofline_pct"] <= 100
