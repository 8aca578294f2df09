"""Loops and grids on the interpreter against torch at ragged sizes: `tile.start`, folds with no
state, scalar index loops and steps other than the block, per-fold num_stages, grouped and
persistent program orders (with the worked GEMMs of docs/my_kernels.py); AOT for gfx942, gfx950
and sm90 with no spills, and the static comparison of the three GEMM schedules."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given, strategies as st

import kdsl as kd
from tests.conftest import poisoned

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "docs"))
import my_kernels as mk  # noqa: E402


@kd.kernel(example={"M": 64, "N": 300})
def l_start(x: kd.In["M", "N", kd.f32], out: kd.Out["M", "N", kd.f32], every: kd.Out["M", "N", kd.f32]):
    """out[m, n] = x + the start of n's fold tile (a stateless fold); every: only tiles 2 blocks apart."""
    m, = kd.grid(kd.tile("M", domain=(1, 2, 4), default=2))

    def body(n):
        out[m, n] = x[m, n] + n.start.to(kd.f32)

    kd.fold(kd.tiles("N", block=16, num_stages=3), (), body)

    def skip(n):
        every[m, n] = x[m, n] * 2.0

    kd.fold(kd.tiles("N", block=16, step=32), None, skip)


@kd.kernel(example={"M": 64, "N": 300})
def l_indices(x: kd.In["M", "N", kd.f32], out: kd.Out["M", "N", kd.f32], acc: kd.Out["M", kd.f32]):
    """A scalar loop over columns 1, 4, 7, ...: out[:, i] = x[:, i] * i; acc = their sum."""
    m, = kd.grid(kd.tile("M", domain=(1, 2, 4, 8), default=4))

    def body(i, s):
        col = x.load(m, i)
        out[m, i] = col * i.to(kd.f32)
        return s + col

    acc[m] = kd.fold(kd.indices(kd.dim("N"), start=1, step=3, num_stages=2), kd.zeros((m,), kd.f32), body)


