"""The embedded default of `python -m models.generate` is the trained pair, and --speculative-config."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from models import generate as G
from models.train import shipped_pair, shipped_prompts


@pytest.fixture(autouse=True)
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_default_is_the_trained_pair_and_drafts_well(capsys):
    """The acceptance criterion of the shipped pair (chain k=3, greedy, held-out prompts), shortened."""
    assert G.main(["--json", "--max-new-tokens", "24"]) == 0
    r = json.loads(capsys.readouterr().out)
    t, d = shipped_pair()
    assert r["target"] == str(t) and r["draft"] == str(d) and r["tokenizer"] == "tiktoken"
    assert r["lossless"] is True and r["steps"] == 3 and r["draft_tokens"] == 4
    assert r["prompts"] == shipped_prompts()[:4]
    assert r["accept_length"] >= 2.3                      # measured 2.63 here; a broken wiring gives ~1.0
    assert all(o["spec_text"].strip() for o in r["outputs"])


def test_speculative_config_alias(capsys):
    a = G.parse_args(["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2, '
                      '"draft_tensor_parallel_size": 1}'])
    assert a.steps == 2 and a.draft is None
    a = G.parse_args(["--target", "T", "--speculative-config", '{"num_speculative_tokens": 5, "model": "D"}'])
    assert a.steps == 5 and a.draft == "D"


@pytest.mark.parametrize("cfg,msg", [
    ("{", "not JSON"),
    ("[3]", "must be a JSON object"),
    ('{"method": "medusa"}', "field 'method' must be"),
    ('{"num_speculative_tokens": 0}', "field 'num_speculative_tokens' must be an integer >= 1"),
    ('{"draft_tensor_parallel_size": 2}', "field 'draft_tensor_parallel_size' must be 1"),
    ('{"speculative_token_tree": "x"}', "unknown field 'speculative_token_tree'"),
])
def test_speculative_config_errors(cfg, msg, capsys):
    with pytest.raises(SystemExit) as e:
        G.parse_args(["--speculative-config", cfg])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "--speculative-config" in err


def test_module_default_prints_code():
    p = subprocess.run([sys.executable, "-m", "models.generate", "--max-new-tokens", "8", "--batch", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "def " in p.stdout and "lossless (spec == plain greedy): true" in p.stdout
