"""The MLA block's small steps fused around the two GEMMs and the attention, written in kdsl.

An MLA layer of the decode step (models.kimi._MLA, absorbed form, a bf16 q_b) runs
    qkv_a split-K GEMM -> q_b GEMM [+ q_a RMSNorm] -> [mla_q_absorb_kv] -> mla_decode_split -> [mla_combine_uv] -> o_proj
where each bracketed kernel replaces several launches of the unfused path:
- the q_a|kv_a GEMM (ops.gemm.gemm_bf16_splitk) writes f32 partial sums [S, T, q_lora + DL + R] over
  S K ranges (its N of 2112 alone gives too few programs to fill the GPU); both consumers add them
  in split order and round to bf16, the row the plain GEMM would have stored.
- the q_b GEMM (ops.gemm.gemm_bf16_rmsnorm) reads the q_a columns of those partials in place
  (strided, no copy) and computes q_c = RMSNorm(q part) * w_q in its prologue.
- `mla_q_absorb_kv` folds q_nope through W_UK per head (a batched-per-head GEMM, f32 accumulate)
  and ropes q_pe into the absorbed query [T, H, C + r] (clone, rope, batched GEMM, concat); then
  the programs of a row tile share out its real rows, one row each (more only where the tile has
  more rows than programs), and write the new latent cache row RMSNorm(kv part) * w_kv | rope(k_pe)
  straight into the paged cache at the row's flat slot (the kv clone, norm, k rope, concat and
  cache append), one writer per row; the others return before the append.
- `mla_combine_uv` (ops.mla.mla_decode with `w_uv`) merges the KV splits of each (row, head) in
  split order, BLOCK_S splits a step (at BLOCK_S 1 exactly as `mla_decode_combine`), rounds the
  latent output to bf16 and multiplies it by W_UV[h] in the same program, writing o [T, H, v], the
  layout o_proj reads.
A quantized q_b or a separate q_a / kv_a (no q_a|kv_a GEMM) keep the older front: `mla_prep_qkv`
(both norms, the k rope and the cache append from the q_a|kv_a row; `mla_prep_kv` without the q part
for configs with q_lora_rank 0), the q_b GEMM, then `mla_q_absorb` (W_UK and the q rope alone).

Rounding follows the unfused ops: the normed rows and the roped values are computed with the same
f32 expressions and rounded to bf16 where those kernels store, so the cache row and q_c equal the
unfused path bit for bit (q_c inside gemm_bf16_rmsnorm: where its NORM_K tile covers K, else the
f32 sum of squares runs in another order and a q_c element may differ by one bf16 ulp); the
absorbed products accumulate in f32 and round once to bf16.
"""
from __future__ import annotations

import math
from typing import Any

import torch

import kdsl as kd
from ops._common import check_backend, check_slots, check_tensor, invariant_config, validating
from ops.gemm import MMA_ROWS, _mma_rows, splitk_sum_ref
from ops.mla import normalized

# ---------------------------------------------------------------------------------------------
# kernel bodies


def _norm(v, d, w, eps, n: int):
    """RMSNorm of a row held in f32 (the expression of ops.norm.rmsnorm, so the bf16 result agrees)."""
    ms = kd.sum(v * v, axis=d) / n
    return v * kd.rsqrt(ms + eps) * w[d].to(kd.f32)


def _cache_row(src, t, col0, wkv, cos, sin, slots, kv, eps):
    """src[t, col0 : col0 + DL + R] -> kv[slot // PS, slot % PS, :]: the normed latent and the
    interleaved rope of k_pe. A slot < 0 (padding) stores nothing; one past the cache is dropped
    by the bounded-gather rule (the page index comes from loaded data)."""
    DL = kd.static("DL")
    PS = kd.dim("PS")
    c = kd.full_range("DL")
    i = kd.full_range("R2")
    slot = slots[t]
    page = slot // PS
    off = slot % PS
    lat = _norm(src[t, c + col0].to(kd.f32), c, wkv, eps, DL)
    # the skip test is made a vector (slot + 0*index): the interpreter rejects a scalar bool in a vector mask
    kv.store(page, off, c, value=lat, mask=(slot + c * 0) >= 0)
    cs = cos[t, i]
    sn = sin[t, i]
    x0 = src[t, col0 + DL + i * 2].to(kd.f32)
    x1 = src[t, col0 + DL + i * 2 + 1].to(kd.f32)
    keep = (slot + i * 0) >= 0
    kv.store(page, off, DL + i * 2, value=x0 * cs - x1 * sn, mask=keep)
    kv.store(page, off, DL + i * 2 + 1, value=x1 * cs + x0 * sn, mask=keep)


