"""`python -m models.bench_spec`: sweep expansion, vLLM counters, the report, clear errors."""
from __future__ import annotations

import json

import pytest
import torch

from models import bench_spec as B
from models.fixtures import write_fixture


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    write_fixture("kimi-k25", root / "t", seed=0)
    write_fixture("eagle3", root / "d", seed=1)
    return root / "t", root / "d"


@pytest.fixture()
def prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n\n" + json.dumps("abc") + "\n")
    return p


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_sweep_configs():
    assert B.sweep_configs([1, 3], [1], None) == [(1, 1, 2), (3, 1, 4)]
    assert B.sweep_configs([3], [1, 2], [4, 8, 30]) == [(3, 1, 4), (3, 2, 4), (3, 2, 8)]   # 30 > 1+2+2*4
    assert B.sweep_configs([2], [2], None) == [(2, 2, None)]


def test_counters_follow_vllm():
    r = {"accept_histogram": [2, 1, 0, 3], "per_position_acceptance": [4 / 6, 3 / 6, 3 / 6], "draft_tokens": 4}
    c = B.counters(r, 3)
    assert c["drafts"] == 6 and c["draft_tokens"] == 18 and c["accepted_tokens"] == 1 + 9
    assert c["accepted_per_position"] == [4, 3, 3]
    assert c["conditional_acceptance"] == pytest.approx([4 / 6, 3 / 4, 1.0])
    assert c["acceptance_rate_vllm"] == pytest.approx(10 / 18)
    assert c["mean_acceptance_length_vllm"] == pytest.approx(1 + 10 / 6)


def test_sweep_json(pair, prompts, capsys):
    t, d = pair
    rc = B.main(["--prompts", str(prompts), "--target", str(t), "--draft", str(d), "--steps", "2",
                 "--topk", "1,2", "--draft-tokens", "4", "--max-new-tokens", "4", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0 and r["prompts"] == 2 and len(r["configs"]) == 2
    chain, tree = r["configs"]
    assert (chain["steps"], chain["topk"], chain["draft_tokens"]) == (2, 1, 3)
    assert (tree["topk"], tree["draft_tokens"]) == (2, 4)
    for c in r["configs"]:
        assert c["lossless"] is True
        assert c["drafts"] == sum(c["accept_histogram"]) > 0
        assert c["accepted_tokens"] == sum(i * n for i, n in enumerate(c["accept_histogram"]))
        assert c["accept_length"] == pytest.approx(c["mean_acceptance_length_vllm"], abs=0.35)
        assert 1.0 <= c["accept_length"] <= 3.0 and len(c["per_position_acceptance"]) == 2
        assert c["target_forwards_per_token"] <= 1.0


def test_table_report(pair, prompts, capsys):
    t, d = pair
    assert B.main(["--prompts", str(prompts), "--target", str(t), "--draft", str(d), "--steps", "1",
                   "--max-new-tokens", "3", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "accept len" in out and "1 prompts" in out and "true" in out


@pytest.mark.parametrize("argv,msg", [
    (["--steps", "0"], "--steps values must be >= 1"),
    (["--topk", "x"], "--topk takes integers"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--target", "/nonexistent"], "--target and --draft go together"),
    (["--target", "/nonexistent", "--draft", "/nonexistent"], "not a checkpoint directory"),
    (["--prompts", "/nonexistent.jsonl"], "no such file"),
])
def test_bad_flags(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        B.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_bad_prompt_file(pair, tmp_path, capsys):
    t, d = pair
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    assert B.main(["--prompts", str(p), "--target", str(t), "--draft", str(d)]) == 2
    err = capsys.readouterr().err
    assert f"{p}:2" in err and err.count("\n") == 1
