"""The model on the kdsl kernels (backend="triton", interpreter on CPU) vs the torch backend.

The kernels compute in bf16, so the torch side runs with bf16 activations (dtype=torch.bfloat16, the
same rounding points): float32 vs bf16 would pick different experts for some tokens (REFERENCE §1).
Tolerance: logits 0.25 absolute, aux rows 0.25 + 5% (bf16 activations through 8 layers; logits ~5,
residual stream up to ~10). The torch side replays the kernels' expert choices (RoutingTrace). Kept to a few
tokens: the interpreter takes seconds per forward. The draft's tree steps (one layer, same inputs on
both sides) agree to 0.05 absolute (measured 0.016, one bf16 step at |logit| ~3), well below the
~0.2 that a wrong tree mask changes them by.
"""
from __future__ import annotations

import pytest
import torch

from models.eagle3 import Eagle3Draft
from models.kimi import KimiModel
from models.spec import Engine, SpecParams
from tests._model_fixtures import one_thread, tiny_pair, triton_greedy

# one worker runs this module and tests/test_mla_fused.py's model test (scripts/test.sh: --dist
# loadgroup): they share tests/_model_fixtures.triton_greedy, computed once per process
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("triton_greedy")]


ROOT = "models_fx"       # tiny_pair's directory under the session's base temp (shared with other modules)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    n = one_thread()
    tk, dk, _, _ = tiny_pair(tmp_path_factory.getbasetemp() / ROOT)
    tri = tiny_pair(tmp_path_factory.getbasetemp() / ROOT, "triton")[2:]
    ref = (KimiModel(tk, backend="torch", dtype=torch.bfloat16),
           Eagle3Draft(dk, target_hidden=tk.config.hidden_size, backend="torch", dtype=torch.bfloat16))
    yield tri, ref
    torch.set_num_threads(n)


PROMPT = [[11, 42, 7, 300, 5]]


@pytest.fixture(scope="module")
def greedy(models, tmp_path_factory):
    """Prefill + 2 greedy decode steps on the kernels, expert choices recorded (one run per process,
    shared with tests/test_mla_fused.py: tests/_model_fixtures.triton_greedy)."""
    return triton_greedy(tmp_path_factory.getbasetemp() / ROOT, PROMPT[0])


def test_triton_matches_torch_and_spec_is_lossless(models, greedy):
    from models.kimi import RoutingTrace

    (tm, td), (rm, rd) = models
    # prefill + 2 greedy decode steps on the kernels (`greedy`), recording the expert choices; the torch
    # side replays them (REFERENCE §1: a bf16 routing margin flip changes logits by whole units)
    assert greedy.model is tm
    steps_t, toks = greedy.outputs, greedy.tokens
    cr = rm.new_cache(1, 16)
    steps_r = []
    rm.routing = RoutingTrace("replay", greedy.routing)
    toks_r = list(PROMPT[0])
    for i in range(3):
        new = toks_r if i == 0 else [toks_r[-1]]
        b = rm.forward(cr, [(0, new)])
        steps_r.append(b)
        toks_r.append(int(b.logits[0][-1].argmax()))
    rm.routing = None
    assert toks_r == toks                                   # same greedy tokens
    for a, b in zip(steps_t, steps_r):
        torch.testing.assert_close(a.logits[0], b.logits[0], atol=0.25, rtol=0)
        torch.testing.assert_close(a.aux[0].float(), b.aux[0].float(), atol=0.25, rtol=0.05)
    # draft on the kernels vs torch, same aux input
    aux = steps_r[0].aux[0]
    da = td.forward(td.new_cache(1, 16), [(0, PROMPT[0][1:] + [toks[5]], aux)])[0][0]
    db = rd.forward(rd.new_cache(1, 16), [(0, PROMPT[0][1:] + [toks[5]], aux)])[0][0]
    torch.testing.assert_close(da, db, atol=0.25, rtol=0)
    # greedy spec decoding on the kernels == plain greedy on the kernels (the loop above is plain
    # greedy: prefill + 2 decode steps)
    spec_t = Engine(tm, td).generate(PROMPT, 3, "spec", SpecParams(steps=2))
    assert spec_t.outputs[0] == toks[len(PROMPT[0]):]



def _draft_tree_steps(d, aux, ancestors):
    """Prefill the draft, then two tree steps with explicit views: 2 frontier rows at depth 1, then 3
    rows at depth 2 whose ancestor among the depth-1 rows is `ancestors[r]` (the carried inputs stay
    fixed, so only the mask differs between calls). Returns the depth-2 logits."""
    c = d.new_cache(1, 32)
    _, y0 = d.forward(c, [(0, PROMPT[0][1:] + [9], aux)])[0]
    L = len(PROMPT[0])
    v1 = torch.zeros(2, L + 2, dtype=torch.bool)
    v1[:, :L] = True
    v1[0, L] = v1[1, L + 1] = True
    _, y1 = d.forward(c, [(0, [20, 30], torch.cat([y0[-1:], y0[-1:]]))], [([L, L], v1)])[0]
    v2 = torch.zeros(3, L + 5, dtype=torch.bool)
    v2[:, :L] = True
    for r, a in enumerate(ancestors):
        v2[r, L + a] = v2[r, L + 2 + r] = True       # its ancestor (with its sibling in between) and itself
    return d.forward(c, [(0, [40, 50, 60], torch.cat([y1[:1], y1[1:], y1[1:]]))], [([L + 1] * 3, v2)])[0][0]


def test_triton_draft_tree_step_matches_torch(models):
    """Draft tree attention on the paged MHA tree kernel == the torch draft, and the mask matters."""
    (_, td), (rm, rd) = models
    aux = rm.forward(rm.new_cache(1, 16), [(0, PROMPT[0])]).aux[0]
    tri = _draft_tree_steps(td, aux, [0, 1, 1])
    torch.testing.assert_close(tri, _draft_tree_steps(rd, aux, [0, 1, 1]), atol=0.05, rtol=0)
    swapped = _draft_tree_steps(td, aux, [1, 0, 0])
    assert bool(((tri - swapped).abs().amax(-1) > 0.1).all())


# one case per test so that the suite's workers share them (each is a minute on the interpreter)
@pytest.mark.parametrize("topk,steps,n", [(2, 3, None), (3, 2, 7), (4, 2, 8)])
def test_triton_tree_spec_is_lossless(models, greedy, topk, steps, n):
    """Greedy tree spec decoding (topk 2, 3, 4; draft and verify with tree masks on the kernels) ==
    plain greedy decoding on the kernels (`greedy`: prefill + 2 decode steps), token for token."""
    (tm, td), _ = models
    r = Engine(tm, td).generate(PROMPT, 3, "spec", SpecParams(steps=steps, topk=topk, draft_tokens=n))
    assert r.outputs == [greedy.tokens[len(PROMPT[0]):]], (topk, steps, n)
