"""Shared tiny target + draft for the model / engine tests (written once per session)."""
from __future__ import annotations

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
