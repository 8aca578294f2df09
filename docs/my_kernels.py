"""Worked examples for kernel developers: small tile programs (a GEMM, a persistent GEMM, a top-k router).

    python -m kdsl -m docs/my_kernels.py list
    python -m kdsl -m docs/my_kernels.py show softmax_rows --arch gfx950 --emit triton
"""
import kdsl as kd
from my_triton_helpers import softplus   # a plain @triton.jit function (docs/my_triton_helpers.py)


@kd.kernel(example={"M": 4, "N": 4096})
def scale_rows(x: kd.In["M", "N", kd.f32], s: kd.In["M", kd.f32], out: kd.Out["M", "N", kd.bf16]):
    """out = x * s[:, None], stored as bf16 (round to nearest even)."""
    m, n = kd.grid("M", "N")
    out[m, n] = x[m, n] * s[m]                  # s[m] has axes (m,): broadcast onto (m, n) by identity


@kd.kernel(example={"M": 4, "N": 4096})
def softmax_rows(x: kd.In["M", "N", kd.f32], out: kd.Out["M", "N", kd.f32]):
    """Row softmax in two passes: an online (max, sum) fold, then normalize."""
    m, = kd.grid(kd.tile("M", "BLOCK_M", domain=(1, 2, 4, 8, 16), default=4))

    def step(n, m_i, l_i):
        v = x.load(m, n, other=float("-inf"))  # masked lanes read -inf, so exp() gives 0
        m_new = kd.maximum(m_i, kd.max(v, axis=n))
        l_new = l_i * kd.exp(m_i - m_new) + kd.sum(kd.exp(v - m_new), axis=n)
        return m_new, l_new

    m_i, l_i = kd.fold("N", (kd.full((m,), float("-inf"), kd.f32), kd.zeros((m,), kd.f32)), step)
    kd.fold("N", kd.zeros((m,), kd.f32),
            lambda n, unused: _write(out, m, n, kd.exp(x[m, n] - m_i) / l_i, unused))


def _write(out, m, n, p, state):
    out[m, n] = p                               # a store inside a fold; the state is unchanged
    return state


@kd.kernel(example={"M": 1, "N": 4096, "K": 7168})
def gemm_i8(x: kd.In["M", "K", kd.i8], xs: kd.In["M", kd.f32], w: kd.In["N", "K", kd.i8],
            ws: kd.In["N", kd.f32], out: kd.Out["M", "N", kd.bf16]):
    """out = (x @ w.T) * xs[:, None] * ws[None, :]: int8 x int8 -> int32 MFMA, per-token x per-channel scales."""
    BK = kd.tunable("BLOCK_K", (32, 64, 128, 256), 64)
    kd.require(BK % 32 == 0, "BLOCK_K must be a multiple of 32", "BLOCK_K")
    m, n = kd.grid(kd.tile("M", domain=(16, 32, 64), default=16), kd.tile("N", domain=(16, 32, 64, 128), default=64))
    acc = kd.fold(kd.tiles("K", block="BLOCK_K"), kd.zeros((m, n), kd.i32),
                  lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))   # contracts the shared axis k
    out[m, n] = acc * xs[m] * ws[n]


# ----------------------------------------------------------------------------------------------
# a persistent GEMM: P programs walk the (M, N) tiles in grouped order

@kd.kernel(example={"M": 512, "N": 4096, "K": 7168, "P": 304})
def gemm_persistent(x: kd.In["M", "K", kd.bf16], w: kd.In["N", "K", kd.bf16], out: kd.Out["M", "N", kd.bf16],
                    P: kd.Dim):
    """out = x @ w.T; P programs (e.g. one per CU) each take every P-th tile in grouped-M order."""
    m, n = kd.grid(kd.tile("M", domain=(16, 32, 64, 128), default=64), kd.tile("N", domain=(16, 32, 64, 128), default=64),
                   order=kd.grouped("GROUP_M"), programs="P")   # the rest of the body runs once per tile
    acc = kd.fold(kd.tiles("K", block="BLOCK_K", domain=(32, 64, 128), default=64, num_stages=2),
                  kd.zeros((m, n), kd.f32), lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))
    out[m, n] = acc


@kd.kernel(example={"M": 512, "N": 4096, "K": 7168})
def gemm_grouped(x: kd.In["M", "K", kd.bf16], w: kd.In["N", "K", kd.bf16], out: kd.Out["M", "N", kd.bf16]):
    """out = x @ w.T with one program per tile, launched in grouped-M order (L2 reuse of w's tiles)."""
    m, n = kd.grid(kd.tile("M", domain=(16, 32, 64, 128), default=64), kd.tile("N", domain=(16, 32, 64, 128), default=64),
                   order=kd.grouped("GROUP_M"))
    acc = kd.fold(kd.tiles("K", block="BLOCK_K", domain=(32, 64, 128), default=64),
                  kd.zeros((m, n), kd.f32), lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))
    out[m, n] = acc


# ----------------------------------------------------------------------------------------------
# a top-k router: softmax over E experts, the K best, renormalized

@kd.kernel(static=("E", "K"), example={"M": 4, "E": 384, "K": 8})
def topk_router(logits: kd.In["M", "E", kd.f32], ids: kd.Out["M", "K", kd.i32], wts: kd.Out["M", "K", kd.f32]):
    """Per token: p = softmax(logits); the K largest p (ties: lowest expert id) and p / sum of those."""
    m, = kd.grid(kd.tile("M", domain=(1, 2, 4, 8), default=1))
    e, k = kd.full_range("E"), kd.full_range("K")          # both padded to powers of two and masked
    v = logits.load(m, e, other=float("-inf"))
    p = kd.exp(v - kd.max(v, axis=e))
    p = p / kd.sum(p, axis=e)
    top, idx = kd.topk(p, kd.static("K"), axis=e, into=k)  # results lie along k: they can index a store
    ids[m, k] = idx
    wts[m, k] = top / kd.sum(top, axis=k)


# ----------------------------------------------------------------------------------------------
# the escape hatch: a plain @triton.jit helper from a user module

@kd.kernel(example={"M": 4, "N": 4096})
def softplus_rows(x: kd.In["M", "N", kd.f32], beta: kd.Scalar[kd.f32], out: kd.Out["M", "N", kd.f32]):
    """out = softplus(x, beta) through my_triton_helpers.softplus (tiles in, one tile out, no masks seen)."""
    m, n = kd.grid("M", "N")
    out[m, n] = kd.triton_call(softplus, x[m, n], beta)
