"""Tree drafting, verification masks and tree acceptance for a whole batch, on the device.

Every function takes and returns fixed-shape device tensors ([B, ...] with shapes set by (topk K,
steps, draft_tokens N) only), makes no device->host read and no data-dependent Python branch, so
the engine can run the draft and verify steps of a tree round through graph capture like a chain's.

The tree of one sequence (EAGLE-2 style, as the module docstring of models.spec states):
- step 0 takes the K best tokens of the draft's root logits (depth 1, score = log-prob);
- each later step expands the K best nodes of the previous step's candidates (the frontier) to their
  K best children, score = parent score + log-prob; the frontier's rows are appended to the draft
  cache and each attends to the prefix, its ancestors' rows and itself (a window over the rows
  drafted this round);
- the verified tree is the best N-1 nodes by score (ties: shallower first, then lower node index),
  which always holds every chosen node's ancestors because a child's score never exceeds its
  parent's; rows are ordered by depth, then score (row 0 is the root).
`greedy_tree_accept` / `sample_tree_accept` in models.spec are the per-sequence host references of
`accept`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["DraftTree", "draft_tree", "VerifyTree", "pick_tree", "accept", "move_rows"]


@dataclass
class DraftTree:
    """All drafted nodes of a round, [B, n] (n = K + (steps - 1) K^2), node index = creation order."""
    tok: torch.Tensor        # long: target token ids
    parent: torch.Tensor     # long: parent node (-1: a child of the root)
    depth: torch.Tensor      # long: 1 for the root's children
    score: torch.Tensor      # float64: sum of the draft log-probs along the path


def draft_tree(step: Callable[..., tuple[torch.Tensor, torch.Tensor]], root_logits: torch.Tensor,
               carry: torch.Tensor, base: torch.Tensor, topk: int, steps: int,
               to_target: Callable[[torch.Tensor], torch.Tensor]) -> DraftTree:
    """Draft one tree per sequence. root_logits [B, Vd] (the draft's logits after the root token),
    carry [B, H] (its pre-norm state), base [B] (cached rows = the root's position).

    step(s, tokens [B, K], hidden [B, K, H], positions [B, K], window bool [B, K, K*s]) runs draft
    step s (1..steps-1) over the frontier and returns (logits [B, K, Vd], carry [B, K, H]); the
    window covers the K*s rows drafted this round, the last K of them the frontier's own."""
    B, dev = root_logits.shape[0], root_logits.device
    K = topk
    R = K * max(steps - 1, 0)                                  # draft rows appended this round
    lp = torch.log_softmax(root_logits.float(), -1)
    v, i = lp.topk(K, -1)
    tok, score = to_target(i), v.double()
    parent = torch.full((B, K), -1, dtype=torch.long, device=dev)
    depth = torch.ones(B, K, dtype=torch.long, device=dev)
    hin = carry[:, None, :].expand(B, K, carry.shape[-1])      # the hidden state each node's step reads
    anc = torch.zeros(B, K, R, dtype=torch.bool, device=dev)   # rows of each node's ancestors
    frontier = torch.arange(K, device=dev).expand(B, K)
    ar = torch.arange(K, device=dev)
    for s in range(1, steps):
        own = K * (s - 1) + ar                                 # the frontier's rows (relative to base)
        f_anc = anc.gather(1, frontier[:, :, None].expand(B, K, R))
        mine = torch.zeros(K, R, dtype=torch.bool, device=dev)
        mine[ar, own] = True
        f_anc = f_anc | mine                                   # + its own row
        f_depth = depth.gather(1, frontier)
        f_hin = hin.gather(1, frontier[:, :, None].expand(B, K, hin.shape[-1]))
        lg, y = step(s, tok.gather(1, frontier), f_hin, base.long()[:, None] + f_depth - 1, f_anc[:, :, :K * s])
        cv, ci = torch.log_softmax(lg.float(), -1).topk(K, -1)                     # [B, K, K]
        first = tok.shape[1]
        tok = torch.cat([tok, to_target(ci).reshape(B, K * K)], 1)
        parent = torch.cat([parent, frontier[:, :, None].expand(B, K, K).reshape(B, K * K)], 1)
        depth = torch.cat([depth, (f_depth + 1)[:, :, None].expand(B, K, K).reshape(B, K * K)], 1)
        c_score = (score.gather(1, frontier)[:, :, None] + cv.double()).reshape(B, K * K)
        score = torch.cat([score, c_score], 1)
        hin = torch.cat([hin, y[:, :, None, :].expand(B, K, K, y.shape[-1]).reshape(B, K * K, y.shape[-1])], 1)
        anc = torch.cat([anc, f_anc[:, :, None, :].expand(B, K, K, R).reshape(B, K * K, R)], 1)
        # the next frontier: the K best new candidates, ties to the lowest index
        frontier = first + torch.sort(c_score, dim=1, descending=True, stable=True).indices[:, :K]
    return DraftTree(tok, parent, depth, score)


@dataclass
class VerifyTree:
    """The rows one target verify step processes, [B, N] (row 0 = the root)."""
    tokens: torch.Tensor     # long
    depths: torch.Tensor     # long: position offset from the root
    mask: torch.Tensor       # bool [B, N, N]: root, ancestors and self
    parent: torch.Tensor     # long: parent row (-1 for the root)
    children: torch.Tensor   # long [B, N, K]: child rows in the order acceptance tries them (-1 padded)


def pick_tree(tree: DraftTree, root: torch.Tensor, n_tokens: int, topk: int, steps: int) -> VerifyTree:
    """The best n_tokens - 1 nodes (see the module docstring) below `root` [B] as verify rows."""
    B, n_all = tree.tok.shape
    dev = root.device
    n = min(n_tokens - 1, n_all)
    by_depth = torch.sort(tree.depth, dim=1, stable=True).indices                  # ties: lower index first
    rank = by_depth.gather(1, torch.sort(tree.score.gather(1, by_depth), dim=1, descending=True, stable=True).indices)
    chosen = rank[:, :n]                                                        # best score, then shallower
    chosen = chosen.gather(1, torch.sort(tree.depth.gather(1, chosen), dim=1, stable=True).indices)   # rows by depth
    N = n + 1
    rows = torch.arange(1, N, device=dev).expand(B, n)
    row_of = torch.full((B, n_all), -1, dtype=torch.long, device=dev).scatter(1, chosen, rows)
    pnode = tree.parent.gather(1, chosen)
    prow = torch.where(pnode >= 0, row_of.gather(1, pnode.clamp(min=0)), torch.zeros_like(pnode))
    parent = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), prow], 1)       # [B, N]
    tokens = torch.cat([root.long()[:, None], tree.tok.gather(1, chosen)], 1)
    depths = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), tree.depth.gather(1, chosen)], 1)
    r_idx = torch.arange(N, device=dev).expand(B, N)
    mask = (r_idx[:, :, None] == r_idx[:, None, :]) | (r_idx[:, None, :] == 0)     # self and the root
    cur = parent.clone()
    for _ in range(steps):                                                      # walk up to the root
        mask = mask | ((cur[:, :, None] == r_idx[:, None, :]) & (cur >= 0)[:, :, None])
        cur = torch.where(cur >= 0, parent.gather(1, cur.clamp(min=0)), cur)
    # children of each row in row order (siblings are rows by score): rank among same-parent rows
    same = (parent[:, :, None] == parent[:, None, :]) & (r_idx[:, None, :] < r_idx[:, :, None])
    sib = same.sum(-1)                                                          # [B, N]
    children = torch.full((B, N * topk + 1), -1, dtype=torch.long, device=dev)
    slot = torch.where(parent >= 0, parent * topk + sib.clamp(max=topk - 1), torch.full_like(parent, N * topk))
    children = children.scatter(1, slot, r_idx)[:, :N * topk].view(B, N, topk)
    return VerifyTree(tokens, depths, mask, parent, children)


