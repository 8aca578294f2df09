"""models.graphs: batch buckets and the static-buffer protocol of StepGraphs (the CUDA-graph path is
in tests/test_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from models.graphs import StepGraphs, bucket


def test_bucket_is_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 64, 128]
    with pytest.raises(ValueError, match="batch must be >= 1"):
        bucket(0)


def test_static_mode_runs_on_its_own_buffers_per_key():
    state = torch.zeros(3, dtype=torch.int32)
    seen = []

    def fn(x):
        seen.append(x.data_ptr())
        state.add_(1)                         # a state tensor the step advances (cache lengths)
        return x * 2

    g = StepGraphs("static", [state])
    a, b = torch.arange(4.0), torch.arange(4.0) + 10
    assert torch.equal(g(("t", 4, 1), fn, a), a * 2)
    out = g(("t", 4, 1), fn, b)
    assert torch.equal(out, b * 2) and seen[0] == seen[1] != a.data_ptr()     # same static buffer, not the input
    g(("t", 4, 2), fn, a)
    assert len(g.entries) == 2 and len({seen[0], seen[2]}) == 2
    assert state.tolist() == [3, 3, 3]        # static mode runs every call once (no warm-up)


def test_off_mode_is_a_plain_call_and_bad_modes_are_named():
    x = torch.ones(2)
    assert StepGraphs("off")(("k",), lambda t: t + 1, x).tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="graphs mode must be one of"):
        StepGraphs("sometimes")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a GPU"):
            StepGraphs("on")
