"""Speculative decoding engine: lossless vs plain greedy, accept lengths with scripted drafts, KV state.

torch backend, float32; KV rows compared at 1e-4 absolute.
"""
from __future__ import annotations

import pytest
import torch

from models.kv_cache import PageTable
from models.spec import Engine, SpecParams
from tests._model_fixtures import one_thread, tiny_mla_draft, tiny_pair

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 41)), [100], [7, 300, 12, 44, 91, 2, 18, 250]]
MAX_NEW = 14


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    n = one_thread()
    yield tiny_pair(tmp_path_factory.getbasetemp() / "models_fx")
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def plain(pair):
    _, _, m, d = pair
    return Engine(m, d).generate(PROMPTS, MAX_NEW, "plain")


class _Cache:
    def __init__(self, batch: int, max_tokens: int, page_size: int):
        self.table = PageTable(batch, batch * (max_tokens // page_size + 1) + 1, page_size)
        self.kv: list = []                  # no KV rows to move after a tree verify


class ScriptedDraft:
    """A stub draft that knows the target's greedy continuation: the row at position p predicts the
    token at p + 2 (right, or deliberately wrong)."""

    def __init__(self, refs: list[list[int]], vocab: int, wrong: bool = False):
        self.refs, self.V, self.wrong = refs, vocab, wrong

    def new_cache(self, batch, max_tokens, page_size=16):
        return _Cache(batch, max_tokens, page_size)

    def to_target(self, ids):
        return ids

    second = False       # the right token only as the second choice (tree drafting finds it)
    conf = 1.0           # logit of the predicted token (others 0)

    def forward(self, cache, batch, views=None):
        out = []
        for i, (b, toks, hid) in enumerate(batch):
            start = cache.table.lengths[b]
            n = len(toks)
            cache.table.append(b, n)
            pos = list(range(start, start + n)) if views is None or views[i] is None else list(views[i][0])
            lg = torch.zeros(n, self.V)
            for r in range(n):
                p = pos[r] + 2
                t = self.refs[b][p] if p < len(self.refs[b]) else 0
                if self.second:
                    lg[r, t] = 1.0
                    lg[r, (t + 1) % self.V] = 2.0
                else:
                    lg[r, (t + 1) % self.V if self.wrong else t] = self.conf
            out.append((lg, torch.zeros(n, 4)))
        return out


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_spec_equals_plain(pair, plain, k):
    _, _, m, d = pair
    r = Engine(m, d).generate(PROMPTS, MAX_NEW, "spec", SpecParams(steps=k))
    assert r.outputs == plain.outputs
    met = r.metrics
    assert 1.0 <= met.accept_length <= k + 1
    assert sum(met.histogram) == met.steps and len(met.per_position_acceptance) == k
    assert met.committed == sum(len(o) for o in r.outputs) - len(PROMPTS)   # prefill token excluded


@pytest.mark.parametrize("k", [1, 2, 3])
def test_oracle_draft_gives_k_plus_1(pair, plain, k):
    """A draft that copies the target's greedy predictions: every draft accepted, accept length k+1."""
    _, _, m, _ = pair
    refs = [p + o for p, o in zip(PROMPTS, plain.outputs)]
    n_new = 1 + 3 * (k + 1)                          # prefill token + 3 full verify steps
    r = Engine(m, ScriptedDraft(refs, m.vocab_size)).generate(PROMPTS, n_new, "spec", SpecParams(steps=k))
    assert r.outputs == [o[:n_new] for o in plain.outputs]
    met = r.metrics
    assert met.accept_length == k + 1 and met.acceptance_rate == 1.0
    assert met.per_position_acceptance == [1.0] * k and met.histogram[k] == met.steps == 3 * len(PROMPTS)
    assert met.target_forwards_per_token == 1 / (k + 1)


def test_wrong_draft_accepts_nothing(pair, plain):
    _, _, m, _ = pair
    refs = [p + o for p, o in zip(PROMPTS, plain.outputs)]
    r = Engine(m, ScriptedDraft(refs, m.vocab_size, wrong=True)).generate(PROMPTS, MAX_NEW, "spec", SpecParams(steps=3))
    assert r.outputs == plain.outputs
    assert r.metrics.accept_length == 1.0 and r.metrics.acceptance_rate == 0.0
    assert r.metrics.histogram[0] == r.metrics.steps


def test_kv_after_rejections_equals_fresh_prefill(pair, plain):
    """Half-right draft (forces partial accepts); then every visible target and draft row equals a
    fresh prefill of the committed tokens."""
    _, _, m, d = pair
    refs = [p + o for p, o in zip(PROMPTS, plain.outputs)]

    class Half(ScriptedDraft):
        def forward(self, cache, batch, views=None):
            out = super().forward(cache, batch, views)
            for (b, toks, _), (lg, _) in zip(batch, out):
                start = cache.table.lengths[b] - len(toks)
                for r in range(len(toks)):
                    if (start + r) % 3 == 0:       # wrong at every third position
                        lg[r] = lg[r].roll(1)
            return out

    r = Engine(m, Half(refs, m.vocab_size)).generate(PROMPTS, MAX_NEW, "spec", SpecParams(steps=3))
    assert r.outputs == plain.outputs
    assert 1.0 < r.metrics.accept_length < 4.0
    tc = r.target_cache
    for b, (p, o) in enumerate(zip(PROMPTS, r.outputs)):
        seq = p + o
        n = min(tc.table.lengths[b], len(seq) - 1)
        assert n >= len(seq) - 1 - 0     # every committed token but the last root is cached
        fresh = m.new_cache(1, len(seq))
        m.forward(fresh, [(0, seq[:n])])
        for layer in range(m.cfg.num_hidden_layers):
            torch.testing.assert_close(tc.rows(layer, b, n), fresh.rows(layer, 0), atol=1e-4, rtol=0)


def test_real_draft_kv_after_rejections(pair, plain):
    """With the real draft: draft cache rows equal a fresh draft prefill over the committed tokens."""
    _, _, m, d = pair
    r = Engine(m, d).generate(PROMPTS[:2], MAX_NEW, "spec", SpecParams(steps=3))
    assert r.outputs == plain.outputs[:2]
    dc = r.draft_cache
    for b, (p, o) in enumerate(zip(PROMPTS, r.outputs)):
        seq = p + o
        n = dc.table.lengths[b]
        assert 0 < n <= len(seq) - 1
        t = m.forward(m.new_cache(1, len(seq)), [(0, seq[:n])])
        fresh = d.new_cache(1, len(seq))
        d.forward(fresh, [(0, seq[1:n + 1], t.aux[0])])
        for a, bb in zip(dc.rows(0, b, n), fresh.rows(0, 0)):
            torch.testing.assert_close(a, bb, atol=1e-4, rtol=0)


def test_eos_stops_sequence(pair, plain):
    _, _, m, d = pair
    eos = plain.outputs[0][3]
    r = Engine(m, d).generate(PROMPTS, MAX_NEW, "spec", SpecParams(steps=2), eos_id=eos)
    out0 = r.outputs[0]
    assert out0 == plain.outputs[0][: plain.outputs[0].index(eos) + 1]
    for o, po in zip(r.outputs, plain.outputs):
        cut = po.index(eos) + 1 if eos in po else len(po)
        assert o == po[:cut]


def test_bad_params(pair):
    _, _, m, d = pair
    e = Engine(m, d)
    with pytest.raises(ValueError, match="top-p"):
        e.generate(PROMPTS, 4, "spec", SpecParams(steps=3, topk=2, temperature=0.5, top_p=0.0))
    with pytest.raises(ValueError, match="draft-tokens must be in"):
        e.generate(PROMPTS, 4, "spec", SpecParams(steps=2, topk=2, draft_tokens=9))
    with pytest.raises(ValueError, match="temperature"):
        e.generate(PROMPTS, 4, "spec", SpecParams(temperature=-1.0))
    with pytest.raises(ValueError, match="draft-tokens"):
        e.generate(PROMPTS, 4, "spec", SpecParams(steps=3, draft_tokens=7))
    with pytest.raises(ValueError, match="steps"):
        e.generate(PROMPTS, 4, "spec", SpecParams(steps=0))
    with pytest.raises(ValueError, match="at least one token"):
        e.generate([[]], 4, "plain")


class BigramTarget:
    """A stub target whose next-token distribution depends only on the current token (table [V, V])."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def new_cache(self, batch, max_tokens, page_size=16):
        return _Cache(batch, max_tokens, page_size)

    def forward(self, cache, batch, trees=None):
        """Logits depend on the token alone, so a tree mask changes nothing (positions ignored)."""
        class Out:
            pass
        o = Out()
        o.logits, o.aux = [], []
        for b, toks in batch:
            cache.table.append(b, len(toks))
            o.logits.append(self.table[torch.tensor(list(toks))])
            o.aux.append(torch.zeros(len(toks), 3))
        return o


class FixedDraft(ScriptedDraft):
    """Deterministic proposals that are sometimes right: token (position * 3) % V."""

    def forward(self, cache, batch, views=None):
        out = []
        for b, toks, hid in batch:
            start = cache.table.lengths[b]
            cache.table.append(b, len(toks))
            lg = torch.zeros(len(toks), self.V)
            for r in range(len(toks)):
                lg[r, ((start + r) * 3) % self.V] = 1.0
            out.append((lg, torch.zeros(len(toks), 4)))
        return out


class TreeDraft(ScriptedDraft):
    """Deterministic draft logits whose top-k order changes with the row's position (tree-aware:
    positions come from the views when given): logit of token v at position p = (3p + 5v) % V."""

    def forward(self, cache, batch, views=None):
        out = []
        for i, (b, toks, hid) in enumerate(batch):
            start = cache.table.lengths[b]
            n = len(toks)
            cache.table.append(b, n)
            pos = range(start, start + n) if views is None or views[i] is None else [int(x) for x in views[i][0]]
            v = torch.arange(self.V)
            out.append((torch.stack([((3 * p + 5 * v) % self.V).float() for p in pos]), torch.zeros(n, 4)))
        return out


def _chi2_check(emp: torch.Tensor, exact: torch.Tensor, n: int, what) -> None:
    """Pearson chi-square of counts `emp` against probabilities `exact` below its 0.999 quantile
    (Wilson-Hilferty), and no count where the exact probability is 0."""
    E = exact * n
    pos = E > 0
    assert emp[~pos].sum() == 0, f"{what}: a token of probability 0 (outside the top-p nucleus) was generated"
    chi2 = float(((emp[pos] - E[pos]) ** 2 / E[pos]).sum())
    dof = int(pos.sum()) - 1
    z = 3.09                                            # Wilson-Hilferty 0.999 quantile of chi2(dof)
    q999 = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < q999, (what, chi2, q999)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("params", [SpecParams(steps=2), SpecParams(steps=2, topk=2), SpecParams(steps=2, topk=3, draft_tokens=6)],
                         ids=["chain", "tree2", "tree3"])
def test_sampled_acceptance_preserves_target_distribution(top_p, params):
    """Spec sampling over a bigram target, chain (k=2, FixedDraft) and trees (TreeDraft, topk 2 and
    3): the joint law of 3 generated tokens matches the exact one: Pearson chi-square over the 64
    cells below its 0.999 quantile (fixed seeds, 3000 sequences), and cells outside the top-p
    nucleus never occur. Plain sampling is checked against the same law."""
    from models.spec import target_probs

    V, T, N = 4, 0.9, 3000
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 1.5
    P = torch.stack([target_probs(table[i], T, top_p) for i in range(V)])   # [V, V] transition law
    prompt = [1]
    exact = torch.zeros(V, V, V, dtype=torch.float64)
    for a in range(V):
        for b in range(V):
            for c in range(V):
                exact[a, b, c] = P[prompt[-1], a] * P[a, b] * P[b, c]
    draft = FixedDraft([], V) if params.topk == 1 else TreeDraft([], V)
    eng = Engine(BigramTarget(table), draft)
    sp = SpecParams(steps=params.steps, topk=params.topk, draft_tokens=params.draft_tokens, temperature=T, top_p=top_p)
    for mode in ("spec", "plain"):
        r = eng.generate([prompt] * N, 3, mode, sp, seed=1)
        emp = torch.zeros(V, V, V, dtype=torch.float64)
        for o in r.outputs:
            emp[o[0], o[1], o[2]] += 1
        _chi2_check(emp, exact, N, mode)
        if mode == "spec":
            assert 0.0 < r.metrics.acceptance_rate < 1.0     # both branches (accept / resample) exercised


def test_sample_tree_accept_one_node_law():
    """One step of sampled tree acceptance at a root with 3 candidate children (tried in order):
    the committed first token is distributed as the target row p, each child is accepted with its
    exact probability (p(x1), (1 - p(x1)) * p(x2) / (1 - p(x1)), ...), and an accepted child's bonus
    comes from the child's own row. 20000 draws, chi-square below its 0.999 quantile."""
    from models.spec import sample_tree_accept, target_probs

    V, T, N = 6, 1.0, 20000
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g) * 1.2          # rows: root, children 1..3
    children = [[1, 2, 3], [], [], []]
    tokens = [-1, int(logits[0].argmax()), 4, int(logits[0].argmin())]
    if len(set(tokens[1:])) < 3:
        tokens[2] = next(t for t in range(V) if t not in tokens)
    rng = torch.Generator().manual_seed(7)
    first = torch.zeros(V, dtype=torch.float64)
    pairs = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(N):
        path, nxt = sample_tree_accept(logits, children, tokens, T, 1.0, rng)
        seq = [tokens[r] for r in path] + [nxt]
        first[seq[0]] += 1
        if path:
            pairs[seq[0], seq[1]] += 1
    p = target_probs(logits[0], T, 1.0)
    _chi2_check(first, p, N, "first token")
    # after an accepted child c, the next token follows the child's row
    for r in (1, 2, 3):
        x = tokens[r]
        n = int(pairs[x].sum())
        assert n > 200, (x, n)
        _chi2_check(pairs[x], target_probs(logits[r], T, 1.0), n, f"bonus after child {r}")