_PREP_CHECKS = [
    ("qkv", lambda d: d["NQ"] == d["QR"] + d["DL"] + 2 * d["R2"], "qkv must be [T, q_lora + latent + rope]"),
    ("kv", lambda d: d["DQ"] == d["DL"] + 2 * d["R2"], "the cache's last dim must be latent + rope (cos/sin width x 2)"),
]
_PREP_EX = {"T": 4, "NQ": 2112, "QR": 1536, "DL": 512, "R2": 32, "NP": 4096, "PS": 64, "DQ": 576}


@kd.kernel(static=("QR", "DL", "R2"), example=_PREP_EX, checks=_PREP_CHECKS)
def mla_prep_qkv(qkv: kd.In["T", "NQ", kd.bf16], wq: kd.In["QR", kd.bf16], wkv: kd.In["DL", kd.bf16],
                 cos: kd.In["T", "R2", kd.f32], sin: kd.In["T", "R2", kd.f32], slots: kd.In["T", kd.i64],
                 qc: kd.Out["T", "QR", kd.bf16], kv: kd.InOut["NP", "PS", "DQ", kd.bf16], eps: kd.Scalar[kd.f32]):
    """From the q_a|kv_a output row: q_c = rmsnorm(q part) * wq, and the cache row
    rmsnorm(kv part) * wkv | rope(k_pe) stored at slots[t] (one program per row)."""
    t, = kd.grid(kd.each("T"))
    QR = kd.static("QR")
    d = kd.full_range("QR")
    qc[t, d] = _norm(qkv[t, d].to(kd.f32), d, wq, eps, QR)
    _cache_row(qkv, t, QR, wkv, cos, sin, slots, kv, eps)


_KV_CHECKS = [
    ("kva", lambda d: d["NQ"] == d["DL"] + 2 * d["R2"], "kv_a output must be [T, latent + rope]"),
    _PREP_CHECKS[1],
]


@kd.kernel(static=("DL", "R2"), example={**_PREP_EX, "NQ": 576}, checks=_KV_CHECKS)
def mla_prep_kv(kva: kd.In["T", "NQ", kd.bf16], wkv: kd.In["DL", kd.bf16],
                cos: kd.In["T", "R2", kd.f32], sin: kd.In["T", "R2", kd.f32], slots: kd.In["T", kd.i64],
                kv: kd.InOut["NP", "PS", "DQ", kd.bf16], eps: kd.Scalar[kd.f32]):
    """The cache row rmsnorm(kv_a[:, :DL]) * wkv | rope(kv_a[:, DL:]) stored at slots[t] (q_lora_rank 0)."""
    t, = kd.grid(kd.each("T"))
    _cache_row(kva, t, 0, wkv, cos, sin, slots, kv, eps)


_ABS_CHECKS = [
    ("q", lambda d: d["DQK"] == d["NOPE"] + 2 * d["R2"], "q must be [T, H, nope + rope]"),
    ("out", lambda d: d["DQ"] == d["DL"] + 2 * d["R2"], "out must be [T, H, latent + rope]"),
]


@kd.kernel(static=("NOPE", "R2"), checks=_ABS_CHECKS,
           example={"T": 1, "H": 64, "DQK": 192, "NOPE": 128, "R2": 32, "DL": 512, "DQ": 576})
def mla_q_absorb(q: kd.In["T", "H", "DQK", kd.bf16], wuk: kd.In["H", "NOPE", "DL", kd.bf16],
                 cos: kd.In["T", "R2", kd.f32], sin: kd.In["T", "R2", kd.f32],
                 out: kd.Out["T", "H", "DQ", kd.bf16]):
    """out[t, h] = (q_nope[t, h] @ W_UK[h]) | rope(q_pe[t, h]): the absorbed MLA query, per head a
    [T, nope] x [nope, DL] GEMM (f32 accumulate, bf16 out); the first DL tile of each head also
    writes the roped q_pe."""
    # rows on grid axis 0 (no 65535 limit for long prefill chunks); programs next to each other share
    # the same W_UK tile
    t, c, h = kd.grid(kd.tile("T", "BLOCK_T", domain=(1, 2, 4, 16, 32, 64), default=1),
                      kd.tile("DL", "BLOCK_C", domain=(32, 64, 128, 256, 512), default=128), kd.each("H"))
    NOPE = kd.static("NOPE")
    ks = kd.tiles("NOPE", block="BLOCK_K", domain=(16, 32, 64, 128), default=64)
    acc = kd.fold(ks, kd.zeros((t, c), kd.f32), lambda k, acc: acc + kd.dot(q[t, h, k], wuk[h, k, c]))
    out[t, h, c] = acc
    DL = kd.dim("DL")
    i = kd.full_range("R2")
    first = (c.start + i * 0) == 0
    cs = cos[t, i]
    sn = sin[t, i]
    x0 = q[t, h, NOPE + i * 2].to(kd.f32)
    x1 = q[t, h, NOPE + i * 2 + 1].to(kd.f32)
    out.store(t, h, DL + i * 2, value=x0 * cs - x1 * sn, mask=first)
    out.store(t, h, DL + i * 2 + 1, value=x1 * cs + x0 * sn, mask=first)


