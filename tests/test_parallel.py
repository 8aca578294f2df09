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
@pytest.mark.xdist_group("parallel_single_run")     # both worlds on one worker: one single_run
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



TRITON_ARGS = ["--backend", "triton", "--cases", "plain-greedy", "--new", "1", "--prompts", "1"]


@pytest.fixture(scope="module")
def triton_refs(tmp_path_factory):
    """Per fixture kind: a 4-layer target and its single-process triton run (the world-1 fused path),
    made once for the parametrized runs below."""
    from tests._parallel_run import main as run_one

    done: dict = {}

    def get(kind: str):
        if kind not in done:
            d = tmp_path_factory.mktemp(kind)
            write_fixture(kind, d / "t", seed=0, layers=4)
            argv = ["--target", str(d / "t"), "--draft", str(d / "t"), *TRITON_ARGS, "--out", str(d / "a.json"),
                    "--no-step"]
            assert run_one(argv) == 0
            done[kind] = (d / "t", json.loads((d / "a.json").read_text()))
        return done[kind]
    return get


@pytest.mark.slow
@pytest.mark.xdist_group("parallel_triton")         # on one worker: the w4a8 reference runs once
@pytest.mark.parametrize("world,moe,kind,addnorm", [(2, "ep", "kimi-k25", "on"), (4, "ep", "kimi-k25-w4a8", "off"),
                                                    (2, "tp", "kimi-k25-w4a8", "on")])
def test_triton_fused_ranks(triton_refs, tmp_path, world, moe, kind, addnorm):
    """The kdsl kernels (interpreter) under N ranks, the fused MoE layer (local ids from the route
    kernel under EP, the rank's share from moe_combine_rank, the all-reduce, then the next layer's
    residual add and input norm: rmsnorm_add, or with `addnorm` on in the next q_a|kv_a GEMM's
    prologue, ops.gemm_addnorm, and the post-attention one (W4A8: with the int8 quant) in the shared
    gate|up + router GEMM's, whose last program then also routes a decode step's tokens, route_in_gemm,
    bit for bit as without): a 4-layer target, one prompt's prefill and first token, and (on the
    ranks) one counted step (bf16 all-reduces: 2 x 4 layers x 3 rows x 64 x 2 bytes), against one
    process (the world-1 fused path)."""
    t, ref = triton_refs(kind)
    got = _run(world, t, t, tmp_path / "b.json", *TRITON_ARGS, "--moe", moe, "--add-norm-in-gemm", addnorm,
               "--route-in-gemm", addnorm)
    assert got["cases"] == ref["cases"]
    starts, halves, routed = got["addnorm_calls"]          # 3 layer starts of 4 per forward; the MoE halves
    assert (starts > 0) == (halves > 0) == (addnorm == "on")
    # with the add and norm there, the decode steps (few rows) route in its last program: the same bits
    assert (routed > 0) == ("route_tail_same_bits" in got) == (addnorm == "on")
    assert got.get("route_tail_same_bits", True)
    # the counted step again on the other path: the captured residual streams (EAGLE-3's aux rows,
    # written by the fused GEMM on that path) and the logits agree to bf16 rounding, relative to their max
    assert got["other_path"]["aux"] <= 2.0 ** -7 and got["other_path"]["logits"] <= 2.0 ** -5
    want = step_collective_bytes(load_target(t).config, 3, world, act_bytes=2)["all_reduce"]
    assert got["one_step"]["all_reduce"] == want


# ---------------------------------------------------------------------------------------------- EP kernels


