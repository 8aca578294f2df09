"""Paged MHA/GQA decode and verify for the EAGLE-3 draft, written in kdsl.

The draft keeps its own KV cache laid out like the target's: pages of `page_size` tokens, one block
table row per sequence, K and V caches [num_pages, page_size, kv_heads, head_dim] bf16. Query
q [B, q_len, q_heads, head_dim]; q_heads = G * kv_heads (GQA ratio G). As for MLA, a split-KV
kernel (`mha_decode`) writes f32 partials plus log2-sum-exp per split and `mha_decode_combine`
merges them. One program handles one kv head and a block of (query row, group member) pairs, so a
GQA group shares every K/V tile it loads. Row r of a q_len-row verify sees positions
< len - q_len + r + 1, or, with a tree mask (`mha_decode_tree`), the positions before the last TW
and, among those TW, the ones marked in tree[b, r, :]. TW = q_len is MLA's verify mask format; a
draft tree step needs TW > q_len because the new rows' ancestors were appended by earlier steps,
between non-ancestor rows.
"""
from __future__ import annotations

from typing import Any

import torch

import kdsl as kd
from ops._common import (check_backend, check_paged, check_paged_lengths, check_slots, check_tensor, config_for,
                         invariant_config, paged_positions, validating)
from ops.mla import (MAX_Q_LEN, _combine_body, cached_len, softmax_init, softmax_step, split_plan,
                     split_range, store_split, visible, LOG2E)

_EX = {"B": 1, "QL": 1, "HQ": 64, "KVH": 64, "D": 128, "NP": 4096, "PS": 64, "MP": 128, "S": 8,
       "BS": 8, "QG": 1}