def _split_row(part, row, cols):
    """ops.gemm.splitk_rows (part[0] + ... + part[S-1] in split order, f32, rounded to bf16) at one
    row, with the static split count unrolled, so the ISA (and the tuner) sees every split's loads
    and adds."""
    def add(s, acc):
        return acc + kd.sum(part[s, row, cols], axis=s)

    total = kd.fold(kd.tiles(start=1, stop=kd.dim("S"), block=1, label="s", unroll=True), part[0, row, cols], add)
    return total.to(kd.bf16).to(kd.f32)


def _split_q(q, t, h, cols):
    """q[0, t, h, cols] + ... + q[P-1, t, h, cols] in split order (f32, P static: unrolled), rounded
    to bf16 and returned in f32: the q_b GEMM's bf16 row (ops.gemm.splitk_rows for a head's columns)."""
    def add(p, acc):
        return acc + kd.sum(q[p, t, h, cols], axis=p)

    total = kd.fold(kd.tiles(start=1, stop=kd.dim("P"), block=1, label="p", unroll=True), q[0, t, h, cols], add)
    return total.to(kd.bf16).to(kd.f32)


def _append_row(src, row, valid, wkv, slots, cos, sin, kv, eps):
    """src[:, row, :DL + R] (the split-K partials of the kv_a part of one q_a|kv_a output row, added
    in split order and rounded to bf16: `_split_row`) -> the cache row
    rmsnorm(latent) * wkv | rope(k_pe) at slots[row], with the expressions of `_cache_row`. `row` is
    a scalar; `valid` (a scalar bool, or None when the caller knows the row is real) masks the
    stores of a row past the batch, whose loads read row T - 1 instead. A slot < 0 stores nothing; a
    page index past the cache is dropped by the bounded-gather rule."""
    DL = kd.static("DL")
    PS = kd.dim("PS")
    d = kd.full_range("DL")
    i = kd.full_range("R2")
    if valid is not None:
        row = kd.minimum(row, kd.dim("T") - 1)
    slot = slots[row]
    page = slot // PS
    off = slot % PS
    # the skip tests are made vectors (slot + 0*index): the interpreter rejects a scalar bool in a
    # vector mask
    keep_d = (slot + d * 0) >= 0
    keep_i = (slot + i * 0) >= 0
    if valid is not None:
        keep_d = keep_d & ((valid.to(kd.i32) + d * 0) > 0)
        keep_i = keep_i & ((valid.to(kd.i32) + i * 0) > 0)
    lat = _norm(_split_row(src, row, d), d, wkv, eps, DL)
    kv.store(page, off, d, value=lat, mask=keep_d)
    cs = cos[row, i]
    sn = sin[row, i]
    x0 = _split_row(src, row, DL + i * 2)
    x1 = _split_row(src, row, DL + i * 2 + 1)
    kv.store(page, off, DL + i * 2, value=x0 * cs - x1 * sn, mask=keep_i)
    kv.store(page, off, DL + i * 2 + 1, value=x1 * cs + x0 * sn, mask=keep_i)


_ABS_KV_CHECKS = [*_ABS_CHECKS,
                  ("kva", lambda d: d["NK"] == d["DL"] + 2 * d["R2"], "kva must be [T, latent + rope]"),
                  ("kv", lambda d: d["DQ"] == d["DL"] + 2 * d["R2"], "the cache's last dim must be latent + rope")]


