"""Fused MoE (DeepSeek-V3 / Kimi-K2.5 noaux_tc routing) in kdsl: routing, expert align, two GEMM stages.

Pipeline of `fused_moe` (backend="triton"):
1. `moe_gate_gemm` + `moe_route` (kdsl): router GEMM x·Wgate^T in f32 (split over H into partials so
   M=1 uses many CUs; summed in fixed order), sigmoid scores, expert choice on
   scores + e_score_correction_bias (group-limited when n_group > 1), combine weights = the
   *unbiased* scores of the chosen experts, / (sum + 1e-20) when norm_topk_prob, × routed_scaling_factor.
   Top-k is k rounds of argmax-and-mask over the whole (padded) expert tile, on i32 keys that order
   like the selection scores (`_order_key`: an integer max and an integer min of the ids, exact);
   ties go to the lower id; the lane of each chosen expert stores its id and unbiased score itself,
   and the k scores are re-read after a barrier, added in k order and scaled. The ids come out int32,
   the dtype the align kernels read (no conversion launch). No result depends on a reduction order
   (split partials added in split order, exact integer max/min, the softmax denominator summed
   exactly in fixed point), so the same per-token code routes one token per program (`moe_route`)
   or a tile of tokens (`moe_route_align`) with the same bits.
   `route_align` (kernel `moe_route_align`, `moe_route_align_local` for an expert-parallel rank):
   for decode and verify (`route_align_fuses`: up to ALIGN_ONE_MAX_T rows and a [p2(M), p2(E)]
   score tile up to ROUTE_ALIGN_MAX_TILE) route the M tokens as one [MB, E] tile, store the ids and
   weights, `kd.barrier()`, and align the stored ids in the same program (up to ALIGN_ROWS_MAX_T
   rows by comparing rows with rows, `_align_few_rows`; above, with the loops of `moe_align_one`):
   the arrays of `moe_route` + `moe_align_one` in one launch; `fused_experts(...,
   aligned=)` takes them, and the model's decode / verify path uses it. The barrier and re-load
   matter: aligning the values still in registers made Triton recompute the route's reduction
   chain in the align's layouts (gfx942: 512 VGPRs, ~13k spilled registers); read back, the
   kernel compiles without spills.
2. Per-token int8 quantization of the input rows (W4A8 only): `ops.quant.quant_per_token_int8` (absmax/127, RNE), or
   none when the caller passes the rows pre-quantized (`fused_experts(..., xq=(x8, xs))`: the model's
   post-attention `ops.norm.rms_norm_quant` emits them with the normed rows).
3. Expert align (`moe_align`, kdsl: `moe_align_one` up to ALIGN_ONE_MAX_T rows (decode, verify: the
   whole align in one program and one launch), above it `moe_align_blocks` then `moe_align_scatter`): the
   (token, k) rows sorted by expert (stable) into BLOCK_M-padded blocks, a block->expert map (-1 =
   unused block) and the sentinel row id T = M*top_k for padding. `moe_align_blocks` (one program)
   counts rows per expert by comparison against all ids, takes the exclusive prefix sum of the
   padded counts in chunks of 16 experts, writes the block map and fills every sorted slot with the
   sentinel; `moe_align_scatter` ranks each row among earlier rows of its expert and writes it. An
   id outside [0, E) is in no block. No atomics, deterministic, and no host sync: the grid is the
   worst-case block count `aligned_blocks` = K + (T - K) // BLOCK_M, K = min(E, T), and the stages
   exit early (kd.exit_if) on unused blocks; at M=1 that is 8 blocks, all used. backend="torch" gives the same arrays with
   bincount/argsort.
4. Stage 1 (`moe_stage1_{w4a8,w4a16,bf16}`): per block, gate and up GEMMs against the block's expert
   (int8 x int4 -> i32 MFMA for W4A8; for W4A16 per group-32 an f32 dot of the exact int4 values,
   times the group's bf16 scale),
   per-token x per-channel scales, SiLU(gate)*up, stored as a **bf16 intermediate** [S, I]. The
   intermediate is not zero-filled: only valid rows are written, and every stage 2 loads it with
   mask = valid row and stores only valid rows, so a padding row's contents never reach an output
   (tests/test_moe_combine.py runs the stages on a NaN-poisoned intermediate).
5. Stage 2 (`moe_stage2_{w4a8,w4a16,bf16}`): per block, the down GEMM. For W4A8 the bf16
   intermediate is quantized to int8 per row (absmax/127, RNE), by default in whichever of the
   next two ways the tuned files predict faster at that M (`amax_pays`; the same bits either way):
   "separate", `quant_per_token_int8` over the [S, I] intermediate and then `moe_stage2_w4a8_pq`
   (main loop = unpack + i32 MFMA only); "amax", `moe_stage1_w4a8_amax` also stores each (valid
   row, BLOCK_N column tile)'s absmax of the bf16 it stores ([S, NT] f32, not zero-filled: stage 2
   reads only valid rows') and `moe_stage2_w4a8_aq` takes the row absmax as the max of the NT tile
   maxima (exact), forms the scale as `quant_per_token_int8` does and divides with one residual
   step fewer (`ops.quant._div_int8`: the same int8 code for every bf16 input) while its A tiles
   load: one launch fewer for ~5 VALU per A element in every program (the int4 unpack, ~14 VALU per
   word of 8 weights, is most of the main loop either way), which hides under the weight stream on
   gfx942 (its wider BLOCK_N up to 256 means fewer programs re-quantizing a block's rows) but not on
   gfx950 past M=1. With config "stage2_quant": "fused", `moe_stage2_w4a8` quantizes its A
   tiles itself (one launch less, but ~2x the main-loop VALU: every wave re-quantizes the A tile);
   with "stage2_quant": "stage1", `moe_stage1_w4a8_q` writes the int8 intermediate itself with one
   scale per (row, stage-1 BLOCK_N columns) (a row's I columns span several stage-1 programs, so a
   per-row scale cannot be formed there) and `moe_stage2_w4a8_gq` (BLOCK_K = that group) scales each
   K tile's i32 dot: one launch less and a pure int8 main loop, with finer-grained (different) numerics.
   The routing weight is applied and the top-k rows are summed per token either by `kd.atomic_add`
   into an f32 [M, H] buffer (REDUCE="atomic") or by storing a partial [T, H] buffer (not zero-filled:
   the row of an id outside [0, E) stays unwritten) reduced by `moe_sum_ids`, which reads the ids
   and counts such a row as 0 (REDUCE="partial"); REDUCE is a tunable of stage 2.
   Batch-invariant mode (`invariant=True`, the default) always uses "partial" (a fixed summation
   order) and the M=1 tiles of every float-accumulating kernel (gate GEMM, bf16 / W4A16 stages;
   W4A8 stages are exact in i32 and keep their tuned tiles), so a token's output does not depend
   on the batch.
6. Shared expert: plain torch in `fused_moe` (bf16 GEMMs, f32 SiLU); output = routed (f32) +
   shared, cast to bf16.

The model's decode step (`models.kimi._MoE.fused_block`) runs the same stages with
`fused_experts(..., xq=..., partials=True)`, the shared expert as `ops.gemm.gemm_bf16_splitk` (gate|up split
along K) + `ops.swiglu.gemm_bf16_swiglu` (SiLU(gate)*up of the summed splits, then down), and ends the layer with `combine_norm` (kernel `moe_combine_norm`): per token the top-k
partial rows summed in k order (ids outside [0, E) count 0), + the shared expert (f32), rounded to
bf16, added into the residual stream in place (bf16) and RMSNorm-ed with the next layer's input
norm (or the final norm): the roundings of `moe_sum` + add + cast + `rmsnorm_add`, one launch. Where the
next layer's q_a|kv_a GEMM norms its input rows itself (`gemm_bf16_rmsnorm`), the layer ends with
`combine_add` instead (kernel `moe_combine_add`: the same residual, no norm, split over D so that a
decode token spreads over many programs; it also returns the residual as f32 rows for that GEMM).
With the split-K shared expert that combine_add runs in the epilogue of the shared down GEMM
(`ops.swiglu.gemm_bf16_swiglu_combine`: the same bits, one launch fewer per layer).
At world size > 1 the layer ends with `combine_rank` (kernel `moe_combine_rank`: the rank's top-k sum
+ shared, bf16, the all-reduce payload) and the next norm runs after the all-reduce; an expert-parallel
rank routes with `route(..., local=(first, count))` (kernel `moe_route_local`: local ids, -1 for other
ranks' experts, straight from the router).

Weight formats (`MoEWeights.fmt`):
- "w4a8":  w13 int32 [E, 2I, H/8] Quark reorder packing (gate rows then up rows), s13 f32 [E, 2I];
           w2 int32 [E, H, I/8], s2 f32 [E, H] (per-channel; fold a per-tensor scale into these).
- "w4a16": w13 int32 [E, 2I, H/8] "ct_reorder" packing (compressed-tensors nibbles in the Quark
           reorder order; the loader repacks a "ct" checkpoint once), s13 bf16 [E, 2I, H/32];
           w2 int32 [E, H, I/8], s2 bf16 [E, H, I/32]. Weight = q * s (the kernels scale each
           group's f32 partial dot, no bf16 rounding of q * s; the dot reads q + 136 as bf16 with no
           convert and subtracts 136 x the group's activation sums, see `kd.group_dot`).
- "bf16":  w13 bf16 [E, 2I, H], w2 bf16 [E, H, I].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kdsl as kd

from ops._common import check_backend, check_tensor, config_for, invariant_config
from ops.quant import MIN_ABSMAX, _div_int8, _int8_code, _round_rne, _row_divider, quant_per_token_int8_ref, quantize_int8

NEG_INF = float("-inf")
BIG = 1 << 30
GROUP = 32  # W4A16 quant group along K
PACK = 8  # int4 values per int32 word
M_BLOCKS = (16, 32, 64)
N_BLOCKS = (16, 32, 64, 128)
K_BLOCKS = (32, 64, 128, 256)

KIMI = {"E": 384, "H": 7168, "I": 2048, "TOPK": 8}


def _p2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ----------------------------------------------------------------------------------------------
# 1. routing

ROUTE_SPLIT_H = 512  # hidden elements per program of the gate GEMM (Kimi: 14 splits x 6 expert tiles)


def route_split(h: int) -> int:
    """Programs along H of the gate GEMM (the SPLIT dim of its partial logits)."""
    return max(1, min(16, -(-h // ROUTE_SPLIT_H)))


@kd.kernel(example={"M": 1, "H": 7168, "E": 384, "SPLIT": 14})
def moe_gate_gemm(x: kd.In["M", "H", kd.bf16], wg: kd.In["E", "H", kd.bf16], part: kd.Out["SPLIT", "M", "E", kd.f32]):
    """Router logits x·Wgate^T in f32, split over H: at M=1 one program per token would stream the
    whole 5.5 MB gate weight through one CU; split partials are summed in fixed order by moe_route."""
    m, e, s = kd.grid(kd.tile("M", "BLOCK_M", domain=(1, 2, 4, 8, 16), default=1),
                      kd.tile("E", "BLOCK_E", domain=(16, 32, 64, 128), default=64), kd.each("SPLIT"))
    hs = kd.cdiv(kd.dim("H"), kd.dim("SPLIT"))
    start = s * hs
    stop = kd.minimum(start + hs, kd.dim("H"))
    acc = kd.fold(kd.tiles(start=start, stop=stop, block="BLOCK_H", domain=(16, 32, 64, 128), default=64, label="h"),
                  kd.zeros((m, e), kd.f32), lambda h, acc: acc + kd.dot(x[m, h], wg[e, h]))
    part[s, m, e] = acc


SCORING = {"sigmoid": 0, "softmax": 1}


def _finite_or_neg_inf(v):
    """NaN -> -inf (a NaN score never wins, never makes an id invalid); +-inf are kept."""
    return kd.where(v == v, v, NEG_INF)


FIX01 = float(2 ** 53)  # fixed-point scale of `_exact_sum01`: a [0, 1] value has 53 fraction bits


def _exact_sum01(v, j, g):
    """Sum over (j, g) of values in [0, 1] (NaN allowed) that no summation order changes: each value
    truncated to 53 fraction bits (ex * 2^53 is exact in f32; the dropped part is below 2^-53, far
    under an f32 ulp of a sum >= 1), added exactly in i64 (up to 2^10 terms), rounded once to f32;
    NaN when any value is NaN (as a float sum)."""
    ok = v == v
    q = kd.cast(kd.where(ok, v, 0.0) * FIX01, kd.i64)
    total = kd.cast(kd.sum(kd.sum(q, axis=j), axis=g), kd.f32) * (1.0 / FIX01)
    bad = kd.max(kd.max(kd.where(ok, 0, 1), axis=j), axis=g)
    return kd.where(bad > 0, float("nan"), total)


def _like(v, ref):
    """`v` broadcast to the axes of `ref` in their order (as is when it has them already)."""
    return v if v.axes == ref.axes else kd.broadcast(v, ref.axes)


def split_sum(logits, m, e):
    """The router logits of tokens `m`, experts `e`: the SPLIT partials of `moe_gate_gemm` added
    one after another in split order (elementwise: the same bits for any tile shape or layout).
    `logits` may be a view that knows its split count (`splits`, e.g. a GEMM's router columns)."""
    acc = logits[0, m, e]
    for s in range(1, getattr(logits, "splits", None) or kd.static("SPLIT")):
        acc = acc + logits[s, m, e]
    return acc


TAKEN = -(1 << 31)  # order keys from TAKEN up to TAKEN + TOPK mark chosen experts (and padding lanes): below every score's


def _order_key(v):
    """An i32 that orders like the f32 `v` (not NaN): the bits of v >= +0, minus the magnitude
    bits below it, so -0.0 and +0.0 get the same key 0 (they compare equal) and -inf the key
    -0x7F800000, far above TAKEN: integer max and equality choose exactly what float ones would."""
    b = kd.bitcast(v, kd.i32)
    return kd.where(b >= 0, b, -(b & 0x7FFFFFFF))


def _route_rows(logits, bias, m, ids, wts, scale, lo=None, n=None):
    """The noaux_tc choice of the tokens `m` (a scalar index: one token; a tile: a block of tokens,
    every reduction below then runs along the experts per row), stored: ids[m, k] and wts[m, k].
    Nothing depends on the order of a reduction (elementwise ops, exact integer max/min along the
    experts, the SPLIT partials added one after another in split order, the softmax denominator
    summed exactly, the k weights added in k order), so both forms, on any tile layout, give the
    same bits: `moe_route` and `moe_route_align` agree, and a token's routing does not depend on
    the batch. Each round, the one lane holding the chosen expert stores its id and its (unbiased)
    score itself (no reduction carries them); after a `kd.barrier()` the k scores are re-read per
    token, summed in k order and scaled. `lo`, `n` (expert parallel): ids are stored as id - lo, or
    -1 outside [lo, lo + n)."""
    E, K, ng, tkg = kd.static("E"), kd.static("TOPK"), kd.static("NG"), kd.static("TOPKG")
    kd.require(E % ng == 0, "E must be a multiple of n_group", "NG")
    eg = E // ng
    g = kd.span(0, _p2(ng), ng if _p2(ng) != ng else None, "g")
    j = kd.span(0, _p2(eg), eg if _p2(eg) != eg else None, "j")
    e = g * eg + j  # expert id over (g, j)
    valid = (g < ng) & (j < eg)
    logits_sum = split_sum(logits, m, e)
    if kd.static("SOFTMAX"):
        lv = kd.where(valid, logits_sum, NEG_INF)
        mx0 = kd.max(kd.max(lv, axis=j), axis=g)
        ex = kd.where(valid, kd.exp(lv - mx0), 0.0)  # in [0, 1], or NaN from NaN / inf logits
        scores = ex / _exact_sum01(ex, j, g)
    else:
        scores = kd.sigmoid(logits_sum)
    sel = kd.where(valid, _finite_or_neg_inf(scores + bias[e]), NEG_INF)
    if ng > 1:  # group score = sum of the top-2 biased scores of the group; keep topk_group groups
        top1 = kd.max(sel, axis=j)
        i1 = kd.min(kd.where(sel == top1, _like(j, sel), BIG), axis=j)
        top2 = kd.max(kd.where(i1 == j, NEG_INF, sel), axis=j)
        gs = kd.where(g < ng, _finite_or_neg_inf(top1 + top2), NEG_INF)  # inf + -inf: -inf
        gg = _like(g, gs)
        gfree = gg < ng
        keep = kd.zeros(gs.axes, kd.i32)
        for _ in range(tkg):
            gm = kd.max(kd.where(gfree, gs, NEG_INF), axis=g)
            gi = kd.min(kd.where(gfree & (gs == gm), gg, BIG), axis=g)
            keep = kd.where(gg == gi, 1, keep)
            gfree = gfree & (gg != gi)
        sel = kd.where(_like(keep, sel) > 0, sel, NEG_INF)
    ee = _like(e, sel)  # a token tile's row axis leads (no transposes)
    key = kd.where(_like(valid, sel), _order_key(sel), TAKEN + K)
    for i in range(K):  # the largest key, ties to the lowest id; the chosen lane's key becomes TAKEN + i
        top = kd.max(kd.max(key, axis=j), axis=g)
        idx = kd.min(kd.min(kd.where(key == top, ee, BIG), axis=j), axis=g)
        key = kd.where(ee == idx, TAKEN + i, key)
    rank = key - TAKEN  # the k slot of a chosen lane; K or more for the others
    stored = ee if lo is None else kd.where((ee - lo >= 0) & (ee - lo < n), ee - lo, -1)
    chosen = rank < K  # one lane per token and slot (padding lanes are masked off by ee's axes)
    ids.store(m, rank, value=stored, mask=chosen)
    wts.store(m, rank, value=scores, mask=chosen)  # the unbiased score; scaled below
    kd.barrier()
    weights = [wts[m, i] for i in range(K)]
    denom = weights[0]
    for w in weights[1:]:
        denom = denom + w
    mult = scale / (denom + 1e-20) if kd.static("NORM") else scale
    for i in range(K):
        wts[m, i] = weights[i] * mult


@kd.kernel(static=("E", "TOPK", "NG", "TOPKG", "NORM", "SPLIT", "SOFTMAX"),
           example={"M": 1, "E": 384, "TOPK": 8, "NG": 1, "TOPKG": 1, "NORM": 1, "SPLIT": 14, "SOFTMAX": 0})
def moe_route(logits: kd.In["SPLIT", "M", "E", kd.f32], bias: kd.In["E", kd.f32],
              ids: kd.Out["M", "TOPK", kd.i32], wts: kd.Out["M", "TOPK", kd.f32],
              NG: kd.Dim, TOPKG: kd.Dim, NORM: kd.Dim, SOFTMAX: kd.Dim, scale: kd.Scalar[kd.f32]):
    """noaux_tc routing for one token per program: sigmoid (or softmax) scores, biased
    group-limited top-k. Every id is in [0, E) whatever the scores: a NaN selection score counts
    as -inf and ties (including all -inf) go to the lowest id not yet chosen."""
    (m,) = kd.grid(kd.each("M"))
    _route_rows(logits, bias, m, ids, wts, scale)


@kd.kernel(static=("E", "TOPK", "NG", "TOPKG", "NORM", "SPLIT", "SOFTMAX"),
           example={"M": 1, "E": 384, "TOPK": 8, "NG": 1, "TOPKG": 1, "NORM": 1, "SPLIT": 14, "SOFTMAX": 0})
def moe_route_local(logits: kd.In["SPLIT", "M", "E", kd.f32], bias: kd.In["E", kd.f32],
                    ids: kd.Out["M", "TOPK", kd.i32], wts: kd.Out["M", "TOPK", kd.f32],
                    NG: kd.Dim, TOPKG: kd.Dim, NORM: kd.Dim, SOFTMAX: kd.Dim, scale: kd.Scalar[kd.f32],
                    lo: kd.Scalar[kd.i32], n: kd.Scalar[kd.i32]):
    """`moe_route` for an expert-parallel rank holding experts [lo, lo + n): the same choice and
    weights over all E experts, each id stored as id - lo, or -1 when another rank holds it (the
    align kernels and the top-k sums skip -1). Every stored id is in [-1, n)."""
    (m,) = kd.grid(kd.each("M"))
    _route_rows(logits, bias, m, ids, wts, scale, lo, n)


# decode and verify route and align in one launch (`moe_route_align`) while the [rows, experts] score
# tile stays this small (Kimi: up to 4 tokens x 512 expert lanes: a batch-1 verify of 4) and the align
# fits one program: one program routes all the tokens, so its time grows with them (gfx942, static
# model: 1.1 us at 1 token, 1.5 at 2, 2.6 at 4, 11 at 8), while route + align take about 2 us plus a
# 2 us launch gap (bench.step TP1 q_len 4: kernels +41 us, step -79 us, 14 launches per MoE layer, not 15)
ROUTE_ALIGN_MAX_TILE = 4 * 512


def _align_rows(read_ids, T, ea, block_expert, sorted_ids):
    """The align of `moe_align_one` (the same loops and the same arrays) over T rows whose ids
    `read_ids(t)` loads for a row tile t, into the experts of the program's tile `ea` (static EA of
    them, aligned in blocks of BM): counts per chunk of ALIGN_CHUNK experts, padded starts, block
    map, sentinel fill, then every real row written once at start[id] + its rank among the rows of
    its expert. An id outside [0, EA) is in no block. Walking row tiles (tunable BLOCK_T) keeps the
    registers of the row x expert compares to one tile."""
    EA, bm = kd.static("EA"), kd.static("BM")
    t_tiles = lambda label: kd.tiles(stop=T, block="BLOCK_T", domain=(8, 16, 32, 64), default=8, label=label)  # noqa: E731

    def raw_count(experts):
        def body(t, n):  # lanes past EA (the padded expert tile) count nothing
            return n + kd.sum(kd.where((read_ids(t) == experts) & (t < T) & (experts < EA), 1, 0), axis=t)
        return kd.fold(t_tiles("t"), kd.zeros((experts,), kd.i32), body)

    def prefix(c, acc):  # acc[ea] += padded counts of the experts c < ea in this chunk
        return acc + kd.sum(kd.where(c < ea, (raw_count(c) + (bm - 1)) // bm * bm, 0), axis=c)

    start = kd.fold(kd.tiles("EA", block=ALIGN_CHUNK, label="c"), kd.zeros((ea,), kd.i32), prefix)
    count = raw_count(ea)
    end = start + (count + (bm - 1)) // bm * bm
    total = kd.sum(end - start, axis=ea)

    def blocks(b):
        bs = b * bm
        used = kd.sum(kd.where(end <= bs, 1, 0), axis=ea)  # experts whose blocks end before block b
        block_expert[b] = kd.where(bs < total, used, -1)

    kd.fold(kd.tiles("NB", block="BLOCK_B", domain=(8, 16, 32, 64), default=16), None, blocks)

    def pad(j):  # each expert's padding: slots start + count + j for j < padded - count (< BM of them)
        sorted_ids.store(start + count + j, value=kd.zeros((ea, j), kd.i32) + T, mask=j < end - start - count)

    kd.fold(kd.tiles(stop=bm, block=min(bm, 8), label="j"), None, pad)

    def tail(r):  # the slots past the used blocks
        sorted_ids.store(r, value=kd.zeros((r,), kd.i32) + T, mask=r >= total)

    kd.fold(kd.tiles("S", block="BLOCK_S", domain=(64, 128, 256, 512), default=256, label="r"), None, tail)

    def scatter(t, seen):  # seen[ea]: rows of expert ea in the tiles before this one
        et = read_ids(t)
        u = kd.span(t.start, t.size, T, label="u")  # the same rows on a second axis
        within = kd.sum(kd.where((read_ids(u) == et) & (u < t), 1, 0), axis=u)
        first = kd.sum(kd.where(ea == et, start + seen, 0), axis=ea)  # start[id] + seen[id]
        sorted_ids.store(first + within, value=t, mask=(et >= 0) & (et < EA))
        return seen + kd.sum(kd.where((et == ea) & (t < T), 1, 0), axis=t)

    kd.fold(t_tiles("t"), kd.zeros((ea,), kd.i32), scatter)


ALIGN_ROWS_MAX_T = 64  # up to this many (token, k) rows (static bound MB*TOPK) the align compares rows with rows


def _align_few_rows(read_ids, T, block_expert, sorted_ids, slots="S"):
    """The arrays of `_align_rows` (and `moe_align_one`) for the few rows of a decode or verify step
    (static bound TB = p2(MB*TOPK) <= ALIGN_ROWS_MAX_T), computed per row from [TB, TB] row x row
    compares instead of per expert over the EA experts: a row's rank among the earlier rows of its
    expert (`within`) and its expert's row count come from one packed sum; the rows with `within` a
    multiple of BM each open one block (an expert of c rows has ceil(c / BM) of them), so a row's
    padded start = BM x the blocks opened by rows of lower experts, and block b's expert is the id of
    the row that opens it. An id outside [0, EA) is in no block. `slots`: the name of sorted_ids'
    dim (a kernel whose S means something else names it otherwise)."""
    EA, bm = kd.static("EA"), kd.static("BM")
    tb = _p2(kd.static("MB") * kd.static("TOPK"))
    t = kd.span(0, tb, T, "t")
    u = kd.span(0, tb, T, "u")  # the same rows on a second axis
    et, eu = read_ids(t), read_ids(u)
    ok_t, ok_u = (et >= 0) & (et < EA), (eu >= 0) & (eu < EA)
    same = (eu == et) & ok_u & (u < T)  # [u, t]: row u has the expert of row t
    packed = kd.sum(kd.where(same, kd.where(u < t, (1 << 16) + 1, 1 << 16), 0), axis=u)
    within, count = packed & 0xFFFF, packed >> 16  # rows before t of its expert; rows of its expert
    opens_u = ok_u & (u < T) & (kd.sum(kd.where(same & (t < u), 1, 0), axis=t) % bm == 0)  # [u]
    below = kd.sum(kd.where(opens_u & (eu < et), 1, 0), axis=u)  # blocks of the experts below t's
    slot = below * bm + within
    opens_t = ok_t & (t < T) & (within % bm == 0)
    total = kd.sum(kd.where(opens_t, bm, 0), axis=t)
    blk = below + within // bm

    def blocks(b):
        block_expert[b] = kd.sum(kd.where(opens_t & (blk == b), et + 1, 0), axis=t) - 1

    kd.fold(kd.tiles("NB", block="BLOCK_B", domain=(8, 16, 32, 64), default=16), None, blocks)
    j = kd.span(0, bm, None, "j")  # the padding slots of each block past its expert's rows
    sorted_ids.store(slot + j, value=kd.zeros((t, j), kd.i32) + T, mask=opens_t & (within + j >= count))

    def tail(r):  # the slots past the used blocks
        sorted_ids.store(r, value=kd.zeros((r,), kd.i32) + T, mask=r >= total)

    kd.fold(kd.tiles(slots, block="BLOCK_S", domain=(64, 128, 256, 512), default=256, label="r"), None, tail)
    sorted_ids.store(slot, value=t, mask=ok_t & (t < T))


def _route_align(logits, bias, ids, wts, block_expert, sorted_ids, scale, lo):
    """Route the M tokens as one [MB, E] tile, store ids and weights, then align the (token, k)
    rows of those ids (`_align_few_rows` up to ALIGN_ROWS_MAX_T rows, else the loops of
    `moe_align_one`, `_align_rows`: the same arrays either way). The align
    reads the ids back after a `kd.barrier()` (the program's stores are then visible to all its
    threads) instead of using the values in registers: from registers, Triton recomputes the
    route's reduction chain in the align's layouts (gfx942: 512 VGPRs, ~13k spilled registers);
    from memory, the align is the small kernel it is on its own. `lo` (expert parallel): the
    rank's first expert; ids are stored and aligned as local ids (-1 for another rank's expert, in
    no block), EA = the rank's expert count."""
    (ea,) = kd.grid(kd.tile("EA", block=_p2(kd.static("EA"))))  # one program: the whole (local) expert range
    route_and_align(logits, bias, ids, wts, block_expert, sorted_ids, scale, lo, ea)


def route_and_align(logits, bias, ids, wts, block_expert, sorted_ids, scale, lo, ea=None, slots="S"):
    """`_route_align`'s work in the program that runs it (no grid of its own: also the serial tail of
    a GEMM whose output holds the router logits, ops.gemm_addnorm). Without the expert tile `ea`
    only the few-rows align exists (MB x TOPK <= ALIGN_ROWS_MAX_T); `slots`: sorted_ids' dim name."""
    EA, K = kd.static("EA"), kd.static("TOPK")
    M = kd.dim("M")
    m = kd.span(0, kd.static("MB"), M, "m")  # every token (the launcher checks M <= MB)
    _route_rows(logits, bias, m, ids, wts, scale, lo, EA)
    kd.barrier()
    read_ids = lambda t: ids[t // K, t % K]  # noqa: E731 - row t = m*K + k
    if kd.static("MB") * K <= ALIGN_ROWS_MAX_T:
        _align_few_rows(read_ids, M * K, block_expert, sorted_ids, slots)
    else:
        kd.require(ea is not None, "more rows than ALIGN_ROWS_MAX_T need the expert tile of moe_route_align", "MB")
        _align_rows(read_ids, M * K, ea, block_expert, sorted_ids)


_ROUTE_ALIGN_STATIC = ("E", "TOPK", "NG", "TOPKG", "NORM", "SPLIT", "SOFTMAX", "EA", "BM", "MB")
_ROUTE_ALIGN_EXAMPLE = {"M": 1, "E": 384, "TOPK": 8, "NG": 1, "TOPKG": 1, "NORM": 1, "SPLIT": 14, "SOFTMAX": 0,
                        "EA": 384, "BM": 16, "MB": 1, "NB": 9, "S": 144}
_ROUTE_ALIGN_CHECKS = (("MB", lambda d: d["M"] <= d["MB"], "MB (the token tile) must cover M: one program"),)


@kd.kernel(static=_ROUTE_ALIGN_STATIC, example=_ROUTE_ALIGN_EXAMPLE, checks=_ROUTE_ALIGN_CHECKS)
def moe_route_align(logits: kd.In["SPLIT", "M", "E", kd.f32], bias: kd.In["E", kd.f32],
                    ids: kd.Out["M", "TOPK", kd.i32], wts: kd.Out["M", "TOPK", kd.f32],
                    block_expert: kd.Out["NB", kd.i32], sorted_ids: kd.Out["S", kd.i32],
                    NG: kd.Dim, TOPKG: kd.Dim, NORM: kd.Dim, SOFTMAX: kd.Dim, EA: kd.Dim, BM: kd.Dim, MB: kd.Dim,
                    scale: kd.Scalar[kd.f32]):
    """`moe_route` + `moe_align_one` in ONE launch (one program) for the few tokens of a decode or
    verify step: the ids and weights of `moe_route` (same bits) and the block map and sorted slots
    of `moe_align_one` over them (EA = E experts, blocks of BM rows, MB >= M the token tile)."""
    _route_align(logits, bias, ids, wts, block_expert, sorted_ids, scale, None)


@kd.kernel(static=_ROUTE_ALIGN_STATIC, example={**_ROUTE_ALIGN_EXAMPLE, "EA": 48}, checks=_ROUTE_ALIGN_CHECKS)
def moe_route_align_local(logits: kd.In["SPLIT", "M", "E", kd.f32], bias: kd.In["E", kd.f32],
                          ids: kd.Out["M", "TOPK", kd.i32], wts: kd.Out["M", "TOPK", kd.f32],
                          block_expert: kd.Out["NB", kd.i32], sorted_ids: kd.Out["S", kd.i32],
                          NG: kd.Dim, TOPKG: kd.Dim, NORM: kd.Dim, SOFTMAX: kd.Dim, EA: kd.Dim, BM: kd.Dim,
                          MB: kd.Dim, scale: kd.Scalar[kd.f32], lo: kd.Scalar[kd.i32]):
    """`moe_route_align` for an expert-parallel rank holding experts [lo, lo + EA): the ids of
    `moe_route_local` (id - lo, or -1 for another rank's expert) and their align over the EA local
    experts, in one launch."""
    _route_align(logits, bias, ids, wts, block_expert, sorted_ids, scale, lo)


def _pick(sel: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest per row, ties (-inf included) to the lowest index: a stable sort."""
    return torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]


def moe_route_ref(x: torch.Tensor, wg: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int = 1,
                  topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                  scoring_func: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `moe_route`: (ids int32 [M, k], weights f32 [M, k]), the same selection
    rules (NaN selection scores are -inf, ties to the lowest id)."""
    logits = x.float() @ wg.float().t()
    scores = torch.sigmoid(logits) if scoring_func == "sigmoid" else torch.softmax(logits, -1)
    sel = (scores + bias.float()[None]).nan_to_num(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
    M, E = scores.shape
    if n_group > 1:
        gsel = sel.view(M, n_group, E // n_group)
        top2 = torch.gather(gsel, 2, _pick(gsel.reshape(M * n_group, -1), 2).view(M, n_group, 2))
        gscore = (top2[..., 0] + top2[..., 1]).nan_to_num(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, _pick(gscore, topk_group), True)
        sel = sel.masked_fill(~gmask.repeat_interleave(E // n_group, dim=1), NEG_INF)
    ids = _pick(sel, top_k)
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), w * routed_scaling_factor


def _check_route(x: torch.Tensor, wg: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                 scoring_func: str, local: tuple[int, int] | None) -> tuple[int, int, int]:
    """The argument checks of `route` (shapes, dtypes, host ints; no device read): (M, H, E)."""
    check_tensor("route", "x", x, 2, (torch.bfloat16, torch.float16, torch.float32))
    M, H = x.shape
    check_tensor("route", "router weight", wg, 2, (torch.bfloat16, torch.float16, torch.float32), x.device)
    check_tensor("route", "e_score_correction_bias", bias, 1, (torch.float32, torch.bfloat16, torch.float16), x.device)
    E = wg.shape[0]
    if wg.shape[1] != H:
        raise ValueError(f"route: router weight must be [E, H={H}], got {tuple(wg.shape)}")
    if E < 1 or H < 1:
        raise ValueError(f"route: needs at least one expert and a hidden size, got router weight {tuple(wg.shape)}")
    if bias.shape != (E,):
        raise ValueError(f"route: e_score_correction_bias must be [E={E}], got {tuple(bias.shape)}")
    if not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"route: top_k={top_k} must be in [1, n_experts={E}]")
    if n_group < 1 or E % n_group:
        raise ValueError(f"route: n_group={n_group} must divide n_experts={E}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"route: topk_group={topk_group} must be in [1, n_group={n_group}]")
    if n_group > 1 and top_k > topk_group * (E // n_group):
        raise ValueError(f"route: top_k={top_k} exceeds the experts in topk_group={topk_group} groups")
    if n_group > 1 and E // n_group < 2:
        raise ValueError(f"route: group-limited routing needs at least 2 experts per group (top-2 group score), "
                         f"got n_experts={E}, n_group={n_group}")
    if scoring_func not in SCORING:
        raise ValueError(f"route: scoring_func must be one of {sorted(SCORING)}, got {scoring_func!r}")
    if local is not None:
        lo, n = local
        if not (isinstance(lo, int) and isinstance(n, int) and 0 <= lo and 1 <= n and lo + n <= E):
            raise ValueError(f"route: local expert range (first, count) must lie in [0, n_experts={E}), got {local}")
    return M, H, E


def _gate_partials(x: torch.Tensor, wg: torch.Tensor, config: dict, invariant: bool,
                   logits: torch.Tensor | None = None) -> torch.Tensor:
    """The router logits as SPLIT partials [SPLIT, M, E] f32 (`moe_gate_gemm`, one launch), or
    `logits` when the caller computed them already (checked, no launch): e.g. the router rows of a
    split-K GEMM that also holds the shared expert's gate|up rows (models.kimi), which saves the
    gate GEMM's launch. The route kernels add any split count in split order."""
    M, H = x.shape
    E = wg.shape[0]
    if logits is not None:
        check_tensor("route", "logits", logits, 3, (torch.float32,), x.device, last_contiguous=True)
        if logits.shape[0] < 1 or logits.shape[1:] != (M, E):
            raise ValueError(f"route: logits must be split partials [S >= 1, M={M}, E={E}] f32, "
                             f"got {tuple(logits.shape)}")
        return logits
    part = torch.empty(route_split(H), M, E, dtype=torch.float32, device=x.device)
    if invariant:
        cfg_g = invariant_config(moe_gate_gemm, {"E": E, "H": H}, M, config.get("gate"))
    else:
        cfg_g = config_for(moe_gate_gemm, {"E": E, "H": H}, M, config.get("gate"))
    xb = x if x.dtype == torch.bfloat16 and x.is_contiguous() else x.to(torch.bfloat16).contiguous()
    wb = wg if wg.dtype == torch.bfloat16 and wg.is_contiguous() else wg.to(torch.bfloat16).contiguous()
    moe_gate_gemm(xb, wb, part, config=cfg_g)
    return part


def route(x: torch.Tensor, wg: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int = 1,
          topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
          backend: str = "triton", config: dict | None = None, scoring_func: str = "sigmoid",
          invariant: bool = True, local: tuple[int, int] | None = None,
          logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids and combine weights per token (noaux_tc). `config`: {"gate": {...}, "route": {...}}.

    Guarantee: every id is in [0, E) and a token's ids are distinct, whatever the input (NaN or
    Inf hidden rows or weights): a NaN selection score counts as -inf, ties go to the lowest id.
    The weights of such a token may be NaN; the ids need no further check (`fused_experts(...,
    check_ids=False)`). `scoring_func`: "sigmoid" (DeepSeek-V3 / Kimi) or "softmax" (scores are
    the softmax over all experts; selection and weights as for sigmoid). `invariant` (default):
    the gate GEMM's tiles come from the M=1 config so a token's logits do not depend on the batch
    (the split over H is fixed by H alone). No device read on either backend's launch path.
    `local` = (first, count): an expert-parallel rank's experts [first, first + count): the choice
    and weights are over all E experts as without it, but each id comes out as id - first, or -1
    for another rank's expert (`moe_route_local`; the align kernels and top-k sums skip -1), so
    the ranks' routed outputs still sum to the whole. `logits` (triton): x @ wg^T already computed
    as f32 split-K partials [S, M, E] (any S, last dim contiguous, e.g. a strided view of a wider
    GEMM's partials): no gate GEMM launch; the torch backend ignores it and computes x @ wg^T."""
    check_backend("route", backend)
    M, H, E = _check_route(x, wg, bias, top_k, n_group, topk_group, scoring_func, local)
    if backend == "torch":
        ids, w = moe_route_ref(x, wg, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                               scoring_func)
        return (ids, w) if local is None else (local_ids(ids, *local), w)
    ids = torch.empty(M, top_k, dtype=torch.int32, device=x.device)
    wts = torch.empty(M, top_k, dtype=torch.float32, device=x.device)
    if M == 0:
        return ids, wts
    config = config or {}
    part = _gate_partials(x, wg, config, invariant, logits)
    cfg = config_for(moe_route, {"E": E, "TOPK": top_k}, M, config.get("route"))
    bf = bias if bias.dtype == torch.float32 and bias.is_contiguous() else bias.float().contiguous()
    args = (part, bf, ids, wts, n_group, topk_group, int(bool(norm_topk_prob)), SCORING[scoring_func],
            float(routed_scaling_factor))
    if local is None:
        moe_route(*args, config=cfg)
    else:
        cfg = config_for(moe_route_local, {"E": E, "TOPK": top_k}, M, config.get("route"))
        moe_route_local(*args, int(local[0]), int(local[1]), config=cfg)
    return ids, wts


def local_ids(ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Global expert ids -> one rank's local ids (id - first), -1 outside [first, first + count):
    the torch form of `moe_route_local`'s ids (reference and replayed routing)."""
    loc = ids - first
    return torch.where((loc >= 0) & (loc < count), loc, torch.full_like(loc, -1)).to(torch.int32)


def route_align_fuses(m: int, n_experts: int, top_k: int) -> bool:
    """Whether `route_align` routes and aligns m tokens in one launch (`moe_route_align`): up to
    ALIGN_ONE_MAX_T rows and a [p2(m), p2(E)] score tile of at most ROUTE_ALIGN_MAX_TILE."""
    return 0 < m * top_k <= ALIGN_ONE_MAX_T and _p2(m) * _p2(n_experts) <= ROUTE_ALIGN_MAX_TILE


def route_align(x: torch.Tensor, wg: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int = 1,
                topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, *,
                block_m: int, backend: str = "triton", config: dict | None = None, scoring_func: str = "sigmoid",
                invariant: bool = True, local: tuple[int, int] | None = None, logits: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route` then `moe_align` of its ids: (ids, weights, sorted_ids, block_expert), the align over
    the E experts (or, with `local`, the rank's `count` experts and its local ids) in blocks of
    `block_m` rows (`expert_block_m`: what `fused_experts` walks; pass the last two as its `aligned`).

    backend="triton": the gate GEMM, then for decode and verify (`route_align_fuses`) ONE launch,
    `moe_route_align` (`moe_route_align_local` with `local`): the same bits as `moe_route` +
    `moe_align_one`; above that `route` and `moe_align` (two or three launches). `config` may hold
    "gate", "route", "route_align" and the align configs; `logits` as for `route`. No device read
    on either backend."""
    check_backend("route_align", backend)
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"route_align: block_m must be a positive int, got {block_m!r}")
    M, H, E = _check_route(x, wg, bias, top_k, n_group, topk_group, scoring_func, local)
    n = E if local is None else local[1]
    if backend == "torch" or not route_align_fuses(M, E, top_k):
        ids, w = route(x, wg, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                       backend=backend, config=config, scoring_func=scoring_func, invariant=invariant, local=local,
                       logits=logits)
        sid, bexp = moe_align(ids, n, block_m, backend=backend, check=False, config=config)
        return ids, w, sid, bexp
    config = config or {}
    part = _gate_partials(x, wg, config, invariant, logits)
    outs, args, _ = route_align_operands(M, bias, top_k, n_group, topk_group, norm_topk_prob, scoring_func, n, block_m)
    kern = moe_route_align if local is None else moe_route_align_local
    cfg = config_for(kern, {"E": E, "TOPK": top_k, "NG": n_group, "EA": n, "BM": block_m}, M, config.get("route_align"))
    args = (part, *args, float(routed_scaling_factor))
    if local is None:
        kern(*args, config=cfg)
    else:
        kern(*args, int(local[0]), config=cfg)
    return outs


def route_align_operands(M: int, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                         scoring_func: str, n: int, block_m: int) -> tuple[tuple, tuple, torch.Tensor]:
    """(ids, weights, sorted_ids, block_expert) allocated for M tokens aligned over `n` experts in
    blocks of `block_m` (every slot is written by the kernel; the last two are views of one int32
    buffer, block map first, also returned), and the route + align kernels' arguments after the
    logits up to the scaling factor (bias as contiguous f32, the outputs, the routing dims): what
    `moe_route_align` takes, and the GEMMs with a route tail (ops.gemm_addnorm: the one buffer)."""
    nb = aligned_blocks(M * top_k, n, block_m)
    dev = bias.device
    ids = torch.empty(M, top_k, dtype=torch.int32, device=dev)
    wts = torch.empty(M, top_k, dtype=torch.float32, device=dev)
    aligned = torch.empty(nb * (1 + block_m), dtype=torch.int32, device=dev)
    bexp, sid = aligned[:nb], aligned[nb:]
    bf = bias if bias.dtype == torch.float32 and bias.is_contiguous() else bias.float().contiguous()
    return (ids, wts, sid, bexp), (bf, ids, wts, bexp, sid, n_group, topk_group, int(bool(norm_topk_prob)),
                                   SCORING[scoring_func], n, block_m, _p2(M)), aligned


# ----------------------------------------------------------------------------------------------
# 3. expert align (torch ops, no host sync)

ALIGN_CHUNK = 16  # experts per step of the prefix sum in moe_align_blocks


@kd.kernel(static=("E", "BM"), example={"T": 8, "E": 384, "NB": 9, "BM": 16, "S": 144})
def moe_align_blocks(ids: kd.In["T", kd.i32], pstart: kd.Out["E", kd.i32], block_expert: kd.Out["NB", kd.i32],
                     sorted_ids: kd.Out["S", kd.i32], BM: kd.Dim):
    """Expert align, part 1 (one program): per-expert row counts, BLOCK_M-padded start offsets
    (exclusive prefix sum), the block -> expert map (-1 past the used blocks) and every slot of
    sorted_ids set to the padding sentinel T (moe_align_scatter then writes the real rows), so no
    fill launch runs before it."""
    E, bm = kd.static("E"), kd.static("BM")
    (e,) = kd.grid(kd.tile("E", block=_p2(E)))
    T = kd.dim("T")
    t_tiles = lambda: kd.tiles("T", block="BLOCK_T", domain=(8, 16, 32, 64), default=16)  # noqa: E731

    def count(experts):
        def body(t, n):
            # lanes past E (the expert tile is padded to a power of two) count nothing, so an id
            # in [E, 2^k) is in no block, like every other id outside [0, E)
            return n + kd.sum(kd.where((ids[t] == experts) & (t < T) & (experts < E), 1, 0), axis=t)
        c = kd.fold(t_tiles(), kd.zeros((experts,), kd.i32), body)
        return (c + (bm - 1)) // bm * bm

    def prefix(c, acc):  # acc[e] += padded counts of the experts c < e in this chunk
        return acc + kd.sum(kd.where(c < e, count(c), 0), axis=c)

    start = kd.fold(kd.tiles("E", block=ALIGN_CHUNK, label="c"), kd.zeros((e,), kd.i32), prefix)
    padded = count(e)
    pstart[e] = start
    end = start + padded
    total = kd.sum(padded, axis=e)

    def blocks(b, dummy):
        bs = b * bm
        used = kd.sum(kd.where(end <= bs, 1, 0), axis=e)  # experts whose blocks end before block b
        block_expert[b] = kd.where(bs < total, used, -1)
        return dummy

    kd.fold(kd.tiles("NB", block="BLOCK_B", domain=(16, 32, 64), default=32), kd.zeros((e,), kd.i32), blocks)

    def fill(r, dummy):
        sorted_ids[r] = kd.zeros((r,), kd.i32) + T
        return dummy

    kd.fold(kd.tiles("S", block="BLOCK_S", domain=(64, 128, 256, 512), default=256, label="r"),
            kd.zeros((e,), kd.i32), fill)


@kd.kernel(example={"T": 8, "E": 384, "S": 144})
def moe_align_scatter(ids: kd.In["T", kd.i32], pstart: kd.In["E", kd.i32], sorted_ids: kd.InOut["S", kd.i32]):
    """Expert align, part 2: row t goes to pstart[ids[t]] + #{t' < t with the same expert}."""
    (t,) = kd.grid(kd.tile("T", "BLOCK_T", domain=(16, 32, 64, 128), default=64))
    et = ids[t]

    def body(u, r):
        return r + kd.sum(kd.where((ids[u] == et) & (u < t), 1, 0), axis=u)

    rank = kd.fold(kd.tiles("T", block="BLOCK_U", domain=(16, 32, 64), default=32, label="u"),
                   kd.zeros((t,), kd.i32), body)
    # a row whose expert id is outside [0, E) is in no block (a no-op: it adds nothing to its token)
    sorted_ids.store(pstart[et] + rank, value=t, mask=(et >= 0) & (et < kd.dim("E")))


# rows up to which moe_align runs as one program: decode and verify of up to 32 tokens (its row
# ranks walk the rows in order, O(T x E) work in one program; the two-kernel path spreads it)
ALIGN_ONE_MAX_T = 256


@kd.kernel(static=("E", "BM"), example={"T": 8, "E": 384, "NB": 9, "BM": 16, "S": 144})
def moe_align_one(ids: kd.In["T", kd.i32], block_expert: kd.Out["NB", kd.i32], sorted_ids: kd.Out["S", kd.i32],
                  E: kd.Dim, BM: kd.Dim):
    """Expert align in ONE launch for the few rows of a decode or verify step (one program): the
    counts, padded starts and block map of moe_align_blocks, then every slot written once, the
    padding slots with the sentinel T and the real ones with their row (row t goes to
    start[ids[t]] + #{t' < t with the same expert}), so no two writes meet and no launch runs before
    or after it. Same result as moe_align_blocks + moe_align_scatter."""
    E, bm = kd.static("E"), kd.static("BM")
    (e,) = kd.grid(kd.tile("E", block=_p2(E)))
    T = kd.dim("T")
    t_tiles = lambda label: kd.tiles("T", block="BLOCK_T", domain=(8, 16, 32, 64), default=8, label=label)  # noqa: E731

    def raw_count(experts):
        def body(t, n):
            # lanes past E (the padded expert tile) count nothing: an id outside [0, E) is in no block
            return n + kd.sum(kd.where((ids[t] == experts) & (t < T) & (experts < E), 1, 0), axis=t)
        return kd.fold(t_tiles("t"), kd.zeros((experts,), kd.i32), body)

    def prefix(c, acc):  # acc[e] += padded counts of the experts c < e in this chunk
        return acc + kd.sum(kd.where(c < e, (raw_count(c) + (bm - 1)) // bm * bm, 0), axis=c)

    start = kd.fold(kd.tiles("E", block=ALIGN_CHUNK, label="c"), kd.zeros((e,), kd.i32), prefix)
    count = raw_count(e)
    end = start + (count + (bm - 1)) // bm * bm
    total = kd.sum(end - start, axis=e)

    def blocks(b):
        bs = b * bm
        used = kd.sum(kd.where(end <= bs, 1, 0), axis=e)  # experts whose blocks end before block b
        block_expert[b] = kd.where(bs < total, used, -1)

    kd.fold(kd.tiles("NB", block="BLOCK_B", domain=(8, 16, 32, 64), default=16), None, blocks)

    def pad(j):  # each expert's padding: slots start + count + j for j < padded - count (< BM of them)
        sorted_ids.store(start + count + j, value=kd.zeros((e, j), kd.i32) + T, mask=j < end - start - count)

    kd.fold(kd.tiles(stop=bm, block=min(bm, 8), label="j"), None, pad)

    def tail(r):  # the slots past the used blocks
        sorted_ids.store(r, value=kd.zeros((r,), kd.i32) + T, mask=r >= total)

    kd.fold(kd.tiles("S", block="BLOCK_S", domain=(64, 128, 256, 512), default=256, label="r"), None, tail)

    def scatter(t, seen):  # seen[e]: rows of expert e in the tiles before this one
        et = ids[t]
        u = kd.span(t.start, t.size, T, label="u")  # the same rows on a second axis
        within = kd.sum(kd.where((ids[u] == et) & (u < t), 1, 0), axis=u)
        first = kd.sum(kd.where(e == et, start + seen, 0), axis=e)  # start[ids[t]] + seen[ids[t]]
        sorted_ids.store(first + within, value=t, mask=(et >= 0) & (et < E))
        return seen + kd.sum(kd.where((et == e) & (t < T), 1, 0), axis=t)

    kd.fold(t_tiles("t"), kd.zeros((e,), kd.i32), scatter)


def aligned_blocks(T: int, E: int, block_m: int) -> int:
    """The most BLOCK_M-row blocks T rows over E experts can fill: k experts with rows (k <= K =
    min(E, T)) fill sum(cdiv(c_e, BM)) = k + sum((c_e - 1) // BM) <= k + (T - k) // BM blocks, which
    does not decrease with k, so K + (T - K) // BM (cdiv(T, BM) + K over-counts by up to cdiv(T, BM):
    at M=1, 9 blocks for 8 rows; every extra block is a launched row of programs that exits at once)."""
    k = min(E, T)
    return k + (T - k) // block_m


def moe_align(ids: torch.Tensor, n_experts: int, block_m: int, backend: str = "triton", check: bool = True,
              config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, k) rows by expert into block_m-padded blocks.

    Returns sorted_ids int32 [NB*block_m] (row id t*top_k+k, or the sentinel T=M*top_k for padding)
    and block_expert int32 [NB] (-1 for blocks past the used ones), NB = aligned_blocks(T, E, block_m).
    backend="triton": for T <= ALIGN_ONE_MAX_T rows (decode and verify) one kdsl kernel,
    moe_align_one; above it two, moe_align_blocks (counts, block map, sentinel fill) then
    moe_align_scatter; nothing else launched for int32 ids. `config` may hold their configs under
    "align_one" / "align_blocks" / "align_scatter" (else tuned, keyed by E (and BLOCK_M), M = T rows);
    "torch": the same result with torch ops (bincount, stable argsort)."""
    _check_backend(backend)
    check_tensor("moe_align", "ids", ids, None, (torch.int32, torch.int64))
    T = ids.numel()
    if check and T and (int(ids.min()) < 0 or int(ids.max()) >= n_experts):  # a host sync: skippable
        raise ValueError(f"moe_align: expert ids must lie in [0, {n_experts}), got [{int(ids.min())}, {int(ids.max())}]")
    nb = aligned_blocks(T, n_experts, block_m)
    if T == 0:
        return (torch.empty(0, dtype=torch.int32, device=ids.device),
                torch.empty(0, dtype=torch.int32, device=ids.device))
    if backend == "triton":
        # int32 ids (what `route` gives) are read in place: no conversion launch
        flat32 = ids.reshape(-1) if ids.dtype == torch.int32 and ids.is_contiguous() else \
            ids.reshape(-1).to(torch.int32).contiguous()
        bexp = torch.empty(nb, dtype=torch.int32, device=ids.device)
        sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=ids.device)  # every slot written below
        config = config or {}
        if T <= ALIGN_ONE_MAX_T:
            c1 = config_for(moe_align_one, {"E": n_experts, "BM": block_m}, T, config.get("align_one"))
            moe_align_one(flat32, bexp, sorted_ids, n_experts, block_m, config=c1)
            return sorted_ids, bexp
        pstart = torch.empty(n_experts, dtype=torch.int32, device=ids.device)
        cb = config_for(moe_align_blocks, {"E": n_experts, "BM": block_m}, T, config.get("align_blocks"))
        cs = config_for(moe_align_scatter, {"E": n_experts}, T, config.get("align_scatter"))
        moe_align_blocks(flat32, pstart, bexp, sorted_ids, block_m, config=cb)
        moe_align_scatter(flat32, pstart, sorted_ids, config=cs)
        return sorted_ids, bexp
    flat = ids.reshape(-1).long()
    ok = (flat >= 0) & (flat < n_experts)  # an id outside [0, E) is in no block (as in the kernels)
    key = torch.where(ok, flat, torch.full_like(flat, n_experts))
    counts = torch.bincount(key, minlength=n_experts + 1)[:n_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    pstart = torch.cumsum(padded, 0) - padded
    cstart = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    se = key[order]
    real = se < n_experts
    sc = torch.where(real, se, torch.zeros_like(se))
    pos = pstart[sc] + (torch.arange(T, device=ids.device) - cstart[sc])
    sorted_ids = torch.full((nb * block_m + 1,), T, dtype=torch.int32, device=ids.device)
    sorted_ids[torch.where(real, pos, torch.full_like(pos, nb * block_m))] = order.to(torch.int32)
    sorted_ids = sorted_ids[:-1]  # the last slot took the rows of invalid ids
    bstart = torch.arange(nb, device=ids.device) * block_m
    pend = pstart + padded
    bexp = (pend[None, :] <= bstart[:, None]).sum(1)  # experts whose blocks end before this block
    used = padded.sum()
    block_expert = torch.where(bstart < used, bexp, torch.full_like(bexp, -1)).to(torch.int32)
    return sorted_ids, block_expert


# ----------------------------------------------------------------------------------------------
# 4./5. expert GEMM stages: shared pieces

def _block_rows(sorted_ids, block_expert, b):
    """The block's expert (exits on unused blocks), its rows, their (token, k) ids and validity."""
    BM = kd.tunable("BLOCK_M", M_BLOCKS, 16, "rows per expert block (MFMA needs >= 16)")
    e = block_expert[b]
    kd.exit_if(e < 0)
    rows = kd.span(b * BM, BM, label="m")
    tid = sorted_ids[rows]
    return e, rows, tid


def _k_tiles(dim: str, default: int = 128):
    return kd.tiles(dim, block="BLOCK_K", domain=K_BLOCKS, default=default)


def _unpack(default: str = "bfe") -> str:
    """The int4 unpack lowering (kdsl `load(..., unpack=)`), tuned like a tile size."""
    return kd.tunable("INT4_UNPACK", ("shift", "bfe", "swar"), default,
                       "int4 nibble extraction: shifts, bit-field extracts, or four nibbles per word operation")


def _w_rows(default: int) -> int:
    """Which side of the expert dot the weight rows take. Triton's AMD backend stacks the warps on
    the MFMA's M side first: with acc(tok, n) = dot(x, w) a 16-row token tile gives every warp the
    same 16 rows, and when BLOCK_N cannot hold one 16-wide tile per warp each wave repeats the whole
    tile (4x MFMA, the A tile written to and read from LDS by every wave). acc(n, tok) = dot(w, x)
    (W_ROWS 1) puts the weight rows on the M side, so the warps split N. Integer dots: the result is
    bit-identical either way. Triton already splits N when BLOCK_N >= 16 * num_warps, so it matters
    for the narrow tiles small-M buckets pick (gfx942 stage 1 at M=1: BLOCK_N 32 runs 16 MFMA per
    wave-iteration with W_ROWS 0, 8 with W_ROWS 1, and 4 KB instead of 6 KB of LDS)."""
    return kd.tunable("W_ROWS", (0, 1), default, "1: acc(n, tok) = dot(w, x), warps split N; 0: acc(tok, n) = dot(x, w)")


def _wdot(a, w, w_rows: int):
    """dot(a, w) with the weight tile on the MFMA side chosen by W_ROWS (same axes either way)."""
    return kd.dot(w, a) if w_rows else kd.dot(a, w)


def _w4a8_gate_up(x, w13, e, n, tok, valid):
    """The W4A8 stage-1 main loop: i32 accumulators of gate and up (shared by the debug kernel)."""
    I = kd.dim("I")
    how = _unpack()
    wr = _w_rows(1)

    def body(k, ag, au):
        a = x.load(tok, k, mask=valid)
        return (ag + _wdot(a, w13.load(e, n, k, unpack=how), wr),
                au + _wdot(a, w13.load(e, n + I, k, unpack=how), wr))

    z = kd.zeros((n, tok) if wr else (tok, n), kd.i32)
    return kd.fold(_k_tiles("K"), (z, z), body)


def _w4a8_silu_up(x, xs, w13, s13, sorted_ids, block_expert, TOPK):
    """Stage 1 of W4A8 up to the activation: (rows, n, valid, SiLU(gate)*up in f32) of this
    program's aligned block and BLOCK_N columns (shared by the bf16- and int8-emitting kernels)."""
    b, n = _s1_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("M") * TOPK
    tok = tid // TOPK
    ag, au = _w4a8_gate_up(x, w13, e, n, tok, valid)
    xsv = xs.load(tok, mask=valid)
    g = ag * xsv * s13[e, n]
    u = au * xsv * s13[e, n + kd.dim("I")]
    return rows, n, valid, kd.silu(g) * u


S1_CHECKS = [("N2", lambda d: d["N2"] == 2 * d["I"], "w13 rows (N2) must be 2*I (gate rows then up rows)")]
S1_EXAMPLE = {"M": 1, "K": KIMI["H"], "I": KIMI["I"], "N2": 2 * KIMI["I"], "E": KIMI["E"], "TOPK": 8,
              "S": 16 * 9, "NB": 9}


def _s1_grid():
    return kd.grid(kd.each("NB"), kd.tile("I", "BLOCK_N", domain=N_BLOCKS, default=64))


@kd.kernel(static=("TOPK",), checks=S1_CHECKS, example=S1_EXAMPLE)
def moe_stage1_w4a8(x: kd.In["M", "K", kd.i8], xs: kd.In["M", kd.f32],
                    w13: kd.In["E", "N2", "K", kd.int4("quark_reorder")], s13: kd.In["E", "N2", kd.f32],
                    sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32],
                    inter: kd.Out["S", "I", kd.bf16], TOPK: kd.Dim):
    """W4A8 gate+up: int8 x int4 -> i32 dot, per-token x per-channel scales, SiLU(gate)*up -> bf16."""
    rows, n, valid, h = _w4a8_silu_up(x, xs, w13, s13, sorted_ids, block_expert, TOPK)
    inter.store(rows, n, value=h, mask=valid)


@kd.kernel(static=("TOPK",), checks=S1_CHECKS + [("NT", lambda d: d["NT"] >= 1, "NT (scale groups per row) must be >= 1")],
           example={**S1_EXAMPLE, "NT": KIMI["I"] // 64})
def moe_stage1_w4a8_q(x: kd.In["M", "K", kd.i8], xs: kd.In["M", kd.f32],
                      w13: kd.In["E", "N2", "K", kd.int4("quark_reorder")], s13: kd.In["E", "N2", kd.f32],
                      sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32],
                      inter: kd.Out["S", "I", kd.i8], inter_s: kd.Out["S", "NT", kd.f32], TOPK: kd.Dim):
    """`moe_stage1_w4a8` emitting the stage-2 A operand directly: the bf16 SiLU(gate)*up row piece
    of this program's BLOCK_N columns is quantized to int8 with its own scale (absmax/127, RNE), so
    no quant launch runs between the stages. A row's absmax over all of I would need every program
    of the row; a scale per (row, BLOCK_N group) does not, and stage 2 (`moe_stage2_w4a8_gq`, its
    BLOCK_K equal to this BLOCK_N) applies one scale per K tile. NT = I / BLOCK_N."""
    rows, n, valid, h = _w4a8_silu_up(x, xs, w13, s13, sorted_ids, block_expert, TOPK)
    h = h.to(kd.bf16).to(kd.f32)  # the bf16 intermediate the unfused path stores
    sc = kd.maximum(kd.max(kd.abs(h), axis=n), MIN_ABSMAX) / 127.0
    inter.store(rows, n, value=_round_rne(kd.minimum(kd.maximum(h / sc, -127.0), 127.0)).to(kd.i32).to(kd.i8),
                mask=valid)
    inter_s.store(rows, n.start // kd.tunable("BLOCK_N", N_BLOCKS, 64), value=sc, mask=valid)


AMAX_CHECKS = [("NT", lambda d: d["NT"] >= 1, "NT (column tiles per row) must be >= 1")]


@kd.kernel(static=("TOPK",), checks=S1_CHECKS + AMAX_CHECKS, example={**S1_EXAMPLE, "NT": KIMI["I"] // 64})
def moe_stage1_w4a8_amax(x: kd.In["M", "K", kd.i8], xs: kd.In["M", kd.f32],
                         w13: kd.In["E", "N2", "K", kd.int4("quark_reorder")], s13: kd.In["E", "N2", kd.f32],
                         sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32],
                         inter: kd.Out["S", "I", kd.bf16], inter_amax: kd.Out["S", "NT", kd.f32], TOPK: kd.Dim):
    """`moe_stage1_w4a8` that also stores, per (valid row, BLOCK_N column tile), the absmax of the
    bf16 values it stores (NT = cdiv(I, BLOCK_N)): a row's absmax over all of I is the max of its
    NT tile maxima (exact), which `moe_stage2_w4a8_aq` forms itself, so no quant launch runs
    between the stages and the int8 codes equal `quant_per_token_int8`'s. Each valid (row, tile) is
    written by the one program of that block and tile; padding rows' entries are never written and
    never read (stage 2 loads them with mask = valid row). A tile index >= NT is not stored."""
    rows, n, valid, h = _w4a8_silu_up(x, xs, w13, s13, sorted_ids, block_expert, TOPK)
    inter.store(rows, n, value=h, mask=valid)
    hb = h.to(kd.bf16).to(kd.f32)  # the values just stored (the store rounds to bf16 the same way)
    t = n.start // kd.tunable("BLOCK_N", N_BLOCKS, 64)
    in_nt = kd.broadcast(t, (rows,)) < kd.dim("NT")  # a vector compare: the interpreter mixes no scalar bool in
    inter_amax.store(rows, t, value=kd.max(kd.abs(hb), axis=n), mask=valid & in_nt)


@kd.kernel(static=("TOPK",), checks=S1_CHECKS, example=S1_EXAMPLE)
def moe_stage1_w4a8_acc(x: kd.In["M", "K", kd.i8], w13: kd.In["E", "N2", "K", kd.int4("quark_reorder")],
                        sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32],
                        acc_g: kd.Out["S", "I", kd.i32], acc_u: kd.Out["S", "I", kd.i32], TOPK: kd.Dim):
    """Test view of `moe_stage1_w4a8`: the same main loop, raw i32 gate/up accumulators stored."""
    b, n = _s1_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("M") * TOPK
    ag, au = _w4a8_gate_up(x, w13, e, n, tid // TOPK, valid)
    acc_g.store(rows, n, value=ag, mask=valid)
    acc_u.store(rows, n, value=au, mask=valid)


def _w4a16_groups(default: int):
    """The axis of a K tile's scale groups (BLOCK_K / 32 of them): the loop-carried accumulators
    keep it until one sum after the loop (`kd.group_dot`)."""
    return kd.span(0, kd.tunable("BLOCK_K", K_BLOCKS, default) // GROUP, label="g")


def _w4a16_dot(a, w, s, e, n, k, groups: str, acc, w_rows: int):
    """acc + the group-scaled dot of a bf16 tile with an int4 (ct_reorder) weight tile (n, k) and its
    bf16 group-32 scales: per group an f32 dot of the int4 values, times s[n, g] (`kd.group_dot`: no
    multiply or bf16 rounding per weight; the pack's nibble pairs become bf16 with one shift, mask
    and or per two weights). One scale per (row, group) is loaded."""
    q = w.load(e, n, k)
    sc = s.load(e, n, kd.mx_groups(k, kd.dim(groups), GROUP))
    return kd.group_dot(q, a, sc, acc) if w_rows else kd.group_dot(a, q, sc, acc)


@kd.kernel(static=("TOPK",), example={**S1_EXAMPLE, "KG": KIMI["H"] // GROUP},
           checks=S1_CHECKS + [("KG", lambda d: d["K"] == GROUP * d["KG"], "s13 must be [E, N2, K/32] (group 32)")])
def moe_stage1_w4a16(x: kd.In["M", "K", kd.bf16], w13: kd.In["E", "N2", "K", kd.int4("ct_reorder")],
                     s13: kd.In["E", "N2", "KG", kd.bf16],
                     sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32],
                     inter: kd.Out["S", "I", kd.bf16], TOPK: kd.Dim):
    """W4A16 group-32 gate+up: per scale group an f32 dot of bf16 x with the exact int4 values,
    times the group's scale (`kd.group_dot`), SiLU(gate)*up."""
    b, n = _s1_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("M") * TOPK
    tok = tid // TOPK
    I = kd.dim("I")

    wr = _w_rows(0)
    g = _w4a16_groups(64)

    def body(k, ag, au):
        a = x.load(tok, k, mask=valid)
        return (_w4a16_dot(a, w13, s13, e, n, k, "KG", ag, wr),
                _w4a16_dot(a, w13, s13, e, n + I, k, "KG", au, wr))

    z = kd.zeros((g, n, tid) if wr else (g, tid, n), kd.f32)
    ag, au = kd.fold(_k_tiles("K", 64), (z, z), body)
    ag, au = kd.sum(ag, axis=g), kd.sum(au, axis=g)
    inter.store(rows, n, value=kd.silu(ag) * au, mask=valid)


@kd.kernel(static=("TOPK",), checks=S1_CHECKS, example=S1_EXAMPLE)
def moe_stage1_bf16(x: kd.In["M", "K", kd.bf16], w13: kd.In["E", "N2", "K", kd.bf16],
                    sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32],
                    inter: kd.Out["S", "I", kd.bf16], TOPK: kd.Dim):
    """bf16 gate+up with SiLU(gate)*up."""
    b, n = _s1_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("M") * TOPK
    tok = tid // TOPK
    I = kd.dim("I")

    def body(k, ag, au):
        a = x.load(tok, k, mask=valid)
        return ag + kd.dot(a, w13[e, n, k]), au + kd.dot(a, w13[e, n + I, k])

    z = kd.zeros((tid, n), kd.f32)
    ag, au = kd.fold(_k_tiles("K"), (z, z), body)
    inter.store(rows, n, value=kd.silu(ag) * au, mask=valid)


S2_EXAMPLE = {"M": 1, "I": KIMI["I"], "H": KIMI["H"], "E": KIMI["E"], "TOPK": 8, "T": 8, "S": 16 * 9, "NB": 9,
              "MO": 1, "P": 8}


def _s2_grid():
    return kd.grid(kd.each("NB"), kd.tile("H", "BLOCK_N", domain=N_BLOCKS, default=64))


def _s2_epilogue(y, tid, valid, n, topk_w, out, partial):
    """Apply the routing weight and reduce over top-k: atomic f32 add, or a partial [T, H] row."""
    y = y * topk_w.load(tid, mask=valid)
    mode = kd.tunable("REDUCE", ("atomic", "partial"), "atomic", "top-k sum: f32 atomics or partial + moe_sum")
    if mode == "atomic":
        out.atomic_add(tid // kd.static("TOPK"), n, value=y, mask=valid)
    else:
        partial.store(tid, n, value=y, mask=valid)


@kd.kernel(static=("TOPK",), example=S2_EXAMPLE)
def moe_stage2_w4a8(inter: kd.In["S", "I", kd.bf16], w2: kd.In["E", "H", "I", kd.int4("quark_reorder")],
                    s2: kd.In["E", "H", kd.f32], sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32],
                    topk_w: kd.In["T", kd.f32], out: kd.InOut["MO", "H", kd.f32], partial: kd.Out["P", "H", kd.f32],
                    TOPK: kd.Dim):
    """W4A8 down: per-row int8 quant of the bf16 intermediate (prologue), int8 x int4 -> i32, scales,
    routing weight, top-k reduction."""
    b, n = _s2_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("T")

    def amax_body(k, a):
        return kd.maximum(a, kd.max(kd.abs(inter.load(rows, k, mask=valid).to(kd.f32)), axis=k))

    a_s = kd.maximum(kd.fold(_k_tiles("I"), kd.zeros((rows,), kd.f32), amax_body), MIN_ABSMAX) / 127.0
    how = _unpack()

    def body(k, acc):
        y = kd.minimum(kd.maximum(inter.load(rows, k, mask=valid).to(kd.f32) / a_s, -127.0), 127.0)
        q = _round_rne(y).to(kd.i32).to(kd.i8)
        return acc + kd.dot(q, w2.load(e, n, k, unpack=how))

    acc = kd.fold(_k_tiles("I"), kd.zeros((rows, n), kd.i32), body)
    _s2_epilogue(acc * a_s * s2[e, n], tid, valid, n, topk_w, out, partial)


@kd.kernel(static=("TOPK",), example=S2_EXAMPLE)
def moe_stage2_w4a8_pq(inter: kd.In["S", "I", kd.i8], inter_s: kd.In["S", kd.f32],
                       w2: kd.In["E", "H", "I", kd.int4("quark_reorder")], s2: kd.In["E", "H", kd.f32],
                       sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32], topk_w: kd.In["T", kd.f32],
                       out: kd.InOut["MO", "H", kd.f32], partial: kd.Out["P", "H", kd.f32], TOPK: kd.Dim):
    """W4A8 down on an intermediate already quantized per row (by `quant_per_token_int8`): the main
    loop is only the int4 unpack and the i32 MFMA (the fused variant re-quantizes A in every wave)."""
    b, n = _s2_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("T")

    how = _unpack()
    wr = _w_rows(0)  # its tuned BLOCK_N (64/128) already splits N; W_ROWS 1 costs +14 VGPRs there

    def body(k, acc):
        return acc + _wdot(inter.load(rows, k, mask=valid), w2.load(e, n, k, unpack=how), wr)

    acc = kd.fold(_k_tiles("I"), kd.zeros((n, rows) if wr else (rows, n), kd.i32), body)
    _s2_epilogue(acc * inter_s[rows] * s2[e, n], tid, valid, n, topk_w, out, partial)


AMAX_TILE = 32  # stage-1 column-tile maxima a stage-2 program reads per step (NT is 8..32 at Kimi sizes)
# moe_stage2_w4a8_aq's N tiles: every program quantizes its block's whole A rows, so wider tiles
# (fewer programs per block) do less of that work in all
AQ_N_BLOCKS = N_BLOCKS + (256,)


@kd.kernel(static=("TOPK",), checks=AMAX_CHECKS, example={**S2_EXAMPLE, "NT": KIMI["I"] // 64})
def moe_stage2_w4a8_aq(inter: kd.In["S", "I", kd.bf16], inter_amax: kd.In["S", "NT", kd.f32],
                       w2: kd.In["E", "H", "I", kd.int4("quark_reorder")], s2: kd.In["E", "H", kd.f32],
                       sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32], topk_w: kd.In["T", kd.f32],
                       out: kd.InOut["MO", "H", kd.f32], partial: kd.Out["P", "H", kd.f32], TOPK: kd.Dim):
    """W4A8 down on the bf16 intermediate of `moe_stage1_w4a8_amax`, quantized as its A tiles load:
    the row absmax is the max of the row's NT stage-1 tile maxima (no pass over the row), the scale is
    `quant_per_token_int8`'s and the division `_div_int8` (3 VALU per element; its int8 codes are
    `_div_rn`'s for every bf16 input), so the int8 codes, the scales and the result equal the separate path
    (`quant_per_token_int8` + `moe_stage2_w4a8_pq`) bit for bit, one launch fewer."""
    b, n = kd.grid(kd.each("NB"), kd.tile("H", "BLOCK_N", domain=AQ_N_BLOCKS, default=64))
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("T")

    def amax_body(t, a):
        return kd.maximum(a, kd.max(inter_amax.load(rows, t, mask=valid), axis=t))

    amax = kd.fold(kd.tiles("NT", block=AMAX_TILE, label="t"), kd.zeros((rows,), kd.f32), amax_body)
    a_s = kd.maximum(amax, MIN_ABSMAX) / 127.0
    d, r = _row_divider(a_s)
    how = _unpack()
    wr = _w_rows(0)

    def body(k, acc):
        y = kd.minimum(kd.maximum(_div_int8(inter.load(rows, k, mask=valid).to(kd.f32), d, r), -127.0), 127.0)
        return acc + _wdot(_int8_code(y), w2.load(e, n, k, unpack=how), wr)

    acc = kd.fold(_k_tiles("I"), kd.zeros((n, rows) if wr else (rows, n), kd.i32), body)
    _s2_epilogue(acc * a_s * s2[e, n], tid, valid, n, topk_w, out, partial)


@kd.kernel(static=("TOPK",), example={**S2_EXAMPLE, "NT": KIMI["I"] // 64})
def moe_stage2_w4a8_gq(inter: kd.In["S", "I", kd.i8], inter_s: kd.In["S", "NT", kd.f32],
                       w2: kd.In["E", "H", "I", kd.int4("quark_reorder")], s2: kd.In["E", "H", kd.f32],
                       sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32], topk_w: kd.In["T", kd.f32],
                       out: kd.InOut["MO", "H", kd.f32], partial: kd.Out["P", "H", kd.f32], TOPK: kd.Dim):
    """W4A8 down on the int8 intermediate of `moe_stage1_w4a8_q` with one scale per (row, group of
    I/NT columns): BLOCK_K must equal that group (fused_experts sets it to stage 1's BLOCK_N). Each
    K tile's i32 dot is scaled by its rows' group scale and summed in f32, in K order."""
    b, n = _s2_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("T")
    how = _unpack()
    wr = _w_rows(0)
    bk = kd.tunable("BLOCK_K", K_BLOCKS, 64)
    nt = kd.dim("NT")

    def body(k, acc):
        d = _wdot(inter.load(rows, k, mask=valid), w2.load(e, n, k, unpack=how), wr)
        g = kd.minimum(k.start // bk, nt - 1)  # < NT when BLOCK_K is the group; clamped to stay in bounds
        return acc + d.to(kd.f32) * inter_s.load(rows, g, mask=valid)

    acc = kd.fold(_k_tiles("I", 64), kd.zeros((n, rows) if wr else (rows, n), kd.f32), body)
    _s2_epilogue(acc * s2[e, n], tid, valid, n, topk_w, out, partial)


@kd.kernel(static=("TOPK",), example={**S2_EXAMPLE, "IG": KIMI["I"] // GROUP},
           checks=[("IG", lambda d: d["I"] == GROUP * d["IG"], "s2 must be [E, H, I/32] (group 32)")])
def moe_stage2_w4a16(inter: kd.In["S", "I", kd.bf16], w2: kd.In["E", "H", "I", kd.int4("ct_reorder")],
                     s2: kd.In["E", "H", "IG", kd.bf16], sorted_ids: kd.In["S", kd.i32],
                     block_expert: kd.In["NB", kd.i32], topk_w: kd.In["T", kd.f32],
                     out: kd.InOut["MO", "H", kd.f32], partial: kd.Out["P", "H", kd.f32], TOPK: kd.Dim):
    """W4A16 group-32 down: bf16 intermediate x exact int4 per scale group, times the group's scale
    (`kd.group_dot`), routing weight, top-k reduction."""
    b, n = _s2_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("T")

    wr = _w_rows(0)
    g = _w4a16_groups(32)

    def body(k, acc):
        return _w4a16_dot(inter.load(rows, k, mask=valid), w2, s2, e, n, k, "IG", acc, wr)

    acc = kd.fold(_k_tiles("I", 32), kd.zeros((g, n, rows) if wr else (g, rows, n), kd.f32), body)
    _s2_epilogue(kd.sum(acc, axis=g), tid, valid, n, topk_w, out, partial)


@kd.kernel(static=("TOPK",), example=S2_EXAMPLE)
def moe_stage2_bf16(inter: kd.In["S", "I", kd.bf16], w2: kd.In["E", "H", "I", kd.bf16],
                    sorted_ids: kd.In["S", kd.i32], block_expert: kd.In["NB", kd.i32], topk_w: kd.In["T", kd.f32],
                    out: kd.InOut["MO", "H", kd.f32], partial: kd.Out["P", "H", kd.f32], TOPK: kd.Dim):
    """bf16 down GEMM, routing weight, top-k reduction."""
    b, n = _s2_grid()
    e, rows, tid = _block_rows(sorted_ids, block_expert, b)
    valid = tid < kd.dim("T")

    def body(k, acc):
        return acc + kd.dot(inter.load(rows, k, mask=valid), w2[e, n, k])

    acc = kd.fold(_k_tiles("I"), kd.zeros((rows, n), kd.f32), body)
    _s2_epilogue(acc, tid, valid, n, topk_w, out, partial)


@kd.kernel(static=("TOPK",), example={"M": 1, "H": KIMI["H"], "TOPK": 8, "P": 8})
def moe_sum(partial: kd.In["P", "H", kd.f32], out: kd.Out["M", "H", kd.f32], TOPK: kd.Dim):
    """Sum the top-k partial rows of each token: out[m] = sum_j partial[m*TOPK + j]."""
    (m, n) = kd.grid(kd.each("M"), kd.tile("H", "BLOCK_N", domain=(64, 128, 256, 512, 1024), default=256))
    acc = partial[m * TOPK, n]
    for j in range(1, kd.static("TOPK")):
        acc = acc + partial[m * TOPK + j, n]
    out[m, n] = acc


def _topk_rows(partial, ids, m, n):
    """sum_j partial[m*TOPK + j, n] in j order (a fixed order: batch invariant), a row whose expert
    id is outside [0, E) counting as 0 and never read (its partial row was never written)."""
    K = kd.static("TOPK")
    acc = None
    for j in range(K):
        e = kd.zeros((n,), kd.i32) + ids[m * K + j]  # as a tile: the interpreter wants tile masks
        v = partial.load(m * K + j, n, mask=(e >= 0) & (e < kd.static("E")))
        acc = v if acc is None else acc + v
    return acc


@kd.kernel(static=("TOPK", "E"), example={"M": 1, "H": KIMI["H"], "TOPK": 8, "P": 8, "E": KIMI["E"]})
def moe_sum_ids(partial: kd.In["P", "H", kd.f32], ids: kd.In["P", kd.i32], out: kd.Out["M", "H", kd.f32],
                TOPK: kd.Dim, E: kd.Dim):
    """`moe_sum` that reads the ids: the partial row of a (token, k) whose id is outside [0, E) is
    in no aligned block, never written, and counts as 0 (so the partials need no zero fill)."""
    (m, n) = kd.grid(kd.each("M"), kd.tile("H", "BLOCK_N", domain=(64, 128, 256, 512, 1024), default=256))
    out[m, n] = _topk_rows(partial, ids, m, n)


@kd.kernel(static=("D", "TOPK", "E", "SH"), example={"M": 1, "D": KIMI["H"], "TOPK": 8, "P": 8, "E": KIMI["E"], "SH": 1})
def moe_combine_norm(partial: kd.In["P", "D", kd.f32], ids: kd.In["P", kd.i32], shared: kd.In["M", "D", kd.bf16],
                     res: kd.InOut["M", "D", kd.bf16], w: kd.In["D", kd.bf16], out: kd.Out["M", "D", kd.bf16],
                     TOPK: kd.Dim, E: kd.Dim, SH: kd.Dim, eps: kd.Scalar[kd.f32]):
    """The end of a MoE layer and the next norm in one pass (one token row per program):
    y = bf16(sum of the top-k partial rows in k order (ids outside [0, E) count 0) + shared (SH=1));
    res <- bf16(y + res); out = rmsnorm(res) * w. The roundings of moe_sum, the f32 shared add,
    the cast to bf16 and `rmsnorm_add`, so the unfused chain gives the same bits."""
    (m,) = kd.grid(kd.each("M"))
    d = kd.full_range("D")
    acc = _topk_rows(partial, ids, m, d)
    if kd.static("SH"):
        acc = acc + shared[m, d].to(kd.f32)
    r = (acc.to(kd.bf16).to(kd.f32) + res[m, d].to(kd.f32)).to(kd.bf16)
    res[m, d] = r
    rf = r.to(kd.f32)
    ms = kd.sum(rf * rf, axis=d) / kd.static("D")
    out[m, d] = rf * kd.rsqrt(ms + eps) * w[d].to(kd.f32)


def _check_combine(op: str, partial: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None,
                   res: torch.Tensor, backend: str) -> tuple[int, int]:
    """The arguments of a combine that ends a layer into the residual stream: residual [M, H] bf16,
    routed partials [M*top_k, H] f32, ids [M, top_k] int32, shared [M, H] bf16 or None. Returns (M, H)."""
    check_backend(op, backend)
    check_tensor(op, "residual", res, 2, (torch.bfloat16,), contiguous=True)
    M, H = res.shape
    dev = res.device
    check_tensor(op, "partial", partial, 2, (torch.float32,), dev, contiguous=True)
    check_tensor(op, "ids", ids, 2, (torch.int32,), dev, contiguous=True)
    if ids.shape[0] != M or tuple(partial.shape) != (ids.numel(), H):
        raise ValueError(f"{op}: needs ids [M={M}, top_k] and partial [M*top_k, {H}], got "
                         f"{tuple(ids.shape)} and {tuple(partial.shape)}")
    if shared is not None:
        check_tensor(op, "shared", shared, 2, (torch.bfloat16,), dev, contiguous=True)
        if shared.shape != res.shape:
            raise ValueError(f"{op}: shared must be [{M}, {H}], got {tuple(shared.shape)}")
    return M, H


def moe_combine_norm_ref(partial: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None, res: torch.Tensor,
                         w: torch.Tensor, eps: float, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `moe_combine_norm`: (normed bf16 [M, D], new residual bf16 [M, D])."""
    M, D = res.shape
    K = ids.shape[-1] if ids.dim() == 2 else ids.numel() // max(M, 1)
    flat = ids.reshape(M, K)
    ok = (flat >= 0) & (flat < n_experts)
    p = partial.reshape(M, K, D)
    acc = torch.where(ok[:, 0, None], p[:, 0], torch.zeros_like(p[:, 0]))
    for j in range(1, K):
        acc = acc + torch.where(ok[:, j, None], p[:, j], torch.zeros_like(p[:, j]))
    if shared is not None:
        acc = acc + shared.float()
    r = (acc.to(torch.bfloat16).float() + res.float()).to(torch.bfloat16)
    rf = r.float()
    y = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(torch.bfloat16)
    return y, r


def combine_norm(partial: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None, res: torch.Tensor,
                 weight: torch.Tensor, eps: float, n_experts: int, backend: str = "triton",
                 config: dict | None = None) -> torch.Tensor:
    """Finish a MoE layer in one launch: routed partials [M*top_k, H] f32 (from
    `fused_experts(..., partials=True)`) summed in k order, + shared [M, H] bf16 (or None), added
    into `res` [M, H] bf16 IN PLACE (the residual stream), returns rmsnorm(res) * weight bf16 (the
    next layer's normed input). Ids outside [0, n_experts) add nothing. No device read."""
    M, H = _check_combine("combine_norm", partial, ids, shared, res, backend)
    dev = res.device
    check_tensor("combine_norm", "weight", weight, 1, (torch.bfloat16,), dev, contiguous=True)
    if weight.shape[0] != H:
        raise ValueError(f"combine_norm: weight must be [{H}], got {tuple(weight.shape)}")
    if backend == "torch":
        y, r = moe_combine_norm_ref(partial, ids, shared, res, weight, eps, n_experts)
        res.copy_(r)
        return y
    out = torch.empty_like(res)
    K = ids.shape[1]
    cfg = invariant_config(moe_combine_norm, {"D": H, "TOPK": K}, M, config)  # its row sum follows num_warps
    if M:
        moe_combine_norm(partial, ids.reshape(-1), res if shared is None else shared, res, weight, out, K, n_experts,
                         int(shared is not None), float(eps), config=cfg)
    return out


@kd.kernel(static=("TOPK", "E", "SH"), example={"M": 1, "D": KIMI["H"], "TOPK": 8, "P": 8, "E": KIMI["E"], "SH": 1})
def moe_combine_add(partial: kd.In["P", "D", kd.f32], ids: kd.In["P", kd.i32], shared: kd.In["M", "D", kd.bf16],
                    res: kd.InOut["M", "D", kd.bf16], rows: kd.Out["M", "D", kd.f32], TOPK: kd.Dim, E: kd.Dim,
                    SH: kd.Dim):
    """moe_combine_norm without the norm, one program per (token, BLOCK_N columns): res <- bf16(y +
    res), y its top-k sum (+ shared) with the same adds and roundings, and rows = res as f32 (exact),
    the un-normalized row the next layer's first GEMM normalizes in its prologue (gemm_bf16_rmsnorm).
    With no row-wide statistic a token spreads over D/BLOCK_N programs (combine_norm's one program
    per token leaves all but M CUs idle at decode)."""
    (m, n) = kd.grid(kd.each("M"), kd.tile("D", "BLOCK_N", domain=(64, 128, 256, 512, 1024), default=256))
    acc = _topk_rows(partial, ids, m, n)
    if kd.static("SH"):
        acc = acc + shared[m, n].to(kd.f32)
    r = (acc.to(kd.bf16).to(kd.f32) + res[m, n].to(kd.f32)).to(kd.bf16)
    res[m, n] = r
    rows[m, n] = r.to(kd.f32)


def combine_add(partial: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None, res: torch.Tensor,
                n_experts: int, backend: str = "triton", config: dict | None = None) -> torch.Tensor:
    """Finish a MoE layer without the next norm, in one launch: routed partials [M*top_k, H] f32
    summed in k order + shared [M, H] bf16 (or None), added into `res` [M, H] bf16 IN PLACE (the
    residual stream, as `combine_norm`); returns that new residual as f32 [M, H] (exact), for a
    consumer that normalizes its rows itself (ops.gemm.gemm_bf16_rmsnorm). Ids outside
    [0, n_experts) add nothing. No device read."""
    M, H = _check_combine("combine_add", partial, ids, shared, res, backend)
    dev = res.device
    if backend == "torch":
        r = (moe_combine_rank_ref(partial, ids, shared, n_experts).float() + res.float()).to(torch.bfloat16)
        res.copy_(r)
        return r.float()
    rows = torch.empty(M, H, dtype=torch.float32, device=dev)
    K = ids.shape[1]
    cfg = config_for(moe_combine_add, {"D": H, "TOPK": K}, M, config)   # elementwise: any tile, the same bits
    if M:
        moe_combine_add(partial, ids.reshape(-1), res if shared is None else shared, res, rows, K, n_experts,
                        int(shared is not None), config=cfg)
    return rows


@kd.kernel(static=("TOPK", "E", "SH"), example={"M": 1, "D": KIMI["H"], "TOPK": 8, "P": 8, "E": KIMI["E"], "SH": 1})
def moe_combine_rank(partial: kd.In["P", "D", kd.f32], ids: kd.In["P", kd.i32], shared: kd.In["M", "D", kd.bf16],
                     out: kd.Out["M", "D", kd.bf16], TOPK: kd.Dim, E: kd.Dim, SH: kd.Dim):
    """A tensor / expert parallel rank's share of a MoE layer, the all-reduce payload:
    out = bf16(sum of the top-k partial rows in k order (ids outside [0, E) count 0) + shared (SH=1)).
    The roundings of `moe_sum_ids`, the f32 shared add and the cast to bf16; the residual add and
    the next norm wait for the sum over the ranks (`rmsnorm_add` after the all-reduce)."""
    (m, n) = kd.grid(kd.each("M"), kd.tile("D", "BLOCK_N", domain=(64, 128, 256, 512, 1024), default=256))
    acc = _topk_rows(partial, ids, m, n)
    if kd.static("SH"):
        acc = acc + shared[m, n].to(kd.f32)
    out[m, n] = acc.to(kd.bf16)


def moe_combine_rank_ref(partial: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None,
                         n_experts: int) -> torch.Tensor:
    """Torch reference of `moe_combine_rank`: bf16 [M, D]."""
    M = ids.shape[0]
    K = ids.shape[1]
    ok = (ids >= 0) & (ids < n_experts)
    p = partial.reshape(M, K, -1)
    acc = torch.where(ok[:, 0, None], p[:, 0], torch.zeros_like(p[:, 0]))
    for j in range(1, K):
        acc = acc + torch.where(ok[:, j, None], p[:, j], torch.zeros_like(p[:, j]))
    if shared is not None:
        acc = acc + shared.float()
    return acc.to(torch.bfloat16)


def _check_partials(op: str, partial: torch.Tensor, ids: torch.Tensor, backend: str) -> tuple[int, int]:
    """A rank's combine inputs: routed partials [M*top_k, H] f32 and ids [M, top_k] int32 (contiguous,
    one device). Returns (M, H)."""
    check_backend(op, backend)
    check_tensor(op, "ids", ids, 2, (torch.int32,), None, contiguous=True)
    M, K = ids.shape
    check_tensor(op, "partial", partial, 2, (torch.float32,), ids.device, contiguous=True)
    if partial.shape[0] != M * K:
        raise ValueError(f"{op}: partial must be [M*top_k={M * K}, H], got {tuple(partial.shape)}")
    return M, partial.shape[1]


def combine_rank(partial: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None, n_experts: int,
                 backend: str = "triton", config: dict | None = None) -> torch.Tensor:
    """One rank's MoE output before the all-reduce, in one launch: routed partials [M*top_k, H] f32
    (`fused_experts(..., partials=True)`) summed in k order + shared [M, H] bf16 (or None), as bf16
    [M, H]. Ids outside [0, n_experts) (another rank's expert: -1) add nothing. No device read."""
    M, H = _check_partials("combine_rank", partial, ids, backend)
    K = ids.shape[1]
    dev = ids.device
    if shared is not None:
        check_tensor("combine_rank", "shared", shared, 2, (torch.bfloat16,), dev, contiguous=True)
        if tuple(shared.shape) != (M, H):
            raise ValueError(f"combine_rank: shared must be [{M}, {H}], got {tuple(shared.shape)}")
    if backend == "torch":
        return moe_combine_rank_ref(partial, ids, shared, n_experts)
    out = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
    cfg = config_for(moe_combine_rank, {"D": H, "TOPK": K}, M, config)
    if M:
        moe_combine_rank(partial, ids.reshape(-1), out if shared is None else shared, out, K, n_experts,
                         int(shared is not None), config=cfg)
    return out


# ----------------------------------------------------------------------------------------------
# 6. the layer op

FORMATS = ("w4a8", "w4a16", "bf16")


@dataclass
class MoEWeights:
    """Routed-expert weights in one format (see the module docstring for layouts)."""
    fmt: str
    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None = None
    s2: torch.Tensor | None = None

    def dims(self) -> tuple[int, int, int]:
        """(E, H, I) from the tensors, validating every shape against the format."""
        f = self.fmt
        if f not in FORMATS:
            raise ValueError(f"MoEWeights: fmt must be one of {FORMATS}, got {f!r}")
        w13, w2 = self.w13, self.w2
        if w13.dim() != 3 or w2.dim() != 3:
            raise ValueError(f"MoEWeights({f}): w13 and w2 must be 3-D [E, N, K], got {tuple(w13.shape)} and {tuple(w2.shape)}")
        packed = f != "bf16"
        want = torch.int32 if packed else torch.bfloat16
        for name, t in (("w13", w13), ("w2", w2)):
            if t.dtype != want:
                raise TypeError(f"MoEWeights({f}): {name} must be {want}{' (packed int4, 8 per word)' if packed else ''}, got {t.dtype}")
        E, N2 = w13.shape[:2]
        if N2 % 2:
            raise ValueError(f"MoEWeights({f}): w13 rows must be 2*I (gate then up), got {N2}")
        I = N2 // 2
        H = w13.shape[2] * (PACK if packed else 1)
        if packed and I % PACK:
            raise ValueError(f"MoEWeights({f}): intermediate size I={I} must be a multiple of the pack factor {PACK}")
        if tuple(w2.shape) != (E, H, I // PACK if packed else I):
            raise ValueError(f"MoEWeights({f}): w2 must be [E={E}, H={H}, {'I/8=' + str(I // PACK) if packed else 'I=' + str(I)}], "
                             f"got {tuple(w2.shape)}")
        if f == "w4a8":
            self._scale("s13", self.s13, (E, N2), torch.float32, "per-channel f32")
            self._scale("s2", self.s2, (E, H), torch.float32, "per-channel f32")
        elif f == "w4a16":
            for name, kk in (("hidden size H", H), ("intermediate size I", I)):
                if kk % GROUP:
                    raise ValueError(f"MoEWeights(w4a16): {name}={kk} must be a multiple of the group size {GROUP}")
            self._scale("s13", self.s13, (E, N2, H // GROUP), torch.bfloat16, "group-32 bf16")
            self._scale("s2", self.s2, (E, H, I // GROUP), torch.bfloat16, "group-32 bf16")
        return E, H, I

    def _scale(self, name: str, t: torch.Tensor | None, shape: tuple, dtype: torch.dtype, what: str) -> None:
        if t is None:
            raise ValueError(f"MoEWeights({self.fmt}): {name} ({what} scales {list(shape)}) is missing")
        if tuple(t.shape) != shape:
            raise ValueError(f"MoEWeights({self.fmt}): {name} must be {what} scales of shape {list(shape)}, got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise TypeError(f"MoEWeights({self.fmt}): {name} must be {dtype}, got {t.dtype}")


@dataclass
class MoEConfig:
    """Routing hyper-parameters (Kimi-K2.5 defaults)."""
    top_k: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.827
    scoring_func: str = "sigmoid"  # or "softmax"


def _check_backend(backend: str) -> None:
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")


def _dequant(w: MoEWeights, which: str) -> torch.Tensor:
    """Reference dequantization to f32 [E, N, K]. W4A16: `q * s` exactly (an int4 times a bf16 is
    exact in f32, no bf16 rounding): the kernels apply each group's scale after an f32 dot of the
    exact int4 values (`kd.group_dot`), the same math up to f32 summation order."""
    from ops.packing import unpack_int4

    words, s = (w.w13, w.s13) if which == "13" else (w.w2, w.s2)
    if w.fmt == "bf16":
        return words.float()
    if w.fmt == "w4a16":
        q = unpack_int4(words, "ct_reorder").float()
        return q * s.float().repeat_interleave(GROUP, dim=-1)
    return unpack_int4(words, "quark_reorder").float()  # w4a8: scales applied after the int dot


def experts_ref(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """Torch reference of the routed experts (stage 1 + 2, same quantization and roundings): f32 [M, H]."""
    E, H, I = w.dims()
    M, K = ids.shape
    out = torch.zeros(M, H, dtype=torch.float64, device=x.device)
    w13, w2 = _dequant(w, "13"), _dequant(w, "2")
    if w.fmt == "w4a8":
        x8, xs = quant_per_token_int8_ref(x)
    for e in ids.unique().tolist():
        if not 0 <= e < E:  # an id outside [0, E) adds nothing (as in the kernels)
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if w.fmt == "w4a8":
            gu = (x8[tok].double() @ w13[e].double().t()).float() * xs[tok, None] * w.s13[e][None]
        else:
            gu = (x[tok].float() @ w13[e].t())
        h = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16)
        if w.fmt == "w4a8":
            hq, hs = quant_per_token_int8_ref(h)
            y = (hq.double() @ w2[e].double().t()).float() * hs[:, None] * w.s2[e][None]
        else:
            y = h.float() @ w2[e].t()
        out.index_add_(0, tok, (y * wts[tok, slot][:, None]).double())
    return out.float()


def quant_groups_int8_ref(h: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, group of `group` columns) int8: scale = absmax/127, RNE; (q [R, C], scale [R, C/group])."""
    R, C = h.shape
    hf = h.float().view(R, C // group, group)
    s = hf.abs().amax(-1).clamp_min(MIN_ABSMAX) / 127.0
    q = torch.round((hf / s[..., None]).clamp(-127.0, 127.0)).to(torch.int8)
    return q.view(R, C), s


def experts_ref_gq(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w: MoEWeights, group: int,
                   partial: bool = False) -> torch.Tensor:
    """Torch reference of W4A8 with stage2_quant='stage1': the bf16 intermediate quantized per (row,
    `group` columns); stage 2 sums the groups' i32 dots x scale in f32 in K order, then x s2 x the
    routing weight. Returns f32 [M, H], or with partial=True the [M*top_k, H] rows before the sum."""
    E, H, I = w.dims()
    M, K = ids.shape
    w13, w2 = _dequant(w, "13"), _dequant(w, "2")
    x8, xs = quant_per_token_int8_ref(x)
    part = torch.zeros(M * K, H, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = (x8[tok].double() @ w13[e].double().t()).float() * xs[tok, None] * w.s13[e][None]
        h = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16)
        hq, hs = quant_groups_int8_ref(h, group)
        acc = torch.zeros(len(tok), H, dtype=torch.float32, device=x.device)
        for j in range(I // group):
            c = slice(j * group, (j + 1) * group)
            acc = acc + (hq[:, c].double() @ w2[e][:, c].double().t()).float() * hs[:, j:j + 1]
        part[tok * K + slot] = acc * w.s2[e][None] * wts[tok, slot][:, None].float()
    return part if partial else part.view(M, K, H).double().sum(1).float()


def shared_expert_ref(x: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    """The shared expert (plain torch: bf16 GEMMs, f32 SiLU*up rounded to bf16), f32 [M, H]."""
    if shared is None:
        return None
    g, u, d = shared
    gu_g = (x @ g.t()).float()
    gu_u = (x @ u.t()).float()
    h = (torch.nn.functional.silu(gu_g) * gu_u).to(torch.bfloat16)
    return (h @ d.t()).float()


STAGE2_QUANT = ("amax", "separate", "fused", "stage1")


def stage2_quant_mode(config: dict | None, E: int, H: int, I: int, top_k: int, M: int, arch: str | None = None) -> str:
    """How W4A8 stage 2 gets its int8 A operand: `config["stage2_quant"]` when given, else the
    faster by the tuned files of `arch` (default: the current target) of "amax" and "separate"
    (`amax_pays`), which give the same bits; "separate" where a file is missing (the interpreter)."""
    mode = (config or {}).get("stage2_quant")
    if not mode:
        from kdsl.targets import current_target

        return "amax" if amax_pays(arch or current_target().name, E, H, I, top_k, M) else "separate"
    if mode not in STAGE2_QUANT:
        raise ValueError(f"fused_experts: config stage2_quant must be one of {STAGE2_QUANT}, got {mode!r}")
    return mode


def _amax_pays(arch: str, E: int, H: int, I: int, top_k: int, bucket: int) -> bool:
    from autotune.costmodel import launch_gap_us
    from autotune.store import lookup_config, lookup_figures
    from ops.quant import quant_per_token_int8

    p1, p2 = {"E": E, "K": H, "I": I, "TOPK": top_k}, {"E": E, "H": H, "I": I, "TOPK": top_k}
    bm = int(lookup_config(moe_stage1_w4a8, arch, p1, bucket).get("BLOCK_M", 16))
    rows = aligned_blocks(bucket * top_k, E, bm) * bm
    figs = [lookup_figures(k, arch, p, m) for k, p, m in (
        (moe_stage1_w4a8_amax, p1, bucket), (moe_stage2_w4a8_aq, p2, bucket),
        (moe_stage1_w4a8, p1, bucket), (quant_per_token_int8, {"K": I}, rows), (moe_stage2_w4a8_pq, p2, bucket))]
    if any(f is None or "predicted_us" not in f for f in figs):
        return False
    us = [float(f["predicted_us"]) for f in figs]
    return us[0] + us[1] < us[2] + us[3] + us[4] + launch_gap_us(arch)


def amax_pays(arch: str, E: int, H: int, I: int, top_k: int, M: int) -> bool:
    """Whether stage2_quant "amax" (moe_stage1_w4a8_amax + moe_stage2_w4a8_aq: the per-row quant
    formed in stage 2 from stage 1's tile maxima) is predicted faster on `arch` at M tokens than
    "separate" (moe_stage1_w4a8 + quant_per_token_int8 + moe_stage2_w4a8_pq) with its extra
    launch's gap: the times recorded in the tuned files of the M bucket. Its extra quant VALU in
    every stage-2 program hides under the weight stream on gfx942 but not on gfx950 above M=1
    (its faster HBM leaves less VALU time per byte). A host lookup of cached files, no launch."""
    from autotune.buckets import bucket_for, bucket_m

    return _amax_pays(arch, E, H, I, top_k, bucket_m(bucket_for(max(M, 1))))


def _stage_configs(config: dict | None, fmt: str, E: int, H: int, I: int, top_k: int, M: int,
                   invariant: bool = False) -> tuple[dict, dict]:
    """Stage configs: explicit ones from `config`, else tuned. `invariant`: the top-k sum as
    partial rows + `moe_sum` in fixed order (REDUCE="partial": no order-dependent float atomics)
    and, for the float-accumulating formats (bf16, W4A16), every numerics key from the M=1 entry;
    W4A8 stages accumulate exactly in i32, so they keep their per-bucket tiles."""
    k1, k2 = STAGE1[fmt], STAGE2[fmt]
    if fmt == "w4a8":
        k1, k2 = W4A8_STAGES[stage2_quant_mode(config, E, H, I, top_k, M)]
    p1, p2 = {"E": E, "K": H, "I": I, "TOPK": top_k}, {"E": E, "H": H, "I": I, "TOPK": top_k}
    pick = invariant_config if invariant else config_for
    c1 = dict((config or {}).get("stage1") or pick(k1, p1, M, None))
    c2 = dict((config or {}).get("stage2") or pick(k2, p2, M, None))
    bm = c1.get("BLOCK_M", 16)
    c1["BLOCK_M"] = bm
    c2["BLOCK_M"] = bm  # both stages walk the same aligned blocks
    if invariant and not (config or {}).get("stage2"):
        c2["REDUCE"] = "partial"
    if k2 is moe_stage2_w4a8_gq:  # stage 2's K tile is stage 1's scale group
        c1["BLOCK_N"] = c1.get("BLOCK_N", 64)
        if c1["BLOCK_N"] not in (32, 64, 128) or I % c1["BLOCK_N"]:
            raise ValueError(f"fused_experts: stage2_quant='stage1' needs stage-1 BLOCK_N in (32, 64, 128) dividing "
                             f"I={I}, got {c1['BLOCK_N']}")
        c2["BLOCK_K"] = c1["BLOCK_N"]
    return c1, c2


def fused_experts(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w: MoEWeights,
                  backend: str = "triton", config: dict | None = None, check_ids: bool = True,
                  invariant: bool = True, xq: tuple[torch.Tensor, torch.Tensor] | None = None,
                  partials: bool = False, aligned: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Routed-expert output f32 [M, H] = sum_k wts[m,k] * expert_{ids[m,k]}(x[m]).

    check_ids (default on) refuses ids outside [0, E) by reading them (a device sync, so not
    inside graph capture); pass False only for ids from `route`, which guarantees them. Unchecked,
    an id outside [0, E) is a defined no-op on both backends: that (token, k) adds nothing.
    `invariant` (default): a token's result does not depend on the batch (top-k summed in fixed
    order by `moe_sum_ids`, never by float atomics; M=1 tiles at every M for the float-accumulating
    formats). M=0 gives [0, H].
    `xq` (W4A8): x already quantized per token, (int8 [M, H], f32 scale [M]) as
    `ops.norm.rms_norm_quant` emits it with the normed rows: no quant launch here.
    `partials`: return the [M*top_k, H] f32 rows before the top-k sum (always REDUCE="partial")
    for `combine_norm`; the row of a (token, k) with an id outside [0, E) is not written (torch
    backend: 0) and must be read through the ids, as `combine_norm` does.
    `aligned`: (sorted_ids, block_expert) of these ids in blocks of `expert_block_m(w, top_k, M,
    config, invariant)` rows, as `route_align` gives them: no align launch here (their sizes are
    checked against that BLOCK_M)."""
    _check_backend(backend)
    E, H, I = w.dims()
    check_tensor("fused_experts", "hidden", x, 2, (torch.bfloat16, torch.float16, torch.float32))
    dev = x.device
    for name, t in (("w13", w.w13), ("w2", w.w2), ("s13", w.s13), ("s2", w.s2)):
        if t is not None:
            check_tensor("fused_experts", name, t, None, None, dev, contiguous=True)
    check_tensor("fused_experts", "ids", ids, 2, (torch.int32, torch.int64), dev)
    check_tensor("fused_experts", "weights", wts, 2, (torch.float32, torch.bfloat16, torch.float16), dev)
    M = x.shape[0]
    if x.shape[1] != H:
        raise ValueError(f"fused_experts: hidden must be [M, H={H}], got {tuple(x.shape)}")
    if ids.shape != wts.shape or ids.shape[0] != M:
        raise ValueError(f"fused_experts: ids and weights must both be [M={M}, top_k], got {tuple(ids.shape)} and {tuple(wts.shape)}")
    top_k = ids.shape[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"fused_experts: top_k={top_k} must be in [1, number of experts {E}]")
    if xq is not None:
        if w.fmt != "w4a8":
            raise ValueError(f"fused_experts: xq (pre-quantized int8 activations) is for W4A8 experts, got {w.fmt}")
        check_tensor("fused_experts", "xq int8", xq[0], 2, (torch.int8,), dev, contiguous=True)
        check_tensor("fused_experts", "xq scale", xq[1], 1, (torch.float32,), dev, contiguous=True)
        if tuple(xq[0].shape) != (M, H) or tuple(xq[1].shape) != (M,):
            raise ValueError(f"fused_experts: xq must be (int8 [M={M}, H={H}], f32 [M={M}]), got "
                             f"{tuple(xq[0].shape)} and {tuple(xq[1].shape)}")
    if check_ids and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
        raise ValueError(f"fused_experts: expert ids out of range [0, {E}): got [{int(ids.min())}, {int(ids.max())}]")
    if w.fmt != "bf16" and H % PACK:
        raise ValueError(f"fused_experts: hidden size {H} must be a multiple of the int4 pack factor {PACK}")
    if backend == "torch":
        if partials:
            q = w.fmt == "w4a8" and stage2_quant_mode(config, E, H, I, top_k, M) == "stage1"
            return (experts_ref_gq(x, ids, wts, w, _gq_group(config, E, H, I, top_k, M), partial=True) if q
                    else experts_ref_rows(x, ids, wts, w))
        return experts_ref(x, ids, wts, w)
    if M == 0:
        return torch.zeros(0, H, dtype=torch.float32, device=dev)
    sq = stage2_quant_mode(config, E, H, I, top_k, M) if w.fmt == "w4a8" else None
    cfg = dict(config or {})
    if sq is not None:
        cfg["stage2_quant"] = sq
    c1, c2 = _stage_configs(cfg, w.fmt, E, H, I, top_k, M, invariant)
    if partials:
        c2["REDUCE"] = "partial"
    bm = c1["BLOCK_M"]
    if aligned is None:
        sorted_ids, bexp = moe_align(ids, E, bm, check=False, config=config)  # the kdsl align kernels
    else:
        sorted_ids, bexp = aligned
        nb = aligned_blocks(M * top_k, E, bm)
        for name, t, n in (("aligned sorted_ids", sorted_ids, nb * bm), ("aligned block_expert", bexp, nb)):
            check_tensor("fused_experts", name, t, 1, (torch.int32,), dev, contiguous=True)
            if t.numel() != n:
                raise ValueError(f"fused_experts: {name} must have {n} entries (blocks of BLOCK_M={bm} rows), "
                                 f"got {t.numel()}")
    S = sorted_ids.numel()
    T = M * top_k
    gq = sq == "stage1"
    # The intermediate is never zero-filled: stage 1 writes only the valid rows of used blocks, and
    # every stage-2 kernel loads it (and its per-row or per-group scales, whose products only reach
    # padding rows of the accumulator) with mask = valid row, stores only valid rows: a padding
    # row's contents (and the quant of it, for "separate") never reach an output.
    inter = torch.empty(S, I, dtype=torch.int8 if gq else torch.bfloat16, device=x.device)
    xb = x if x.dtype == torch.bfloat16 and x.is_contiguous() else x.to(torch.bfloat16).contiguous()
    if w.fmt == "w4a8":
        x8, xs = xq if xq is not None else quantize_int8(xb)
    if gq:  # stage 1 writes the int8 intermediate and its group scales: no quant launch between
        inter_s = torch.empty(S, I // c1["BLOCK_N"], dtype=torch.float32, device=x.device)
        moe_stage1_w4a8_q(x8, xs, w.w13, w.s13, sorted_ids, bexp, inter, inter_s, top_k, config=c1)
    elif sq == "amax":  # stage 1 also writes each (row, BLOCK_N tile)'s absmax; only valid rows' are read
        inter_amax = torch.empty(S, -(-I // c1.get("BLOCK_N", 64)), dtype=torch.float32, device=x.device)
        moe_stage1_w4a8_amax(x8, xs, w.w13, w.s13, sorted_ids, bexp, inter, inter_amax, top_k, config=c1)
    elif w.fmt == "w4a8":
        moe_stage1_w4a8(x8, xs, w.w13, w.s13, sorted_ids, bexp, inter, top_k, config=c1)
    elif w.fmt == "w4a16":
        moe_stage1_w4a16(xb, w.w13, w.s13, sorted_ids, bexp, inter, top_k, config=c1)
    else:
        moe_stage1_bf16(xb, w.w13, sorted_ids, bexp, inter, top_k, config=c1)
    atomic = c2.get("REDUCE", "atomic") == "atomic"
    out = torch.zeros(M if atomic else 0, H, dtype=torch.float32, device=x.device)
    # the partial row of an id outside [0, E) is in no block and stays unwritten: its readers
    # (moe_sum_ids, combine_norm) read the ids and skip it
    part = torch.empty(0 if atomic else T, H, dtype=torch.float32, device=x.device)
    tw = wts.reshape(-1) if wts.dtype == torch.float32 and wts.is_contiguous() else wts.reshape(-1).float().contiguous()
    if gq:
        moe_stage2_w4a8_gq(inter, inter_s, w.w2, w.s2, sorted_ids, bexp, tw, out, part, top_k, config=c2)
    elif sq == "amax":
        moe_stage2_w4a8_aq(inter, inter_amax, w.w2, w.s2, sorted_ids, bexp, tw, out, part, top_k, config=c2)
    elif sq == "separate":
        from ops.quant import quant_per_token_int8

        i8 = torch.empty(S, I, dtype=torch.int8, device=x.device)
        i8s = torch.empty(S, dtype=torch.float32, device=x.device)
        cq = config_for(quant_per_token_int8, {"K": I}, S, (config or {}).get("quant"))
        quant_per_token_int8(inter, i8, i8s, config=cq)  # padding rows are quantized too but never read
        moe_stage2_w4a8_pq(i8, i8s, w.w2, w.s2, sorted_ids, bexp, tw, out, part, top_k, config=c2)
    else:
        scales = (w.s2,) if w.fmt != "bf16" else ()
        STAGE2[w.fmt](inter, w.w2, *scales, sorted_ids, bexp, tw, out, part, top_k, config=c2)
    if atomic:
        return out
    if partials:
        return part
    res = torch.empty(M, H, dtype=torch.float32, device=x.device)
    ids32 = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
    cs = config_for(moe_sum_ids, {"H": H, "TOPK": top_k}, M, (config or {}).get("sum"))
    moe_sum_ids(part, ids32.reshape(-1), res, top_k, E, config=cs)
    return res


def expert_block_m(w: MoEWeights, top_k: int, m: int, config: dict | None = None, invariant: bool = True) -> int:
    """The BLOCK_M (rows per aligned block) `fused_experts` walks for m tokens: stage 1's tuned (or
    given) tile; what `route_align` must align with (a host lookup, no launch)."""
    E, H, I = w.dims()
    cfg = dict(config or {})
    if w.fmt == "w4a8":
        cfg["stage2_quant"] = stage2_quant_mode(config, E, H, I, top_k, m)
    return int(_stage_configs(cfg, w.fmt, E, H, I, top_k, m, invariant)[0]["BLOCK_M"])


def experts_ref_rows(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """`experts_ref` per (token, k) row before the top-k sum: f32 [M*top_k, H], 0 for ids outside [0, E)."""
    E, H, I = w.dims()
    M, K = ids.shape
    part = torch.zeros(M * K, H, dtype=torch.float32, device=x.device)
    for j in range(K):
        one = torch.full_like(ids[:, :1], -1).repeat(1, K)
        one[:, j] = ids[:, j]
        part.view(M, K, H)[:, j] = experts_ref(x, one, wts, w)
    return part


def _gq_group(config: dict | None, E: int, H: int, I: int, top_k: int, M: int) -> int:
    """Stage 1's BLOCK_N (the scale group of stage2_quant 'stage1') that fused_experts launches with."""
    cfg = dict(config or {})
    cfg["stage2_quant"] = "stage1"
    return _stage_configs(cfg, "w4a8", E, H, I, top_k, M, True)[0]["BLOCK_N"]


STAGE1 = {"w4a8": moe_stage1_w4a8, "w4a16": moe_stage1_w4a16, "bf16": moe_stage1_bf16}
STAGE2 = {"w4a8": moe_stage2_w4a8, "w4a16": moe_stage2_w4a16, "bf16": moe_stage2_bf16}
# W4A8 (stage 1, stage 2) kernels per stage2_quant mode
W4A8_STAGES = {"amax": (moe_stage1_w4a8_amax, moe_stage2_w4a8_aq), "separate": (moe_stage1_w4a8, moe_stage2_w4a8_pq),
               "fused": (moe_stage1_w4a8, moe_stage2_w4a8), "stage1": (moe_stage1_w4a8_q, moe_stage2_w4a8_gq)}


def fused_moe(hidden: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, experts: MoEWeights,
              shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              cfg: MoEConfig | None = None, backend: str = "triton", config: dict | None = None,
              invariant: bool = True) -> torch.Tensor:
    """One MoE layer: bf16 [M, H] -> bf16 [M, H] = routed experts + shared expert.

    `config` may hold per-kernel configs under "gate", "route", "stage1", "stage2", "quant" (BLOCK_M of stage 1 is
    used by both stages; missing ones come from the tuned files) and, for W4A8, "stage2_quant"
    (default: the faster of "amax" and "separate" by the tuned files, `stage2_quant_mode`):
    "amax" (stage 1 stores tile absmaxes, moe_stage2_w4a8_aq quantizes per row from them),
    "separate" (quant_per_token_int8 on the intermediate, then moe_stage2_w4a8_pq) or
    "fused" (moe_stage2_w4a8 quantizes its A tiles itself) or "stage1" (stage 1 emits int8 with a
    scale per (row, stage-1 BLOCK_N group); reference `experts_ref_gq`). `cfg.scoring_func` "sigmoid" or
    "softmax" is honoured by both backends. `invariant` (default): a token's output does not depend
    on the batch (see `route` and `fused_experts`). No device read on the triton launch path."""
    cfg = cfg or MoEConfig()
    _check_backend(backend)
    E, H, I = experts.dims()
    check_tensor("fused_moe", "hidden", hidden, 2, (torch.bfloat16,))
    if hidden.shape[1] != H:
        raise ValueError(f"fused_moe: hidden must be [M, H={H}], got {tuple(hidden.shape)}")
    if tuple(router_w.shape) != (E, H):
        raise ValueError(f"fused_moe: router weight must be [E={E}, H={H}], got {tuple(router_w.shape)}")
    if cfg.top_k > E:
        raise ValueError(f"fused_moe: top_k={cfg.top_k} exceeds the number of experts {E}")
    if shared is not None:
        for name, t in zip(("gate", "up", "down"), shared):
            check_tensor("fused_moe", f"shared {name}", t, 2, (torch.bfloat16,), hidden.device)
    ids, wts = route(hidden, router_w, bias, cfg.top_k, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                     cfg.routed_scaling_factor, backend=backend, config=config, scoring_func=cfg.scoring_func,
                     invariant=invariant)
    # route guarantees ids in [0, E): no check (it would read the device)
    y = fused_experts(hidden, ids, wts, experts, backend=backend, config=config, check_ids=False, invariant=invariant)
    s = shared_expert_ref(hidden, shared)
    if s is not None:
        y = y + s
    return y.to(torch.bfloat16)
