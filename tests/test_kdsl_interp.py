"""Tier 1: kdsl semantics through Triton's interpreter on CPU tensors, against torch.

Small shapes with tails in every tiled dim, fresh random data, outputs poisoned before each run.
Tolerances: integer paths and pure data movement exact; bf16 casts bit-exact against torch;
f32 math 1e-6 relative (softmax 1e-6 absolute); bf16 dot vs float64 within 2^-22 * sum|a||b|.
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given, strategies as st

import kdsl as kd
from kdsl import types as T
from tests.conftest import poisoned

IT = "interpret"
B16 = {"BLOCK_M": 16, "BLOCK_N": 16}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# elementwise, broadcasting by axis identity, automatic masks

@kd.kernel
def i_bcast(x: kd.In["M", "N", kd.f32], s: kd.In["M", kd.f32], b: kd.In["N", kd.f32],
            out: kd.Out["M", "N", kd.f32]):
    m, n = kd.grid("M", "N")
    out[m, n] = x[m, n] * s[m] + b[n]          # s over (m,), b over (n,): no [:, None] anywhere


@kd.kernel
def i_transpose(x: kd.In["M", "N", kd.f32], y: kd.In["N", "M", kd.f32], out: kd.Out["M", "N", kd.f32]):
    m, n = kd.grid("M", "N")
    out[m, n] = y[n, m] * 2.0 + x[m, n]        # y[n, m] is an (n, m) value stored into (m, n)


@given(M=st.integers(1, 40), N=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_broadcast_tails(M, N, seed):
    g = gen(seed)
    x, s, b = torch.randn(M, N, generator=g), torch.randn(M, generator=g), torch.randn(N, generator=g)
    out = poisoned((M, N), torch.float32)
    i_bcast(x, s, b, out, config=B16)
    torch.testing.assert_close(out, x * s[:, None] + b[None, :], rtol=1e-6, atol=1e-6)


def test_permuted_axes_store():
    g = gen(1)
    M, N = 19, 23
    x, y = torch.randn(M, N, generator=g), torch.randn(N, M, generator=g)
    out = poisoned((M, N), torch.float32)
    sp = i_transpose(x, y, out, config=B16)
    assert "tl.trans(" in sp.source
    torch.testing.assert_close(out, y.T * 2 + x, rtol=0, atol=0)


def test_non_contiguous_strides():
    g = gen(2)
    big = torch.randn(30, 50, generator=g)
    x = big[::2, 3:40]          # strided view: the launcher passes real strides
    s, b = torch.randn(15, generator=g), torch.randn(37, generator=g)
    out = poisoned((15, 37), torch.float32)
    i_bcast(x, s, b, out, config=B16)
    torch.testing.assert_close(out, x * s[:, None] + b, rtol=1e-6, atol=1e-6)


@kd.kernel
def i_fma(a: kd.In["M", "N", kd.f32], b: kd.In["M", kd.f32], out: kd.Out["M", "N", kd.f32]):
    m, n = kd.grid("M", "N")
    p = a[m, n] * b[m]
    out[m, n] = kd.fma(a[m, n], b[m], -p)      # the rounding error of the product: one rounding only


def test_fma_rounds_once():
    g = gen(5)
    M, N = 7, 33
    a, b = torch.randn(M, N, generator=g), torch.randn(M, generator=g)
    out = poisoned((M, N), torch.float32)
    i_fma(a, b, out, config=B16)
    exact = (a.double() * b.double()[:, None] - (a * b[:, None]).double()).float()  # exact in f64
    assert torch.equal(out, exact) and bool((exact != 0).any())


def test_interpreter_fma_rounds_the_exact_sum():
    """kdsl.interp.fma (the interpreter lowering) rounds a * b + c once, also where an f64 sum would
    land on an f32 midpoint: (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is a midpoint and + 2^-80 lies just
    above it, so the answer rounds up; an f64 multiply-add rounds the 2^-80 away and then ties to even."""
    import numpy as np

    from kdsl import interp

    a = np.full(2, 1 + 2.0 ** -12, np.float32)
    c = np.array([2.0 ** -80, -(2.0 ** -80)], np.float32)
    up, down = np.float32(1 + 2.0 ** -11 + 2.0 ** -23), np.float32(1 + 2.0 ** -11)
    assert list(interp.fma(a, a, c).handle.data) == [up, down]
    assert (a.astype(np.float64) * a + c).astype(np.float32)[0] == down  # the double rounding it avoids


@kd.kernel
def i_dot(a: kd.In["M", "K", kd.bf16], b: kd.In["N", "K", kd.bf16], out: kd.Out["M", "N", kd.f32]):
    m, n = kd.grid(kd.tile("M", "BLOCK_M", domain=(16,), default=16),
                   kd.tile("N", "BLOCK_N", domain=(16, 32, 64), default=16))
    out[m, n] = kd.fold(kd.tiles("K", block="BLOCK_K", domain=(32,), default=32), kd.zeros((m, n), kd.f32),
                        lambda k, acc: acc + kd.dot(a[m, k], b[n, k]))


def test_interpreter_dot_does_not_depend_on_the_tile():
    """On the interpreter a dot's output does not depend on the tile's width (kdsl.interp.dot: f64
    products and sum, one rounding, as a matrix instruction sums an output's K products at any tile
    width; numpy's f32 matmul changed bits with it), and each K step adds the exact dot rounded once."""
    g = gen(9)
    M, N, K = 16, 64, 96
    a, b = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
    outs = []
    for bn in (16, 32, 64):
        out = poisoned((M, N), torch.float32)
        i_dot(a, b, out, config={"BLOCK_N": bn})
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    want = torch.zeros(M, N, dtype=torch.float32)
    for k0 in range(0, K, 32):
        want = (want.double() + a[:, k0:k0 + 32].double() @ b[:, k0:k0 + 32].double().T).float()
    assert torch.equal(outs[0], want)


# ---------------------------------------------------------------------------------------------
# fold with tuple state: online softmax

@kd.kernel
def i_softmax(x: kd.In["M", "N", kd.f32], out: kd.Out["M", "N", kd.f32]):
    m, = kd.grid(kd.tile("M", domain=(1, 2, 4, 8), default=4))

    def step(n, m_i, l_i):
        v = x.load(m, n, other=float("-inf"))
        m_new = kd.maximum(m_i, kd.max(v, axis=n))
        return m_new, l_i * kd.exp(m_i - m_new) + kd.sum(kd.exp(v - m_new), axis=n)

    m_i, l_i = kd.fold(kd.tiles("N", block="BLOCK_N", domain=(8, 16), default=8),
                       (kd.full((m,), float("-inf"), kd.f32), kd.zeros((m,), kd.f32)), step)

    def write(n, c):
        out[m, n] = kd.exp(x[m, n] - m_i) / l_i
        return c

    kd.fold(kd.tiles("N", block="BLOCK_N"), kd.zeros((m,), kd.f32), write)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_online_softmax_fold():
    g = gen(3)
    x = torch.randn(6, 29, generator=g) * 4
    out = poisoned((6, 29), torch.float32)
    i_softmax(x, out)
    torch.testing.assert_close(out, torch.softmax(x, -1), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# reductions (masked tails take no part), exit_if, atomics, gathers

@kd.kernel(static=("N",))
def i_reduce(x: kd.In["M", "N", kd.f32], o_sum: kd.Out["M", kd.f32], o_max: kd.Out["M", kd.f32],
             o_min: kd.Out["M", kd.f32]):
    m, = kd.grid(kd.tile("M", domain=(4, 8), default=4))
    n = kd.full_range("N")                     # 37 -> a 64 tile masked by n < 37
    v = x[m, n]
    o_sum[m] = kd.sum(v, axis=n)
    o_max[m] = kd.max(v, axis=n)
    o_min[m] = kd.min(v, axis=n)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_reductions_ignore_tail(sign):
    g = gen(4)
    x = (torch.rand(7, 37, generator=g) + 0.5) * sign    # all one sign: a masked 0 would win max/min
    outs = [poisoned((7,), torch.float32) for _ in range(3)]
    i_reduce(x, *outs)
    torch.testing.assert_close(outs[0], x.sum(1), rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[1], x.max(1).values) and torch.equal(outs[2], x.min(1).values)


@kd.kernel
def i_exit(lens: kd.In["B", kd.i32], x: kd.In["B", "N", kd.f32], out: kd.Out["B", "N", kd.f32]):
    b, n = kd.grid(kd.each("B"), "N")
    kd.exit_if(lens[b] == 0)                   # scalar load: b is a program index
    out[b, n] = x[b, n] + 1.0


def test_exit_if():
    g = gen(5)
    lens = torch.tensor([3, 0, 1, 0, 2], dtype=torch.int32)
    x = torch.randn(5, 21, generator=g)
    out = poisoned((5, 21), torch.float32)
    i_exit(lens, x, out, config={"BLOCK_N": 16})
    live = lens != 0
    assert torch.equal(out[live], x[live] + 1) and torch.isnan(out[~live]).all()


@kd.kernel
def i_first_tile_only(x: kd.In["M", "N", kd.f32], out: kd.Out["M", "N", kd.f32]):
    m, n = kd.grid("M", "N")
    kd.store(out, (m, n), x[m, n] * 2.0, mask=n.start == 0)   # a program-level (scalar) condition


def test_scalar_store_mask_next_to_the_bounds():
    """A store masked by a scalar condition of the program (its N tile is the first) as well as by
    the tile's bounds: only the first column tile's in-bounds elements are written. The interpreter
    cannot AND a scalar bool into a vector mask, so the emitter widens it there."""
    x = torch.randn(21, 40, generator=gen(13))
    out = poisoned((21, 40), torch.float32)
    i_first_tile_only(x, out, config=B16)
    assert torch.equal(out[:, :16], x[:, :16] * 2.0) and torch.isnan(out[:, 16:]).all()


@kd.kernel(static=("D",))
def i_nest(x: kd.In["B", "M", "D", kd.f32], out: kd.Out["B", "M", "D", kd.f32]):
    """Three grid dims on two launch axes: (B, D tiles) share axis 0, the D tiles fastest."""
    b, d, m = kd.grid(kd.nest(kd.each("B"), kd.tile("D", domain=(4, 8, 16), default=8)), "M")
    out[b, m, d] = x[b, m, d] * 2.0 + b


def test_nest_grid_axis():
    """Every (B, D tile) pair of a nest axis runs once (poisoned output fully written), a static
    dim the tiles cover exactly gets no mask, and the grid counts the product on one axis."""
    g = gen(12)
    x = torch.randn(3, 21, 16, generator=g)
    for bd in (4, 8, 16):
        out = poisoned((3, 21, 16), torch.float32)
        sp = i_nest(x, out, config={"BLOCK_D": bd, "BLOCK_M": 16})
        assert sp.grid_size({"B": 3, "M": 21, "D": 16}) == (3 * 16 // bd, 2)
        assert torch.equal(out, x * 2.0 + torch.arange(3.0)[:, None, None])
    src = i_nest.source({"BLOCK_D": 4}, "interpret", static={"D": 16})
    assert "% 4" in src and " < 16" not in src


@kd.kernel(static=("M", "N"))
def i_store_barrier_reload(x: kd.In["M", "N", kd.f32], buf: kd.Out["M", "N", kd.f32],
                           out: kd.Out["N", "M", kd.f32]):
    """One program: store a tile, barrier, read it back transposed and reversed along M (each lane
    reads what other lanes stored)."""
    m, = kd.grid(kd.tile("M", block=8))        # M <= 8: one program
    n = kd.full_range("N")
    buf[m, n] = x[m, n] * 2.0 + 1.0
    kd.barrier()
    M = kd.static("M")
    u, v = kd.span(0, 8, M, "u"), kd.span(0, 16, kd.static("N"), "v")
    out[v, u] = buf[(M - 1) - u, v]


def test_barrier_store_then_reload():
    g = gen(9)
    x = torch.randn(5, 11, generator=g)
    buf, out = poisoned((5, 11), torch.float32), poisoned((11, 5), torch.float32)
    i_store_barrier_reload(x, buf, out)
    assert torch.equal(buf, x * 2.0 + 1.0)
    assert torch.equal(out, (x * 2.0 + 1.0).flip(0).t())
    for target in ("interpret", "gfx942"):
        src = i_store_barrier_reload.source({}, target, static={"M": 5, "N": 11})
        store_at, barrier_at = src.index("tl.store("), src.index("tl.debug_barrier()")
        assert store_at < barrier_at < src.rindex("tl.load(")


@kd.kernel
def i_colsum_atomic(x: kd.In["M", "N", kd.i32], out: kd.InOut["N", kd.i32]):
    m, n = kd.grid("M", "N")
    kd.atomic_add(out, (n,), kd.sum(x[m, n], axis=m))   # every M-tile program adds into one row


def test_atomic_add_from_several_programs():
    g = gen(6)
    x = torch.randint(-1000, 1000, (70, 20), generator=g, dtype=torch.int32)
    base = torch.randint(-5, 5, (20,), generator=g, dtype=torch.int32)
    out = base.clone()
    sp = i_colsum_atomic(x, out, config={"BLOCK_M": 16, "BLOCK_N": 16})
    assert sp.grid_size({"M": 70, "N": 20}) == (5, 2)
    assert torch.equal(out, base + x.sum(0, dtype=torch.int32))


@kd.kernel
def i_gather(ids: kd.In["M", kd.i32], x: kd.In["T", "K", kd.f32], out: kd.Out["M", "K", kd.f32]):
    m, k = kd.grid("M", "K")
    out[m, k] = x[ids[m], k]                   # row gather through an index tensor


def test_gather_through_index_tensor():
    g = gen(7)
    x = torch.randn(50, 24, generator=g)
    ids = torch.randint(0, 50, (19,), generator=g, dtype=torch.int32)
    out = poisoned((19, 24), torch.float32)
    i_gather(ids, x, out, config={"BLOCK_M": 16, "BLOCK_K": 16})
    assert torch.equal(out, x[ids.long()])


@kd.kernel(static=("D",))
def i_paged(kv: kd.In["NP", "P", "D", kd.f32], table: kd.In["S", "MP", kd.i32], out: kd.Out["S", "L", "D", kd.f32]):
    s, pos = kd.grid(kd.each("S"), kd.tile("L", domain=(8, 16), default=8))
    d = kd.full_range("D")
    P = kd.dim("P")
    page = table[s, pos // P]                  # per-position physical page: axes (pos,)
    out[s, pos, d] = kv[page, pos % P, d]      # page and pos % P both live on pos -> tile (pos, d)


def test_paged_gather_block_table():
    g = gen(8)
    NP, P, D, S, L = 12, 4, 8, 3, 13
    kv = torch.randn(NP, P, D, generator=g)
    MP = -(-L // P)
    table = torch.randperm(NP, generator=g)[: S * MP].reshape(S, MP).to(torch.int32)
    out = poisoned((S, L, D), torch.float32)
    i_paged(kv, table, out)
    pos = torch.arange(L)
    ref = kv[table.long()[:, pos // P], pos % P]  # [S, L, D]
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------
# casts: bf16 round-to-nearest-even and round-toward-zero

@kd.kernel
def i_cast(x: kd.In["M", kd.f32], rne: kd.Out["M", kd.bf16], rtz: kd.Out["M", kd.bf16]):
    m, = kd.grid("M")
    v = x[m]
    rne[m] = v.to(kd.bf16)
    rtz[m] = v.to(kd.bf16, rounding="rtz")


def _cast_inputs() -> torch.Tensor:
    g = gen(9)
    rnd = torch.randn(300, generator=g) * torch.exp2(torch.randint(-30, 30, (300,), generator=g).float())
    bits = torch.randint(0, 1 << 15, (120,), generator=g, dtype=torch.int32) << 16
    ties = (bits | 0x8000).view(torch.float32)            # exactly half-way: even and odd upper halves
    near = (bits | 0x7FFF).view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, -3e-39, 3.4e38, float("nan")])
    return torch.cat([rnd, ties, -ties, near, special])


def test_bf16_rne_and_rtz_bit_exact():
    x = _cast_inputs()
    x = x[torch.isfinite(x) | torch.isinf(x) | torch.isnan(x)]
    rne, rtz = poisoned(x.shape, torch.bfloat16), poisoned(x.shape, torch.bfloat16)
    i_cast(x, rne, rtz)
    ref_rne = x.to(torch.bfloat16)
    fin = ~torch.isnan(x)
    assert torch.equal(rne[fin].view(torch.int16), ref_rne[fin].view(torch.int16))
    assert torch.isnan(rne[~fin]).all()
    ref_rtz = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)  # exact: low bits zero
    assert torch.equal(rtz[fin].view(torch.int16), ref_rtz[fin].view(torch.int16))


# ---------------------------------------------------------------------------------------------
# dot: int8 exact, bf16 vs float64, small tiles (multiply-sum form)

@kd.kernel
def i_dot_i8(a: kd.In["M", "K", kd.i8], b: kd.In["N", "K", kd.i8], out: kd.Out["M", "N", kd.i32]):
    m, n = kd.grid(kd.tile("M", domain=(4, 16, 32), default=16), kd.tile("N", domain=(4, 16, 32), default=16))
    acc = kd.fold(kd.tiles("K", block="BLOCK_K", domain=(8, 16, 32), default=32), kd.zeros((m, n), kd.i32),
                  lambda k, acc: acc + kd.dot(a[m, k], b[n, k]))
    out[m, n] = acc


@kd.kernel
def i_dot_bf16(a: kd.In["M", "K", kd.bf16], b: kd.In["K", "N", kd.bf16], out: kd.Out["M", "N", kd.f32]):
    m, n = kd.grid(kd.tile("M", domain=(16, 32), default=16), kd.tile("N", domain=(16, 32), default=16))
    acc = kd.fold(kd.tiles("K", block="BLOCK_K", domain=(16, 32), default=32), kd.zeros((m, n), kd.f32),
                  lambda k, acc: acc + kd.dot(a[m, k], b[k, n]))
    out[m, n] = acc


def _i8(shape, g):
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)


@pytest.mark.parametrize("cfg,mma", [({}, True), ({"BLOCK_M": 4, "BLOCK_N": 4, "BLOCK_K": 8}, False)])
def test_dot_int8_exact(cfg, mma):
    g = gen(10)
    M, N, K = 19, 21, 70
    a, b = _i8((M, K), g), _i8((N, K), g)
    out = poisoned((M, N), torch.int32)
    sp = i_dot_i8(a, b, out, config=cfg)
    assert ("tl.dot(" in sp.source) is mma and sp.stats["dot_acc_fused"] == 1   # tiles < 16: multiply + sum
    assert torch.equal(out, a.int() @ b.int().T)


def test_dot_bf16_vs_float64():
    g = gen(11)
    M, N, K = 18, 20, 75
    a = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(K, N, generator=g).bfloat16()
    out = poisoned((M, N), torch.float32)
    i_dot_bf16(a, b, out)
    ref = a.double() @ b.double()
    bound = 2.0 ** -22 * (a.double().abs() @ b.double().abs()) + 1e-30   # f32 accumulation of exact products
    assert ((out.double() - ref).abs() <= bound).all()


# ---------------------------------------------------------------------------------------------
# packed int4 loads in the three packings

def _int4_tile(w, out):
    """out = the int4 tile of w, unpacked by the lowering the UNPACK tunable names ("index": w[n, k])."""
    n, k = kd.grid(kd.tile("N", domain=(4, 16), default=4), kd.tile("K", domain=(16, 32), default=16))
    how = kd.tunable("UNPACK", ("index", "shift", "bfe", "sbfe", "swar"), "index")
    out[n, k] = w[n, k] if how == "index" else w.load(n, k, unpack=how)


@kd.kernel
def i_int4_qo(w: kd.In["N", "K", kd.int4("quark_order")], out: kd.Out["N", "K", kd.i8]):
    _int4_tile(w, out)


@kd.kernel
def i_int4_qr(w: kd.In["N", "K", kd.int4("quark_reorder")], out: kd.Out["N", "K", kd.i8]):
    _int4_tile(w, out)


@kd.kernel
def i_int4_ct(w: kd.In["N", "K", kd.int4("ct")], out: kd.Out["N", "K", kd.i8]):
    _int4_tile(w, out)


@kd.kernel
def i_int4_ctr(w: kd.In["N", "K", kd.int4("ct_reorder")], out: kd.Out["N", "K", kd.i8]):
    _int4_tile(w, out)


@kd.kernel
def i_dequant_g(w: kd.In["N", "K", kd.int4("ct")], s: kd.In["N", "KG", kd.bf16], out: kd.Out["N", "K", kd.bf16]):
    n, k = kd.grid(kd.tile("N", domain=(4, 16), default=4), kd.tile("K", domain=(32, 64), default=64))
    q = w.load(n, k, unpack=kd.tunable("INT4_UNPACK", ("shift", "sbfe"), "sbfe"))
    out[n, k] = kd.dequant(q, s.load(n, kd.mx_groups(k, kd.dim("KG"), 32)))


def pack_ref(q: torch.Tensor, pack: str) -> torch.Tensor:
    """Independent packer: nibble i of each int32 word holds element order[i] of its group of 8."""
    order = {"quark_order": [0, 1, 2, 3, 4, 5, 6, 7], "quark_reorder": [0, 2, 4, 6, 1, 3, 5, 7],
             "ct": [0, 1, 2, 3, 4, 5, 6, 7], "ct_reorder": [0, 2, 4, 6, 1, 3, 5, 7]}[pack]
    nib = (q.long() + 8) if pack.startswith("ct") else (q.long() & 0xF)
    g = nib.reshape(*q.shape[:-1], -1, 8)
    word = torch.zeros(g.shape[:-1], dtype=torch.long)
    for i, e in enumerate(order):
        word |= g[..., e] << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


@pytest.mark.parametrize("how", ["index", "shift", "bfe", "sbfe", "swar"])
@pytest.mark.parametrize("kern,pack", [(i_int4_qo, "quark_order"), (i_int4_qr, "quark_reorder"), (i_int4_ct, "ct"),
                                       (i_int4_ctr, "ct_reorder")])
def test_int4_unpack(kern, pack, how):
    g = gen(12)
    N, K = 7, 40                                   # K tail: 40 = 2.5 tiles of 16
    q = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
    q[0, :8] = torch.tensor([-8, 7, -1, 0, 1, -7, 6, -2], dtype=torch.int8)
    out = poisoned((N, K), torch.int8)
    kern(pack_ref(q, pack), out, config={"UNPACK": how})
    assert torch.equal(out, q)


@pytest.mark.parametrize("how", ["shift", "sbfe"])
def test_dequant_group_scales_bit_exact(how):
    """kd.dequant = (q * s[row, k // 32]) rounded to nearest even in bf16, bit for bit, also for
    tie products, huge / tiny / inf / NaN scales; K tail of half a tile."""
    g = gen(13)
    N, K = 7, 96
    q = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
    s = (torch.randn(N, K // 32, generator=g) * 0.05).bfloat16()
    s[0, 0] = torch.tensor(1.0 + 2.0 ** -7).bfloat16()  # 3 * (1 + 2^-7) sits on a bf16 rounding tie
    q[0, :4] = torch.tensor([3, -3, 5, 7], dtype=torch.int8)
    s[1] = torch.tensor([3.0e38, 1.0e-30, float("inf")]).bfloat16()  # (subnormal scales: the interpreter flushes)
    s[2, 0] = float("nan")
    out = poisoned((N, K), torch.bfloat16)
    i_dequant_g(pack_ref(q, "ct"), s, out, config={"INT4_UNPACK": how})
    ref = (q.float() * s.float().repeat_interleave(32, dim=1)).bfloat16()
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out[~ref.isnan()], ref[~ref.isnan()])


def _group_dot_body(x, w, s, out):
    m, n = kd.grid(kd.tile("M", domain=(16,), default=16), kd.tile("N", domain=(16,), default=16))
    bk = kd.tunable("BLOCK_K", (32, 64), 64)
    rows = kd.tunable("Q_ROWS", (0, 1), 0)  # 1: the int tile is the dot's a side
    g = kd.span(0, bk // 32, label="g")

    def body(k, acc):
        q = w.load(n, k, unpack="sbfe")
        sc = s.load(n, kd.mx_groups(k, kd.dim("KG"), 32))
        return kd.group_dot(q, x[m, k], sc, acc) if rows else kd.group_dot(x[m, k], q, sc, acc)

    acc = kd.fold(kd.tiles("K", block="BLOCK_K", domain=(32, 64), default=64),
                  kd.zeros((g, n, m) if rows else (g, m, n), kd.f32), body)
    out[m, n] = kd.sum(acc, axis=g)


@kd.kernel
def i_group_dot(x: kd.In["M", "K", kd.bf16], w: kd.In["N", "K", kd.int4("ct")], s: kd.In["N", "KG", kd.bf16],
                out: kd.Out["M", "N", kd.f32]):
    _group_dot_body(x, w, s, out)


@kd.kernel
def i_group_dot_ctr(x: kd.In["M", "K", kd.bf16], w: kd.In["N", "K", kd.int4("ct_reorder")],
                    s: kd.In["N", "KG", kd.bf16], out: kd.Out["M", "N", kd.f32]):
    _group_dot_body(x, w, s, out)


@kd.kernel
def i_group_dot_qr(x: kd.In["M", "K", kd.bf16], w: kd.In["N", "K", kd.int4("quark_reorder")],
                   s: kd.In["N", "KG", kd.bf16], out: kd.Out["M", "N", kd.f32]):
    _group_dot_body(x, w, s, out)


# the pair-ordered packs reach the dot as bf16 q + 136 (one mask and or per two weights) and
# subtract 136 x the group's row sums after it: the f32 partial then carries the bias's magnitude
# (here ~16x the exact-int path's error, 9e-7 of the largest output: the same bound holds)
GROUP_DOT_PACKS = {"ct": (i_group_dot, False), "ct_reorder": (i_group_dot_ctr, True),
                   "quark_reorder": (i_group_dot_qr, True)}


@pytest.mark.parametrize("pack", sorted(GROUP_DOT_PACKS))
@pytest.mark.parametrize("bk,rows", [(64, 0), (32, 1), (64, 1)])
def test_group_dot_scales_after_the_dot(bk, rows, pack):
    """kd.group_dot = sum over groups of s[n, g] * (x . q over the group's 32 K), the int4 values
    exact (no bf16 rounding of q * s): f32-accurate against float64, both operand sides, M/N/K
    tails (K = 3 groups: half a 64-wide tile); the pair-ordered packs by the biased bf16 form."""
    kern, biased = GROUP_DOT_PACKS[pack]
    g = gen(14)
    M, N, K = 19, 21, 96
    x = torch.randn(M, K, generator=g).bfloat16()
    q = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
    q[0, :16] = torch.arange(-8, 8, dtype=torch.int8)  # every value, both nibbles of each pair
    s = (torch.rand(N, K // 32, generator=g) * 0.05 + 0.01).bfloat16()
    out = poisoned((M, N), torch.float32)
    cfg = {"BLOCK_K": bk, "Q_ROWS": rows}
    assert ("0x43004300" in kern.source(cfg)) == biased
    kern(x, pack_ref(q, pack), s, out, config=cfg)
    ref = x.double() @ (q.double() * s.double().repeat_interleave(32, dim=1)).t()
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
    coarse = x.double() @ (q.float() * s.float().repeat_interleave(32, dim=1)).bfloat16().double().t()
    assert (out.double() - ref).abs().max() < (coarse - ref).abs().max() / 10  # finer than a bf16 dequant


def test_group_dot_rejects_bad_operands():
    @kd.kernel
    def two_floats(x: kd.In["M", "K", kd.bf16], y: kd.In["N", "K", kd.bf16], s: kd.In["N", "KG", kd.bf16],
                   out: kd.Out["M", "N", kd.f32]):
        m, n = kd.grid(kd.tile("M", domain=(16,), default=16), kd.tile("N", domain=(16,), default=16))
        k = kd.span(0, 32, kd.dim("K"), label="k")
        out[m, n] = kd.sum(kd.group_dot(x[m, k], y[n, k], s.load(n, kd.mx_groups(k, kd.dim("KG"), 32))), axis=0)

    with pytest.raises(kd.TraceError, match="one int8 tile and one bf16 tile"):
        two_floats.source({})


def test_int4_pack_ref_known_word():
    # element e = e+1 for e in 0..7: quark_order puts element i in nibble i
    q = torch.arange(1, 9, dtype=torch.int8)[None]
    assert pack_ref(q, "quark_order").item() == 0x87654321 - 2**32
    assert pack_ref(q, "quark_reorder").item() == 0x86427531 - 2**32
    assert pack_ref(q - 8, "ct").item() == 0x87654321 - 2**32


# ---------------------------------------------------------------------------------------------
# more than one kernel per op: split reduction + combine

@kd.kernel
def i_split_partial(x: kd.In["M", "N", kd.f32], part: kd.Out["S", "M", kd.f32], S: kd.Dim):
    m, s = kd.grid(kd.tile("M", domain=(4, 8), default=4), kd.each("S"))
    chunk = kd.cdiv(kd.dim("N"), S)
    start = s * chunk
    acc = kd.fold(kd.tiles(start=start, stop=kd.minimum(start + chunk, kd.dim("N")), block=8, label="N"),
                  kd.zeros((m,), kd.f32),
                  lambda n, acc: acc + kd.sum(x.load(m, n, mask=n < start + chunk), axis=n))
    part[s, m] = acc


@kd.kernel
def i_split_combine(part: kd.In["S", "M", kd.f32], out: kd.Out["M", kd.f32]):
    m, = kd.grid(kd.tile("M", domain=(4, 8), default=4))
    out[m] = kd.fold(kd.tiles("S", block=1), kd.zeros((m,), kd.f32), lambda s, acc: acc + kd.sum(part[s, m], axis=s))


def test_split_then_combine():
    g = gen(13)
    M, N, S = 9, 45, 3
    x = torch.randn(M, N, generator=g)
    part, out = poisoned((S, M), torch.float32), poisoned((M,), torch.float32)
    i_split_partial(x, part, S)
    i_split_combine(part, out)
    ref_part = torch.stack([c.sum(1) for c in x.split(-(-N // S), dim=1)])
    torch.testing.assert_close(part, ref_part, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, x.sum(1), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# kd.pad: a few-row tile widened with zero rows for a 16-row matrix dot

@kd.kernel
def i_pad_dot(x: kd.In["M", "K", kd.bf16], w: kd.In["N", "K", kd.bf16], out: kd.Out["M", "N", kd.f32]):
    m, n = kd.grid(kd.tile("M", domain=(1, 2, 4, 8), default=2), kd.tile("N", domain=(16,), default=16))
    mm = kd.span(m.start, 16, kd.minimum(kd.dim("M"), m.start + m.size), "Mp")
    k = kd.arange(32, "K", kd.dim("K"))
    a = (x[m, k].to(kd.f32) * 2.0).to(kd.bf16)   # elementwise work on the tile's rows only
    out[mm, n] = kd.dot(kd.pad(a, m, mm), w[n, k])


@pytest.mark.parametrize("bm", [1, 2, 4, 8])
def test_pad_feeds_a_16_row_dot(bm):
    """Rows past the tile are zeros and masked at the store: every BLOCK_M gives the product of its
    rows, and no padding row is ever written."""
    g = gen(21)
    M, N, K = 11, 16, 32
    x, w = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
    out = poisoned((M, N), torch.float32)
    i_pad_dot(x, w, out, config={"BLOCK_M": bm})
    ref = (2.0 * x.double()) @ w.double().T
    assert not out.isnan().any()
    assert ((out.double() - ref).abs() <= 2.0 ** -22 * ((2.0 * x.double()).abs() @ w.double().abs().T)).all()
    src = i_pad_dot.source({"BLOCK_M": 2}, "gfx942")
    assert src.count("tl.join(") == 3 and "tl.dot(" in src   # 2 -> 4 -> 8 -> 16 rows, no arithmetic


@kd.kernel
def i_pad_dot_at(x: kd.In["M", "K", kd.bf16], w: kd.In["N", "K", kd.bf16], out: kd.Out["M", "N", kd.f32]):
    m, n = kd.grid(kd.tile("M", domain=(1, 2, 4, 8, 16), default=2), kd.tile("N", domain=(16,), default=16))
    m16 = m.start // 16 * 16
    mm = kd.span(m16, 16, kd.minimum(kd.dim("M"), m.start + m.size), "Mp")
    k = kd.arange(32, "K", kd.dim("K"))
    a = (x[m, k].to(kd.f32) * 2.0).to(kd.bf16)
    kd.store(out, (mm, n), kd.dot(kd.pad(a, m, mm, offset=m.start - m16), w[n, k]), mask=m.start <= mm)


@pytest.mark.parametrize("bm", [1, 2, 4, 8, 16])
def test_pad_at_an_offset_keeps_row_places(bm):
    """offset: the tile's rows at their own rows of the aligned 16 (zeros around them), the others
    masked at the store: every BLOCK_M gives the same bits, and nothing past M is written."""
    g = gen(22)
    M, N, K = 21, 16, 32
    x, w = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
    buf = poisoned((M + 16, N), torch.float32)
    i_pad_dot_at(x, w, buf[:M], config={"BLOCK_M": bm})
    full = poisoned((M, N), torch.float32)
    i_pad_dot_at(x, w, full, config={"BLOCK_M": 16})
    assert buf[M:].isnan().all() and torch.equal(buf[:M], full)
    ref = (2.0 * x.double()) @ w.double().T
    assert ((full.double() - ref).abs() <= 2.0 ** -22 * ((2.0 * x.double()).abs() @ w.double().abs().T)).all()
    if bm < 16:
        src = i_pad_dot_at.source({"BLOCK_M": bm}, "gfx942")
        assert src.count("tl.join(") == (16 // bm).bit_length() - 1 and src.count("tl.where(") == 1


def test_pad_rejects_a_bad_offset():
    @kd.kernel
    def bad_offset(x: kd.In["M", kd.f32], out: kd.Out["M", kd.f32]):
        m, = kd.grid(kd.tile("M", domain=(4,), default=4))
        out[m] = kd.pad(x[m], m, kd.arange(16, "r"), offset=6)

    with pytest.raises(kd.TraceError, match="multiple of 4"):
        bad_offset.source({})


def test_pad_rejects_a_bad_target():
    @kd.kernel
    def bad(x: kd.In["M", kd.f32], out: kd.Out["M", kd.f32]):
        m, = kd.grid(kd.tile("M", domain=(4,), default=4))
        out[m] = kd.pad(x[m], m, kd.arange(2, "r"))

    with pytest.raises(kd.TraceError, match="power-of-two multiple"):
        bad.source({})


# ---------------------------------------------------------------------------------------------
# generated source: DSL line comments and the dot-accumulate fusion

def test_source_points_to_dsl_lines():
    src = i_bcast.source(B16)
    lines, first = inspect.getsourcelines(i_bcast.fn)
    line_no = first + next(i for i, l in enumerate(lines) if "out[m, n] = x[m, n] * s[m] + b[n]" in l)
    assert f"# test_kdsl_interp.py:{line_no}: out[m, n] = x[m, n] * s[m] + b[n]" in src
    assert f"source: {inspect.getsourcefile(i_bcast.fn)}:{first}" in src


def test_dot_accumulate_fusion_fires():
    src = i_dot_i8.source({}, "gfx942")
    assert "acc=" in src and "passes: {'dot_acc_fused': 1" in src
