"""Record mode: launches on meta tensors are captured with the recording target's tuned config."""
import pytest
import torch

import kdsl as kd
from kdsl.errors import LaunchError
from ops.gemm import gemm_w4a8


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_record_captures_launch_without_running():
    x, xs = _meta(4, 7168, dtype=torch.int8), _meta(4)
    w, ws = _meta(4096, 7168 // 8, dtype=torch.int32), _meta(4096)
    with kd.recording("gfx942") as rec:
        assert kd.current_target().name == "gfx942"
        gemm_w4a8(x, xs, w, ws)
    assert kd.current_target().name != "gfx942" or torch.cuda.is_available()
    (r,) = rec.launches
    assert r.kernel.name == "gemm_w4a8" and r.target == "gfx942"
    assert r.dims == {"M": 4, "K": 7168, "N": 4096}
    assert r.grid[0] * r.config["BLOCK_M"] >= 4 and r.grid[1] * r.config["BLOCK_N"] >= 4096


def test_record_still_checks_arguments():
    x, xs = _meta(4, 7168, dtype=torch.int8), _meta(4)
    w, ws = _meta(4096, 7168 // 8, dtype=torch.int32), _meta(4000)
    with kd.recording("gfx950"), pytest.raises((LaunchError, ValueError)):
        gemm_w4a8(x, xs, w, ws)
