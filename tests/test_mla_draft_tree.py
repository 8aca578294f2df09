"""Tree drafting with the MLA-midlayer EAGLE-3 draft (eagle3-mla fixture) on the triton backend.

A draft tree step attends with a window [B, q_len, TW > q_len] over its last TW cached rows (the
earlier tree levels are in the cache); on the triton backend that runs `mla_decode_split_tree`
through the fused MLA path. The target stays on the torch backend (float32) to keep this fast; the
target's own tree verify on the kernels is tests/test_triton_backend.py's.
Tolerance of a draft tree step against the torch draft in bf16: 0.03 absolute on the logits
(measured 0.016: one bf16 layer at |logit| ~1); moving a row's ancestor to its sibling changes
that row's logits by 0.06 to 0.2, which the test requires to exceed 3x the measured difference.
"""
from __future__ import annotations

import pytest
import torch

from models.eagle3 import Eagle3Draft
from models.loader import load_draft
from models.spec import Engine, SpecParams
from tests._model_fixtures import one_thread, tiny_mla_draft, tiny_pair
from tests.host_reads import HostReadProbe, summary
from tests.test_triton_backend import PROMPT, _draft_tree_steps


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    n = one_thread()
    root = tmp_path_factory.getbasetemp() / "models_fx"
    tk, _, m, _ = tiny_pair(root)
    torch_draft = tiny_mla_draft(root, tk)
    dk = load_draft(root / "eagle3-mla", tk.config)
    assert dk.config.kind == "mla"
    hid = tk.config.hidden_size
    tri = Eagle3Draft(dk, target_hidden=hid, backend="triton")
    bf16 = Eagle3Draft(dk, target_hidden=hid, backend="torch", dtype=torch.bfloat16)
    yield m, torch_draft, tri, bf16
    torch.set_num_threads(n)


@pytest.mark.slow
def test_mla_draft_tree_step_matches_torch(fx):
    """Two tree steps (the second's window covers the first's rows, siblings between ancestors):
    the kernels == the torch draft, and which earlier row is the ancestor matters."""
    m, _, tri, bf16 = fx
    aux = m.forward(m.new_cache(1, 16), [(0, PROMPT[0])]).aux[0]
    got = _draft_tree_steps(tri, aux, [0, 1, 1])
    ref = _draft_tree_steps(bf16, aux, [0, 1, 1])
    torch.testing.assert_close(got, ref, atol=0.03, rtol=0)
    swapped = _draft_tree_steps(tri, aux, [1, 0, 0])
    torch.testing.assert_close(swapped, _draft_tree_steps(bf16, aux, [1, 0, 0]), atol=0.03, rtol=0)
    err = (got - ref).abs().amax(-1)
    assert bool(((got - swapped).abs().amax(-1) > 3 * err).all())


def test_mla_draft_tree_step_reads_nothing(fx):
    """The draft tree step on the kernels makes no device->host read (graph-capturable)."""
    _, _, tri, _ = fx
    dc = tri.new_cache(2, 40)
    dc.table.reserve_all(40)
    H3 = 3 * tri.target_hidden
    g = torch.Generator().manual_seed(0)
    tri.forward(dc, [(0, [2, 3, 4, 9], torch.randn(4, H3, generator=g)),
                     (1, [6, 7, 8, 9], torch.randn(4, H3, generator=g))])
    T = lambda rows: torch.tensor(rows, dtype=torch.long, device=tri.device)  # noqa: E731
    h = torch.randn(2, 2, tri.cfg.hidden_size, generator=g).to(tri.device)
    win = torch.ones(2, 2, 3, dtype=torch.bool, device=tri.device)
    win[:, 0, 2] = win[:, 1, 1] = False                       # two siblings: each sees its parent and itself
    t2, p2 = T([[7, 8], [7, 8]]), T([[5, 5], [5, 5]])
    with HostReadProbe(raise_on=("models", "kdsl", "other")) as p:
        lg, _ = tri.step(dc, t2, h, window=win, positions=p2)
    assert not p.events, summary(p.events)
    assert lg.shape[:2] == (2, 2) and bool(lg.isfinite().all())


@pytest.mark.slow
def test_mla_draft_tree_spec_on_triton_is_lossless(fx):
    """Greedy tree spec decoding (topk 3, two draft steps, 7 nodes: the second step's window spans
    the first level) with the MLA draft on the kernels == the same with the torch draft == plain
    greedy decoding, token for token, over a batch of two."""
    m, torch_draft, tri, _ = fx
    prompts = [PROMPT[0], [3, 4, 5]]
    plain = Engine(m, torch_draft).generate(prompts, 4, "plain").outputs
    p = SpecParams(steps=2, topk=3, draft_tokens=7)
    got = Engine(m, tri).generate(prompts, 4, "spec", p)
    assert got.outputs == Engine(m, torch_draft).generate(prompts, 4, "spec", p).outputs == plain
    assert got.metrics.steps > 0
