"""Shared test settings: hypothesis profile sized for 2 CI cores, and the output-poisoning helper."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

settings.register_profile("ci", max_examples=8, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=60, deadline=None)
settings.load_profile(os.environ.get("KDSL_HYPOTHESIS_PROFILE", "ci"))


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """An output buffer filled with NaN (floats) or a sentinel (ints), so unwritten rows show."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -123, dtype=dtype, device=device)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup` (scripts/test.sh) the workers take the tests one at a time, in
    collection order after the xdist groups: the `slow` tests go first, so that no minute-long test
    starts last while the other worker idles; the fast ones even out the end. Other modes keep the
    collection order (`--dist load` hands out long runs of consecutive tests at the start)."""
    if config.getoption("dist", "no") == "loadgroup":
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)   # stable: files stay together


def has_gpu() -> bool:
    return torch.cuda.is_available()


gpu = pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
