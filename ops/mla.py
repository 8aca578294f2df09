"""MLA decode/verify over a paged latent cache (absorbed form), written in kdsl.

Layout (REFERENCE §1): every cached token holds DL latent values (kv_lora_rank, 512 for Kimi)
followed by DR rope values (64): cache [num_pages, page_size, DL+DR] bf16, shared by all heads
(MQA with H query heads). The query is already absorbed: q [B, QL, H, DL+DR] = (q_nope·W_UK | q_pe).
The output is the attention-weighted latent [B, QL, H, DL]; W_UV is applied by the caller.

Two kernels: `mla_decode_split` walks one split of one sequence's pages for a block of
(query row, head) pairs with an online softmax and writes an f32 partial output and its
log2-sum-exp; `mla_decode_combine` merges the splits. Rows of a QL-row verify see the prefix and,
among the QL new tokens, the causal triangle (row r sees positions < len - QL + r + 1) or, with a
tree mask [B, QL, TW] over the last TW cached tokens (`mla_decode_split_tree`, TW >= QL), every
token before those TW and, of the TW, the ones marked (mask[b, r, j] != 0: its ancestors and
itself). TW = QL is the target's tree verify; a draft tree step (the EAGLE-3 MLA midlayer) needs
TW > QL because the new rows' ancestors were appended by earlier steps, between non-ancestors.
The grid's M axis packs (query row, head) pairs so a q_len=4 verify reads each KV tile once per
M block, like q_len=1 with more heads.
"""
from __future__ import annotations

from typing import Any

import torch

import kdsl as kd
from kdsl.targets import current_target
from ops._common import (check_backend, check_paged, check_paged_lengths, check_slots, check_tensor, config_for,
                         invariant_config, paged_positions, validating)

LOG2E = 1.4426950408889634
MAX_Q_LEN = 8
NEG_BIG = -1.0e30  # finite "minus infinity" for the running max: keeps exp2(m_old - m_new) finite
MAX_SPLITS = 128
# The split cap of a batch-invariant MLA launch is set so that a query row's partials (heads x splits
# rows of DL f32, 8 MiB at DL 512) stay bounded: 64 splits at Kimi's 64 heads (one GPU), the full
# MAX_SPLITS at 8 or 16 heads (TP8 / TP4), where fewer splits leave most CUs idle. At 64 heads a cap
# of 32 cut an 8k context (plus MAX_Q_LEN - 1) into 32 chunks of 272 tokens instead of the
# tuned 256; 64 keeps the chunk at SPLIT_TOKENS up to a 16k context. The price is partial traffic
# (the split kernel writes and the combine reads heads x splits x DL f32 per row) and memory: at
# batch 32, q_len 4 and 64 splits the partial buffer is 1 GiB. A model constant per rank (the heads),
# so a row's numerics still depend on neither the batch nor q_len.
MAX_SPLIT_ROWS = 4096
DEFAULT_MAX_SPLITS = 32  # paged MHA: its split cap


