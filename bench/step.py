"""python -m bench.step: the whole decode step as the unit of performance, predicted statically.

Builds the real model path (models.kimi.KimiModel, backend "triton") at a real config (Kimi-K2.5 by
default, or a config.json) on meta tensors (bench/meta_model.py: no weight is allocated), runs one
forward of `batch` sequences at context `ctx` with q_len 1 (decode) and q_len 4 (EAGLE-3 verify)
under kdsl's record mode (every kdsl launch is bound, checked and specialized with the recording
target's tuned config, none runs) and a dispatch mode that counts the torch ops the forward runs
besides the kernels. Then every launch is costed:

* kdsl launch: compiled for the arch (AOT, cached) and scored by autotune's cost model
  (`autotune.search.score`: the kernel's problem model, the ISA report, LDS, occupancy, HBM) with
  the config it looked up; its floor is the problem model's roofline (bytes / HBM, flops / peak);
* torch op: max(bytes / HBM, flops / peak of its dtype) (gathers count the rows read, not the table);
* every launch (kdsl or torch) adds the stated launch gap (`autotune.costmodel.LAUNCH_GAP_US`:
  graph replay by default, `--gap eager` for eager launches); the floor has no gaps;
* with --tp N > 1 the model is rank 0 of the real tensor-parallel model (models.parallel: MLA by
  heads, experts "ep" or "tp", vocab-parallel lm_head); each collective its forward calls (two
  all-reduces per layer, the logits' all-gather) is costed as latency + ring bytes / link bandwidth
  (`ALLREDUCE`, stated assumptions); with experts "ep" the rank's MoE stages cost its expected share
  of the routed rows (`EP_ROUTING`: uniform routing, the mean rank).

Predicted step = sum of predicted launch times + gaps (+ all-reduces); floor = sum of floors.
`--layers N` records N layers and scales the MoE layers' items to the config's layer count: with
N >= first dense layers + 3, the first and last MoE layers count once and the ones between them
stand for the rest (`layer_weights`), so use --layers 4 for Kimi-K2.5.
On a machine with a GPU the step is also run and timed (eager; graph capture when the forward
allows it) next to the prediction.

`--model draft` records and costs the EAGLE-3 draft's step instead (models.eagle3.Eagle3Draft at TP1,
bench.meta_model.build_draft / run_draft_step); `--model both` both, plus the chain spec step (verify
at q_len k+1, k-1 draft steps at q_len 1, the draft's extend at q_len k+1) per arch and format.
"""
from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.meta_model import EXPERT_FORMATS, KIMI_K25_CONFIG, HostShadowMode, build_model, limit_layers, run_step

# All-reduce of the hidden state per TP layer (twice a layer): (latency us, effective bus GB/s).
# Stated assumptions: RCCL/NCCL small-message collective ~10 us on 8 GPUs over XGMI (MI300X/MI355X)
# or NVLink (H100); ring traffic 2 (N-1)/N x bytes at the effective per-GPU bandwidth.
ALLREDUCE = {"gfx942": (10.0, 300.0), "gfx950": (10.0, 400.0), "sm90": (8.0, 350.0)}
# Expert parallel (--moe-parallel ep): what rank 0's MoE stages are costed for.
EP_ROUTING = ("uniform routing, mean rank: each token's TOPK experts land on a rank in proportion to the "
              "experts it holds (E/N of E), so the rank computes TOPK/N rows per token on average and touches "
              "E/N x (1 - (1 - TOPK/E)^M) of its experts; the most loaded rank of a real batch does more. "
              "MXFP4 experts compute every row (other ranks' experts weigh 0) and are costed so.")
REPORT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "kdsl", "step_reports.json")


class UsageError(Exception):
    """Bad input: one line naming the flag or file, exit status 2."""


def load_model_config(spec: str, tp: int = 1, moe_parallel: str = "tp", layers: int | None = None) -> Any:
    """`spec`: 'kimi-k2.5' (REFERENCE section 1 values) or a config.json path, cut to its first `layers`
    layers; raises ValueError when a `tp`-way split of it (models.parallel.ShardPlan) is impossible."""
    from models.config import parse_config
    from models.parallel import ShardPlan

    if spec in ("kimi-k2.5", "kimi", "kimi-k25"):
        d = KIMI_K25_CONFIG
    else:
        with open(spec) as f:
            d = json.load(f)
    cfg = parse_config(d)
    if not hasattr(cfg, "n_routed_experts"):
        raise ValueError(f"{spec}: not a target (DeepSeek-V3 / Kimi) config")
    if not 1 <= tp <= 64:
        raise ValueError(f"--tp must be in 1..64, got {tp}")
    ShardPlan(0, tp, moe_parallel).check(cfg)
    return limit_layers(cfg, layers)


@dataclass
class StepRecord:
    """What one recorded step launched."""
    q_len: int
    launches: list[Any]
    lookups: list[dict[str, Any]]
    mode: HostShadowMode
    layers: int
    record_s: float


def record_step(cfg: Any, experts: str, arch: str, batch: int, ctx: int, q_len: int, model: Any = None,
                mode: HostShadowMode | None = None, tp: int = 1, moe_parallel: str = "tp") -> StepRecord:
    """Record one forward of `batch` x `q_len` new tokens at context `ctx` (see module docstring)."""
    mode = mode or HostShadowMode()
    if model is None:
        model = build_model(cfg, experts, mode, tp, moe_parallel)
    return _record(mode, arch, q_len, cfg.num_hidden_layers, lambda: run_step(model, cfg, mode, batch, ctx, q_len))


def _record(mode: HostShadowMode, arch: str, q_len: int, layers: int, run: Any) -> StepRecord:
    """Run `run()` (one step) under kdsl's record mode and a lookup log, with `mode` emptied first."""
    import kdsl as kd
    from autotune.store import lookup_log

    mode.ops.clear()
    mode.device_reads.clear()
    mode.marks.clear()
    mode.collectives.clear()
    mode.last_layer = None
    mode.host_ops = 0
    t0 = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lookup_log() as log, kd.recording(arch) as rec:
            run()
    return StepRecord(q_len, list(rec.launches), list(log), mode, layers, time.time() - t0)


def step_problems(cfg: Any, experts: str, arch: str, q_lens: list[int], batch: int = 1, ctx: int = 8192,
                  tp: int = 1, moe_parallel: str = "tp") -> list[tuple[Any, dict[str, Any], int]]:
    """Distinct (kernel, keyed problem, smallest M launched) of the kdsl launches of the recorded
    steps (for tune-model). Kernels whose op looks up no tuned config are left out (nothing would
    read their files). The smallest M matters for decode attention: at q_len 4, M = batch x 4."""
    probs = _with_add_norm_paths(_with_stage2_quant_paths(
        _recorded(cfg, experts, arch, q_lens, batch, ctx, tp, moe_parallel, per_sequence=True)), cfg, tp, experts, arch)
    return _ep_scored(cfg, tp, moe_parallel, _with_o_proj_tail_paths(probs, arch))


