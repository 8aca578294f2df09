"""No device->host read inside a forward: the target's decode / verify / tree-verify steps and the
draft's steps run under HostReadProbe (tests/host_reads.py), on the torch backend and on the triton
backend: neither the model nor the ops it launches read the device (KNOWN_OP_READS stays empty). The
engine reads back once per decode step.
"""
from __future__ import annotations

import pytest
import torch

from models.spec import Engine, SpecParams
from tests._model_fixtures import one_thread, tiny_pair
from tests.host_reads import HostReadProbe, summary

# op-level host reads the model cannot avoid today (argument checks inside the ops); each is
# "ops/FILE.py:FUNCTION". Remove an entry once its op checks its arguments without reading the device
# (the test then fails if the read comes back).
KNOWN_OP_READS: set[str] = set()   # every op now checks its arguments without reading the device


def _where(e) -> str:
    path, rest = e.where.split(":", 1)
    return f"{path}:{rest.split(' in ')[-1]}"


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    n = one_thread()
    yield tiny_pair(tmp_path_factory.getbasetemp() / "models_fx")
    torch.set_num_threads(n)


def _steps(m, d, H):
    """A spec-decoding step's forwards on B=2 (prefill outside the probe): draft q_len 1, target verify
    q_len 4, target tree verify (4 nodes), draft extension q_len 4, target decode q_len 1, draft tree
    step with a window mask. Returns the list of (name, thunk)."""
    c, dc = m.new_cache(2, 40), d.new_cache(2, 40)
    c.table.reserve_all(40)
    dc.table.reserve_all(40)
    # one-token prompts: the probed steps see the lengths only as device tensors (a read of them is
    # what the probe catches), so the prompt length cannot change what they launch; longer prompts
    # only cost interpreter time on the triton backend
    out = m.forward(c, [(0, [1]), (1, [5])])
    d.forward(dc, [(0, [9], out.aux[0]), (1, [9], out.aux[1])])
    T = lambda rows: torch.tensor(rows, dtype=torch.long, device=m.device)  # noqa: E731
    t1, t4 = T([[3], [4]]), T([[3, 4, 5, 6], [4, 5, 6, 7]])
    g = torch.Generator().manual_seed(0)
    h1 = torch.randn(2, 1, d.cfg.hidden_size, generator=g).to(m.device)
    h4 = torch.randn(2, 4, 3 * H, generator=g).to(m.device)
    dep = T([[0, 1, 1, 2]] * 2)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = mask[None].expand(2, 4, 4).to(m.device)
    win = torch.ones(2, 2, 3, dtype=torch.bool, device=m.device)
    win[:, 0, 2] = win[:, 1, 1] = False                       # two siblings: each sees its parent and itself
    t2, p2 = T([[7, 8], [7, 8]]), T([[20, 20], [21, 21]])
    return [("draft q1", lambda: d.step(dc, t1, h1)),
            ("verify q4", lambda: m.step(c, t4)),
            ("tree verify", lambda: m.step(c, t4, tree=(dep, mask))),
            ("draft extend q4", lambda: d.step(dc, t4, h4)),
            ("decode q1", lambda: m.step(c, t1)),
            ("draft tree step", lambda: d.step(dc, t2, h1.expand(2, 2, -1), window=win, positions=p2))]


def test_torch_backend_steps_read_nothing(fx):
    _, _, m, d = fx
    for name, f in _steps(m, d, m.hidden_size):
        with HostReadProbe(raise_on=("models", "ops", "kdsl", "other", "tests")) as p:
            f()
        assert not p.events, (name, summary(p.events))


@pytest.mark.slow
def test_triton_backend_model_reads_nothing(fx):
    """The model makes no host read on the kernels; the op-level reads are only the known ones."""
    from models.eagle3 import Eagle3Draft
    from models.kimi import KimiModel

    tk, dk, _, _ = fx
    m = KimiModel(tk, backend="triton")
    d = Eagle3Draft(dk, target_hidden=tk.config.hidden_size, backend="triton")
    seen: dict[str, dict[str, int]] = {}
    for name, f in _steps(m, d, m.hidden_size):
        with HostReadProbe(raise_on=("models", "kdsl", "other")) as p:
            f()
        seen[name] = summary(p.events)
        unknown = {_where(e) for e in p.events} - KNOWN_OP_READS
        assert not unknown, (name, seen[name])
    # the decode and verify steps read only through the two argument checks named above
    assert {k.split(" @ ")[1].split(" in ")[-1] for k in seen["decode q1"]} <= {"check_paged_lengths", "append_latent"}


@pytest.mark.parametrize("mode,params", [("plain", SpecParams(steps=3)), ("spec", SpecParams(steps=3)),
                                         ("spec", SpecParams(steps=3, topk=2, draft_tokens=6)),
                                         ("spec", SpecParams(steps=2, topk=3, draft_tokens=6, temperature=0.7))],
                         ids=["plain", "chain", "tree", "sampled-tree"])
def test_engine_reads_back_once_per_step(fx, mode, params):
    """Decode loop of the engine: the forwards read nothing, and the engine itself reads back once
    per batched step, plus once after prefill (the first tokens) and once at the end (the metrics
    counters, kept on the device); the ragged prefill wrapper is outside the count. Tree rounds
    (drafting, tree pick, acceptance walk, KV moves in models/spec_tree.py) read nothing either."""
    _, _, m, d = fx
    with HostReadProbe() as p:
        r = Engine(m, d).generate([[5, 6, 7], [9, 10, 11, 12, 13]], 7, mode, params)
    steps = r.metrics.batched_forwards
    assert steps >= 2
    in_step = [e for e in p.events if e.where.split(" in ")[-1] in ("step", "_attend", "_mha", "__call__", "make_ctx",
                                                                    "advance", "visibility", "paged_rows")]
    assert not in_step, summary(in_step)
    reads = [e for e in p.events if "models/spec" in e.where and e.what in ("tolist", "item", "__bool__", "__int__",
                                                                                "cpu", "nonzero", "unique")]
    assert len(reads) == steps + 2, summary(reads)
