"""One rank of a tensor-parallel decoding run for tests/test_parallel.py.

`python -m tests._parallel_run --target T --draft D --out F [--moe ep|tp] [--backend B]` runs the
whole model in one process; under `torchrun --nproc-per-node N` every rank loads its shard and rank 0
writes the outputs of every case (plain, chain, tree; greedy and sampled) to F as JSON, with the
bytes the rank's loader read and the collectives' byte counts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

CASES = [  # (name, mode, topk, temperature)
    ("plain-greedy", "plain", 1, 0.0), ("chain-greedy", "spec", 1, 0.0), ("tree-greedy", "spec", 2, 0.0),
    ("plain-sampled", "plain", 1, 0.8), ("chain-sampled", "spec", 1, 0.8), ("tree-sampled", "spec", 2, 0.8),
]
PROMPTS = [[5, 17, 300, 42, 9], [100, 200, 7]]


def main(argv: list[str]) -> int:
    from models.eagle3 import Eagle3Draft
    from models.kimi import KimiModel
    from models.loader import load_draft, load_sharded, load_target
    from models.parallel import init_from_env
    from models.spec import Engine, SpecParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--moe", default="ep")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES))
    ap.add_argument("--new", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts")
    ap.add_argument("--no-step", action="store_true", help="skip the counted single step")
    ap.add_argument("--add-norm-in-gemm", choices=("auto", "on", "off"), default="auto",
                    help="KimiModel.add_norm_in_gemm (world size > 1)")
    ap.add_argument("--route-in-gemm", choices=("auto", "on", "off"), default="auto",
                    help="KimiModel.route_in_gemm (where the add and norm run in the gate|up + router GEMM)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    comm = init_from_env(world, a.moe, torch.device("cpu"))
    tk = load_sharded(a.target, comm.plan) if world > 1 else load_target(a.target)
    want = a.cases.split(",")
    target = KimiModel(tk, backend=a.backend, device="cpu", comm=comm)
    target.add_norm_in_gemm = {"auto": "auto", "on": True, "off": False}[a.add_norm_in_gemm]
    target.route_in_gemm = {"auto": "auto", "on": True, "off": False}[a.route_in_gemm]
    import ops.gemm_addnorm as addnorm                    # count the fused add-norm GEMMs the run takes
    calls, fused_op = [0, 0, 0], addnorm.gemm_bf16_addnorm   # [layer starts, MoE halves, with the route tail]

    def counted(*args, **kwargs):
        calls[bool(kwargs.get("normed") or kwargs.get("quant"))] += 1
        calls[2] += kwargs.get("route") is not None
        return fused_op(*args, **kwargs)
    addnorm.gemm_bf16_addnorm = counted
    draft = None
    if any(c[1] == "spec" for c in CASES if c[0] in want):      # plain-only runs need no draft
        dk = load_draft(a.draft, tk.config)
        draft = Eagle3Draft(dk, target_hidden=tk.config.hidden_size, backend=a.backend, device="cpu")
    eng = Engine(target, draft)
    out: dict = {"bytes_read": getattr(tk, "bytes_read", None), "cases": {}}
    for name, mode, topk, temp in CASES:
        if name not in want:
            continue
        p = SpecParams(steps=3, topk=topk, temperature=temp)
        r = eng.generate(PROMPTS[:a.prompts], a.new, mode, p, seed=7)
        out["cases"][name] = r.outputs
    out["collective_bytes"] = dict(comm.bytes)
    if not a.no_step:
        comm.reset_counts()                               # one target step of 1 x 3 rows: what it moves
        cache = target.new_cache(1, 16)
        cache.table.reserve_all(16)
        got = target.step(cache, torch.tensor([[1, 2, 3]]))
        out["one_step"] = dict(comm.bytes)
        out["addnorm_calls"] = list(calls)            # before the step on the other path below
        if world > 1 and a.backend == "triton":    # the same step with the other residual-add path
            was, target.add_norm_in_gemm = target.add_norm_in_gemm, not target.add_norm_in_gemm
            other_cache = target.new_cache(1, 16)
            other_cache.table.reserve_all(16)
            other = target.step(other_cache, torch.tensor([[1, 2, 3]]))
            target.add_norm_in_gemm = was
            if target.route_in_gemm is True:       # and without the route tail: the same bits
                target.route_in_gemm = False
                plain_cache = target.new_cache(1, 16)
                plain_cache.table.reserve_all(16)
                plain = target.step(plain_cache, torch.tensor([[1, 2, 3]]))
                target.route_in_gemm = True
                out["route_tail_same_bits"] = bool(torch.equal(got.logits, plain.logits) and
                                                   torch.equal(got.aux, plain.aux))
            out["other_path"] = {"aux": (got.aux.float() - other.aux.float()).abs().max().item() /
                                 got.aux.float().abs().max().item(),
                                 "logits": (got.logits - other.logits).abs().max().item() /
                                 got.logits.abs().max().item()}
    if comm.rank == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