def _with_add_norm_paths(probs: list[tuple[Any, dict[str, Any], int]], cfg: Any, tp: int, experts: str,
                         arch: str) -> list[tuple[Any, dict[str, Any], int]]:
    """`probs` plus, at world size > 1, gemm_bf16_addnorm at the q_a|kv_a shape, and (any world size)
    gemm_bf16_addnorm_y (W4A8: _yq; world size 1: the _splitk_ forms) at the shared gate|up + router
    shape (2 x the shared intermediate / tp + the routed experts; world size 1: at o_proj's split
    count S on `arch`) and its _route form at each moe_route_align problem (and the other way round): the
    model takes them or the
    chains (rmsnorm_add(_quant)(_splitk) + gemm_bf16_splitk, also launched elsewhere in the step) from the files of both
    (`ops.gemm_addnorm.addnorm_pays`), so a step recorded before their files exist (the chains)
    must still get them tuned."""
    from ops.gemm_addnorm import kernel_for

    out, add = _extendable(probs)
    if cfg.q_lora_rank and tp > 1:
        add(kernel_for(), {"N": cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim, "K": cfg.hidden_size}, 1)
    if experts != "mxfp4" and cfg.n_routed_experts and cfg.n_shared_experts:
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts // tp
        prob = {"N": 2 * shared + cfg.n_routed_experts, "K": cfg.hidden_size}
        if tp == 1:                        # o_proj's split-K partials in; the chain's norm over them
            from ops._common import invariant_config
            from ops.gemm import SPLIT_K_DEFAULT, gemm_bf16_splitk_kernel
            from ops.norm import rmsnorm_add_quant_splitk, rmsnorm_add_splitk

            o_proj = {"N": cfg.hidden_size, "K": cfg.num_attention_heads * cfg.v_head_dim}
            prob["S"] = int(invariant_config(gemm_bf16_splitk_kernel, o_proj, 1, None, arch=arch)
                            .get("SPLIT_K", SPLIT_K_DEFAULT))
            add(rmsnorm_add_quant_splitk if experts == "w4a8" else rmsnorm_add_splitk,
                {"D": cfg.hidden_size, "S": prob["S"]}, 1)
        add(kernel_for(True, experts == "w4a8", tp == 1), prob, 1)
        # its route-tail form at each routing problem of the step, and the routing launch where the record
        # took the tail (ops.gemm_addnorm.route_tail_pays reads the figures of both)
        from ops.moe import moe_route_align, moe_route_align_local

        for k, p, _ in probs:
            if k.name in ("moe_route_align", "moe_route_align_local"):
                add(kernel_for(True, experts == "w4a8", tp == 1, route=True), {**prob, **p}, 1)
            elif k.name.startswith("gemm_bf16_addnorm") and k.name.endswith("_route"):
                rp = {d: p[d] for d in ("E", "TOPK", "NG", "EA", "BM")}
                add(moe_route_align_local if rp["EA"] < rp["E"] else moe_route_align, rp, 1)
    return out


