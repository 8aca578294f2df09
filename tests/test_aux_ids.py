"""EAGLE-3 aux-layer ids end to end (issue 11.6): the target model captures a list literally, repeats
included (a 4-layer target's default (2, 2, 1) is well defined), in list order."""
from __future__ import annotations

import torch

from models.fixtures import write_fixture
from models.kimi import KimiModel
from models.loader import load_draft, load_target


def test_repeated_and_unordered_capture_ids(tmp_path):
    t = write_fixture("kimi-k25", tmp_path / "t", seed=0)
    tk = load_target(t)
    H, N = tk.config.hidden_size, tk.config.num_hidden_layers
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        toks = torch.randint(0, tk.config.vocab_size - 16, (5,), generator=torch.Generator().manual_seed(3)).tolist()
        ref = KimiModel(tk, capture_ids=(1, 2, N))
        r = ref.forward(ref.new_cache(1, 8), [(0, toks)]).aux[0]
        cap = {1: r[:, :H], 2: r[:, H:2 * H], N: r[:, 2 * H:]}
        for ids in ((2, 2, 1), (N, 1, 2), (1, 1, 1)):
            m = KimiModel(tk, capture_ids=ids)
            a = m.forward(m.new_cache(1, 8), [(0, toks)]).aux[0]
            assert a.shape == (5, 3 * H)
            for j, i in enumerate(ids):
                torch.testing.assert_close(a[:, j * H:(j + 1) * H], cap[i], atol=0, rtol=0)
        assert not torch.equal(cap[1], cap[2])
    finally:
        torch.set_num_threads(n)


def test_draft_config_ids_reach_the_loader_check(tmp_path):
    """load_draft checks the draft's resolved ids against the target, or the override instead."""
    import json

    import pytest

    from models.config import ConfigError

    t = write_fixture("kimi-k25", tmp_path / "t", seed=0)
    d = write_fixture("eagle3", tmp_path / "d", seed=1)
    tk = load_target(t)
    c = json.loads((d / "config.json").read_text())
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 40]       # pre-layer, 40 > N = 8
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids: aux layer id 40 outside"):
        load_draft(d, tk.config)
    dk = load_draft(d, tk.config, aux_ids=(2, 2, 1))
    assert dk.config.capture_layer_ids(8, (2, 2, 1)) == (2, 2, 1)
