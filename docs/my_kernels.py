"""A worked example for kernel developers: three small tile programs.

    python -m kdsl -m docs/my_kernels.py list
    python -m kdsl -m docs/my_kernels.py show softmax_rows --arch gfx950 --emit triton
"""
import kdsl as kd


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
