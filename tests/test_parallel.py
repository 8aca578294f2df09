"""Tensor / expert parallel decoding on CPU with gloo (models.parallel, models.loader.load_sharded).

World sizes 2 and 4 on the tiny fixtures (4 MLA heads, 16 experts, intermediate 128 / 32, vocab 512:
all divisible by 4) must give exactly the tokens of one process for plain, chain and tree decoding,
greedy and sampled; each rank's loader reads only its slice of every split tensor; a rank that fails
to load names itself and the tensor while the other ranks stop without hanging.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.fixtures import write_fixture
from models.loader import load_sharded, load_target
from models.parallel import Comm, ParallelError, ShardPlan, single, step_collective_bytes

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 150


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    write_fixture("kimi-k25", d / "t", seed=0)
    write_fixture("eagle3", d / "d", seed=1)
    return d / "t", d / "d"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _torchrun(n: int, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port())] + args
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)


def _run(world: int, t: Path, d: Path, out: Path, *extra: str) -> dict:
    args = ["-m", "tests._parallel_run", "--target", str(t), "--draft", str(d), "--out", str(out), *extra]
    if world == 1:
        p = subprocess.run([sys.executable] + args, cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=TIMEOUT)
    else:
        p = _torchrun(world, args)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single_run(pair, tmp_path_factory):
    t, d = pair
    return _run(1, t, d, tmp_path_factory.mktemp("ref") / "r.json")


# ---------------------------------------------------------------------------------------------- plan


def test_plan_splits_by_name():
    p = ShardPlan(1, 4, "ep")
    assert p.split_dim("model.layers.3.self_attn.q_b_proj.weight") == 0
    assert p.split_dim("model.layers.3.self_attn.kv_b_proj.weight") == 0
    assert p.split_dim("model.layers.3.self_attn.o_proj.weight") == 1
    assert p.split_dim("model.layers.3.self_attn.q_a_proj.weight") is None
    assert p.split_dim("model.layers.3.self_attn.kv_a_proj_with_mqa.weight") is None
    assert p.split_dim("model.layers.0.mlp.gate_proj.weight") == 0
    assert p.split_dim("model.layers.0.mlp.down_proj.weight") == 1
    assert p.split_dim("model.layers.3.mlp.shared_experts.up_proj.weight") == 0
    assert p.split_dim("model.layers.3.mlp.shared_experts.down_proj.weight") == 1
    assert p.split_dim("model.layers.3.mlp.experts.5.down_proj.weight_packed") is None
    assert p.split_dim("model.layers.3.mlp.gate.weight") is None
    assert p.split_dim("lm_head.weight") == 0
    assert p.split_dim("model.embed_tokens.weight") is None
    assert p.expert_range(16) == range(4, 8)
    assert p.keeps("model.layers.3.mlp.experts.5.up_proj.weight", 16)
    assert not p.keeps("model.layers.3.mlp.experts.9.up_proj.weight", 16)
    t = ShardPlan(1, 4, "tp")
    assert t.split_dim("model.layers.3.mlp.experts.5.down_proj.weight") == 1
    assert t.split_dim("model.layers.3.mlp.experts.5.gate_proj.weight_scale") == 0
    assert t.expert_range(16) == range(16)
    with pytest.raises(ParallelError, match="moe-parallel"):
        ShardPlan(0, 2, "xx")


def test_plan_refuses_indivisible_sizes(pair):
    cfg = load_target(pair[0]).config
    with pytest.raises(ParallelError, match="num_attention_heads"):
        ShardPlan(0, 3).check(cfg)
    with pytest.raises(ParallelError, match="quantization groups"):    # int4 group 32, intermediate 32
        ShardPlan(0, 2, "tp").check(cfg)
    ShardPlan(0, 2, "ep").check(cfg)


def test_world_one_collectives_are_noops():
    c = single()
    x = torch.randn(3, 5)
    assert c.all_reduce(x) is x and c.gather_last(x) is x and c.broadcast(x) is x
    assert c.bytes == {"all_reduce": 0, "all_gather": 0, "broadcast": 0}
    assert isinstance(c, Comm) and c.world == 1


# ---------------------------------------------------------------------------------------------- loader


@pytest.mark.parametrize("world,moe", [(2, "ep"), (4, "ep"), (4, "tp")])
def test_loader_reads_only_its_shard(pair, world, moe):
    t = pair[0]
    if moe == "tp":               # the int4 group-32 experts cannot split intermediate 32 four ways
        t = t.parent / "bf16"
        if not (t / "config.json").exists():
            write_fixture("kimi-k25-bf16", t, seed=0, moe_intermediate=128)
    full = load_sharded(t, ShardPlan(0, 1))
    whole = full.read_log                                   # every stored tensor, read whole
    total = sum(whole.values())
    ranks = [load_sharded(t, ShardPlan(r, world, moe)) for r in range(world)]
    E = full.config.n_routed_experts
    for r, ck in enumerate(ranks):
        plan = ck.shard
        for name, nb in whole.items():
            if not plan.keeps(name, E):
                assert name not in ck.read_log, name          # another rank's expert: never touched
            elif plan.split_dim(name) is None:
                assert ck.read_log[name] == nb, name          # replicated: read whole
            elif name.endswith(".weight") and full[name].dim() == 2:
                assert ck.read_log[name] * world == nb, name  # a dense split weight: exactly its 1/N slice
            else:                                             # quantized parts: sliced, or scalar / per-channel
                assert ck.read_log[name] in (nb // world, nb), name
        assert ck.bytes_read == sum(ck.read_log.values())
        split = sum(nb for n, nb in whole.items() if plan.split_dim(n) is not None or not plan.keeps(n, E))
        assert ck.bytes_read <= total - split + split // world + 64 * world, (r, ck.bytes_read, total)
    # the slices put back together are the whole tensors
    for name, dim in (("lm_head.weight", 0), ("model.layers.1.self_attn.o_proj.weight", 1),
                      ("model.layers.1.self_attn.q_b_proj.weight", 0)):
        cat = torch.cat([ck[name] for ck in ranks], dim)
        assert torch.equal(cat, full[name]), name


# ---------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_give_the_single_process_tokens(pair, single_run, tmp_path, world):
    t, d = pair
    got = _run(world, t, d, tmp_path / "r.json")
    assert set(got["cases"]) == set(single_run["cases"])
    for name, outs in single_run["cases"].items():
        assert got["cases"][name] == outs, name
    assert got["collective_bytes"]["all_reduce"] > 0 and got["collective_bytes"]["broadcast"] > 0
    # the static per-step figure a bench reads equals what one counted step moved (float32 on torch)
    cfg = load_target(t).config
    want = step_collective_bytes(cfg, tokens=3, world=world, act_bytes=4)
    assert got["one_step"]["all_reduce"] == want["all_reduce"]
    assert got["one_step"]["all_gather"] == want["all_gather"] and got["one_step"]["broadcast"] == 0
    assert single_run["one_step"] == {"all_reduce": 0, "all_gather": 0, "broadcast": 0}


@pytest.mark.slow
def test_tensor_parallel_experts(pair, tmp_path):
    t = pair[0].parent / "bf16"
    if not (t / "config.json").exists():
        write_fixture("kimi-k25-bf16", t, seed=0, moe_intermediate=128)
    cases = "plain-greedy,chain-greedy,chain-sampled"
    ref = _run(1, t, pair[1], tmp_path / "a.json", "--cases", cases)
    got = _run(2, t, pair[1], tmp_path / "b.json", "--cases", cases, "--moe", "tp")
    assert got["cases"] == ref["cases"]


@pytest.mark.slow
def test_cli_tp2_json_equals_single_process(pair):
    t, d = pair
    args = ["-m", "models.generate", "--target", str(t), "--draft", str(d), "--json", "--max-new-tokens", "6",
            "--batch", "2"]
    one = subprocess.run([sys.executable] + args, cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert one.returncode == 0, one.stderr[-2000:]
    two = _torchrun(2, args + ["--tp", "2"])
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)      # only rank 0 printed: one JSON object
    assert b["outputs"] == a["outputs"] and b["lossless"] is a["lossless"] is True
    assert b["tp"] == 2 and a["tp"] == 1 and b["collective_bytes"]["all_reduce"] > 0


def test_cli_tp_must_match_the_launch(pair):
    p = subprocess.run([sys.executable, "-m", "models.generate", "--tp", "2"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "--tp 2 does not match" in p.stderr


@pytest.mark.slow
def test_failing_rank_is_named_and_the_others_stop(pair, tmp_path):
    """Rank 1 (experts 8..15 under EP) meets a NaN quantization scale; rank 0 never reads that tensor,
    learns of the failure from the ok-flag all-reduce and stops too."""
    t, d = pair
    bad = tmp_path / "bad"
    bad.mkdir()
    victim = "language_model.model.layers.1.mlp.experts.12.up_proj.weight_scale"
    for f in t.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
            continue
        with safe_open(f, "pt") as h:
            ts = {k: h.get_tensor(k) for k in h.keys()}
            meta = h.metadata()
        if victim in ts:
            ts[victim] = ts[victim].clone()
            ts[victim][0, 0] = float("nan")
        save_file(ts, bad / f.name, metadata=meta)
    p = _torchrun(2, ["-m", "models.generate", "--target", str(bad), "--draft", str(d), "--tp", "2",
                      "--max-new-tokens", "2"])
    assert p.returncode != 0
    assert "rank 1 failed to load its shard: tensor 'model.layers.1.mlp.experts.12.up_proj.weight'" in p.stderr
    assert "rank 0: another rank failed to load its shard" in p.stderr



@pytest.mark.slow
def test_triton_backend_two_ranks(tmp_path):
    """The kdsl kernels (interpreter) under 2 ranks: a 4-layer target, one prompt's prefill and first
    token, and (on the ranks) one counted step (bf16 all-reduces: 2 x 4 layers x 3 rows x 64 x 2 bytes), against one process."""
    from tests._parallel_run import main as run_one

    t = tmp_path / "t4"
    write_fixture("kimi-k25", t, seed=0, layers=4)
    args = ["--target", str(t), "--draft", str(t), "--backend", "triton", "--cases", "plain-greedy", "--new", "1",
            "--prompts", "1"]
    assert run_one(args + ["--out", str(tmp_path / "a.json"), "--no-step"]) == 0
    ref = json.loads((tmp_path / "a.json").read_text())
    got = _run(2, t, t, tmp_path / "b.json", *args[4:])
    assert got["cases"] == ref["cases"]
    assert got["one_step"]["all_reduce"] == step_collective_bytes(load_target(t).config, 3, 2, act_bytes=2)["all_reduce"]
