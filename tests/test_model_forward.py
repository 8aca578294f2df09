"""Target (Kimi MLA + MoE) and EAGLE-3 draft forwards from the tiny fixtures, torch backend, float32.

Tolerances: float32 end to end, 1e-4 absolute on logits of magnitude ~5 (reassociation only).
"""
from __future__ import annotations

import pytest
import torch

from tests._model_fixtures import one_thread, tiny_mla_draft, tiny_pair

ATOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    n = one_thread()
    yield tiny_pair(tmp_path_factory.getbasetemp() / "models_fx")
    torch.set_num_threads(n)


def _tokens(n, seed, V):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n,), generator=g).tolist()


def test_prefill_equals_prefix_plus_decode(pair):
    _, _, m, _ = pair
    V = m.vocab_size
    a, b = _tokens(13, 1, V), _tokens(9, 2, V)
    c1 = m.new_cache(2, 32, page_size=4)            # small pages: rows span several pages
    full = m.forward(c1, [(0, a), (1, b)])
    c2 = m.new_cache(2, 32, page_size=4)
    m.forward(c2, [(1, b[:4]), (0, a[:6])])           # slots in another order, different prefix lengths
    step = m.forward(c2, [(0, a[6:9]), (1, b[4:5])])  # q_len 3 verify-like chunk (causal) + a decode row
    torch.testing.assert_close(step.logits[0], full.logits[0][6:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(step.logits[1], full.logits[1][4:5], atol=ATOL, rtol=0)
    for t in range(9, 13):
        o = m.forward(c2, [(0, [a[t]])])
        torch.testing.assert_close(o.logits[0][0], full.logits[0][t], atol=ATOL, rtol=0)
        torch.testing.assert_close(o.aux[0][0], full.aux[0][t], atol=ATOL, rtol=0)
    assert c2.table.lengths[0] == 13 and c2.table.lengths[1] == 5


def test_ragged_batch_equals_single(pair):
    _, _, m, _ = pair
    a, b = _tokens(7, 3, m.vocab_size), _tokens(11, 4, m.vocab_size)
    both = m.forward(m.new_cache(2, 16), [(0, a), (1, b)])
    sa = m.forward(m.new_cache(1, 16), [(0, a)])
    sb = m.forward(m.new_cache(1, 16), [(0, b)])
    torch.testing.assert_close(both.logits[0], sa.logits[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(both.logits[1], sb.logits[0], atol=ATOL, rtol=0)


def test_aux_capture_is_input_of_documented_layers(pair):
    """aux = residual stream ENTERING layers (2, N//2, N-3): replay the layers by hand and compare.
    Fails if capture is off by one (the neighbouring layers' inputs differ by whole units)."""
    _, _, m, _ = pair
    N, H = m.cfg.num_hidden_layers, m.hidden_size
    assert m.capture_ids == (2, N // 2, N - 3)
    toks = _tokens(6, 5, m.vocab_size)
    out = m.forward(m.new_cache(1, 8), [(0, toks)])
    from ops.rope import cos_sin

    from models.step import make_ctx

    cos, sin = cos_sin(torch.arange(6), m.cfg.qk_rope_head_dim, m.cfg.rope_theta, m.rope_scaling)
    cache = m.new_cache(1, 8)
    cache.table.reserve(0, 6)
    segs = make_ctx(cache.table, 1, 6)
    h = m.embed[torch.tensor(toks)]
    inputs = []
    for i, (n1, attn, n2, mlp) in enumerate(m.layers):
        inputs.append(h)                                # input of layer i
        h = h + attn(n1(h), cos, sin, cache, i, segs)
        h = h + mlp(n2(h))
    inputs.append(h)                                    # "input of layer N" = last layer output
    for j, lid in enumerate(m.capture_ids):
        got = out.aux[0][:, j * H:(j + 1) * H]
        torch.testing.assert_close(got, inputs[lid], atol=ATOL, rtol=0)
        for other in (lid - 1, lid + 1):                 # the test can tell neighbours apart
            assert (got - inputs[other]).abs().max() > 1e-2


def test_draft_prefill_equals_prefix_plus_steps(pair):
    """The draft's own paged cache: one pass over n rows == prefix + extension rows (shifted input)."""
    _, _, m, d = pair
    toks = _tokens(12, 6, m.vocab_size)
    tout = m.forward(m.new_cache(1, 16), [(0, toks)])
    aux = tout.aux[0]
    full = d.forward(d.new_cache(1, 16, page_size=4), [(0, toks[1:], aux[:-1])])[0]
    dc = d.new_cache(1, 16, page_size=4)
    d.forward(dc, [(0, toks[1:6], aux[:5])])
    ext = d.forward(dc, [(0, toks[6:9], aux[5:8])])[0]
    torch.testing.assert_close(ext[0], full[0][5:8], atol=ATOL, rtol=0)
    torch.testing.assert_close(ext[1], full[1][5:8], atol=ATOL, rtol=0)
    # a carried (H-wide) hidden state goes through the same midlayer without fc
    lg, y = d.forward(dc, [(0, [toks[9]], ext[1][-1:])])[0]
    assert lg.shape == (1, d.cfg.draft_vocab_size) and y.shape == (1, d.cfg.hidden_size)
    ids = d.to_target(lg.argmax(-1))
    assert 0 <= int(ids.min()) and int(ids.max()) < m.vocab_size


def test_draft_rejects_bad_hidden_width(pair):
    _, _, _, d = pair
    with pytest.raises(ValueError, match="hidden width"):
        d.forward(d.new_cache(1, 8), [(0, [1, 2], torch.zeros(2, 5))])


def test_mla_draft_prefill_equals_prefix_plus_steps(pair, tmp_path_factory):
    """The MLA midlayer draft (eagle3-mla) over its own latent cache, same shifted-input contract."""
    tk, _, m, _ = pair
    d = tiny_mla_draft(tmp_path_factory.getbasetemp() / "models_fx", tk)
    assert d.cfg.kind == "mla"
    toks = _tokens(12, 7, m.vocab_size)
    aux = m.forward(m.new_cache(1, 16), [(0, toks)]).aux[0]
    full = d.forward(d.new_cache(1, 16, page_size=4), [(0, toks[1:], aux[:-1])])[0]
    dc = d.new_cache(1, 16, page_size=4)
    d.forward(dc, [(0, toks[1:6], aux[:5])])
    ext = d.forward(dc, [(0, toks[6:9], aux[5:8])])[0]
    torch.testing.assert_close(ext[0], full[0][5:8], atol=ATOL, rtol=0)
    torch.testing.assert_close(ext[1], full[1][5:8], atol=ATOL, rtol=0)