def max_splits_for(heads: int) -> int:
    """The split cap of an MLA launch with `heads` query heads per rank (see MAX_SPLIT_ROWS)."""
    return max(1, min(MAX_SPLITS, MAX_SPLIT_ROWS // max(1, heads)))


def visible(p, r, base, wbase, stop, tree, b):
    """Which cached positions p new row r sees: causal (everything before base + r + 1), or with a
    tree mask [B, QL, TW] over the TW positions from wbase, everything before wbase plus the rows
    the mask marks; never past this split's stop."""
    if tree is None:
        vis = p < base + r + 1
    else:
        j = p - wbase
        vis = (p < wbase) | (tree.load(b, r, j, mask=j >= 0, other=0) != 0)
    return vis & (p < stop)


def softmax_step(s, vis, m_i, l_i, p):
    """One online-softmax step over the key axis p (base-2 scores): new running max and sum, the
    rescale factor of the old accumulator and the probabilities of this tile."""
    s = kd.where(vis, s, float("-inf"))
    m_new = kd.maximum(m_i, kd.max(s, axis=p))
    alpha = kd.exp2(m_i - m_new)
    pr = kd.exp2(s - m_new)
    return m_new, l_i * alpha + kd.sum(pr, axis=p), alpha, pr


def normalized(acc, l_i):
    """acc / l_i for rows with keys (acc itself where l_i is 0) as acc times the row's reciprocal:
    one rounding more than a division, but 1 VALU per element instead of an IEEE division's ~10,
    which otherwise dominates a decode split's epilogue (its whole [rows, latent] accumulator)."""
    return acc * (1.0 / kd.where(l_i > 0, l_i, 1.0))


def softmax_init(rows, cols):
    """Online-softmax state of a split: running max (finite, see NEG_BIG), running sum, accumulator."""
    return kd.full((rows,), NEG_BIG, kd.f32), kd.zeros((rows,), kd.f32), kd.zeros((rows, cols), kd.f32)


def store_split(part, lse, idx, cols, m_i, l_i, acc):
    """A split's normalised partial output and its base-2 log-sum-exp (-inf when it saw no key),
    for the combine kernel."""
    has = l_i > 0
    part[(*idx, cols)] = normalized(acc, l_i)
    lse[idx] = kd.where(has, m_i + kd.log2(kd.where(has, l_i, 1.0)), float("-inf"))


def store_value_block(part, lse, idx, cols, m_i, l_i, acc, first):
    """store_split for one of DL_SPLIT programs: its columns of the partial; the lse (the same
    bits in each) only from the program of the first column block (`first`, a row vector)."""
    has = l_i > 0
    part[(*idx, cols)] = normalized(acc, l_i)
    lse.store(*idx, value=kd.where(has, m_i + kd.log2(kd.where(has, l_i, 1.0)), float("-inf")), mask=first)


def kernel_max_splits(heads):
    """max_splits_for(heads) inside a kernel, where the heads are a runtime dim."""
    if isinstance(heads, int):
        return max_splits_for(heads)
    return kd.minimum(kd.maximum(MAX_SPLIT_ROWS // kd.maximum(heads, 1), 1), MAX_SPLITS)


def split_range(n_len, split, QL, BN, max_splits=DEFAULT_MAX_SPLITS):
    """This split's token range [start, stop) of a sequence of n_len cached tokens (QL new).

    SPLIT_TOKENS > 0 (batch-invariant, the default): chunks of a fixed size, SPLIT_TOKENS or, for a
    context too long for `max_splits` chunks of that size, the context / max_splits rounded up to
    BLOCK_N, where the context is that of the first new row (n_len - QL + 1) plus MAX_Q_LEN - 1: so
    the boundaries depend on neither the batch, nor the grid's split count, nor q_len (a q_len-4
    verify's row 0 and the q_len-1 decode of the same context reduce in the same order).
    SPLIT_TOKENS = 0: the sequence cut into S chunks rounded up to BLOCK_N (fewer splits at large
    batch, but a row's numerics then follow the batch's split count)."""
    # searched among the batch-invariant sizes only (0 sets numerics by the batch); the tuner picks
    # it with the other numerics keys, once for every M bucket of a problem
    st = kd.tunable("SPLIT_TOKENS", (0, 64, 128, 256, 512, 1024), 256,
                    "tokens per KV split (0: the length cut into S splits; numerics then depend on S)",
                    search=(64, 128, 256, 512))
    if st:
        kd.require(st % BN == 0, "SPLIT_TOKENS must be a multiple of BLOCK_N", "SPLIT_TOKENS")
        ctx = n_len - QL + MAX_Q_LEN
        chunk = kd.maximum(kd.cdiv(kd.cdiv(kd.maximum(ctx, 1), max_splits), BN) * BN, st)
    else:
        chunk = kd.cdiv(kd.cdiv(n_len, kd.dim("S")), BN) * BN
    start = kd.minimum(split * chunk, n_len)
    return start, kd.minimum(start + chunk, n_len)


def cached_len(seq_lens, b, pages, page_size):
    """Sequence b's cached length, clamped to [0, table capacity]: positions past the block table
    do not exist (a defined no-op for a length the table cannot hold)."""
    return kd.maximum(kd.minimum(seq_lens[b], pages * page_size), 0)


def value_tile(dl_pad):
    """The grid spec of the output latent columns one program accumulates: DL_SPLIT programs share
    a (row block, split), each computing the full scores (the K tile over all DL + DR dims, so the
    softmax state is the same in each) but P.V and the partial only for its DL / DL_SPLIT columns.
    That divides the V tile every warp re-reads from LDS per step. A column's sum over the tokens
    runs in the same order for any DL_SPLIT (the value block stays >= 32, so the matrix
    instruction is the one of the whole row): a launch key, it changes no bit."""
    dls = kd.tunable("DL_SPLIT", (1, 2, 4, 8), 1, "programs sharing a row block and split, each owning DL/DL_SPLIT "
                     "output columns")
    kd.require(dl_pad // dls >= 32, "DL_SPLIT must leave value blocks of >= 32 columns", "DL_SPLIT")
    return kd.tile("DL", block=dl_pad // dls)


def _split_body(q, kv, block_table, seq_lens, tree, part, lse, sm_scale):
    dl = kd.full_range("DL")
    b, dv, mrow, split = kd.grid(kd.nest(kd.each("B"), value_tile(dl.size)),
                                 kd.tile("QH", "BLOCK_M", domain=(16, 32, 64), default=16), kd.each("S"))
    whole = dv.size == dl.size  # DL_SPLIT 1: the one value block is the latent tile itself
    if whole:
        dv = dl
    # default 32 (gfx942: 36 KiB LDS, 0 spills, also for the tree variant with its mask tile). Both
    # variants share it: the tile sets the summation order, and a tree verify's root row must
    # reproduce plain decode's numerics for greedy spec decoding to stay lossless
    BN = kd.tunable("BLOCK_N", (16, 32, 64, 128), 32, "KV tokens per inner step")
    pv_f32 = kd.tunable("PV_F32", (0, 1), 0, "1: probabilities stay f32 in the PV product (exact split merge)",
                        search=False)
    # Which side of the score product the KV tokens take. Triton's AMD backend puts every warp on
    # the rows of a dot whose result feeds another dot's A operand (the flash-attention rule): with
    # S = Q.K^T those rows are the BLOCK_M query rows, so at BLOCK_M 16 all warps repeat the same
    # 16-row QK^T tile. With S^T = K.Q^T (KV_ROWS 1) the warps split the BLOCK_N tokens instead and
    # each holds only its share of the K tile (fewer VGPRs); the PV product is unchanged.
    kv_rows = kd.tunable("KV_ROWS", (0, 1), 1, "1: scores as S^T = K.Q^T (warps split KV tokens); 0: S = Q.K^T")
    # Which side of the value product the probabilities take. Triton's AMD backend puts every warp
    # on the rows of a score product whose result feeds the next product's A operand (see KV_ROWS):
    # with O^T = V^T.P^T (PV_T 1) the scores feed the B operand instead, so the compiler spreads the
    # warps over both score dims (each warp then reads only its share of the K tile from LDS) and
    # over both dims of the value product.
    pv_t = kd.tunable("PV_T", (0, 1), 0, "1: the value product as O^T = V^T.P^T (warps over both score dims)")
    if pv_t:  # 16x16 blocks: a [64, 32] score tile is one block per warp of 8 (32x32 ones: 2 blocks for 8 warps)
        kd.compile_option("matrix_instr_nonkdim", 16)
    H = kd.dim("H")
    QL = kd.static("QL")
    DL = kd.static("DL")
    PS = kd.dim("PS")
    r = mrow // H
    h = mrow % H
    dr = kd.full_range("DR")
    n_len = cached_len(seq_lens, b, kd.dim("MP"), PS)
    start, stop = split_range(n_len, split, QL, BN, kernel_max_splits(H))
    # The latent part of the score product in QK_BLOCK-column pieces chained through one
    # accumulator (rope first, then the pieces in column order: the matrix instructions' order of
    # the whole-width product, 0 = one piece). A piece's K tile is all a warp holds at a time, so
    # the registers of the whole K row block are not live at once; the value tile is then loaded
    # on its own (one extra, cache-hit read of the latent columns).
    qkb = kd.tunable("QK_BLOCK", (0, 16, 32, 64, 128, 256), 0, "latent columns per piece of the score product (0 or "
                     ">= the latent width: one piece)", search=(0, 64, 128, 256))
    qkb = qkb if qkb < dl.size else 0
    pieces = [dl] if not qkb else [kd.span(c0, qkb, limit=DL if DL < dl.size else None, label="DLc")
                                   for c0 in range(0, dl.size, qkb)]
    qls = [q[b, r, h, c] for c in pieces]
    qr = q[b, r, h, dr + DL]
    base = n_len - QL  # first new token's position
    wbase = n_len - kd.dim("TW") if tree is not None else base  # first position the tree mask covers
    qk_scale = sm_scale * LOG2E

    def step(p, m_i, l_i, acc):
        page = block_table[b, p // PS]
        off = p % PS
        kr = kv[page, off, dr + DL]
        s = kd.dot(kr, qr) if kv_rows else kd.dot(qr, kr)  # [BLOCK_N, BLOCK_M] or [BLOCK_M, BLOCK_N]
        for c, qc in zip(pieces, qls):
            kc = kv[page, off, c]
            s = kd.dot(kc, qc, s) if kv_rows else kd.dot(qc, kc, s)
        s = s * qk_scale
        vl = kc if whole and not qkb else kv[page, off, dv]
        m_new, l_new, alpha, pr = softmax_step(s, visible(p, r, base, wbase, stop, tree, b), m_i, l_i, p)
        pa = pr if pv_f32 else pr.to(kd.bf16)
        vb = vl.to(kd.f32) if pv_f32 else vl
        pv = kd.dot(vb, pa) if pv_t else kd.dot(pa, vb)  # [DV, BLOCK_M] or [BLOCK_M, DV]
        return m_new, l_new, acc * alpha + pv

    m0, l0, acc0 = softmax_init(mrow, dv)
    if pv_t:
        acc0 = kd.zeros((dv, mrow), kd.f32)
    m_i, l_i, acc = kd.fold(kd.tiles(start=start, stop=stop, block=BN, label="N"), (m0, l0, acc0), step)
    if whole:
        store_split(part, lse, (b, r, h, split), dl, m_i, l_i, acc)
    else:
        store_value_block(part, lse, (b, r, h, split), dv, m_i, l_i, acc, (h * 0 + dv.start) == 0)


_EX = {"B": 1, "QL": 1, "QH": 64, "H": 64, "DQ": 576, "DL": 512, "DR": 64, "NP": 4096, "PS": 64, "MP": 128, "S": 8}
_CHECKS = [
    ("q", lambda d: d["DQ"] == d["DL"] + d["DR"], "q/cache last dim must equal latent + rope dims (DL + DR)"),
    ("q", lambda d: d["QH"] == d["QL"] * d["H"], "QH must be q_len * heads"),
    ("q", lambda d: 1 <= d["QL"] <= MAX_Q_LEN, f"q_len must be 1..{MAX_Q_LEN}"),
]


@kd.kernel(static=("QL", "DL", "DR"), example=_EX, checks=_CHECKS)
def mla_decode_split(q: kd.In["B", "QL", "H", "DQ", kd.bf16], kv: kd.In["NP", "PS", "DQ", kd.bf16],
                     block_table: kd.In["B", "MP", kd.i32], seq_lens: kd.In["B", kd.i32],
                     part: kd.Out["B", "QL", "H", "S", "DL", kd.f32], lse: kd.Out["B", "QL", "H", "S", kd.f32],
                     sm_scale: kd.Scalar[kd.f32], QH: kd.Dim, DR: kd.Dim):
    """One KV split of MLA decode/verify (causal among the QL new rows): f32 partial out + log2-sum-exp."""
    _split_body(q, kv, block_table, seq_lens, None, part, lse, sm_scale)


# tree verify at the Kimi shape: q_len 4, the window = the new rows (a draft tree step has TW > QL)
_TEX = {**_EX, "QL": 4, "QH": 256, "TW": 4}
_TCHECKS = _CHECKS + [("tree", lambda d: d["TW"] >= d["QL"], "the tree window TW must cover the q_len new rows")]


@kd.kernel(static=("QL", "DL", "DR"), example=_TEX, checks=_TCHECKS)
def mla_decode_split_tree(q: kd.In["B", "QL", "H", "DQ", kd.bf16], kv: kd.In["NP", "PS", "DQ", kd.bf16],
                          block_table: kd.In["B", "MP", kd.i32], seq_lens: kd.In["B", kd.i32],
                          tree: kd.In["B", "QL", "TW", kd.i8],
                          part: kd.Out["B", "QL", "H", "S", "DL", kd.f32], lse: kd.Out["B", "QL", "H", "S", kd.f32],
                          sm_scale: kd.Scalar[kd.f32], QH: kd.Dim, DR: kd.Dim):
    """One KV split of MLA tree attention: row r sees the positions before the last TW and, among
    those TW, the ones with tree[b, r, j] != 0 (its ancestors and itself)."""
    _split_body(q, kv, block_table, seq_lens, tree, part, lse, sm_scale)


def _combine_body(part, lse, out):
    """Merge a row's splits one at a time in split order (an online log-sum-exp): an empty split
    (lse -inf, partial 0) leaves the running state bit for bit unchanged, so a row's result does
    not depend on how many (empty) splits the grid had beyond its own."""
    b, qh, d = kd.grid(kd.each("B"), kd.each("QH"), kd.tile("DL", "BLOCK_D", domain=(64, 128, 256, 512), default=512))
    H = kd.dim("H")
    r = qh // H
    h = qh % H

    def merge(s, m_i, l_i, acc):
        ls = lse[b, r, h, s]
        m_new = kd.maximum(m_i, kd.max(ls, axis=s))
        alpha = kd.exp2(m_i - m_new)
        w = kd.exp2(kd.max(ls, axis=s) - m_new)
        return m_new, l_i * alpha + w, acc * alpha + kd.sum(part[b, r, h, s, d], axis=s) * w

    init = (kd.full((d,), NEG_BIG, kd.f32), kd.zeros((d,), kd.f32), kd.zeros((d,), kd.f32))
    m_i, l_i, acc = kd.fold(kd.tiles("S", block=1, label="s"), init, merge)
    out[b, r, h, d] = normalized(acc, l_i)


_CEX = {"B": 1, "QL": 1, "QH": 64, "H": 64, "S": 8, "DL": 512}


@kd.kernel(static=("S",), example=_CEX)
def mla_decode_combine(part: kd.In["B", "QL", "H", "S", "DL", kd.f32], lse: kd.In["B", "QL", "H", "S", kd.f32],
                       out: kd.Out["B", "QL", "H", "DL", kd.bf16], QH: kd.Dim):
    """Merge the KV splits of MLA decode by their log2-sum-exp weights -> bf16 latent output."""
    _combine_body(part, lse, out)


@kd.kernel(static=("S",), example=_CEX)
def mla_decode_combine_f32(part: kd.In["B", "QL", "H", "S", "DL", kd.f32], lse: kd.In["B", "QL", "H", "S", kd.f32],
                           out: kd.Out["B", "QL", "H", "DL", kd.f32], QH: kd.Dim):
    """Like mla_decode_combine with an f32 output (tests compare split counts through it)."""
    _combine_body(part, lse, out)


@kd.kernel(example={"NT": 4, "DQ": 576, "NP": 4096, "PS": 64})
def mla_cache_append(new: kd.In["NT", "DQ", kd.bf16], slots: kd.In["NT", kd.i64],
                     kv: kd.InOut["NP", "PS", "DQ", kd.bf16]):
    """kv[slot // PS, slot % PS, :] = new[t, :] for each new token t (slot < 0: skipped, e.g. padding)."""
    t, d = kd.grid(kd.each("NT"), kd.tile("DQ", "BLOCK_D", domain=(64, 128, 256, 512, 1024), default=1024))
    slot = slots[t]
    PS = kd.dim("PS")
    # the skip test is made a vector (slot + 0*d): the interpreter rejects a scalar bool in a vector mask
    kv.store(slot // PS, slot % PS, d, value=new[t, d], mask=(slot + d * 0) >= 0)


# ---------------------------------------------------------------------------------------------
# host side

def invariant_splits(capacity: int, split_tokens: int = 256, max_splits: int = DEFAULT_MAX_SPLITS) -> int:
    """The grid's split count of a batch-invariant launch (SPLIT_TOKENS > 0): enough fixed-size
    chunks for the table's capacity (block-table width x page size, a host int), at most
    `max_splits` (longer contexts then get longer chunks, see `split_range`). It depends on neither
    the batch, nor q_len, nor the CU count, and the kernels make a row's numerics independent of it."""
    return int(max(1, min(max_splits, -(-max(capacity, 1) // split_tokens))))


def num_splits(seq_lens: torch.Tensor | list[int] | int, q_len: int, heads: int, block_m: int = 16,
               cu_count: int | None = None, block_n: int = 32, min_tokens_per_split: int = 256,
               max_splits: int = DEFAULT_MAX_SPLITS) -> int:
    """Number of KV splits of a launch that is not batch-invariant (`invariant=False`).

    Without splitting the grid has B * cdiv(q_len*H, BLOCK_M) programs; decode at small batch
    leaves most CUs idle, so split each sequence until there are about two programs per CU, but
    never below `min_tokens_per_split` tokens per split of the longest sequence (the combine and
    the per-split q load cost about that much), and at most `max_splits` (the combine holds all
    splits of a row in one tile). Shorter sequences in the batch get fewer non-empty splits,
    because each sequence cuts its own length into S chunks rounded up to BLOCK_N.
    `seq_lens`: the lengths (a list, or a tensor: a device read, not for launch paths) or
    (batch, longest length) as `[n] * batch`; the ops pass the table capacity, a host int."""
    if isinstance(seq_lens, torch.Tensor):
        lens = seq_lens.tolist()
    elif isinstance(seq_lens, int):
        lens = [seq_lens]
    else:
        lens = list(seq_lens)
    if not lens:
        return 1
    if cu_count is None:
        cu_count = current_target().cu_count
    programs = len(lens) * -(-(q_len * heads) // block_m)
    want = -(-2 * cu_count // programs)
    by_len = max(1, max(lens) // max(min_tokens_per_split, block_n))
    return int(max(1, min(want, by_len, max_splits)))


def split_plan(kern: Any, cfg: dict[str, Any], static: dict[str, int], batch: int, capacity: int, heads_rows: int,
               block_m: int, splits: int | None, invariant: bool, cu_count: int | None, op: str,
               max_splits: int = DEFAULT_MAX_SPLITS) -> int:
    """The split count S of a decode launch and the SPLIT_TOKENS the kernel runs with (set in
    `cfg`): from host ints only (the table capacity, the batch, the CU count), never from the
    lengths on the device. An explicit `splits` cuts each sequence into that many chunks (the
    kernel's SPLIT_TOKENS=0 mode) unless `cfg` sets SPLIT_TOKENS itself. `max_splits`: the cap the
    kernel's split_range uses (MLA: max_splits_for(heads))."""
    tun = kern.tunables(static=static)
    bn = cfg.get("BLOCK_N", tun["BLOCK_N"].default)
    if splits is not None:
        if not isinstance(splits, int) or not 1 <= splits <= max_splits:
            raise ValueError(f"{op}: splits must be an int in 1..{max_splits}, got {splits!r}")
        cfg.setdefault("SPLIT_TOKENS", 0)
        st = cfg["SPLIT_TOKENS"]
        if st and splits < invariant_splits(capacity, st, max_splits):
            raise ValueError(f"{op}: splits={splits} is below the {invariant_splits(capacity, st, max_splits)} chunks of "
                             f"SPLIT_TOKENS={st} that a {capacity}-token table needs")
        return splits
    if invariant:
        cfg.setdefault("SPLIT_TOKENS", tun["SPLIT_TOKENS"].default)
    else:
        cfg["SPLIT_TOKENS"] = 0
    return launch_split_count(capacity, batch, heads_rows, block_m, bn, cfg["SPLIT_TOKENS"], cu_count, max_splits)


def launch_split_count(capacity: int, batch: int, rows_per_seq: int, block_m: int, block_n: int,
                       split_tokens: int = 256, cu_count: int | None = None,
                       max_splits: int = DEFAULT_MAX_SPLITS) -> int:
    """The split count a decode launch uses (for problem models: pass the context as `capacity`):
    SPLIT_TOKENS > 0 (batch-invariant) -> `invariant_splits`; 0 -> `num_splits` for the CUs.
    `rows_per_seq`: query rows x heads one sequence puts on the grid's M axis (MLA: q_len x H)."""
    if split_tokens:
        return invariant_splits(capacity, split_tokens, max_splits)
    return num_splits([capacity] * batch, 1, rows_per_seq, block_m, cu_count=cu_count, block_n=block_n,
                      max_splits=max_splits)


def _check(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           latent_dim: int, tree_mask: torch.Tensor | None, validate: bool) -> None:
    """Argument rules (shapes, dtypes, devices, layout, host ints); with `validate` also the values."""
    op = "mla_decode"
    check_tensor(op, "q", q, 4, (torch.bfloat16,), last_contiguous=True)
    dev = q.device
    B, QL, H, DQ = q.shape
    if B < 1 or H < 1:
        raise ValueError(f"mla_decode: q must have a batch and heads, got shape {tuple(q.shape)}")
    if not 1 <= QL <= MAX_Q_LEN:
        raise ValueError(f"mla_decode: q_len must be 1..{MAX_Q_LEN}, got {QL}")
    check_tensor(op, "kv_cache", kv, 3, (torch.bfloat16,), dev, last_contiguous=True)
    if kv.shape[-1] != DQ:
        raise ValueError(f"mla_decode: head dims do not match: q has {DQ} (latent+rope) per head, "
                         f"cache is {tuple(kv.shape)} (want [pages, page_size, {DQ}])")
    if kv.shape[0] < 1 or kv.shape[1] < 1:
        raise ValueError(f"mla_decode: kv_cache must have pages and a page size, got {tuple(kv.shape)}")
    if not isinstance(latent_dim, int) or not 0 < latent_dim < DQ:
        raise ValueError(f"mla_decode: latent_dim {latent_dim} must be in (0, {DQ})")
    check_paged(op, block_table, seq_lens, B, dev)
    if tree_mask is not None:
        check_tensor(op, "tree_mask", tree_mask, 3, None, dev)
        if tree_mask.shape[:2] != (B, QL) or tree_mask.shape[2] < QL:
            raise ValueError(f"mla_decode: tree_mask must be [B, q_len, TW] = [{B}, {QL}, >= {QL}], got "
                             f"{tuple(tree_mask.shape)}")
    if validate:
        check_paged_lengths(op, block_table, seq_lens, kv.shape[1], B, QL, kv.shape[0])
        if tree_mask is not None:
            TW = tree_mask.shape[2]
            if int(seq_lens.min()) < TW:
                raise ValueError(f"mla_decode: the tree window TW={TW} is longer than a sequence ({seq_lens.tolist()})")
            if not bool(tree_mask[:, :, TW - QL:].diagonal(dim1=1, dim2=2).bool().all()):
                raise ValueError("mla_decode: tree_mask must mark every row as its own ancestor (diagonal set)")


def mla_decode_ref(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   sm_scale: float, latent_dim: int = 512, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """float64 reference: gather each sequence's tokens through the block table, mask (causal among
    the new rows, or tree_mask [B, q_len, TW] over the last TW tokens, everything before them
    visible), softmax. The kernels' no-op rules: a length is clamped to [0, table capacity]; a
    token whose table entry is outside [0, num_pages) reads as zeros; a row that sees no token is 0;
    a window longer than the sequence covers the whole sequence (its first TW - len columns unused)."""
    B, QL, H, DQ = q.shape
    PS = kv.shape[1]
    out = torch.zeros(B, QL, H, latent_dim, dtype=torch.float64, device=q.device)
    for b in range(B):
        pos, pages, ok = paged_positions(block_table, b, int(seq_lens[b]), PS, kv.shape[0])
        n = pos.numel()
        k = kv[pages, pos % PS].double() * ok[:, None]  # [n, DQ]; a page outside the cache reads 0
        s = torch.einsum("rhd,nd->rhn", q[b].double(), k) * sm_scale
        base = n - QL
        rows = torch.arange(QL, device=q.device)
        if tree_mask is None:
            vis = pos[None, :] < (base + rows + 1)[:, None]
        else:
            TW = tree_mask.shape[2]
            wb = n - TW
            j = (pos - wb).clamp(min=0, max=TW - 1)
            vis = (pos[None, :] < wb) | (tree_mask[b].bool()[:, j] & (pos >= wb)[None, :])
        s = s.masked_fill(~vis[:, None, :], float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)  # a row that sees nothing: 0
        out[b] = torch.einsum("rhn,nd->rhd", p, k[:, :latent_dim])
    return out


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               sm_scale: float, latent_dim: int = 512, tree_mask: torch.Tensor | None = None,
               splits: int | None = None, out_dtype: torch.dtype = torch.bfloat16, backend: str = "triton",
               config: dict[str, Any] | None = None, invariant: bool = True, validate: bool | None = None,
               cu_count: int | None = None, w_uv: torch.Tensor | None = None) -> torch.Tensor:
    """MLA decode/verify: q [B, q_len, H, latent+rope] over the paged latent cache -> [B, q_len, H, latent].

    seq_lens count every cached token including the q_len new ones (append them first with
    `append_latent`). tree_mask [B, q_len, TW] (optional, TW >= q_len): row r sees the tokens
    before the last TW and those of the last TW marked nonzero in row r (its own, the diagonal of
    the last q_len columns, must be set); TW = q_len is a tree verify, TW > q_len a draft tree step
    whose ancestors sit in earlier rows; None = causal among the new rows. A window longer than a
    sequence covers all of it (positions before 0 do not exist; `validate` refuses it).
    The launch reads no device value (graph-capturable): the split count comes
    from host ints. `invariant` (default): a row's result depends neither on the batch nor on
    q_len (fixed-size KV splits, one reduction config shared by decode and verify, see
    `split_range`); False: splits sized to fill `cu_count` CUs (default: the target's).
    `splits` overrides the split count. Out-of-range values are defined no-ops, the same on both
    backends: a length is clamped to [0, block_table width x page size]; a token whose table entry
    is outside [0, num_pages) reads as zeros (K = V = 0: a score of 0 and no value; never a wrapped
    index, never memory outside the cache); a row that sees no token is 0.
    `validate=True` (or `ops._common.set_validate`) checks those values instead (device reads).
    `w_uv` [H, latent, v] bf16 (absorbed W_UV): the output is instead [B, q_len, H, v] bf16 =
    bf16(attention) @ W_UV[h], the split combine and the product in one launch (mla_combine_uv)."""
    check_backend("mla_decode", backend)
    _check(q, kv_cache, block_table, seq_lens, latent_dim, tree_mask, validating(validate))
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"mla_decode: out_dtype must be bf16 or f32, got {out_dtype}")
    if w_uv is not None:
        check_tensor("mla_decode", "w_uv", w_uv, 3, (torch.bfloat16,), q.device, contiguous=True)
        if w_uv.shape[:2] != (q.shape[2], latent_dim) or out_dtype != torch.bfloat16:
            raise ValueError(f"mla_decode: w_uv must be [H={q.shape[2]}, latent={latent_dim}, v] with a bf16 output, "
                             f"got {tuple(w_uv.shape)} ({out_dtype})")
    if backend == "torch":
        o = mla_decode_ref(q, kv_cache, block_table, seq_lens, sm_scale, latent_dim, tree_mask).to(out_dtype)
        if w_uv is None:
            return o
        return torch.einsum("bqhc,hcv->bqhv", o.float(), w_uv.float()).to(torch.bfloat16)
    B, QL, H, DQ = q.shape
    DR = DQ - latent_dim
    kern = mla_decode_split if tree_mask is None else mla_decode_split_tree
    # the tuned-config key (autotune/problems.py): head shapes and q_len; batch x q_len is the M
    # bucket; batch, table width and context length are not part of it. The tree variant runs the
    # causal kernel's config: same tiles, same summation order as a chain verify of that q_len.
    problem = {"QL": QL, "H": H, "DL": latent_dim, "DR": DR, "PS": kv_cache.shape[1]}
    if invariant:  # every numerics key from the q_len-1, M=1 decode config
        cfg = invariant_config(mla_decode_split, problem, B * QL, config, {**problem, "QL": 1})
    else:
        cfg = dict(config_for(mla_decode_split, problem, B * QL, config))
    bm = cfg.get("BLOCK_M", 16)
    cap = block_table.shape[1] * kv_cache.shape[1]
    S = split_plan(mla_decode_split, cfg, {"QL": QL, "DL": latent_dim, "DR": DR}, B, cap, QL * H, bm, splits,
                   invariant, cu_count, "mla_decode", max_splits_for(H))
    part = torch.empty(B, QL, H, S, latent_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, QL, H, S, dtype=torch.float32, device=q.device)
    bt = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    sl = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    args = [q, kv_cache, bt, sl] + ([tree_mask.to(torch.int8).contiguous()] if tree_mask is not None else [])
    kern(*args, part, lse, float(sm_scale), QL * H, DR, config=cfg)
    if w_uv is not None:
        from ops.mla_fused import combine_uv

        return combine_uv(part.view(B * QL, H, S, latent_dim), lse.view(B * QL, H, S), w_uv,
                          invariant=invariant).view(B, QL, H, w_uv.shape[-1])
    out = torch.empty(B, QL, H, latent_dim, dtype=out_dtype, device=q.device)
    ck = mla_decode_combine if out_dtype == torch.bfloat16 else mla_decode_combine_f32
    ccfg = config_for(ck, {"B": B, "QL": QL, "QH": QL * H, "H": H, "S": S, "DL": latent_dim}, B * QL, None)
    ck(part, lse, out, QL * H, config=ccfg)
    return out


def _check_append(op: str, cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor, cache_dims: int) -> None:
    check_tensor(op, "cache", cache, cache_dims, (torch.bfloat16,))
    dev = cache.device
    check_tensor(op, "new", new, cache_dims - 1, (torch.bfloat16,), dev)
    check_tensor(op, "slots", slots, 1, (torch.int32, torch.int64), dev)
    if not cache.is_contiguous():
        raise ValueError(f"{op}: the cache must be contiguous (it is written in place)")
    if slots.shape != (new.shape[0],):
        raise ValueError(f"{op}: slots must be [{new.shape[0]}], got {tuple(slots.shape)}")


def append_latent(kv_cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor, backend: str = "triton",
                  config: dict[str, Any] | None = None, validate: bool | None = None) -> None:
    """Write new latent entries [NT, DL+DR] into the paged cache at slots [NT] (page*page_size + offset).

    A slot < 0 (padding) or >= the cache's capacity is skipped, on both backends (no store; never a
    wrapped index). `validate=True` refuses a slot past the capacity instead (a device read)."""
    check_backend("append_latent", backend)
    _check_append("append_latent", kv_cache, new, slots, 3)
    if new.shape[-1] != kv_cache.shape[-1]:
        raise ValueError(f"append_latent: new must be [NT, {kv_cache.shape[-1]}], got {tuple(new.shape)}")
    cap = kv_cache.shape[0] * kv_cache.shape[1]
    if validating(validate):
        check_slots("append_latent", slots, cap)
    if backend == "torch":
        ok = (slots >= 0) & (slots < cap)
        s = slots[ok].long()
        kv_cache[s // kv_cache.shape[1], s % kv_cache.shape[1]] = new[ok]
        return
    if new.shape[0] == 0:
        return
    cfg = config_for(mla_cache_append, {"NT": new.shape[0], "DQ": new.shape[1], "NP": kv_cache.shape[0],
                                        "PS": kv_cache.shape[1]}, new.shape[0], config)
    sl = slots if slots.dtype == torch.int64 else slots.to(torch.int64)
    mla_cache_append(new.contiguous(), sl, kv_cache, config=cfg)