@given(M=st.integers(1, 9), N=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_tile_start_stateless_step(M, N, seed):
    x = torch.randn(M, N, generator=torch.Generator().manual_seed(seed))
    out, every = poisoned((M, N), torch.float32), poisoned((M, N), torch.float32)
    l_start(x, out, every)
    starts = (torch.arange(N) // 16 * 16).float()
    torch.testing.assert_close(out, x + starts, rtol=0, atol=0)
    hit = (torch.arange(N) // 16) % 2 == 0                            # tiles 0, 2, 4, ...
    assert torch.equal(every[:, hit], x[:, hit] * 2) and every[:, ~hit].isnan().all()


@given(M=st.integers(1, 9), N=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_index_loop(M, N, seed):
    x = torch.randn(M, N, generator=torch.Generator().manual_seed(seed))
    out, acc = poisoned((M, N), torch.float32), poisoned((M,), torch.float32)
    l_indices(x, out, acc)
    cols = torch.arange(1, N, 3)
    torch.testing.assert_close(out[:, cols], x[:, cols] * cols.float(), rtol=0, atol=0)
    rest = torch.ones(N, dtype=torch.bool)
    rest[cols] = False
    assert out[:, rest].isnan().all()
    torch.testing.assert_close(acc, x[:, cols].sum(1), rtol=1e-6, atol=1e-6)


def test_num_stages_reaches_the_loop():
    src = l_indices.source({}, "gfx942")
    assert "tl.range(1, N, 3, num_stages=2)" in src
    assert "range(1, N, 3)" in l_indices.source({}, "interpret")


@pytest.mark.parametrize("M,N,K,P,cfg", [(37, 50, 70, 3, {"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 2}),
                                          (100, 20, 33, 5, {"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 4}),
                                          (16, 16, 16, 7, {"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 1})])
def test_persistent_and_grouped_gemm(M, N, K, P, cfg):
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    ref = (x.double() @ w.double().T)
    tol = 2.0 ** -7 * ref.abs().max().item() + 1e-6                   # one bf16 rounding of the output
    for kern, extra in ((mk.gemm_persistent, (P,)), (mk.gemm_grouped, ())):
        out = poisoned((M, N), torch.bfloat16)
        kern(x, w, out, *extra, config={**cfg, "BLOCK_K": 32})
        assert not out.isnan().any(), kern.name
        assert (out.double() - ref).abs().max().item() <= tol, kern.name


def test_grouped_order_visits_every_tile_once():
    """The grouped remap is a permutation of the tile ids, for ragged tile counts and group sizes."""
    for tm in range(1, 9):
        for tn in range(1, 6):
            for G in (1, 2, 3, 8):
                seen = set()
                for lin in range(tm * tn):
                    width = tn * G
                    first = lin // width * G
                    gsz = min(tm - first, G)
                    seen.add((first + (lin % width) % gsz, (lin % width) // gsz))
                assert seen == {(i, j) for i in range(tm) for j in range(tn)}


def test_persistent_schedule_rejects_exit_if():
    @kd.kernel(name="l_persist_exit")
    def k(x: kd.In["M", kd.f32], out: kd.Out["M", kd.f32], P: kd.Dim):
        m, = kd.grid(kd.tile("M", block=16), programs="P")
        kd.exit_if(m.start > 5)
        out[m] = x[m]

    with pytest.raises(kd.TraceError, match="persistent"):
        k.source({}, "interpret")


@pytest.mark.aot
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm90"])
@pytest.mark.parametrize("kern", [l_start, l_indices], ids=lambda k: k.name)
def test_loops_compile_without_spills(kern, arch):
    from kdsl import aot

    r = aot.report(kern, arch)
    assert r.ok and r.spills == 0, (r.errors, r.text())


@pytest.mark.aot
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm90"])
def test_gemm_schedules_static(arch):
    """Same tile config, three schedules: the remaps cost a few scalar instructions, no registers
    spill and the MFMA/wgmma main loop is the same."""
    from kdsl import aot

    reports = {k.name: aot.report(k, arch) for k in (mk.gemm_persistent, mk.gemm_grouped)}
    for name, r in reports.items():
        assert r.ok and r.spills == 0, (name, r.errors)
        assert r.matrix_instructions, name


@kd.kernel(static=("S",), example={"S": 3, "M": 8, "N": 40})
def l_unrolled(part: kd.In["S", "M", "N", kd.f32], out: kd.Out["M", "N", kd.f32]):
    """out = part[0] + part[1] + ... in split order, the split loop unrolled (S static)."""
    m, n = kd.grid(kd.tile("M", domain=(1, 2, 4, 8), default=4), kd.tile("N", domain=(16, 32), default=16))
    out[m, n] = kd.fold(kd.tiles(start=1, stop=kd.dim("S"), block=1, label="s", unroll=True), part[0, m, n],
                        lambda s, acc: acc + kd.sum(part[s, m, n], axis=s))


@pytest.mark.parametrize("S", [1, 3, 5])
def test_unrolled_fold(S):
    part = torch.randn(S, 7, 37, generator=torch.Generator().manual_seed(S))
    out = poisoned((7, 37), torch.float32)
    l_unrolled(part, out)
    ref = part[0].clone()
    for s in range(1, S):
        ref = ref + part[s]
    assert torch.equal(out, ref)
    src = l_unrolled.source({}, "gfx942", {"S": S})
    assert f"tl.static_range(1, {S}, 1)" in src


def test_unroll_needs_constant_bounds():
    @kd.kernel(example={"S": 3, "M": 8})
    def l_bad(part: kd.In["S", "M", kd.f32], out: kd.Out["M", kd.f32]):
        m, = kd.grid(kd.tile("M", domain=(8,), default=8))
        out[m] = kd.fold(kd.tiles(start=0, stop=kd.dim("S"), block=1, label="s", unroll=True),
                         kd.zeros((m,), kd.f32), lambda s, acc: acc + kd.sum(part[s, m], axis=s))

    with pytest.raises(kd.TraceError, match="unroll=True needs constant loop bounds"):
        l_bad.source({}, "gfx942")