@pytest.mark.parametrize("topk,steps,n", [(2, 3, None), (3, 2, 6), (4, 3, 8)])
def test_tree_greedy_equals_plain(pair, plain, topk, steps, n):
    _, _, m, d = pair
    r = Engine(m, d).generate(PROMPTS, MAX_NEW, "spec", SpecParams(steps=steps, topk=topk, draft_tokens=n))
    assert r.outputs == plain.outputs


def test_tree_finds_second_choices_and_keeps_kv_consistent(pair, plain):
    """A draft whose right token is only its 2nd choice: chain accepts nothing, a topk-2 tree accepts
    2 per step (the right path R, RR is in the 7-node tree); output stays exact and the target KV
    rows (accepted rows moved to their positions) equal a fresh prefill."""
    _, _, m, _ = pair
    refs = [p + o for p, o in zip(PROMPTS, plain.outputs)]
    sd = ScriptedDraft(refs, m.vocab_size)
    sd.second = True
    chain = Engine(m, sd).generate(PROMPTS, MAX_NEW, "spec", SpecParams(steps=3))
    assert chain.outputs == plain.outputs and chain.metrics.accept_length == 1.0
    r = Engine(m, sd).generate(PROMPTS, MAX_NEW, "spec", SpecParams(steps=3, topk=2, draft_tokens=7))
    assert r.outputs == plain.outputs
    assert r.metrics.accept_length > 2.5
    tc = r.target_cache
    for b, (p, o) in enumerate(zip(PROMPTS, r.outputs)):
        seq = p + o
        n = min(tc.table.lengths[b], len(seq) - 1)
        fresh = m.new_cache(1, len(seq))
        m.forward(fresh, [(0, seq[:n])])
        for layer in range(m.cfg.num_hidden_layers):
            torch.testing.assert_close(tc.rows(layer, b, n), fresh.rows(layer, 0), atol=1e-4, rtol=0)


