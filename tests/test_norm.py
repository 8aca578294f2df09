"""RMSNorm (+ fused residual add) and SiLU*mul against their torch references (interpreter)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from ops import norm
from tests.conftest import poisoned

# bf16 outputs: kernel and reference both compute in f32 and round once (RNE), so they agree to
# one bf16 ulp (a different f32 summation order can flip a rounding): rtol 2^-7.
BF16_TOL = dict(atol=1e-2, rtol=2 ** -7)


@given(m=st.integers(1, 5), d=st.sampled_from([16, 48, 96, 130]))
def test_rmsnorm_matches_ref(m: int, d: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + d)
    x = torch.randn(m, d, generator=g).bfloat16()
    w = (torch.rand(d, generator=g) + 0.5).bfloat16()
    y = norm.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y.float(), norm.rmsnorm_ref(x, w, 1e-5).float(), **BF16_TOL)


def test_rmsnorm_residual_returns_both() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 80, generator=g).bfloat16()
    res = torch.randn(3, 2, 80, generator=g).bfloat16()
    res_before = res.clone()
    w = torch.randn(80, generator=g).bfloat16()
    y, r = norm.rms_norm(x, w, 1e-6, residual=res)
    y_ref, r_ref = norm.rmsnorm_add_ref(x, res, w, 1e-6)
    assert torch.equal(r, r_ref)  # the sum is one f32 add rounded once: exact
    torch.testing.assert_close(y.float(), y_ref.float(), **BF16_TOL)
    assert torch.equal(res, res_before)
    assert y.shape == x.shape and r.shape == x.shape


def test_rmsnorm_residual_strided_view() -> None:
    """A residual read through a view of a wider buffer (rows with a stride): the sum is exact and
    the buffer is left as it was (the new residual is a tensor of its own)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 48, generator=g).bfloat16()
    buf = torch.randn(4, 80, generator=g).bfloat16()
    buf_before = buf.clone()
    w = (torch.rand(48, generator=g) + 0.5).bfloat16()
    y, r = norm.rms_norm(x, w, 1e-6, residual=buf[:, 16:64], config={"BLOCK_D": 16})
    y_ref, r_ref = norm.rmsnorm_add_ref(x, buf[:, 16:64], w, 1e-6)
    assert torch.equal(r, r_ref) and torch.equal(buf, buf_before)
    torch.testing.assert_close(y.float(), y_ref.float(), **BF16_TOL)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rmsnorm_out_writes_only_its_half_of_a_wider_row(backend: str) -> None:
    """out= one half of a [T, 2D] row buffer (the draft's attention input): the same bits as a new
    tensor, the other half and the guard rows around the buffer untouched (poisoned first)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 48, generator=g).bfloat16()
    w = (torch.rand(48, generator=g) + 0.5).bfloat16()
    buf = poisoned((3 + 2, 96), torch.bfloat16)
    rows = buf[1:4]
    got = norm.rms_norm(x, w, 1e-6, backend=backend, out=rows[:, 48:])
    assert got.data_ptr() == rows[:, 48:].data_ptr()
    assert torch.equal(rows[:, 48:], norm.rms_norm(x, w, 1e-6, backend=backend))
    assert buf[0].isnan().all() and buf[4].isnan().all() and rows[:, :48].isnan().all()


def test_rmsnorm_out_errors() -> None:
    x = torch.randn(2, 16).bfloat16()
    w = torch.ones(16).bfloat16()
    with pytest.raises(ValueError, match="out must have x's shape"):
        norm.rms_norm(x, w, out=torch.empty(2, 8).bfloat16())
    with pytest.raises(TypeError, match="out must be bfloat16"):
        norm.rms_norm(x, w, out=torch.empty(2, 16))
    with pytest.raises(ValueError, match="out must be contiguous along its last dim"):
        norm.rms_norm(x, w, out=torch.empty(16, 2).bfloat16().t())
    with pytest.raises(ValueError, match="no residual"):
        norm.rms_norm(x, w, residual=x, out=torch.empty_like(x))


def test_rmsnorm_kernel_writes_every_row() -> None:
    x = torch.randn(4, 32).bfloat16()
    w = torch.randn(32).bfloat16()
    out = poisoned((4, 32), torch.bfloat16)
    norm.rmsnorm(x, w, out, 1e-5)
    assert not out.isnan().any()


@given(m=st.integers(1, 4), i=st.sampled_from([8, 40, 300]))
def test_silu_mul(m: int, i: int) -> None:
    x = torch.randn(m, 2 * i, generator=torch.Generator().manual_seed(i + m)).bfloat16()
    y = norm.silu_and_mul(x, config={"BLOCK_I": 256})
    torch.testing.assert_close(y.float(), norm.silu_mul_ref(x).float(), **BF16_TOL)


def test_silu_mul_kernel_poisoned_and_checks() -> None:
    x = torch.randn(2, 600).bfloat16()
    out = poisoned((2, 300), torch.bfloat16)
    norm.silu_mul(x, out, config={"BLOCK_I": 256})
    assert not out.isnan().any()
    with pytest.raises(Exception, match="gate"):
        norm.silu_mul(x, torch.empty(2, 200, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="even"):
        norm.silu_and_mul(torch.randn(2, 5).bfloat16())


def _run_norm_kernel(name: str, x, res, w, block_d: int) -> list[torch.Tensor]:
    """Every output of one norm kernel at BLOCK_D=block_d, into poisoned buffers."""
    m, d = x.shape
    y = poisoned((m, d), torch.bfloat16)
    cfg = {"BLOCK_D": block_d}
    if name == "rmsnorm":
        norm.rmsnorm(x, w, y, 1e-6, config=cfg)
        return [y]
    if name == "rmsnorm_add":
        r = poisoned((m, d), torch.bfloat16)
        norm.rmsnorm_add(x, res, w, y, r, 1e-6, config=cfg)
        return [y, r]
    q, s = poisoned((m, d), torch.int8), poisoned((m,), torch.float32)
    if name == "rmsnorm_quant":
        norm.rmsnorm_quant(x, w, y, q, s, 1e-6, config=cfg)
        return [y, q, s]
    r = poisoned((m, d), torch.bfloat16)
    norm.rmsnorm_add_quant(x, res, w, y, q, s, r, 1e-6, config=cfg)
    return [y, q, s, r]


@pytest.mark.parametrize("name", ["rmsnorm", "rmsnorm_add", "rmsnorm_quant", "rmsnorm_add_quant"])
@pytest.mark.parametrize("d", [48, 130])
def test_norm_chunks_change_no_bit(name: str, d: int) -> None:
    """One program per (row, BLOCK_D chunk): every chunk size gives the bits of the row-wide kernel
    (each program reduces over the whole row), a ragged last chunk included; `res` is only read."""
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(3, d, generator=g) * 3).bfloat16()
    res = torch.randn(3, d, generator=g).bfloat16()
    res_before = res.clone()
    w = (torch.rand(d, generator=g) + 0.5).bfloat16()
    whole = _run_norm_kernel(name, x, res, w, norm.WHOLE_ROW)
    assert all(not t.isnan().any() and not (t == -123).all(-1).any() for t in whole)
    y_ref, r_ref = norm.rmsnorm_add_ref(x, res, w, 1e-6) if "add" in name else (norm.rmsnorm_ref(x, w, 1e-6), None)
    torch.testing.assert_close(whole[0].float(), y_ref.float(), **BF16_TOL)
    if r_ref is not None:
        assert torch.equal(whole[-1], r_ref)
    for bd in (16, 32, 64):
        got = _run_norm_kernel(name, x, res, w, bd)
        for a, b in zip(got, whole):
            assert torch.equal(a, b), f"BLOCK_D={bd} changed {name}'s output"
    assert torch.equal(res, res_before)


def test_norm_chunk_rule() -> None:
    """A chunk wider than the (padded) row is refused by name, except the row-wide default."""
    from kdsl.errors import ConfigError

    x = torch.randn(2, 48).bfloat16()
    with pytest.raises(ConfigError, match="BLOCK_D"):
        norm.rmsnorm(x, torch.randn(48).bfloat16(), torch.empty_like(x), 1e-6, config={"BLOCK_D": 128})


def test_norm_bad_weight() -> None:
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(7).bfloat16())


@pytest.mark.aot
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm90"])
def test_aot_small_ops(arch: str) -> None:
    """Kimi shapes (hidden 7168, MoE 2x2048) compile with no spills at defaults."""
    from kdsl import aot

    for k in (norm.rmsnorm, norm.rmsnorm_add, norm.silu_mul):
        r = aot.check(k, arch)
        assert r.spills == 0
    r = aot.check(norm.rmsnorm_add, arch, config={"BLOCK_D": 1024})  # the chunked form
    assert r.spills == 0


# --- kdsl extension used by these ops: reductions, sigmoid and small (mul+sum) dots run in the
# interpreter (tl.sum/tl.max/tl.sigmoid are JITFunctions that the interpreter cannot call, so
# the interpret target emits tl.reduce with the standard combine functions and 1/(1+exp(-x)))
import kdsl as kd  # noqa: E402


@kd.kernel(static=("N", "K"), example={"M": 4, "N": 8, "K": 8})
def attn_test_reduce_ops(x: kd.In["M", "N", kd.f32], w: kd.In["N", "K", kd.f32], out: kd.Out["M", kd.f32],
                         dout: kd.Out["M", "K", kd.f32]):
    m, = kd.grid(kd.tile("M", "BLOCK_M", domain=(4, 8), default=4))
    n = kd.full_range("N")
    k = kd.full_range("K")
    xv = x[m, n]
    out[m] = kd.sum(xv, axis=n) + kd.max(xv, axis=n) * 2 + kd.min(xv, axis=n) * 3 + kd.sum(kd.sigmoid(xv), axis=n)
    dout[m, k] = kd.dot(xv, w[n, k])  # 4x8x8 tile: the multiply+sum form


def test_kdsl_interpreter_reductions() -> None:
    x, w = torch.randn(6, 8), torch.randn(8, 8)
    out, dout = poisoned((6,), torch.float32), poisoned((6, 8), torch.float32)
    attn_test_reduce_ops(x, w, out, dout)
    want = x.sum(1) + x.amax(1) * 2 + x.amin(1) * 3 + torch.sigmoid(x).sum(1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dout, x @ w, atol=1e-5, rtol=1e-5)
