"""Device tree drafting (models.spec_tree) against plain-Python walks of the same rules: the drafted
nodes, the verified tree (rows, depths, masks, child order), greedy and sampled acceptance, the KV
row moves. Random draft logits with ties and random target rows; batch rows checked one by one."""
from __future__ import annotations

import math

import pytest
import torch

from models.spec import greedy_tree_accept, target_probs
from models.spec_tree import accept, draft_tree, move_rows, pick_tree


def _random_tree(B: int, K: int, steps: int, V: int, seed: int):
    """draft_tree over a step function with random logits (a few exact ties); also returns every call."""
    g = torch.Generator().manual_seed(seed)
    calls = []

    def step(s, tokens, hidden, pos, win):
        calls.append((s, tokens.clone(), hidden.clone(), pos.clone(), win.clone()))
        lg = torch.randint(0, 6, (B, K, V), generator=g).float()        # small ints: ties happen
        return lg, torch.randn(B, K, 2, generator=g)

    root_lg = torch.randint(0, 6, (B, V), generator=g).float()
    carry = torch.randn(B, 2, generator=g)
    base = torch.tensor([5, 9, 2][:B])
    t = draft_tree(step, root_lg, carry, base, K, steps, lambda i: i + 1000)
    return t, calls, base


def _host_pick(t, b: int, n_tokens: int):
    """The verified tree by the rules stated in models.spec (lists): best N-1 by (-score, depth,
    index), closed under ancestors; rows by (depth, -score) stably; mask = root + ancestors + self."""
    sc, dp, par = t.score[b].tolist(), t.depth[b].tolist(), t.parent[b].tolist()
    order = sorted(range(len(sc)), key=lambda j: (-sc[j], dp[j], j))
    chosen: list[int] = []
    for j in order:
        path, p = [], j
        while p >= 0 and p not in chosen:
            path.append(p)
            p = par[p]
        if len(chosen) + len(path) <= n_tokens - 1:
            chosen.extend(path)
        if len(chosen) >= n_tokens - 1:
            break
    chosen.sort(key=lambda j: (dp[j], -sc[j]))
    idx = {j: r + 1 for r, j in enumerate(chosen)}
    n = len(chosen) + 1
    mask = [[c == 0 or c == r for c in range(n)] for r in range(n)]
    for j in chosen:
        p = par[j]
        while p >= 0:
            mask[idx[j]][idx[p]] = True
            p = par[p]
    children = [[] for _ in range(n)]
    for j in chosen:
        children[idx[par[j]] if par[j] >= 0 else 0].append(idx[j])
    toks = [-1] + [t.tok[b, j].item() for j in chosen]
    return toks, [0] + [dp[j] for j in chosen], mask, children


@pytest.mark.parametrize("K,steps,n_tokens", [(2, 3, 6), (3, 3, 9), (4, 2, 8), (3, 4, 30)])
def test_tree_pick_matches_the_host_rules(K, steps, n_tokens):
    B, V = 3, 7
    for seed in range(4):
        t, calls, base = _random_tree(B, K, steps, V, seed)
        assert t.tok.shape == (B, K + (steps - 1) * K * K)
        # every draft step: frontier positions = base + depth - 1, the window holds ancestors and self
        for s, toks, hid, pos, win in calls:
            assert win.shape == (B, K, K * s) and bool(win[:, torch.arange(K), K * (s - 1) + torch.arange(K)].all())
            assert bool((pos >= base[:, None]).all())
        root = torch.tensor([11, 12, 13])
        vt = pick_tree(t, root, n_tokens, K, steps)
        for b in range(B):
            toks, depths, mask, children = _host_pick(t, b, n_tokens)
            assert vt.tokens[b].tolist() == [int(root[b])] + toks[1:]
            assert vt.depths[b].tolist() == depths
            assert vt.mask[b].tolist() == mask
            for r, ch in enumerate(children):
                got = [c for c in vt.children[b, r].tolist() if c >= 0]
                assert got == ch, (seed, b, r)


def test_tree_draft_scores_are_path_sums():
    """A node's score is its parent's plus its own draft log-prob; the frontier of each step is the
    best K of that step's candidates (ties: lowest index)."""
    K, steps = 3, 3
    t, calls, _ = _random_tree(2, K, steps, 6, 5)
    par, sc, dp = t.parent, t.score, t.depth
    for b in range(2):
        for j in range(K, par.shape[1]):
            p = int(par[b, j])
            assert p >= 0 and int(dp[b, j]) == int(dp[b, p]) + 1 and float(sc[b, j]) <= float(sc[b, p])
    # step 2's frontier tokens are the best 3 of step 1's 9 candidates
    s2_tokens = calls[1][1]
    cand = sc[:, K:K + K * K]
    best = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :K] + K
    assert torch.equal(s2_tokens, t.tok.gather(1, best))


