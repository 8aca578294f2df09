"""Cached launchers: a repeated launch with the same shapes, strides, dtypes, devices, dims and
config reuses a bound launcher (no re-binding); anything else takes the full path, so every bind()
error stays as it was and results match the uncached path exactly (interpreter)."""
from __future__ import annotations

import importlib

import pytest
import torch

import kdsl as kd

kk = importlib.import_module("kdsl.kernel")


@kd.kernel(name="_launch_axpy")
def axpy(x: kd.In["M", "N", kd.f32], y: kd.In["M", "N", kd.f32], out: kd.Out["M", "N", kd.f32],
         a: kd.Scalar[kd.f32], R: kd.Dim):
    m, n = kd.grid(kd.tile("M", block=4), kd.tile("N", block=16))
    out[m, n] = x[m, n] * a + y[m, n] * R


def _args(M=5, N=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, N, generator=g), torch.randn(M, N, generator=g), torch.full((M, N), float("nan"))


def test_repeated_launch_hits_the_cache_and_matches() -> None:
    axpy._launchers.clear()
    x, y, out = _args()
    for a in (0.5, 2.0, -1.0):  # scalar values vary, the launcher is the same
        out.fill_(float("nan"))
        axpy(x, y, out, a, 3)
        torch.testing.assert_close(out, x * a + y * 3)
    assert len(axpy._launchers) == 1
    xt = torch.randn(20, 5).t()  # same shape, other strides: a new launcher, still right
    axpy(xt, y, out, 1.0, 2)
    torch.testing.assert_close(out, xt + y * 2)
    axpy(x, y, out, 1.0, R=4)  # keyword arguments take the cache too
    torch.testing.assert_close(out, x + y * 4)
    assert len(axpy._launchers) == 3


def test_cached_and_uncached_paths_agree() -> None:
    x, y, out = _args(7, 33, seed=1)
    ref = out.clone()
    axpy(x, y, out, 0.25, 1)
    kk.LAUNCH_CACHE["enabled"] = False
    try:
        axpy(x, y, ref, 0.25, 1)
    finally:
        kk.LAUNCH_CACHE["enabled"] = True
    assert torch.equal(out, ref)


def test_bad_arguments_still_rejected_after_a_cached_launch() -> None:
    x, y, out = _args()
    axpy(x, y, out, 1.0, 1)
    with pytest.raises(kd.LaunchError, match="parameter 'y'.*dtype must be torch.float32, got torch.float64"):
        axpy(x, y.double(), out, 1.0, 1)
    with pytest.raises(kd.LaunchError, match="parameter 'R'.*Dim argument must be an int, got True"):
        axpy(x, y, out, 1.0, True)  # True == 1 and hashes alike: the key keeps the type
    with pytest.raises(kd.LaunchError, match="parameter 'a'.*scalar argument must be a number"):
        axpy(x, y, out, "1", 1)
    with pytest.raises(kd.LaunchError, match="shape mismatch on dim N"):
        axpy(x, y[:, :3], out, 1.0, 1)
    with pytest.raises(kd.LaunchError, match="takes 5 arguments"):
        axpy(x, y, out, 1.0, 1, 2)
    with pytest.raises(kd.LaunchError, match="missing argument"):
        axpy(x, y, out, 1.0)


def test_config_is_part_of_the_key() -> None:
    @kd.kernel(name="_launch_cfg")
    def tiled(x: kd.In["N", kd.f32], out: kd.Out["N", kd.f32]):
        (n,) = kd.grid(kd.tile("N", domain=(8, 16)))
        out[n] = x[n] + 1.0

    x = torch.randn(40)
    out = torch.empty(40)
    sps = {tiled(x, out, config={"BLOCK_N": b}).config["BLOCK_N"] for b in (8, 16, 8)}
    assert sps == {8, 16} and len(tiled._launchers) == 2
    with pytest.raises(kd.ConfigError, match="BLOCK_N=32 is outside its domain"):
        tiled(x, out, config={"BLOCK_N": 32})
    torch.testing.assert_close(out, x + 1)


def test_record_mode_never_uses_a_cached_launcher() -> None:
    x, y, out = _args()
    axpy(x, y, out, 1.0, 1)  # cached
    out.fill_(float("nan"))
    with kd.recording("gfx942") as rec:
        axpy(x, y, out, 1.0, 1)
    assert len(rec.launches) == 1 and out.isnan().all()  # logged, not run


def test_bench_launch_runs() -> None:
    from bench import launch

    assert launch.main(["-n", "2", "--rounds", "1", "--json"]) == 0
    x, y, out = _args()  # the stubbed compiled functions are gone again: launches run
    axpy(x, y, out, 1.0, 1)
    torch.testing.assert_close(out, x + y)


def test_size_one_dims_share_a_launcher_and_stay_right() -> None:
    """A contiguous tensor is keyed without its strides: two [1, N] tensors whose row strides differ
    (irrelevant: row 0 is the only row) take one launcher, and each result reads its own data."""
    axpy._launchers.clear()
    big = torch.randn(8, 40)
    x1 = big[:1, :20]                              # row stride 40
    x2 = torch.randn(1, 20)                        # row stride 20
    assert x1.is_contiguous() and x2.is_contiguous() and x1.stride() != x2.stride()
    y = torch.randn(1, 20)
    for x in (x1, x2, x1):
        out = torch.full((1, 20), float("nan"))
        axpy(x, y, out, 2.0, 1)
        torch.testing.assert_close(out, x * 2 + y)
    assert len(axpy._launchers) == 1


@kd.kernel(name="_launch_rows_scaled", static=("N",), contiguous=("x", "out"))
def rows_scaled(x: kd.In["S", "M", "N", kd.f32], y: kd.In["M", "N", kd.f32], out: kd.Out["S", "M", "N", kd.f32]):
    s, m, n = kd.grid(kd.tile("S", block=1), kd.tile("M", block=4), kd.tile("N", block=16))
    out[s, m, n] = x[s, m, n] * 2.0 + y[m, n]


def test_contiguous_operands_take_strides_from_static_dims() -> None:
    """`contiguous` operands: a stride over static dims only is a constant of the generated code (no
    argument); one over a dynamic dim (S's, M x N) stays an argument; y keeps all its strides. A
    launch with a non-contiguous one is refused, naming it; the results are the plain math."""
    sp = rows_scaled.specialize({}, "interpret", {"N": 20})
    strides = [p.name for p in sp.params if p.kind == "stride"]
    assert strides == ["x_s0", "y_s0", "y_s1", "out_s0"]
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(3, 5, 20, generator=g), torch.randn(7, 20, generator=g)[:5]   # y: a view of a bigger one
    big = torch.full((3 * 5 * 20 + 16,), float("nan"))
    out = big[:300].view(3, 5, 20)
    rows_scaled(x, y, out)
    torch.testing.assert_close(out, x * 2 + y)
    assert big[300:].isnan().all()
    with pytest.raises(kd.LaunchError, match="parameter 'x'.*must be contiguous"):
        rows_scaled(torch.randn(3, 20, 5).transpose(1, 2), y, out)
    with pytest.raises(kd.ConfigError, match="contiguous names operands"):
        kd.kernel(name="_launch_bad_contig", contiguous=("nope",))(_copy_rows)


def _copy_rows(x: kd.In["M", kd.f32], out: kd.Out["M", kd.f32]):
    (m,) = kd.grid(kd.tile("M", block=4))
    out[m] = x[m]