_CHECKS = [
    ("q", lambda d: d["HQ"] % d["KVH"] == 0, "q heads must be a multiple of kv heads (GQA)"),
    ("q", lambda d: d["QG"] == d["QL"] * (d["HQ"] // d["KVH"]), "QG must be q_len * (q heads / kv heads)"),
    ("q", lambda d: d["BS"] == d["B"] * d["S"], "BS must be batch * splits"),
    ("q", lambda d: 1 <= d["QL"] <= MAX_Q_LEN, f"q_len must be 1..{MAX_Q_LEN}"),
]


def _decode_body(q, k_cache, v_cache, block_table, seq_lens, tree, part, lse, sm_scale):
    """Shared by the causal and tree kernels: only the visibility test differs (`tree` None = causal)."""
    bs, kvh, mrow = kd.grid(kd.each("BS"), kd.each("KVH"), kd.tile("QG", "BLOCK_M", domain=(16, 32, 64), default=16))
    # default 64; the tree variant also holds the mask tile and spills 8 VGPRs at 64 on gfx942
    # (0 at 32, at the Kimi draft shape), so it defaults to 32
    BN = kd.tunable("BLOCK_N", (16, 32, 64, 128), 32, "KV tokens per inner step")
    S = kd.dim("S")
    b = bs // S
    split = bs % S
    G = kd.dim("HQ") // kd.dim("KVH")
    QL = kd.static("QL")
    PS = kd.dim("PS")
    r = mrow // G
    hq = kvh * G + mrow % G
    d = kd.full_range("D")
    n_len = cached_len(seq_lens, b, kd.dim("MP"), PS)
    start, stop = split_range(n_len, split, QL, BN)
    qt = q[b, r, hq, d]
    base = n_len - QL
    qk_scale = sm_scale * LOG2E
    wbase = n_len - kd.dim("TW") if tree is not None else base   # first position the tree mask covers

    def step(p, m_i, l_i, acc):
        page = block_table[b, p // PS]
        off = p % PS
        s = kd.dot(qt, k_cache[page, off, kvh, d]) * qk_scale
        m_new, l_new, alpha, pr = softmax_step(s, visible(p, r, base, wbase, stop, tree, b), m_i, l_i, p)
        return m_new, l_new, acc * alpha + kd.dot(pr.to(kd.bf16), v_cache[page, off, kvh, d])

    m_i, l_i, acc = kd.fold(kd.tiles(start=start, stop=stop, block=BN, label="N"), softmax_init(mrow, d), step)
    store_split(part, lse, (b, r, hq, split), d, m_i, l_i, acc)


@kd.kernel(static=("QL", "D"), example=_EX, checks=_CHECKS)
def mha_decode(q: kd.In["B", "QL", "HQ", "D", kd.bf16], k_cache: kd.In["NP", "PS", "KVH", "D", kd.bf16],
               v_cache: kd.In["NP", "PS", "KVH", "D", kd.bf16], block_table: kd.In["B", "MP", kd.i32],
               seq_lens: kd.In["B", kd.i32], part: kd.Out["B", "QL", "HQ", "S", "D", kd.f32],
               lse: kd.Out["B", "QL", "HQ", "S", kd.f32], sm_scale: kd.Scalar[kd.f32], QG: kd.Dim, BS: kd.Dim):
    """One KV split of paged GQA decode/verify (causal among the q_len new rows): f32 partials + lse."""
    _decode_body(q, k_cache, v_cache, block_table, seq_lens, None, part, lse, sm_scale)


# draft tree step at the Kimi draft shape: topk 4 frontier rows, a 16-row tree window
_TEX = {**_EX, "QL": 4, "QG": 4, "TW": 16}
_TCHECKS = _CHECKS + [("tree", lambda d: d["TW"] >= d["QL"], "the tree window TW must cover the q_len new rows")]


@kd.kernel(static=("QL", "D"), example=_TEX, checks=_TCHECKS)
def mha_decode_tree(q: kd.In["B", "QL", "HQ", "D", kd.bf16], k_cache: kd.In["NP", "PS", "KVH", "D", kd.bf16],
                    v_cache: kd.In["NP", "PS", "KVH", "D", kd.bf16], block_table: kd.In["B", "MP", kd.i32],
                    seq_lens: kd.In["B", kd.i32], tree: kd.In["B", "QL", "TW", kd.i8],
                    part: kd.Out["B", "QL", "HQ", "S", "D", kd.f32], lse: kd.Out["B", "QL", "HQ", "S", kd.f32],
                    sm_scale: kd.Scalar[kd.f32], QG: kd.Dim, BS: kd.Dim):
    """One KV split of paged GQA tree attention: row r sees the positions before the last TW and,
    among those TW, the ones with tree[b, r, j] != 0 (its ancestors and itself)."""
    _decode_body(q, k_cache, v_cache, block_table, seq_lens, tree, part, lse, sm_scale)


@kd.kernel(static=("S",), example={"B": 1, "QL": 1, "QH": 64, "H": 64, "S": 8, "DL": 128})
def mha_decode_combine(part: kd.In["B", "QL", "H", "S", "DL", kd.f32], lse: kd.In["B", "QL", "H", "S", kd.f32],
                       out: kd.Out["B", "QL", "H", "DL", kd.bf16], QH: kd.Dim):
    """Merge the KV splits of paged MHA decode by their log2-sum-exp weights -> bf16."""
    _combine_body(part, lse, out)


@kd.kernel(static=("D",), example={"NT": 4, "KVH": 64, "D": 128, "NP": 4096, "PS": 64})
def mha_cache_append(k_new: kd.In["NT", "KVH", "D", kd.bf16], v_new: kd.In["NT", "KVH", "D", kd.bf16],
                     slots: kd.In["NT", kd.i64], k_cache: kd.InOut["NP", "PS", "KVH", "D", kd.bf16],
                     v_cache: kd.InOut["NP", "PS", "KVH", "D", kd.bf16]):
    """k/v_cache[slot // PS, slot % PS] = k/v_new[t] for each new token (slot < 0: skipped)."""
    t, h = kd.grid(kd.each("NT"), kd.tile("KVH", "BLOCK_H", domain=(1, 2, 4, 8, 16, 32, 64), default=8))
    d = kd.full_range("D")
    slot = slots[t]
    PS = kd.dim("PS")
    ok = (slot + h * 0) >= 0  # a vector mask: the interpreter rejects scalar bools in vector masks
    k_cache.store(slot // PS, slot % PS, h, d, value=k_new[t, h, d], mask=ok)
    v_cache.store(slot // PS, slot % PS, h, d, value=v_new[t, h, d], mask=ok)


# ---------------------------------------------------------------------------------------------

def _check(q, k_cache, v_cache, block_table, seq_lens, tree_mask, validate: bool) -> None:
    """Argument rules (shapes, dtypes, devices, layout, host ints); with `validate` also the values."""
    op = "paged_mha_decode"
    check_tensor(op, "q", q, 4, (torch.bfloat16,), last_contiguous=True)
    dev = q.device
    B, QL, HQ, D = q.shape
    if B < 1 or HQ < 1:
        raise ValueError(f"{op}: q must have a batch and heads, got shape {tuple(q.shape)}")
    if not 1 <= QL <= MAX_Q_LEN:
        raise ValueError(f"mha_decode: q_len must be 1..{MAX_Q_LEN}, got {QL}")
    check_tensor(op, "k_cache", k_cache, 4, (torch.bfloat16,), dev, last_contiguous=True)
    check_tensor(op, "v_cache", v_cache, 4, (torch.bfloat16,), dev, last_contiguous=True)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"mha_decode: k/v caches must both be [pages, page_size, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if min(k_cache.shape) < 1:
        raise ValueError(f"{op}: the caches must have pages, a page size and kv heads, got {tuple(k_cache.shape)}")
    if k_cache.shape[-1] != D:
        raise ValueError(f"mha_decode: head dims do not match: q has {D}, cache has {k_cache.shape[-1]}")
    if HQ % k_cache.shape[2]:
        raise ValueError(f"mha_decode: q heads {HQ} must be a multiple of kv heads {k_cache.shape[2]}")
    check_paged(op, block_table, seq_lens, B, dev)
    if tree_mask is not None:
        check_tensor(op, "tree_mask", tree_mask, 3, None, dev)
        if tree_mask.shape[:2] != (B, QL) or tree_mask.shape[2] < QL:
            raise ValueError(f"mha_decode: tree_mask must be [B, q_len, TW] = [{B}, {QL}, >= {QL}], got "
                             f"{tuple(tree_mask.shape)}")
    if validate:
        check_paged_lengths(op, block_table, seq_lens, k_cache.shape[1], B, QL, k_cache.shape[0])
        if tree_mask is not None:
            TW = tree_mask.shape[2]
            if int(seq_lens.min()) < TW:
                raise ValueError(f"mha_decode: the tree window TW={TW} is longer than a sequence ({seq_lens.tolist()})")
            if not bool(tree_mask[:, :, TW - QL:].diagonal(dim1=1, dim2=2).bool().all()):
                raise ValueError("mha_decode: tree_mask must mark every row as its own ancestor (diagonal set)")


def mha_decode_ref(q, k_cache, v_cache, block_table, seq_lens, sm_scale: float,
                   tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """float64 reference of paged GQA decode/verify: causal among the new rows, or the tree mask
    [B, q_len, TW] over the last TW positions (everything before them visible). The kernels'
    no-op rules: a length is clamped to [0, table capacity]; a token whose table entry is outside
    [0, num_pages) reads as zeros; a row that sees no token is 0."""
    B, QL, HQ, D = q.shape
    PS, KVH = k_cache.shape[1], k_cache.shape[2]
    G = HQ // KVH
    out = torch.zeros(B, QL, HQ, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        pos, pages, ok = paged_positions(block_table, b, int(seq_lens[b]), PS, k_cache.shape[0])
        n = pos.numel()
        z = ok[:, None, None]  # a page outside the cache reads 0
        k = (k_cache[pages, pos % PS].double() * z).repeat_interleave(G, dim=1)  # [n, HQ, D]
        v = (v_cache[pages, pos % PS].double() * z).repeat_interleave(G, dim=1)
        s = torch.einsum("rhd,nhd->rhn", q[b].double(), k) * sm_scale
        if tree_mask is None:
            vis = pos[None, :] < (n - QL + torch.arange(QL, device=q.device) + 1)[:, None]
        else:
            TW = tree_mask.shape[2]
            wb = n - TW
            vis = torch.ones(QL, n, dtype=torch.bool, device=q.device)
            lo = max(wb, 0)
            vis[:, lo:] = tree_mask[b, :, lo - wb:].bool()
        s = s.masked_fill(~vis[:, None, :], float("-inf"))
        out[b] = torch.einsum("rhn,nhd->rhd", torch.softmax(s, -1).nan_to_num(0.0), v)
    return out


def paged_mha_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, sm_scale: float, splits: int | None = None, backend: str = "triton",
                     config: dict[str, Any] | None = None, tree_mask: torch.Tensor | None = None,
                     invariant: bool = True, validate: bool | None = None, cu_count: int | None = None
                     ) -> torch.Tensor:
    """Paged GQA attention of q [B, q_len, q_heads, D] over the cached tokens (the q_len new ones
    included in seq_lens) -> [B, q_len, q_heads, D] bf16. tree_mask [B, q_len, TW] (optional):
    row r sees the positions before the last TW and those of the last TW marked nonzero in row r
    (diagonal, i.e. the row itself, must be set); None = causal among the new rows.

    The launch reads no device value (graph-capturable). `invariant` (default): a row's result
    depends neither on the batch nor on q_len nor on the tree variant (fixed-size KV splits, the
    q_len-1 decode config's tiles for every launch); False: splits sized for `cu_count` CUs.
    Out-of-range values are defined no-ops, the same on both backends: a length is clamped to
    [0, block_table width x page size]; a token whose table entry is outside [0, num_pages) reads
    as zeros (K = V = 0; never a wrapped index, never memory outside the cache); a row that sees no
    token is 0. `validate=True` checks the
    values instead (device reads)."""
    check_backend("paged_mha_decode", backend)
    _check(q, k_cache, v_cache, block_table, seq_lens, tree_mask, validating(validate))
    if backend == "torch":
        return mha_decode_ref(q, k_cache, v_cache, block_table, seq_lens, sm_scale, tree_mask).to(q.dtype)
    B, QL, HQ, D = q.shape
    KVH = k_cache.shape[2]
    G = HQ // KVH
    kern = mha_decode if tree_mask is None else mha_decode_tree
    # the tuned-config key (autotune/problems.py): head shapes and q_len; batch x q_len is the M bucket
    problem = {"QL": QL, "HQ": HQ, "KVH": KVH, "D": D, "PS": k_cache.shape[1]}
    if invariant:  # tiles of the causal q_len-1 decode at M=1, for verify and tree steps too
        cfg = invariant_config(mha_decode, problem, B * QL, config, {**problem, "QL": 1})
        cfg.setdefault("BLOCK_N", mha_decode.tunables(static={"QL": 1, "D": D})["BLOCK_N"].default)
    else:
        cfg = dict(config_for(kern, problem, B * QL, config))
    bm = cfg.get("BLOCK_M", 16)
    cap = block_table.shape[1] * k_cache.shape[1]
    # programs per sequence: KVH * cdiv(QL*G, BLOCK_M), i.e. "heads" = KVH*BLOCK_M-padded rows
    S = split_plan(kern, cfg, {"QL": QL, "D": D}, B, cap, KVH * -(-(QL * G) // bm) * bm, bm, splits, invariant,
                   cu_count, "paged_mha_decode")
    part = torch.empty(B, QL, HQ, S, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, QL, HQ, S, dtype=torch.float32, device=q.device)
    bt = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    sl = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    args = [q, k_cache, v_cache, bt, sl]
    if tree_mask is not None:
        args.append(tree_mask.to(torch.int8).contiguous())
    kern(*args, part, lse, float(sm_scale), QL * G, B * S, config=cfg)
    out = torch.empty(B, QL, HQ, D, dtype=torch.bfloat16, device=q.device)
    ccfg = config_for(mha_decode_combine, {"B": B, "QL": QL, "QH": QL * HQ, "H": HQ, "S": S, "DL": D}, B * QL, None)
    mha_decode_combine(part, lse, out, QL * HQ, config=ccfg)
    return out


def append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
              slots: torch.Tensor, backend: str = "triton", config: dict[str, Any] | None = None,
              validate: bool | None = None) -> None:
    """Write new K/V rows [NT, kv_heads, D] into the paged caches at slots [NT].

    A slot < 0 (padding) or >= the caches' capacity is skipped, on both backends (no store; never a
    wrapped index). `validate=True` refuses a slot past the capacity instead (a device read)."""
    from ops.mla import _check_append

    check_backend("append_kv", backend)
    _check_append("append_kv", k_cache, k_new, slots, 4)
    _check_append("append_kv", v_cache, v_new, slots, 4)
    if k_new.shape != v_new.shape or k_cache.shape != v_cache.shape or k_new.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"append_kv: k/v_new must be [NT, {k_cache.shape[2]}, {k_cache.shape[3]}], got "
                         f"{tuple(k_new.shape)} / {tuple(v_new.shape)}")
    cap = k_cache.shape[0] * k_cache.shape[1]
    if validating(validate):
        check_slots("append_kv", slots, cap)
    if backend == "torch":
        ok = (slots >= 0) & (slots < cap)
        s = slots[ok].long()
        PS = k_cache.shape[1]
        k_cache[s // PS, s % PS] = k_new[ok]
        v_cache[s // PS, s % PS] = v_new[ok]
        return
    if k_new.shape[0] == 0:
        return
    cfg = config_for(mha_cache_append, {"NT": k_new.shape[0], "KVH": k_new.shape[1], "D": k_new.shape[2],
                                        "NP": k_cache.shape[0], "PS": k_cache.shape[1]}, k_new.shape[0], config)
    sl = slots if slots.dtype == torch.int64 else slots.to(torch.int64)
    mha_cache_append(k_new.contiguous(), v_new.contiguous(), sl, k_cache, v_cache, config=cfg)