def test_greedy_accept_matches_host_walk():
    g = torch.Generator().manual_seed(1)
    K, steps, N, V = 3, 3, 9, 5
    t, _, _ = _random_tree(3, K, steps, V, 2)
    vt = pick_tree(t, torch.tensor([1, 2, 3]), N, K, steps)
    for trial in range(20):
        logits = torch.randn(3, N, V + 1000, generator=g)
        # make some target argmaxes follow the tree so paths of every length occur
        for b in range(3):
            for r in range(N):
                kids = [c for c in vt.children[b, r].tolist() if c >= 0]
                if kids and torch.rand((), generator=g) < 0.7:
                    c = kids[int(torch.randint(0, len(kids), (), generator=g))]
                    logits[b, r, int(vt.tokens[b, c])] = 50.0
        a, path, toks = accept(logits, vt, steps, 0.0, 1.0)
        pred = logits.argmax(-1)
        for b in range(3):
            children = [[c for c in vt.children[b, r].tolist() if c >= 0] for r in range(N)]
            hp, bonus = greedy_tree_accept(pred[b].tolist(), children, vt.tokens[b].tolist())
            assert int(a[b]) == len(hp) and path[b, :len(hp)].tolist() == hp
            assert toks[b, :len(hp) + 1].tolist() == [int(vt.tokens[b, r]) for r in hp] + [bonus]


def _host_sampled(logits, children, tokens, u, T, top_p, K):
    """The sampled walk of models.spec.sample_tree_accept, drawing u[level][j] for the j-th child tried
    and u[level][K] for the next token (inverse CDF)."""
    path, cur, lvl = [], 0, 0
    while True:
        p = target_probs(logits[cur], T, top_p).clone()
        nxt = None
        for j, c in enumerate(children[cur]):
            x = tokens[c]
            if float(u[lvl][j]) < float(p[x]):
                nxt = c
                break
            p[x] = 0.0
            p = p / p.sum()
        if nxt is None:
            cdf = p.cumsum(0)
            return path, int(torch.searchsorted(cdf, (u[lvl][K] * cdf[-1]).reshape(1), right=True).clamp(max=len(p) - 1))
        path.append(nxt)
        cur, lvl = nxt, lvl + 1


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_sampled_accept_matches_host_walk_on_the_same_uniforms(top_p):
    g = torch.Generator().manual_seed(4)
    K, steps, N, V, T = 2, 3, 6, 4, 0.8
    t, _, _ = _random_tree(3, K, steps, V, 7)
    vt = pick_tree(t, torch.tensor([0, 1, 2]), N, K, steps)
    tok = vt.tokens - 1000
    tok[:, 0] = 0
    vt.tokens = tok.clamp(min=0)                           # target ids inside a V-token vocabulary
    lengths = set()
    for trial in range(40):
        logits = torch.randn(3, N, V, generator=g) * 2
        u = torch.rand(3, steps + 1, K + 1, generator=g, dtype=torch.float64)
        a, path, toks = accept(logits, vt, steps, T, top_p, u)
        for b in range(3):
            children = [[c for c in vt.children[b, r].tolist() if c >= 0] for r in range(N)]
            hp, nxt = _host_sampled(logits[b], children, vt.tokens[b].tolist(), u[b], T, top_p, K)
            assert int(a[b]) == len(hp) and path[b, :len(hp)].tolist() == hp, (trial, b)
            assert int(toks[b, len(hp)]) == nxt
            lengths.add(len(hp))
    assert len(lengths) >= 2                               # accepting and rejecting both exercised


def test_move_rows_moves_the_accepted_rows_only():
    class Table:
        page_size, max_pages = 4, 4

        def __init__(self):
            self.bt = torch.tensor([[3, 1, 0, 2], [5, 6, 4, 7]], dtype=torch.int32)

    class Cache:
        table = Table()
        kv = [torch.randn(8, 4, 3) for _ in range(2)]

    c = Cache()
    before = [k.clone() for k in c.kv]
    base = torch.tensor([2, 5])
    path = torch.tensor([[3, 5, -1], [2, 4, 7]])
    a = torch.tensor([2, 1])

    def row(kv, b, pos):
        return kv[int(c.table.bt[b, pos // 4]), pos % 4]

    move_rows(c, base, path, a)
    for k0, k1 in zip(before, c.kv):
        for b in range(2):
            for j in range(1, int(a[b]) + 1):               # row base + j now holds verify row path[j - 1]
                assert torch.equal(row(k1, b, int(base[b]) + j), row(k0, b, int(base[b]) + int(path[b, j - 1])))
        changed = (k0 != k1).any(-1).nonzero().tolist()
        want = {(int(c.table.bt[b, (int(base[b]) + j) // 4]), (int(base[b]) + j) % 4)
                for b in range(2) for j in range(1, int(a[b]) + 1)}
        assert {tuple(x) for x in changed} <= want
    assert math.isfinite(float(c.kv[0].sum()))