@pytest.mark.parametrize("E,K,ng,tkg,M", [(16, 4, 1, 1, 5), (24, 6, 4, 2, 3), (12, 12, 1, 1, 2)])
def test_route_local_ids_match_the_torch_reference(E, K, ng, tkg, M):
    """`route(..., local=(first, count))` (kernel moe_route_local): the weights of the plain route and,
    per rank of an even split, the global ids mapped to local ids (-1 for other ranks' experts), against
    the torch reference; the ids and weights land in views of bigger poisoned buffers, nothing around them
    written."""
    from ops import moe
    from tests.conftest import poisoned

    g = torch.Generator().manual_seed(E * 10 + M)
    x = torch.randn(M, 64, generator=g)
    wg = torch.randn(E, 64, generator=g) * 0.2
    bias = torch.randn(E, generator=g) * 0.1
    gids, gw = moe.route(x, wg, bias, K, ng, tkg, True, 2.5)
    rids, rw = moe.moe_route_ref(x, wg, bias, K, ng, tkg, True, 2.5)
    assert torch.equal(gids, rids)
    for ranks in (2, 4):
        n = E // ranks
        for r in range(ranks):
            ids, w = moe.route(x, wg, bias, K, ng, tkg, True, 2.5, local=(r * n, n))
            assert torch.equal(ids, moe.local_ids(rids, r * n, n)) and ids.dtype == torch.int32
            assert torch.equal(w, gw)                               # the same weights on every rank
            tids, tw = moe.route(x, wg, bias, K, ng, tkg, True, 2.5, backend="torch", local=(r * n, n))
            assert torch.equal(tids, ids)
            torch.testing.assert_close(tw, rw, rtol=1e-6, atol=1e-6)
    # NaN / +-inf logits through a view of a bigger buffer; outputs into views of bigger poisoned buffers
    part_big = torch.randn(3, M + 2, E + 5, generator=g)
    part = part_big[:, 1:M + 1, 2:E + 2]
    part[:, 0, :] = float("nan")
    if M > 1:
        part[0, 1, ::3] = float("inf")
        part[1, 1, 1::3] = float("-inf")
    ids_big, w_big = poisoned((M + 2, K + 3), torch.int32), poisoned((M + 2, K + 3), torch.float32)
    ids, w = ids_big[1:M + 1, 1:K + 1], w_big[1:M + 1, 1:K + 1]
    n = E // 2
    moe.moe_route_local(part, bias, ids, w, ng, tkg, 1, 0, 2.5, n, n)
    assert bool(((ids >= -1) & (ids < n)).all())
    mask = torch.ones_like(ids_big, dtype=torch.bool)
    mask[1:M + 1, 1:K + 1] = False
    assert bool((ids_big[mask] == -123).all()) and bool(w_big[mask].isnan().all())
    ref = torch.empty(M, K, dtype=torch.int32)
    moe.moe_route(part.contiguous(), bias, ref, torch.empty(M, K), ng, tkg, 1, 0, 2.5)
    assert torch.equal(ids, moe.local_ids(ref, n, n))


def test_route_local_range_is_checked():
    from ops import moe

    x, wg, bias = torch.randn(2, 8), torch.randn(16, 8), torch.zeros(16)
    for bad in ((-1, 4), (0, 0), (12, 8)):
        with pytest.raises(ValueError, match="local expert range"):
            moe.route(x, wg, bias, 4, local=bad)


@pytest.mark.parametrize("shared", [True, False])
def test_combine_rank_matches_the_reference(shared):
    """moe_combine_rank: the top-k partial rows in k order (rows of ids outside [0, E) are NaN: never
    read) + shared, bf16; equal bits to moe_sum_ids + the f32 shared add + the cast."""
    from ops import moe
    from tests.conftest import poisoned

    g = torch.Generator().manual_seed(3)
    M, K, H, E = 5, 4, 96, 8
    ids = torch.randint(-1, E + 2, (M, K), generator=g, dtype=torch.int32)
    part = torch.randn(M * K, H, generator=g)
    bad = ((ids < 0) | (ids >= E)).reshape(-1)
    part[bad] = float("nan")
    s = torch.randn(M, H, generator=g).to(torch.bfloat16) if shared else None
    got = moe.combine_rank(part, ids, s, E)
    ref = moe.moe_combine_rank_ref(part, ids, s, E)
    assert torch.equal(got, ref) and not got.isnan().any()
    summed = poisoned((M, H), torch.float32)
    moe.moe_sum_ids(part, ids.reshape(-1), summed, K, E)
    want = (summed + s.float() if shared else summed).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert torch.equal(moe.combine_rank(part, ids, s, E, backend="torch"), ref)