def step_problem_spans(cfg: Any, experts: str, arch: str, q_lens: list[int], tokens: int, ctx: int = 8192,
                       tp: int = 1, moe_parallel: str = "tp") -> list[tuple[Any, dict[str, Any], int, int]]:
    """`step_problems` (batch 1) with, for each problem, the largest M its launches take in a step of
    `tokens` new tokens (each q_len at batch tokens / q_len; the largest step tune-model tunes for):
    (kernel, keyed problem, smallest per-sequence M, largest M). A launch's own M is not always the
    step's tokens (the MoE align kernels count routed pairs, top-k per token) and some kernels launch
    only from a few tokens on (route and align apart from 8 tokens): the batch-1 record alone would
    leave their large-batch buckets, or the kernels, untuned. Problems only the tuner's both-paths
    rule adds keep their batch-1 M."""
    spans: dict[tuple, list] = {}
    for k, p, m in step_problems(cfg, experts, arch, q_lens, ctx=ctx, tp=tp, moe_parallel=moe_parallel):
        spans[(k.name, json.dumps(p, sort_keys=True))] = [k, p, m, m]
    for ql in q_lens:
        b = max(1, tokens // ql)
        raw = _recorded(cfg, experts, arch, [ql], b, ctx, tp, moe_parallel, per_sequence=False)
        for k, p, m in _ep_scored(cfg, tp, moe_parallel, raw):
            span = spans.setdefault((k.name, json.dumps(p, sort_keys=True)), [k, p, max(1, m // b), m])
            span[3] = max(span[3], m)
    return [tuple(v) for _, v in sorted(spans.items(), key=lambda kv: kv[0])]


def _recorded(cfg: Any, experts: str, arch: str, q_lens: list[int], batch: int, ctx: int, tp: int,
              moe_parallel: str, per_sequence: bool) -> list[tuple[Any, dict[str, Any], int]]:
    """`_problems` of one forward per q_len at `batch` sequences: the smallest M per sequence
    (`per_sequence`) or the largest M launched."""
    mode = HostShadowMode()
    model = build_model(cfg, experts, mode, tp, moe_parallel)
    recs = [record_step(cfg, experts, arch, batch, ctx, ql, model, mode) for ql in q_lens]
    return _problems(recs, batch) if per_sequence else _problems(recs, 1, largest=True)


def _ep_scored(cfg: Any, tp: int, moe_parallel: str, probs: list[tuple[Any, dict[str, Any], int]]
               ) -> list[tuple[Any, dict[str, Any], int]]:
    """EP: the routed-expert problems carry EALL, so they are tuned for the rank's share."""
    ep = cfg.n_routed_experts if moe_parallel == "ep" and tp > 1 else None
    return [(k, {**p, **ep_share(k, p, ep)}, m) for k, p, m in probs]


def _extendable(probs: list[tuple[Any, dict[str, Any], int]]) -> tuple[list, Any]:
    """A copy of `probs` and an `add(kernel, problem, m)` that appends a (kernel, problem) not in it yet."""
    seen = {(k.name, json.dumps(p, sort_keys=True)) for k, p, _ in probs}
    out = list(probs)

    def add(kern: Any, prob: dict[str, Any], m: int) -> None:
        key = (kern.name, json.dumps(prob, sort_keys=True))
        if key not in seen:
            seen.add(key)
            out.append((kern, prob, m))

    return out, add


def _with_stage2_quant_paths(probs: list[tuple[Any, dict[str, Any], int]]) -> list[tuple[Any, dict[str, Any], int]]:
    """`probs` plus the kernels of both W4A8 stage-2 quant paths ("amax" and "separate") at every
    routed-expert shape one of them launched: which path the model takes is chosen from the tuned
    files' figures of both (`ops.moe.amax_pays`), so a step recorded on an arch with no files yet
    (it takes "separate") must still get the amax pair tuned, and the other way round."""
    from ops.moe import W4A8_STAGES, aligned_blocks
    from ops.quant import quant_per_token_int8

    paths = (W4A8_STAGES["amax"], W4A8_STAGES["separate"])
    stage_kernels = {k.name for pair in paths for k in pair}
    out, add = _extendable(probs)

    for kern, prob, m in probs:
        if kern.name not in stage_kernels:
            continue
        E, I, top_k = prob["E"], prob["I"], prob["TOPK"]
        H = prob.get("K", prob.get("H"))
        p1, p2 = {"E": E, "K": H, "I": I, "TOPK": top_k}, {"E": E, "H": H, "I": I, "TOPK": top_k}
        for s1, s2 in paths:
            add(s1, p1, m)
            add(s2, p2, m)
        add(quant_per_token_int8, {"K": I}, aligned_blocks(m * top_k, E, 16) * 16)  # "separate"'s rows at M=m
    return out


def _with_o_proj_tail_paths(probs: list[tuple[Any, dict[str, Any], int]], arch: str
                            ) -> list[tuple[Any, dict[str, Any], int]]:
    """`probs` plus both paths of o_proj's residual-add norm at world size 1: gemm_bf16_splitk then
    rmsnorm_add(_quant)_splitk, or one gemm_bf16_splitk_norm(_quant) launch. The model picks between
    them from both paths' files (`ops.splitk_norm.fused_pays`), so whichever the recorded step took,
    the other must be tuned too."""
    from ops._common import invariant_config
    from ops.gemm import SPLIT_K_DEFAULT, gemm_bf16_splitk_kernel
    from ops.norm import rmsnorm_add_quant_splitk, rmsnorm_add_splitk
    from ops.splitk_norm import KERNELS

    chain_norms = {rmsnorm_add_splitk.name: False, rmsnorm_add_quant_splitk.name: True}
    fused = {k.name: quant for quant, k in enumerate(KERNELS)}
    out, add = _extendable(probs)

    splitk_k = {p["N"]: p["K"] for k, p, _ in probs if k.name == gemm_bf16_splitk_kernel.name}
    for kern, prob, m in probs:
        if kern.name in fused:
            D, K = prob["D"], prob["K"]
            S = int(invariant_config(gemm_bf16_splitk_kernel, {"N": D, "K": K}, 1, None, arch=arch).get("SPLIT_K", SPLIT_K_DEFAULT))
            add(gemm_bf16_splitk_kernel, {"N": D, "K": K}, m)
            add(rmsnorm_add_quant_splitk if fused[kern.name] else rmsnorm_add_splitk, {"D": prob["D"], "S": S}, m)
        elif kern.name in chain_norms and prob["D"] in splitk_k:
            add(KERNELS[chain_norms[kern.name]], {"D": prob["D"], "K": splitk_k[prob["D"]]}, m)
    return out


def _problems(recs: list[StepRecord], batch: int, largest: bool = False) -> list[tuple[Any, dict[str, Any], int]]:
    """Distinct (kernel, keyed problem, smallest per-sequence M; `largest`: the largest M over
    `batch`) of the recorded steps' launches whose op looked up a tuned config (or its base kernel's:
    `configs_of`)."""
    from autotune.problems import m_of, model_for, strip_m

    out: dict[tuple, tuple[Any, dict[str, Any], int]] = {}
    for rec in recs:
        looked = {e["kernel"] for e in rec.lookups}
        for r in rec.launches:   # a configs_of kernel keeps its base's looked-up numerics: its figures have a file
            if r.kernel.name not in looked and model_for(r.kernel).configs_of not in looked:
                continue
            p = strip_m(r.kernel, r.dims)
            key = (r.kernel.name, json.dumps(p, sort_keys=True))
            m = m_of(r.kernel, r.dims) // max(1, batch)  # per sequence: the batch-1 M of this launch
            prev = out.get(key)
            out[key] = (r.kernel, p, ((max if largest else min)(m, prev[2])) if prev else m)
    return [out[k] for k in sorted(out)]


# ---------------------------------------------------------------------------------------------
# costing

def _load_cache() -> dict[str, Any]:
    try:
        with open(REPORT_CACHE) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(d: dict[str, Any]) -> None:
    try:
        os.makedirs(os.path.dirname(REPORT_CACHE), exist_ok=True)
        tmp = f"{REPORT_CACHE}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(d, f)
        os.replace(tmp, REPORT_CACHE)
    except OSError:
        pass


@functools.lru_cache(maxsize=1)
def _kdsl_hash() -> str:
    """The kdsl package's own code: a lowering change (same kernel source, other generated Triton)
    must not reuse the reports of the old code."""
    import kdsl

    h = hashlib.sha256()
    for f in sorted(Path(kdsl.__file__).parent.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _report_key(r: Any, arch: str) -> str:
    import triton

    from autotune.store import helpers_hash, kernel_source_hash

    return json.dumps([r.kernel.name, kernel_source_hash(r.kernel), helpers_hash(r.kernel), _kdsl_hash(), arch,
                       triton.__version__, sorted(r.config.items()), sorted(r.dims.items())], default=str)


def compile_reports(launches: list[Any], arch: str, workers: int | None = None, log: Any = None) -> dict[str, Any]:
    """AOT reports of the distinct (kernel, config, dims) launches, compiled in parallel, cached on disk."""
    import concurrent.futures as cf
    import multiprocessing as mp

    from autotune.search import _run_job

    cache = _load_cache()
    todo: dict[str, Any] = {}
    for r in launches:
        k = _report_key(r, arch)
        if k not in cache and k not in todo:
            todo[k] = r
    if todo:
        if log:
            log(f"compiling {len(todo)} distinct launches for {arch} ...")
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
        with cf.ProcessPoolExecutor(max_workers=workers or min(4, os.cpu_count() or 1), mp_context=ctx) as ex:
            futs = {ex.submit(_run_job, r.kernel.name, arch, dict(r.config), dict(r.dims)): k for k, r in todo.items()}
            for f in cf.as_completed(futs):
                rep = f.result()
                rep.pop("problem", None)
                cache[futs[f]] = rep
        _save_cache(cache)
    return cache


@dataclass
class Item:
    kind: str            # "kdsl" | "torch" | "allreduce"
    name: str
    shape: str
    layer: int | None
    predicted_us: float  # without the gap
    floor_us: float
    gap_us: float
    weight: float = 1.0  # layer scaling (--layers)
    config: dict[str, Any] = field(default_factory=dict)
    tuned: str = ""      # "tuned" | "fallback" (a lookup found no file) | "no lookup" (the op looks none up)
    bound: str = ""


def _shape_label(dims: dict[str, Any], keys: list[str]) -> str:
    return " ".join(f"{k}={dims[k]}" for k in keys if k in dims)


def _layer_of(launch_layers: list[int | None], i: int) -> int | None:
    return launch_layers[i] if i < len(launch_layers) else None


def ep_share(kernel: Any, prob: dict[str, Any], ep_experts: int | None) -> dict[str, int]:
    """{"EALL": ...} for a routed-expert launch of an expert-parallel rank (`ep_experts`: the routed
    experts of all ranks): ops.problems.routed_share then costs E / EALL of each token's experts;
    {} otherwise (MXFP4 stages keep every top-k row: their EP ids are clamped with weight 0)."""
    if ep_experts and "TOPK" in prob and "E" in prob and "mxfp4" not in kernel.name:
        return {"EALL": ep_experts}
    return {}


def layer_weights(recorded: int, first: int, full: int) -> Any:
    """How many of the config's `full` layers each recorded layer stands for. Dense layers (below
    `first`) and launches outside the layers count once. The first MoE layer (its input comes from
    a dense layer) and the last layer (it ends with the final norm) differ from the others, so with
    three or more MoE layers recorded each of those two counts once and the MoE layers between them
    stand for all the rest; with fewer, every recorded MoE layer stands for an equal share."""
    moe, last = recorded - first, recorded - 1
    if moe >= 3 and full > recorded:
        mid = (full - first - 2) / (moe - 2)
        return lambda layer: 1.0 if layer is None or layer < first or layer in (first, last) else mid
    share = (full - first) / max(1, moe)
    return lambda layer: 1.0 if layer is None or layer < first else share


def cost_step(rec: StepRecord, cfg: Any, arch: str, ctx: int, gap: str = "graph", tp: int = 1,
              full_layers: int | None = None, launch_layers: list[int | None] | None = None,
              workers: int | None = None, log: Any = None, ep_experts: int | None = None) -> list[Item]:
    """Predicted and floor time of every launch of the recorded step (see module docstring).
    `ep_experts`: an expert-parallel rank (the routed experts of all ranks together): its MoE
    stages and combine are costed for the rank's expected share of the routed rows (EP_ROUTING)."""
    from autotune import costmodel
    from autotune.problems import key_dims, m_of, model_for
    from autotune.search import score
    from kdsl.targets import get_target

    target = get_target(arch)
    g = costmodel.launch_gap_us(target, gap)
    reports = compile_reports(rec.launches, arch, workers, log)
    weight = layer_weights(rec.layers, cfg.first_k_dense_replace, full_layers or rec.layers)

    items: list[Item] = []
    for i, r in enumerate(rec.launches):
        k = r.kernel
        layer = _layer_of(launch_layers or [], i)
        prob = dict(r.dims)
        if "PS" in prob:  # paged decode attention: the context sets its bytes and split count
            prob["CTX"] = ctx + rec.q_len
        prob.update(ep_share(k, prob, ep_experts))
        m = m_of(k, r.dims)
        rep = reports[_report_key(r, arch)]
        try:
            fig = score(k, target, prob, m, dict(r.config), rep)
            pred, floor = float(fig["predicted_us"]), float(fig["floor_us"])
            bound = fig.get("bound", "")
        except Exception as e:  # noqa: BLE001 - a launch the model cannot score is shown, not dropped
            pred, floor, bound = math.nan, math.nan, f"unscored: {type(e).__name__}: {e}"[:80]
        names = (k.name, model_for(k).configs_of)      # a configs_of kernel keeps its base's looked-up numerics
        looks = [e for e in rec.lookups if e["kernel"] in names and e["launch_index"] is not None
                 and e["launch_index"] <= i]
        tuned = "no lookup" if not looks else ("tuned" if looks[-1]["hit"] else "fallback")
        keys = key_dims(k, prob) or sorted(prob)
        label = _shape_label(prob, keys) + f" M={m}"
        items.append(Item("kdsl", k.name, label, layer, pred, floor, g, weight(layer),
                          {a: b for a, b in r.config.items()}, tuned, bound))
    for op in rec.mode.ops:
        dt = op.dtypes[0] if op.dtypes else "bfloat16"
        peak = target.peak_tflops.get({"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(dt, "bf16"),
                                      target.peak_tflops["bf16"])
        mem = op.nbytes / (target.hbm_gbps * 1e9) * 1e6
        comp = op.flops / (peak * 1e12) * 1e6
        t = max(mem, comp)
        shape = " x ".join("[" + ",".join(map(str, s)) + "]" for s in op.shapes[:3])
        items.append(Item("torch", op.name, shape, op.layer, t, t, g, weight(op.layer), {}, "torch op",
                          "memory" if mem >= comp else "compute"))
    lat, bw = ALLREDUCE.get(arch, (10.0, 300.0))
    for c in rec.mode.collectives:     # what the tensor-parallel forward called (bench.meta_model.recording_comm)
        link = 2 * (tp - 1) / tp * c.nbytes if c.kind == "all_reduce" else (tp - 1) / tp * c.nbytes * tp
        t = link / (bw * 1e9) * 1e6
        items.append(Item("allreduce", c.kind.replace("_", "-"), f"{c.nbytes} B tp={tp}", c.layer, lat + t, t, 0.0,
                          weight(c.layer), {}, "", "link"))
    return items


def launch_layers(rec: StepRecord) -> list[int | None]:
    from bench.meta_model import launch_layers as ll

    return ll(rec.mode, len(rec.launches))


def summarize(items: list[Item], rec: StepRecord, cfg: Any, full_layers: int, top: int = 10) -> dict[str, Any]:
    """Totals, per-layer launch counts, the top items by share and the fallbacks."""
    pred = sum((it.predicted_us + it.gap_us) * it.weight for it in items if math.isfinite(it.predicted_us))
    pred_rec = sum(it.predicted_us + it.gap_us for it in items if math.isfinite(it.predicted_us))
    floor = sum(it.floor_us * it.weight for it in items if math.isfinite(it.floor_us))
    gaps = sum(it.gap_us * it.weight for it in items)
    links = [it for it in items if it.kind == "allreduce" and math.isfinite(it.predicted_us)]
    coll = sum((it.predicted_us + it.gap_us) * it.weight for it in links)
    coll_floor = sum(it.floor_us * it.weight for it in links)
    n_kdsl = sum(it.weight for it in items if it.kind == "kdsl")
    n_torch = sum(it.weight for it in items if it.kind == "torch")
    # launches per layer of each kind, counted over the layers that stand for the most (the MoE
    # layers between the first and the last, see layer_weights)
    in_layers = [it for it in items if it.layer is not None and it.kind != "allreduce"]
    kind_of = lambda it: "dense" if it.layer < cfg.first_k_dense_replace else "moe"  # noqa: E731
    top_w = {}
    for it in in_layers:
        top_w[kind_of(it)] = max(top_w.get(kind_of(it), 0.0), it.weight)
    per_layer: dict[str, dict[str, int]] = {}
    for kind, w in top_w.items():
        rep = [it for it in in_layers if kind_of(it) == kind and it.weight == w]
        n = len({it.layer for it in rep})
        per_layer[kind] = {"kdsl": sum(it.kind == "kdsl" for it in rep) // n,
                           "torch": sum(it.kind == "torch" for it in rep) // n, "layers": n}
    groups: dict[tuple, dict[str, Any]] = collections.OrderedDict()
    for it in items:
        key = (it.kind, it.name, it.shape)
        g = groups.setdefault(key, {"kind": it.kind, "name": it.name, "shape": it.shape, "count": 0.0,
                                    "us": 0.0, "floor_us": 0.0, "per_launch_us": it.predicted_us,
                                    "config": it.config, "tuned": it.tuned})
        g["count"] += it.weight
        g["us"] += (it.predicted_us + it.gap_us) * it.weight
        g["floor_us"] += it.floor_us * it.weight
    ranked = sorted(groups.values(), key=lambda g: -g["us"] if math.isfinite(g["us"]) else 0)
    for g in ranked:
        g["share"] = g["us"] / pred if pred else 0.0
    fb = [g for g in ranked if g["kind"] == "kdsl" and g["tuned"] != "tuned"]
    return {"q_len": rec.q_len, "launches": round(n_kdsl + n_torch), "kdsl_launches": round(n_kdsl),
            "torch_launches": round(n_torch), "launches_per_layer": per_layer, "predicted_us": pred,
            "floor_us": floor, "gaps_us": gaps, "collective_us": coll,
            # the launches alone (no gaps, no collectives) against their own floor
            "kernels_us": pred - gaps - coll, "kernels_floor_us": floor - coll_floor,
            "predicted_us_recorded_layers": pred_rec, "ratio": pred / floor if floor else math.inf,
            # every kernel at its floor, these launches' gaps and the collectives as predicted: the
            # ratio no kernel change can beat (only fewer launches or cheaper collectives can)
            "launch_bound_ratio": (floor - coll_floor + gaps + sum(it.predicted_us * it.weight for it in links)) / floor
            if floor else math.inf,
            "layers_recorded": rec.layers, "layers": full_layers, "host_ops": rec.mode.host_ops,
            "device_reads": len(rec.mode.device_reads), "record_s": round(rec.record_s, 2),
            "top": ranked[:top], "fallbacks": [{"name": g["name"], "shape": g["shape"], "why": g["tuned"],
                                                "count": g["count"]} for g in fb],
            "items": ranked}


def print_summary(s: dict[str, Any], head: str) -> None:
    print(f"\n== {head}: q_len {s['q_len']} ==")
    print(f"launches {s['launches']} ({s['kdsl_launches']} kdsl + {s['torch_launches']} torch);  per layer: "
          + "; ".join(f"{k} {v['kdsl']} kdsl + {v['torch']} torch" for k, v in s["launches_per_layer"].items()))
    print(f"predicted {s['predicted_us'] / 1e3:.3f} ms (launch gaps {s['gaps_us'] / 1e3:.3f} ms)  floor "
          f"{s['floor_us'] / 1e3:.3f} ms  ratio {s['ratio']:.2f}x   [{s['layers']} layers"
          + (f", {s['layers_recorded']} recorded and scaled" if s["layers_recorded"] != s["layers"] else "") + "]")
    kf = s["kernels_floor_us"]
    print(f"kernels {s['kernels_us'] / 1e3:.3f} ms vs their floor {kf / 1e3:.3f} ms = "
          f"{s['kernels_us'] / kf if kf else math.inf:.2f}x; collectives {s['collective_us'] / 1e3:.3f} ms")
    print(f"every kernel at its floor, with these launches' gaps and collectives: ratio {s['launch_bound_ratio']:.2f}x "
          "(no kernel change gets below it)")
    print(f"host-side tensor ops {s['host_ops']}, device->host reads in the forward {s['device_reads']}")
    print(f"{'share':>6} {'total us':>10} {'count':>6} {'each us':>9}  item")
    for g in s["top"]:
        print(f"{g['share']:>6.1%} {g['us']:>10.1f} {g['count']:>6.0f} {g['per_launch_us']:>9.2f}  "
              f"{g['kind']} {g['name']} {g['shape']}" + ("" if g["kind"] != "kdsl" else f"  [{g['tuned']}]"))
    if s["fallbacks"]:
        print("default configs (no tuned file / the op looks none up):")
        for f in s["fallbacks"]:
            print(f"  {f['name']} {f['shape']}  ({f['why']}, x{f['count']:.0f})")
    else:
        print("no launch fell back to a default config")


def plot(summaries: list[tuple[str, dict[str, Any]]], path: str) -> None:
    """Waterfall of each step's items (cumulative predicted time, floor beside it) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(summaries), 1, figsize=(12, 4.5 * len(summaries)), squeeze=False)
    for ax, (title, s) in zip(axes[:, 0], summaries):
        groups = [g for g in s["items"] if math.isfinite(g["us"])][:25]
        rest = s["predicted_us"] - sum(g["us"] for g in groups)
        labels = [f"{g['name']} {g['shape']}"[:48] for g in groups] + ["rest"]
        vals = [g["us"] / 1e3 for g in groups] + [max(0.0, rest) / 1e3]
        floors = [g["floor_us"] / 1e3 for g in groups] + [0.0]
        start = 0.0
        for i, (v, f) in enumerate(zip(vals, floors)):
            ax.barh(i, v, left=start, color="tab:blue" if i < len(groups) else "tab:gray")
            ax.barh(i, f, left=start, color="tab:orange", height=0.35)
            start += v
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms (blue: predicted incl. launch gaps, cumulative; orange: floor)")
        ax.set_title(f"{title}: predicted {s['predicted_us'] / 1e3:.2f} ms, floor {s['floor_us'] / 1e3:.2f} ms "
                     f"({s['ratio']:.2f}x), {s['launches']} launches")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure_gpu(cfg: Any, experts: str, batch: int, ctx: int, q_len: int, iters: int = 20) -> dict[str, Any]:
    """On a GPU: the device step (`KimiModel.step`, random weights, `cfg`'s layers, a paged cache at
    context `ctx`) timed eagerly and replayed from a CUDA/HIP graph, each the median of `iters` runs
    bracketed by device events. The lengths are reset on the device before each step (inside the
    graph too), so every run sees the same context."""
    import torch

    from bench.meta_model import meta_checkpoint
    from models.formats import QuantLinear
    from models.kimi import KimiModel

    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}
    ck = meta_checkpoint(cfg, experts)

    def real(t: torch.Tensor) -> torch.Tensor:
        if t.dtype in (torch.int32, torch.int8, torch.uint8):
            return torch.randint(-2 ** 31, 2 ** 31 - 1, t.shape, dtype=torch.int64, device="cuda").to(t.dtype)
        return (torch.randn(t.shape, device="cuda", dtype=torch.float32) * 0.02).to(t.dtype)

    for n, w in list(ck.weights.items()):
        ck.weights[n] = w.__class__(**{**w.__dict__, "packed": real(w.packed), "scale": real(w.scale).abs() * 0.01}) \
            if isinstance(w, QuantLinear) else real(w)
    model = KimiModel(ck, backend="triton", dtype=torch.bfloat16, capture_ids=(), device="cuda")
    cache = model.new_cache(batch, ctx + q_len, page_size=64)
    cache.table.reserve_all(ctx + q_len)
    for kv in cache.kv:
        kv.normal_(0, 0.1)
    tokens = torch.ones(batch, q_len, dtype=torch.long, device="cuda")

    def step() -> None:
        cache.table.lens.fill_(ctx)
        model.step(cache, tokens)

    def timed(fn: Any) -> float:
        ts = []
        for _ in range(iters):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3)
        return sorted(ts)[len(ts) // 2]

    step()
    torch.cuda.synchronize()
    out["eager_us"] = timed(step)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        g.replay()
        torch.cuda.synchronize()
        out["graph_us"] = timed(g.replay)
    except Exception as e:  # noqa: BLE001
        out["graph_us"] = None
        out["graph_error"] = f"not capturable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return out


# ---------------------------------------------------------------------------------------------
# CLI

def _args(argv: list[str] | None) -> argparse.Namespace:
    class P(argparse.ArgumentParser):
        def error(self, message: str) -> None:
            raise UsageError(f"bench.step: {message}")

    p = P(prog="python -m bench.step", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="kimi-k2.5", help="config.json of the target, or 'kimi-k2.5' (default)")
    p.add_argument("--arch", default="gfx942,gfx950", help="comma-separated: gfx942, gfx950, sm90")
    p.add_argument("--experts", default="w4a8,w4a16", help="routed-expert formats, comma-separated: w4a8, w4a16, mxfp4 (default w4a8,w4a16)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--ctx", type=int, default=8192, help="cached tokens per sequence (default 8192)")
    p.add_argument("--q-lens", default="1,4", help="q_len per step: 1 = decode, 4 = verify (default 1,4)")
    p.add_argument("--layers", type=int, default=None, help="record this many layers and scale to the config's count")
    p.add_argument("--tp", type=int, default=1, help="rank 0 of an N-way tensor-parallel model (models.parallel), its collectives costed")
    p.add_argument("--moe-parallel", default="tp", choices=("tp", "ep"), help="routed experts with --tp: tp (intermediate / N) or ep (E / N whole experts); default tp")
    p.add_argument("--gap", default="graph", choices=("graph", "eager"), help="launch gap figure (default graph)")
    p.add_argument("--top", type=int, default=10, help="items listed per step (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    p.add_argument("--plot", default=None, help="write the waterfall PNG here")
    p.add_argument("--workers", type=int, default=None, help="parallel AOT compiles (default min(4, cores))")
    p.add_argument("--no-measure", action="store_true", help="skip the GPU measurement even when a GPU is present")
    p.add_argument("--o-proj-norm", default="auto", choices=("auto", "on", "off"),
                   help="world size 1: o_proj runs the residual-add norm in its last programs (KimiModel.o_proj_norm): "
                        "auto (where the tuned files say it pays, ops.splitk_norm.fused_pays), on, off (default auto)")
    p.add_argument("--add-norm-in-gemm", default="auto", choices=("auto", "on", "off"),
                   help="the residual adds and norms run in the prologue of the GEMM that reads the normed rows "
                        "(KimiModel.add_norm_in_gemm: the post-attention one in the shared gate|up + router GEMM; "
                        "with --tp > 1 also a layer's input norm in its q_a|kv_a GEMM): auto (where the tuned files "
                        "say it pays for every size up to --batch x 8 rows, ops.mla.MAX_Q_LEN; "
                        "ops.gemm_addnorm.addnorm_pays), on, off (default auto)")
    p.add_argument("--route-in-gemm", default="auto", choices=("auto", "on", "off"),
                   help="where the shared gate|up + router GEMM adds and norms its rows, its last program also "
                        "routes a decode or verify step's tokens instead of moe_route_align's launch "
                        "(KimiModel.route_in_gemm): auto (where the tuned files say it pays at the step's rows, "
                        "ops.gemm_addnorm.route_tail_pays), on, off (default auto)")
    _add_draft_args(p)
    a = p.parse_args(argv)
    for flag, v, lo, hi in (("--batch", a.batch, 1, 4096), ("--ctx", a.ctx, 1, 1 << 22), ("--tp", a.tp, 1, 64),
                            ("--top", a.top, 1, 1000)):
        if not lo <= v <= hi:
            raise UsageError(f"bench.step: {flag} must be in {lo}..{hi}, got {v}")
    if a.layers is not None and not 1 <= a.layers <= 1024:
        raise UsageError(f"bench.step: --layers must be in 1..1024, got {a.layers}")
    if a.workers is not None and not 1 <= a.workers <= 256:
        raise UsageError(f"bench.step: --workers must be in 1..256, got {a.workers}")
    a.archs = [x.strip() for x in a.arch.split(",") if x.strip()]
    for x in a.archs:
        if x not in ("gfx942", "gfx950", "sm90"):
            raise UsageError(f"bench.step: --arch: unknown arch {x!r} (gfx942, gfx950, sm90)")
    a.fmts = [x.strip() for x in a.experts.split(",") if x.strip()]
    for x in a.fmts:
        if x not in EXPERT_FORMATS:
            raise UsageError(f"bench.step: --experts: unknown format {x!r} ({', '.join(EXPERT_FORMATS)})")
    try:
        a.qls = [int(x) for x in a.q_lens.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"bench.step: --q-lens takes ints, got {a.q_lens!r}") from None
    if not a.qls or any(not 1 <= q <= 16 for q in a.qls):
        raise UsageError(f"bench.step: --q-lens values must be in 1..16, got {a.q_lens!r}")
    if a.plot and os.path.isdir(a.plot):
        raise UsageError(f"bench.step: --plot {a.plot!r} is a folder; give a .png path")
    _check_draft_args(a)
    return a


def main(argv: list[str] | None = None) -> int:
    try:
        a = _args(argv)
        try:
            full = load_model_config(a.config, a.tp, a.moe_parallel)
            cfg = load_model_config(a.config, a.tp, a.moe_parallel, layers=a.layers)
        except (OSError, ValueError) as e:
            raise UsageError(f"bench.step: --config {a.config!r}: {str(e).splitlines()[0] if str(e) else e}") from None
        dcfg = _draft_config_or_usage(a)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    from autotune import costmodel

    log = (lambda m: print(m, file=sys.stderr)) if a.json else (lambda m: print(m, flush=True))
    doc: dict[str, Any] = {"config": a.config, "batch": a.batch, "ctx": a.ctx, "tp": a.tp, "gap": a.gap,
                           "o_proj_norm": a.o_proj_norm, "add_norm_in_gemm": a.add_norm_in_gemm,
                           "route_in_gemm": a.route_in_gemm,
                           "layers": full.num_hidden_layers, "layers_recorded": cfg.num_hidden_layers,
                           "assumptions": {"launch_gap_us": costmodel.LAUNCH_GAP_US,
                                           "allreduce_latency_us_bw_gbps": ALLREDUCE,
                                           "lds_bytes_per_clk": costmodel.LDS_BYTES_PER_CLK},
                           "steps": []}
    if a.model != "target":
        doc.update(model=a.model, draft_config=a.draft_config, draft_steps=a.draft_steps)
    ep = full.n_routed_experts if a.tp > 1 and a.moe_parallel == "ep" else None
    if ep:
        doc["assumptions"]["expert_parallel_routing"] = EP_ROUTING
        if not a.json and a.model != "draft":
            print(f"expert parallel: {EP_ROUTING}")
    plots = []
    for fmt in (a.fmts if a.model != "draft" else []):
        mode = HostShadowMode()
        t0 = time.time()
        model = build_model(cfg, fmt, mode, a.tp, a.moe_parallel)
        model.o_proj_norm = {"auto": "auto", "on": True, "off": False}[a.o_proj_norm]
        model.add_norm_in_gemm = {"auto": "auto", "on": True, "off": False}[a.add_norm_in_gemm]
        model.route_in_gemm = {"auto": "auto", "on": True, "off": False}[a.route_in_gemm]
        log(f"built {fmt} model ({cfg.num_hidden_layers} layers) on meta in {time.time() - t0:.1f}s")
        for arch in a.archs:
            for ql in a.qls:
                rec = record_step(cfg, fmt, arch, a.batch, a.ctx, ql, model, mode)
                items = cost_step(rec, cfg, arch, a.ctx, a.gap, a.tp, full.num_hidden_layers,
                                  launch_layers(rec), a.workers, log, ep_experts=ep)
                s = summarize(items, rec, cfg, full.num_hidden_layers, a.top)
                head = f"{arch} {fmt} batch {a.batch} ctx {a.ctx} tp {a.tp}"
                if not a.json:
                    print_summary(s, head)
                s.update(arch=arch, experts=fmt)
                doc["steps"].append(s)
                plots.append((f"{head} q_len {ql}", s))
    if a.model != "target":
        draft_rows(a, dcfg, doc, plots, log)
    if a.model == "both":
        spec_lines(a, doc)
    if a.plot:
        try:
            plot(plots, a.plot)
            log(f"wrote {a.plot}")
        except ImportError:
            print("bench.step: --plot needs matplotlib (pip install matplotlib, or the 'bench' extra)", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"bench.step: --plot {a.plot!r}: {e.strerror or e}", file=sys.stderr)
            return 2
    try:
        import torch

        gpu = torch.cuda.is_available() and not a.no_measure and a.model != "draft"
    except Exception:  # noqa: BLE001
        gpu = False
    if gpu and (cfg.num_hidden_layers > 4 or a.tp > 1):
        log("note: not measured on the GPU: that needs the weights in memory and one process per rank; pass "
            "--layers 2..4 and --tp 1 (the prediction for the same recorded layers is printed beside it)")
        gpu = False
    if gpu:
        for fmt in a.fmts:
            for ql in a.qls:
                try:
                    m = measure_gpu(cfg, fmt, a.batch, a.ctx, ql)
                    here = [s for s in doc["steps"] if s["experts"] == fmt and s["q_len"] == ql]
                    m["predicted_us_same_layers"] = {s["arch"]: s["predicted_us_recorded_layers"] for s in here}
                except Exception as e:  # noqa: BLE001
                    m = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}
                m.update(experts=fmt, q_len=ql)
                doc.setdefault("measured", []).append(m)
                if not a.json:
                    print(f"measured {fmt} q_len {ql}: {m}")
    if a.json:
        for s in doc["steps"]:
            if a.model != "target":
                s.setdefault("model", "target")
            s.pop("items", None)
        print(json.dumps(doc, indent=1, default=str, allow_nan=False) if _finite(doc) else
              json.dumps(_nan_to_none(doc), indent=1, default=str))
    return 0


def _finite(x: Any) -> bool:
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return all(_finite(v) for v in x)
    return True


def _nan_to_none(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_to_none(v) for v in x]
    return x



# ---------------------------------------------------------------------------------------------
# the EAGLE-3 draft step (--model draft|both) and the spec step (--model both)

DRAFT_MODELS = ("target", "draft", "both")
# Accept lengths users report for Kimi-K2.5 + its EAGLE-3 draft (REFERENCE section 8, chain k=3):
# tokens committed per spec step, to turn the spec step into a time per token comparable with TPOT.
ACCEPT_LENGTHS = {"MT-Bench": 2.69, "GSM8K": 3.20}
ACCEPT_LENGTHS_K = 3   # the chain length those figures were measured at (other k: no per-token figure)
# the draft is one decoder layer; the cost and summary code reads these two fields of a layout
_DRAFT_LAYOUT = type("DraftLayout", (), {"first_k_dense_replace": 0, "num_hidden_layers": 1})()


def load_draft_config(spec: str) -> Any:
    """`spec`: 'kimi-k2.5-eagle3' (bench.meta_model.KIMI_K25_EAGLE3_CONFIG) or a draft config.json path;
    raises ValueError (or OSError) when it is not a Llama-style or MLA EAGLE-3 draft config."""
    from bench.meta_model import KIMI_K25_EAGLE3_CONFIG
    from models.config import ConfigError, Eagle3Config, load_config, parse_config

    try:
        cfg = parse_config(KIMI_K25_EAGLE3_CONFIG) if spec in ("kimi-k2.5-eagle3", "kimi-eagle3") else load_config(spec)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if not isinstance(cfg, Eagle3Config):
        raise ValueError(f"{spec}: not an EAGLE-3 draft config")
    if cfg.quantization is not None:
        raise ValueError(f"{spec}: quantized drafts are not modelled (the released Kimi-K2.5 draft is bf16)")
    return cfg


def _add_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="target", choices=DRAFT_MODELS,
                   help="target (default): the target's steps; draft: the EAGLE-3 draft's step (TP1, bf16) at each "
                        "--q-lens; both: both, and the spec step (verify + draft steps) per arch and format")
    p.add_argument("--draft-config", default="kimi-k2.5-eagle3",
                   help="the draft's config.json, or 'kimi-k2.5-eagle3' (default; lightseekorg/kimi-k2.5-eagle3, "
                        "stated choices in bench/meta_model.py)")
    p.add_argument("--draft-steps", type=int, default=3,
                   help="k, draft tokens per spec step (default 3): verify at q_len k+1, k-1 draft steps at q_len 1, "
                        "one draft extend at q_len k+1 (--model both)")


def _check_draft_args(a: argparse.Namespace) -> None:
    if not 1 <= a.draft_steps <= 15:
        raise UsageError(f"bench.step: --draft-steps must be in 1..15, got {a.draft_steps}")
    if a.model != "target" and a.tp != 1:
        raise UsageError("bench.step: --tp: the draft runs replicated at TP1 on every rank; use --model target with --tp")
    if a.model == "both":   # the spec step needs the draft's single-row step and the verify / extend width
        a.qls = sorted(set(a.qls) | {1, a.draft_steps + 1})


def _draft_config_or_usage(a: argparse.Namespace) -> Any:
    if a.model == "target":
        return None
    try:
        return load_draft_config(a.draft_config)
    except (OSError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"bench.step: --draft-config {a.draft_config!r}: {msg}") from None


def record_draft_step(dcfg: Any, arch: str, batch: int, ctx: int, q_len: int, draft: Any = None,
                      mode: HostShadowMode | None = None, hidden: str | None = None) -> StepRecord:
    """Record one draft step (`bench.meta_model.run_draft_step`: carried state at q_len 1, the target's
    aux rows above) as `record_step` records the target's."""
    from bench.meta_model import build_draft, run_draft_step

    mode = mode or HostShadowMode()
    if draft is None:
        draft = build_draft(dcfg)
    return _record(mode, arch, q_len, 1, lambda: run_draft_step(draft, mode, batch, ctx, q_len, hidden))


def draft_step_problems(dcfg: Any, arch: str, q_lens: list[int], batch: int = 1, ctx: int = 8192
                        ) -> list[tuple[Any, dict[str, Any], int]]:
    """As `step_problems`, for the draft's steps at `q_lens` (for tune-model --model draft)."""
    from bench.meta_model import build_draft

    mode = HostShadowMode()
    draft = build_draft(dcfg)
    return _problems([record_draft_step(dcfg, arch, batch, ctx, ql, draft, mode) for ql in q_lens], batch)


def draft_summary(dcfg: Any, arch: str, batch: int, ctx: int, q_len: int, gap: str, top: int, draft: Any,
                  mode: HostShadowMode, workers: int | None = None, log: Any = None) -> dict[str, Any]:
    """Record and cost one draft step; the summary `summarize` makes, launches counted as one layer."""
    rec = record_draft_step(dcfg, arch, batch, ctx, q_len, draft, mode)
    items = cost_step(rec, _DRAFT_LAYOUT, arch, ctx, gap, 1, 1, None, workers, log)
    s = summarize(items, rec, _DRAFT_LAYOUT, 1, top)
    s["launches_per_layer"] = {"draft": {"kdsl": s["kdsl_launches"], "torch": s["torch_launches"], "layers": 1}}
    s.update(model="draft", hidden="carry" if q_len == 1 else "aux")
    return s


def draft_rows(a: argparse.Namespace, dcfg: Any, doc: dict[str, Any], plots: list, log: Any) -> None:
    """The draft's step at each --q-lens value and arch: printed and appended to doc["steps"]."""
    from bench.meta_model import build_draft

    t0 = time.time()
    draft = build_draft(dcfg)
    log(f"built the draft ({dcfg.architecture}, hidden {dcfg.hidden_size}, {dcfg.num_attention_heads} heads, "
        f"vocab {dcfg.draft_vocab_size}) on meta in {time.time() - t0:.1f}s")
    mode = HostShadowMode()
    for arch in a.archs:
        for ql in a.qls:
            s = draft_summary(dcfg, arch, a.batch, a.ctx, ql, a.gap, a.top, draft, mode, a.workers, log)
            head = f"{arch} draft (EAGLE-3, TP1, bf16) batch {a.batch} ctx {a.ctx}"
            if not a.json:
                print_summary(s, head)
            s.update(arch=arch, experts=None)
            doc["steps"].append(s)
            plots.append((f"{head} q_len {ql}", s))


def spec_step(target_verify: dict[str, Any], draft_q1: dict[str, Any], draft_ext: dict[str, Any], k: int,
              target_decode: dict[str, Any] | None = None) -> dict[str, Any]:
    """One chain spec step as models/spec.py runs it: the target's verify at q_len k+1, k-1 draft steps at
    q_len 1 (the first of the k drafts comes from the previous step's extend) and the draft's extend over
    the verified rows at q_len k+1; predicted and floor summed, and per committed token at the stated
    accept lengths (a figure to compare with TPOT; the plain decode step's is its own time)."""
    parts = [("target verify", target_verify, 1), ("draft", draft_q1, k - 1), ("draft extend", draft_ext, 1)]
    pred = sum(s["predicted_us"] * n for _, s, n in parts)
    floor = sum(s["floor_us"] * n for _, s, n in parts)
    accept = ACCEPT_LENGTHS if k == ACCEPT_LENGTHS_K else {}
    out = {"k": k, "predicted_us": pred, "floor_us": floor, "ratio": pred / floor if floor else math.inf,
           "launches": sum(s["launches"] * n for _, s, n in parts),
           "parts": [{"what": w, "q_len": s["q_len"], "count": n, "predicted_us": s["predicted_us"],
                      "floor_us": s["floor_us"]} for w, s, n in parts],
           "per_token_us": {f"{name} (accept {al})": pred / al for name, al in accept.items()},
           "per_token_floor_us": {f"{name} (accept {al})": floor / al for name, al in accept.items()}}
    if target_decode is not None:
        out["plain_decode_us"] = target_decode["predicted_us"]
        out["plain_decode_floor_us"] = target_decode["floor_us"]
    return out


def spec_lines(a: argparse.Namespace, doc: dict[str, Any]) -> None:
    """The spec step per arch and expert format (--model both): doc["spec_steps"], printed."""
    k = a.draft_steps
    by = {(s.get("model", "target"), s["arch"], s.get("experts"), s["q_len"]): s for s in doc["steps"]}
    for arch in a.archs:
        d1, dk = by.get(("draft", arch, None, 1)), by.get(("draft", arch, None, k + 1))
        for fmt in a.fmts:
            tv, t1 = by.get(("target", arch, fmt, k + 1)), by.get(("target", arch, fmt, 1))
            if tv is None or d1 is None or dk is None:
                continue
            sp = spec_step(tv, d1, dk, k, t1)
            sp.update(arch=arch, experts=fmt, batch=a.batch, ctx=a.ctx)
            doc.setdefault("spec_steps", []).append(sp)
            if not a.json:
                print_spec(sp)


def print_spec(sp: dict[str, Any]) -> None:
    print(f"\n== {sp['arch']} {sp['experts']} batch {sp['batch']} ctx {sp['ctx']}: spec step (chain, k={sp['k']}) ==")
    print("  " + " + ".join(f"{p['count']} x {p['what']} q_len {p['q_len']} ({p['predicted_us'] / 1e3:.3f} ms)"
                            for p in sp["parts"]))
    print(f"spec step predicted {sp['predicted_us'] / 1e3:.3f} ms  floor {sp['floor_us'] / 1e3:.3f} ms  "
          f"ratio {sp['ratio']:.2f}x  ({sp['launches']} launches)")
    per = "; ".join(f"{n}: {v / 1e3:.3f} ms (floor {sp['per_token_floor_us'][n] / 1e3:.3f})"
                    for n, v in sp["per_token_us"].items()) or f"no reported accept length at k={sp['k']}"
    plain = (f"; plain decode {sp['plain_decode_us'] / 1e3:.3f} ms (floor {sp['plain_decode_floor_us'] / 1e3:.3f})"
             if "plain_decode_us" in sp else "")
    print(f"per token (compare with TPOT): {per}{plain}")


if __name__ == "__main__":
    sys.exit(main())