def accept(logits: torch.Tensor, vt: VerifyTree, steps: int, temperature: float, top_p: float,
           u: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree from its root (models.spec.greedy_tree_accept / sample_tree_accept per row):
    logits [B, N, V] of the verify rows; u [B, steps + 1, K + 1] uniforms when sampling (level l: one
    per child tried, the last for the next token). Returns (accepted count a [B], accepted rows
    [B, steps] (-1 past a), committed tokens [B, steps + 1]: the accepted rows' tokens, then the next
    token at index a)."""
    from models.spec import sample_rows, target_probs

    B, N, V = logits.shape
    K = vt.children.shape[-1]
    dev = logits.device
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    a = torch.zeros(B, dtype=torch.long, device=dev)
    path = torch.full((B, steps), -1, dtype=torch.long, device=dev)
    toks = torch.zeros(B, steps + 1, dtype=torch.long, device=dev)
    pred = logits.argmax(-1) if temperature == 0 else None
    for lvl in range(steps + 1):
        ch = vt.children.gather(1, cur[:, None, None].expand(B, 1, K))[:, 0]          # [B, K]
        ctok = vt.tokens.gather(1, ch.clamp(min=0))
        if pred is not None:
            nxt = pred.gather(1, cur[:, None])[:, 0]
            hit = (ch >= 0) & (ctok == nxt[:, None])
            found = hit.any(1)
            sel = ch.gather(1, hit.to(torch.int64).argmax(1, keepdim=True))[:, 0]
        else:
            p = target_probs(logits.gather(1, cur[:, None, None].expand(B, 1, V))[:, 0], temperature, top_p)
            found = torch.zeros(B, dtype=torch.bool, device=dev)
            sel = torch.zeros(B, dtype=torch.long, device=dev)
            for j in range(K):
                c, x = ch[:, j], ctok[:, j]
                trying = (c >= 0) & ~found
                take = trying & (u[:, lvl, j] < p.gather(1, x[:, None])[:, 0])
                drop = (trying & ~take)[:, None]
                q = p.scatter(1, x[:, None], 0.0)
                p = torch.where(drop, q / q.sum(-1, keepdim=True), p)
                sel = torch.where(take, c, sel)
                found = found | take
            nxt = sample_rows(p, u[:, lvl, K])
        found = found & ~done
        ends = ~found & ~done
        sel = sel.clamp(min=0)                                 # no child found: any row (unused)
        toks[:, lvl] = torch.where(found, vt.tokens.gather(1, sel[:, None])[:, 0], torch.where(ends, nxt, toks[:, lvl]))
        if lvl < steps:
            path[:, lvl] = torch.where(found, sel, path[:, lvl])
        a = a + found.long()
        cur = torch.where(found, sel, cur)
        done = done | ends
    return a, path, toks


def move_rows(cache: object, base: torch.Tensor, path: torch.Tensor, a: torch.Tensor) -> None:
    """Target KV after a tree verify: the accepted rows (verify rows path[:, :a], at cache rows
    base + row) move to rows base + 1 .. base + a, in every layer; the others are left past the
    length the caller sets. One gather and one scatter per layer for the whole batch."""
    kv = getattr(cache, "kv", None)
    if not kv:
        return
    table = cache.table
    B, S = path.shape
    j = torch.arange(1, S + 1, device=base.device).expand(B, S)
    dst = base.long()[:, None] + j
    src = torch.where(j <= a[:, None], base.long()[:, None] + path.clamp(min=0), dst)   # past a: onto itself
    ps = table.page_size

    def slot(rows: torch.Tensor) -> torch.Tensor:
        pages = table.bt.long().gather(1, (rows // ps).clamp(max=table.max_pages - 1))
        return (pages * ps + rows % ps).reshape(-1)

    s_src, s_dst = slot(src), slot(dst)
    for t in kv:
        t[s_dst // ps, s_dst % ps] = t[s_src // ps, s_src % ps].clone()
