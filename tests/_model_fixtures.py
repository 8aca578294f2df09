"""Shared tiny target + draft for the model / engine tests (written once per session), and the
interpreter runs that several tests check (computed once per process: each forward of the tiny
target on the kernels takes tens of seconds on the interpreter)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from models.eagle3 import Eagle3Draft
from models.fixtures import write_fixture
from models.kimi import KimiModel
from models.loader import load_draft, load_target

_CACHE: dict = {}


def tiny_pair(root, backend: str = "torch"):
    """(target checkpoint, draft checkpoint, KimiModel, Eagle3Draft) from the kimi-k25 + eagle3 fixtures."""
    key = (str(root), backend)
    if key not in _CACHE:
        t = root / "kimi-k25"
        d = root / "eagle3"
        if not (t / "config.json").exists():
            write_fixture("kimi-k25", t, seed=0)
            write_fixture("eagle3", d, seed=1)
        tk = load_target(t)
        dk = load_draft(d, tk.config)
        _CACHE[key] = (tk, dk, KimiModel(tk, backend=backend), Eagle3Draft(dk, target_hidden=tk.config.hidden_size,
                                                                          backend=backend))
    return _CACHE[key]


def one_thread():
    """Tiny models are dominated by thread overhead on a loaded 2-core box: compute single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    return n


def tiny_mla_draft(root, target_ck, backend: str = "torch"):
    """The eagle3-mla fixture (MLA midlayer) as an Eagle3Draft for the tiny target."""
    key = (str(root), "mla", backend)
    if key not in _CACHE:
        d = root / "eagle3-mla"
        if not (d / "config.json").exists():
            write_fixture("eagle3-mla", d, seed=2)
        dk = load_draft(d, target_ck.config)
        _CACHE[key] = Eagle3Draft(dk, target_hidden=target_ck.config.hidden_size, backend=backend)
    return _CACHE[key]


def triton_greedy(root, prompt: list[int], steps: int = 3) -> SimpleNamespace:
    """Greedy decoding of `prompt` by the default triton target of `tiny_pair(root, "triton")`: the
    prefill and steps - 1 single-token decode steps through `forward`, on a NaN-poisoned cache (every
    row a step reads must have been written), the expert choices recorded (models.kimi.RoutingTrace).
    Fields: model, cache, outputs (one TargetOutput per forward), tokens (prompt + the steps greedy
    tokens), routing (the recorded log, in call order). tests/test_triton_backend.py checks it against
    the torch backend and against spec decoding, tests/test_mla_fused.py against the unfused MLA ops;
    read-only for its users."""
    from models.kimi import RoutingTrace

    key = (str(root), "greedy", tuple(prompt), steps)
    if key not in _CACHE:
        m = tiny_pair(root, "triton")[2]
        rec = RoutingTrace("record")
        m.routing = rec
        try:
            c = m.new_cache(1, 16)
            for kv in c.kv:
                kv.fill_(float("nan"))
            toks, outs = list(prompt), []
            for i in range(steps):
                outs.append(m.forward(c, [(0, toks if i == 0 else [toks[-1]])]))
                toks.append(int(outs[-1].logits[0][-1].argmax()))
        finally:
            m.routing = None
        _CACHE[key] = SimpleNamespace(model=m, cache=c, outputs=outs, tokens=toks, routing=rec.log)
    return _CACHE[key]
