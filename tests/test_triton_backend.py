"""The model on the kdsl kernels (backend="triton", interpreter on CPU) vs the torch backend.

The kernels compute in bf16, so the torch side runs with bf16 activations (dtype=torch.bfloat16, the
same rounding points): float32 vs bf16 would pick different experts for some tokens (REFERENCE §1).
Tolerance: logits 0.25 absolute, aux rows 0.25 + 5% (bf16 activations through 8 layers; logits ~5,
residual stream up to ~10). The torch side replays the kernels' expert choices (RoutingTrace). Kept to a few
tokens: the interpreter takes seconds per forward.
"""
from __future__ import annotations

import pytest
import torch

from models.eagle3 import Eagle3Draft
from models.kimi import KimiModel
from models.spec import Engine, SpecParams
from tests._model_fixtures import one_thread, tiny_pair

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    n = one_thread()
    tk, dk, _, _ = tiny_pair(tmp_path_factory.getbasetemp() / "models_fx")
    tri = (KimiModel(tk, backend="triton"), Eagle3Draft(dk, target_hidden=tk.config.hidden_size, backend="triton"))
    ref = (KimiModel(tk, backend="torch", dtype=torch.bfloat16),
           Eagle3Draft(dk, target_hidden=tk.config.hidden_size, backend="torch", dtype=torch.bfloat16))
    yield tri, ref
    torch.set_num_threads(n)


PROMPT = [[11, 42, 7, 300, 5]]


def test_triton_matches_torch_and_spec_is_lossless(models):
    from models.kimi import RoutingTrace

    (tm, td), (rm, rd) = models
    # prefill + 2 greedy decode steps on the kernels, recording the expert choices; the torch side
    # replays them (REFERENCE §1: a bf16 routing margin flip changes logits by whole units)
    rec = RoutingTrace("record")
    tm.routing = rec
    ct, cr = tm.new_cache(1, 16), rm.new_cache(1, 16)
    toks = list(PROMPT[0])
    steps_t, steps_r = [], []
    for _ in range(3):
        new = toks if not steps_t else [toks[-1]]
        a = tm.forward(ct, [(0, new)])
        steps_t.append(a)
        toks.append(int(a.logits[0][-1].argmax()))
    tm.routing = None
    rm.routing = RoutingTrace("replay", rec.log)
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