@kd.kernel(static=("NOPE", "R2", "DL", "H", "S", "P"), checks=_ABS_KV_CHECKS,
           example={"T": 1, "H": 64, "DQK": 192, "NOPE": 128, "R2": 32, "DL": 512, "DQ": 576, "NK": 576,
                    "NP": 4096, "PS": 64, "S": 1, "P": 1})
def mla_q_absorb_kv(q: kd.In["P", "T", "H", "DQK", kd.f32], wuk: kd.In["H", "NOPE", "DL", kd.bf16],
                    cos: kd.In["T", "R2", kd.f32], sin: kd.In["T", "R2", kd.f32],
                    kva: kd.In["S", "T", "NK", kd.f32], wkv: kd.In["DL", kd.bf16], slots: kd.In["T", kd.i64],
                    out: kd.Out["T", "H", "DQ", kd.bf16], kv: kd.InOut["NP", "PS", "DQ", kd.bf16],
                    eps: kd.Scalar[kd.f32]):
    """mla_q_absorb plus the cache append of mla_prep_qkv: out[t, h] = (q_nope @ W_UK[h]) |
    rope(q_pe), then the cache rows rmsnorm(kva latent) * wkv | rope(k_pe) at slots[t]: row r of a
    row tile is appended by the tile's program of rank r (rank = h x DL tiles + DL tile; with fewer
    ranks P than rows, rank r mod P in unrolled trips), exactly one program per row, and a program
    that owns no real row returns before the append, so the append costs one row per writer (not a
    masked BLOCK_T-row tile in every program). H and S are static for that: the trips and the
    unrolled split sum (`_split_row`) are straight-line code in the ISA, which the cost model counts
    in full. kva holds the kv part of the q_a|kv_a GEMM as split-K partials [S, T, DL + R] f32
    (ops.gemm.gemm_bf16_splitk; S = 1 one f32 row), added in split order and rounded to bf16 as the
    GEMM's bf16 output would be. The q_b GEMM before it reads the q_a part of the same partials
    (ops.gemm.gemm_bf16_rmsnorm), so the MLA front needs no separate prep launch; q comes as that
    GEMM's own split-K partials [P, T, H, DQK] f32 (P static, unrolled), added and rounded the same
    way where a tile is loaded. That elementwise work runs over the BLOCK_T rows of the tile only: a
    tile under 16 rows is padded with zeros to the aligned 16 of the matrix dot, each row at its own
    place (row mod 16: ops.gemm._mma_rows), so BLOCK_T (1 to 16) changes no bit, nor does BLOCK_C
    (a column sums over NOPE in BLOCK_K steps): each M bucket takes its own."""
    t, c, h = kd.grid(kd.tile("T", "BLOCK_T", domain=(1, 2, 4, 8, 16), default=1),
                      kd.tile("DL", "BLOCK_C", domain=(32, 64, 128, 256, 512), default=128), kd.each("H"))
    NOPE = kd.static("NOPE")
    DL = kd.static("DL")
    ks = kd.tiles("NOPE", block="BLOCK_K", domain=(16, 32, 64, 128), default=64)
    small = t.size < MMA_ROWS
    tt, place = _mma_rows(t, "T") if small else (t, 0)

    def absorb(k, acc):
        a = _split_q(q, t, h, k).to(kd.bf16)
        return acc + kd.dot(kd.pad(a, t, tt, offset=place) if small else a, wuk[h, k, c])

    acc = kd.fold(ks, kd.zeros((tt, c), kd.f32), absorb)
    if small:
        kd.store(out, (tt, h, c), acc, mask=t.start <= tt)
    else:
        out[t, h, c] = acc
    i = kd.full_range("R2")
    first = (c.start + i * 0) == 0
    cs = cos[t, i]
    sn = sin[t, i]
    x0 = _split_q(q, t, h, NOPE + i * 2)
    x1 = _split_q(q, t, h, NOPE + i * 2 + 1)
    out.store(t, h, DL + i * 2, value=x0 * cs - x1 * sn, mask=first)
    out.store(t, h, DL + i * 2 + 1, value=x1 * cs + x0 * sn, mask=first)
    # the cache append: row r of the tile goes to the program of rank r mod P (P ranks = heads x DL
    # tiles; trip r // P of an unrolled loop, trips past the first masked by the row count); a
    # program past the tile's last real row leaves here
    ntiles = -(-DL // c.size)
    ranks = kd.static("H") * ntiles
    rank = h * ntiles + c.start // c.size
    rows = kd.minimum(kd.dim("T") - t.start, t.size)
    kd.exit_if(rank >= rows)
    for j in range(-(-t.size // ranks)):
        row = t.start + rank + j * ranks
        _append_row(kva, row, None if j == 0 else rank + j * ranks < rows, wkv, slots, cos, sin, kv, eps)


_NEG_BIG = -1.0e30  # ops.mla.NEG_BIG: the combine's finite start of the running max


@kd.kernel(static=("S",), example={"BQ": 1, "H": 64, "S": 8, "DL": 512, "V": 128})
def mla_combine_uv(part: kd.In["BQ", "H", "S", "DL", kd.f32], lse: kd.In["BQ", "H", "S", kd.f32],
                   wuv: kd.In["H", "DL", "V", kd.bf16], out: kd.Out["BQ", "H", "V", kd.bf16]):
    """out[m, h] = bf16(combine of the splits of (m, h)) @ W_UV[h]: per DL tile, an online
    log-sum-exp over the splits in split order, BLOCK_S splits a step (the tile's max, one rescale
    of the running state, the tile's weighted sum), rounded to bf16, then multiplied into W_UV with
    an f32 accumulator. BLOCK_S 1 is mla_decode_combine's merge, op for op. Tiles start at
    multiples of BLOCK_S from split 0 and an empty split (lse -inf, partial 0; past S: masked to
    the same) adds an exact zero, so a row's result does not depend on how many splits the launch
    has beyond its own; BLOCK_S changes the summation order, so it is a numerics key."""
    m, v, h = kd.grid(kd.tile("BQ", "BLOCK_M", domain=(1, 2, 4, 16, 32), default=1),
                      kd.tile("V", "BLOCK_V", domain=(16, 32, 64, 128, 256), default=128), kd.each("H"))

    def ctile(c, y):
        def merge(s, m_i, l_i, acc):
            ls = lse.load(m, h, s, other=float("-inf"))
            m_new = kd.maximum(m_i, kd.max(ls, axis=s))
            alpha = kd.exp2(m_i - m_new)
            w = kd.exp2(ls - m_new)
            return m_new, l_i * alpha + kd.sum(w, axis=s), acc * alpha + kd.sum(part[m, h, s, c] * w, axis=s)

        init = (kd.full((m,), _NEG_BIG, kd.f32), kd.zeros((m,), kd.f32), kd.zeros((m, c), kd.f32))
        ss = kd.tiles("S", block="BLOCK_S", domain=(1, 2, 4, 8, 16, 32, 64, 128), default=1, label="s")
        m_i, l_i, acc = kd.fold(ss, init, merge)
        o = normalized(acc, l_i).to(kd.bf16)
        return y + kd.dot(o, wuv[h, c, v])

    cs = kd.tiles("DL", block="BLOCK_C", domain=(16, 32, 64, 128, 256, 512), default=64, label="c")
    out[m, h, v] = kd.fold(cs, kd.zeros((m, v), kd.f32), ctile)


# ---------------------------------------------------------------------------------------------
# torch references


def mla_prep_ref(qkv: torch.Tensor, wq: torch.Tensor | None, wkv: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor, eps: float, q_lora: int
                 ) -> torch.Tensor | None:
    """The unfused path: rmsnorm_ref of each part (bf16), rope_ref of k_pe, the row written at its
    slot (slots < 0 or past the cache skipped). Returns q_c (None when q_lora is 0)."""
    from ops.norm import rmsnorm_ref
    from ops.rope import rope_ref

    DQ = kv_cache.shape[-1]
    C = wkv.shape[0]
    qc = rmsnorm_ref(qkv[:, :q_lora], wq, eps) if q_lora else None
    lat = rmsnorm_ref(qkv[:, q_lora:q_lora + C], wkv, eps)
    pe = rope_ref(qkv[:, q_lora + C:q_lora + DQ].reshape(-1, 1, DQ - C), cos, sin, "interleaved")
    new = torch.cat([lat, pe.reshape(-1, DQ - C)], -1)
    cap = kv_cache.shape[0] * kv_cache.shape[1]
    ok = (slots >= 0) & (slots < cap)
    s = slots[ok].long()
    kv_cache[s // kv_cache.shape[1], s % kv_cache.shape[1]] = new[ok].to(kv_cache.dtype)
    return qc


def mla_q_absorb_ref(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(q_nope @ W_UK[h] in f32, rounded to bf16) | rope_ref(q_pe) -> [T, H, DL + R] bf16."""
    from ops.rope import rope_ref

    nope = w_uk.shape[1]
    lat = torch.einsum("thn,hnc->thc", q[..., :nope].float(), w_uk.float()).to(torch.bfloat16)
    return torch.cat([lat, rope_ref(q[..., nope:], cos, sin, "interleaved")], -1)


def mla_combine_uv_ref(part: torch.Tensor, lse: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """mla_combine_uv in plain torch: the splits merged by their log2-sum-exp weights in f64 (a row
    with no split, every lse -inf, is 0), rounded to bf16, times W_UV[h] in f32, rounded to bf16."""
    lse64 = lse.double()
    top = lse64.amax(-1, keepdim=True)
    w = torch.exp2(lse64 - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    den = w.sum(-1, keepdim=True)
    o = ((part.double() * w[..., None]).sum(-2) / torch.where(den > 0, den, torch.ones_like(den))).to(torch.bfloat16)
    return torch.einsum("mhc,hcv->mhv", o.float(), w_uv.float()).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# torch-facing functions


def _check_rope(op: str, cos: torch.Tensor, sin: torch.Tensor, T: int, R: int, dev: torch.device) -> None:
    for n, t in (("cos", cos), ("sin", sin)):
        check_tensor(op, n, t, 2, (torch.float32,), dev)
        if t.shape != (T, R // 2):
            raise ValueError(f"{op}: {n} must be [{T}, {R // 2}], got {tuple(t.shape)}")


def mla_prep(qkv: torch.Tensor, q_norm_w: torch.Tensor | None, kv_norm_w: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor, eps: float, q_lora: int = 0,
             backend: str = "triton", config: dict[str, Any] | None = None,
             validate: bool | None = None) -> torch.Tensor | None:
    """From qkv [T, q_lora + DL + R] (the q_a|kv_a GEMM output, or kv_a's alone when q_lora is 0;
    any row stride, last dim contiguous): write the new latent cache rows
    rmsnorm(latent) * kv_norm_w | rope_interleaved(k_pe) at `slots` [T] in the paged cache
    [pages, page_size, DL + R], and return q_c = rmsnorm(qkv[:, :q_lora]) * q_norm_w [T, q_lora]
    (None when q_lora is 0). A slot < 0 (padding) or past the cache is skipped on both backends;
    `validate=True` refuses one past the cache instead (a device read)."""
    op = "mla_prep"
    check_backend(op, backend)
    check_tensor(op, "qkv", qkv, 2, (torch.bfloat16,), last_contiguous=True)
    dev = qkv.device
    T, NQ = qkv.shape
    check_tensor(op, "kv_cache", kv_cache, 3, (torch.bfloat16,), dev, contiguous=True)
    check_tensor(op, "kv_norm_w", kv_norm_w, 1, (torch.bfloat16,), dev, contiguous=True)
    check_tensor(op, "slots", slots, 1, (torch.int32, torch.int64), dev)
    DQ, C = kv_cache.shape[-1], kv_norm_w.shape[0]
    R = DQ - C
    if not isinstance(q_lora, int) or q_lora < 0 or NQ != q_lora + DQ:
        raise ValueError(f"{op}: qkv must be [T, q_lora({q_lora}) + {DQ}] for a {DQ}-wide cache, got {tuple(qkv.shape)}")
    if R < 2 or R % 2:
        raise ValueError(f"{op}: the rope part (cache width {DQ} - latent {C}) must be even and >= 2")
    if q_lora:
        check_tensor(op, "q_norm_w", q_norm_w, 1, (torch.bfloat16,), dev, contiguous=True)
        if q_norm_w.shape[0] != q_lora:
            raise ValueError(f"{op}: q_norm_w must be [{q_lora}], got {tuple(q_norm_w.shape)}")
    if slots.shape != (T,):
        raise ValueError(f"{op}: slots must be [{T}], got {tuple(slots.shape)}")
    _check_rope(op, cos, sin, T, R, dev)
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    if validating(validate):
        check_slots(op, slots, kv_cache.shape[0] * kv_cache.shape[1])
    if backend == "torch":
        return mla_prep_ref(qkv, q_norm_w, kv_norm_w, cos, sin, slots, kv_cache, eps, q_lora)
    qc = torch.empty(T, q_lora, dtype=torch.bfloat16, device=dev) if q_lora else None
    if T == 0:
        return qc
    from ops._common import config_for

    sl = slots if slots.dtype == torch.int64 else slots.to(torch.int64)
    if q_lora:
        cfg = config_for(mla_prep_qkv, {"QR": q_lora, "DL": C, "R2": R // 2}, T, config)
        mla_prep_qkv(qkv, q_norm_w, kv_norm_w, cos, sin, sl, qc, kv_cache, float(eps), config=cfg)
    else:
        cfg = config_for(mla_prep_kv, {"DL": C, "R2": R // 2}, T, config)
        mla_prep_kv(qkv, kv_norm_w, cos, sin, sl, kv_cache, float(eps), config=cfg)
    return qc


def _check_absorb(op: str, q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  q_dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int, int]:
    """Argument rules of the absorbed query (q [T, H, nope + R], W_UK [H, nope, DL], per-row cos/sin);
    returns (T, H, nope, DL, R)."""
    check_tensor(op, "q", q, 3, (q_dtype,), last_contiguous=True)
    dev = q.device
    T, H, DQK = q.shape
    check_tensor(op, "w_uk", w_uk, 3, (torch.bfloat16,), dev, contiguous=True)
    if w_uk.shape[0] != H or w_uk.shape[1] >= DQK:
        raise ValueError(f"{op}: w_uk must be [H={H}, nope < {DQK}, latent], got {tuple(w_uk.shape)}")
    nope, DL = w_uk.shape[1], w_uk.shape[2]
    R = DQK - nope
    if R < 2 or R % 2:
        raise ValueError(f"{op}: the rope part of q ({DQK} - nope {nope}) must be even and >= 2")
    _check_rope(op, cos, sin, T, R, dev)
    return T, H, nope, DL, R


def q_absorb(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "triton",
             config: dict[str, Any] | None = None, invariant: bool = True) -> torch.Tensor:
    """The absorbed MLA query: q [T, H, nope + R] (any strides with a contiguous last dim, e.g. the
    q_b output viewed) and W_UK [H, nope, DL] bf16 -> [T, H, DL + R] bf16 = (q_nope @ W_UK[h]) |
    rope_interleaved(q_pe) with per-row cos/sin [T, R/2]. `invariant` (default): the M=1 tiles at
    every T, so a row's result does not depend on the batch."""
    op = "mla_q_absorb"
    check_backend(op, backend)
    T, H, nope, DL, R = _check_absorb(op, q, w_uk, cos, sin)
    dev = q.device
    if backend == "torch":
        return mla_q_absorb_ref(q, w_uk, cos, sin)
    out = torch.empty(T, H, DL + R, dtype=torch.bfloat16, device=dev)
    if T == 0:
        return out
    problem = {"H": H, "NOPE": nope, "DL": DL, "R2": R // 2}
    if invariant:
        cfg = invariant_config(mla_q_absorb, problem, T, config)
    else:
        from ops._common import config_for

        cfg = config_for(mla_q_absorb, problem, T, config)
    mla_q_absorb(q, w_uk, cos, sin, out, config=cfg)
    return out


def q_absorb_append(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kva: torch.Tensor,
                    kv_norm_w: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor, eps: float,
                    backend: str = "triton", config: dict[str, Any] | None = None, invariant: bool = True,
                    validate: bool | None = None) -> torch.Tensor:
    """`q_absorb` and the cache append of `mla_prep` in one launch (kernel mla_q_absorb_kv): returns
    the absorbed query [T, H, DL + R] and writes rmsnorm(kva[:, :DL]) * kv_norm_w |
    rope_interleaved(kva[:, DL:]) at `slots` [T] of the paged cache [pages, page_size, DL + R].
    q is bf16 [T, H, nope + R] or the f32 split-K partials [P, T, H, nope + R] of the q_b GEMM
    (ops.gemm.gemm_bf16_rmsnorm with partials=True, viewed per head; any strides, last dim
    contiguous), added in split order and rounded to bf16 as that GEMM's bf16 output would be.
    kva [T, DL + R] is the kv_a part of the q_a|kv_a output (any row stride, last dim contiguous).
    kva may also be given as the f32 split-K partials [S, T, DL + R] of that GEMM (ops.gemm.
    gemm_bf16_splitk, e.g. its kv columns: any strides, last dim contiguous); the kernel adds them in
    split order and rounds to bf16, the row a bf16 GEMM would have stored.
    A slot < 0 (padding) or past the cache is skipped on both backends; `validate=True` refuses one
    past the cache instead (a device read). `invariant` (default): the M=1 tiles at every T."""
    op = "mla_q_absorb_kv"
    check_backend(op, backend)
    check_tensor(op, "q", q, None, (torch.bfloat16, torch.float32), last_contiguous=True)
    if q.dim() == 3 and q.dtype == torch.bfloat16:
        qp = q.float().unsqueeze(0)  # one split (exact)
    elif q.dim() == 4 and q.dtype == torch.float32 and q.shape[0] >= 1:
        qp = q
    else:
        raise ValueError(f"{op}: q must be bfloat16 [T, H, nope + R] or float32 split-K partials "
                         f"[P >= 1, T, H, nope + R], got {str(q.dtype).replace('torch.', '')} {tuple(q.shape)}")
    T, H, nope, DL, R = _check_absorb(op, qp[0], w_uk, cos, sin, torch.float32)
    dev = q.device
    check_tensor(op, "kva", kva, None, (torch.bfloat16, torch.float32), dev, last_contiguous=True)
    if kva.dim() == 2 and kva.dtype == torch.bfloat16:
        kva = kva.float().unsqueeze(0)  # one split (exact)
    elif kva.dim() != 3 or kva.dtype != torch.float32 or kva.shape[0] < 1:
        raise ValueError(f"{op}: kva must be bfloat16 [T, DL + R] or float32 split-K partials [S >= 1, T, DL + R], "
                         f"got {str(kva.dtype).replace('torch.', '')} {tuple(kva.shape)}")
    check_tensor(op, "kv_cache", kv_cache, 3, (torch.bfloat16,), dev, contiguous=True)
    check_tensor(op, "kv_norm_w", kv_norm_w, 1, (torch.bfloat16,), dev, contiguous=True)
    check_tensor(op, "slots", slots, 1, (torch.int32, torch.int64), dev)
    if kv_norm_w.shape[0] != DL or kv_cache.shape[-1] != DL + R:
        raise ValueError(f"{op}: kv_norm_w must be [{DL}] and the cache [pages, page_size, {DL + R}] for a "
                         f"{DL}-wide latent and rope {R}, got {tuple(kv_norm_w.shape)} and {tuple(kv_cache.shape)}")
    if kva.shape[1:] != (T, DL + R):
        raise ValueError(f"{op}: kva must be [{T}, {DL + R}] (or [S, {T}, {DL + R}] partials), got {tuple(kva.shape)}")
    if slots.shape != (T,):
        raise ValueError(f"{op}: slots must be [{T}], got {tuple(slots.shape)}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    if validating(validate):
        check_slots(op, slots, kv_cache.shape[0] * kv_cache.shape[1])
    if backend == "torch":
        mla_prep_ref(splitk_sum_ref(kva), None, kv_norm_w, cos, sin, slots, kv_cache, eps, 0)
        return mla_q_absorb_ref(splitk_sum_ref(qp), w_uk, cos, sin)
    out = torch.empty(T, H, DL + R, dtype=torch.bfloat16, device=dev)
    if T == 0:
        return out
    problem = {"H": H, "NOPE": nope, "DL": DL, "R2": R // 2}
    if invariant:
        cfg = invariant_config(mla_q_absorb_kv, problem, T, config)
    else:
        from ops._common import config_for

        cfg = config_for(mla_q_absorb_kv, problem, T, config)
    sl = slots if slots.dtype == torch.int64 else slots.to(torch.int64)
    mla_q_absorb_kv(qp, w_uk, cos, sin, kva, kv_norm_w, sl, out, kv_cache, float(eps), config=cfg)
    return out


def combine_uv(part: torch.Tensor, lse: torch.Tensor, w_uv: torch.Tensor, config: dict[str, Any] | None = None,
               invariant: bool = True) -> torch.Tensor:
    """Launch mla_combine_uv: part [BQ, H, S, DL] f32, lse [BQ, H, S] f32, W_UV [H, DL, V] bf16 ->
    [BQ, H, V] bf16 (called by ops.mla.mla_decode with `w_uv`, which checks the arguments)."""
    BQ, H, S, DL = part.shape
    V = w_uv.shape[-1]
    out = torch.empty(BQ, H, V, dtype=torch.bfloat16, device=part.device)
    problem = {"H": H, "DL": DL, "V": V}
    if invariant:
        cfg = invariant_config(mla_combine_uv, problem, BQ, config)
    else:
        from ops._common import config_for

        cfg = config_for(mla_combine_uv, problem, BQ, config)
    mla_combine_uv(part, lse, w_uv, out, config=cfg)
    return out