def test_tree_oracle_accepts_full_depth(pair, plain):
    _, _, m, _ = pair
    refs = [p + o for p, o in zip(PROMPTS, plain.outputs)]
    sd = ScriptedDraft(refs, m.vocab_size)
    sd.conf = 20.0                      # confident: the all-right path has the best scores
    r = Engine(m, sd).generate(PROMPTS, 13, "spec", SpecParams(steps=3, topk=2, draft_tokens=6))
    assert r.outputs == [o[:13] for o in plain.outputs]
    assert r.metrics.accept_length == 4.0


@pytest.mark.parametrize("params", [SpecParams(steps=3), SpecParams(steps=2, topk=3, draft_tokens=6)])
def test_mla_draft_spec_equals_plain(pair, plain, params, tmp_path_factory):
    tk, _, m, _ = pair
    d = tiny_mla_draft(tmp_path_factory.getbasetemp() / "models_fx", tk)
    r = Engine(m, d).generate(PROMPTS, MAX_NEW, "spec", params)
    assert r.outputs == plain.outputs


def test_accept_length_counts_truncated_verify_commits(pair, plain):
    """An oracle draft accepts all k=3 drafts every step, so each verify commits 4 tokens; with
    max_new_tokens = 1 + 4 + 4 + 2 the last step's output is cut to 2, yet the step committed 4:
    accept length is the histogram's mean + 1 = 4.0 (counting output tokens would give 3.33)."""
    _, _, m, _ = pair
    refs = [p + o for p, o in zip(PROMPTS, plain.outputs)]
    r = Engine(m, ScriptedDraft(refs, m.vocab_size)).generate(PROMPTS, 11, "spec", SpecParams(steps=3))
    assert r.outputs == [o[:11] for o in plain.outputs]
    met = r.metrics
    assert met.histogram == [0, 0, 0, met.steps] and met.steps == 3 * len(PROMPTS)
    mean_hist = sum(i * c for i, c in enumerate(met.histogram)) / met.steps
    assert met.accept_length == mean_hist + 1 == 4.0
    assert met.committed == 10 * len(PROMPTS)              # output tokens after prefill: truncated


@pytest.mark.parametrize("mode,params", [("plain", SpecParams(temperature=0.8)),
                                         ("spec", SpecParams(steps=2, temperature=0.8))])
def test_sampling_per_request_is_batch_independent(pair, mode, params):
    """Request i samples from its own generator seeded from (seed, i): the same prompt at the same
    index gives the same sampled tokens alone or with other requests; another seed differs."""
    _, _, m, d = pair
    e = Engine(m, d)
    alone = e.generate([PROMPTS[0]], 8, mode, params, seed=7).outputs[0]
    batched = e.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]], 8, mode, params, seed=7).outputs[0]
    assert alone == batched
    others = [e.generate([PROMPTS[0]], 8, mode, params, seed=s).outputs[0] for s in (8, 9)]
    assert any(o != alone for o in others)


@pytest.mark.parametrize("mode,k", [("plain", 0), ("spec", 3)])
def test_static_graph_buffers_match_eager(pair, plain, mode, k):
    """The graph protocol run eagerly on CPU (StepGraphs 'static'): batch 3 padded to the bucket of 4,
    inputs copied into static buffers per (step, bucket, q_len); tokens identical to eager decoding."""
    _, _, m, d = pair
    e = Engine(m, d, graphs="static")
    r = e.generate(PROMPTS[:3], MAX_NEW, mode, SpecParams(steps=max(k, 1)))
    assert r.outputs == plain.outputs[:3]
    keys = set(e.last_graphs.entries)
    if mode == "plain":
        assert keys == {("target", 4, 1)}
    else:
        assert keys == {("draft", 4, 1), ("target", 4, k + 1), ("draft", 4, k + 1)}
    assert r.target_cache.table.batch == 4


def test_static_graph_buffers_tree(pair, plain):
    """Tree drafting through the graph protocol (StepGraphs 'static'): every draft step of the tree
    (window width fixed per step), the tree verify and the extension run on static buffers per key;
    tokens identical to plain decoding."""
    _, _, m, d = pair
    e = Engine(m, d, graphs="static")
    r = e.generate(PROMPTS[:3], MAX_NEW, "spec", SpecParams(steps=3, topk=2, draft_tokens=6))
    assert r.outputs == plain.outputs[:3]
    assert set(e.last_graphs.entries) == {("draft-tree", 4, 2, 1), ("draft-tree", 4, 2, 2), ("target-tree", 4, 6),
                                          ("draft", 4, 4)}
