"""The tuner: per M bucket, build the pruned space, AOT-compile candidates in parallel (reports
shared between buckets that compile to the same code), rank them (static cost model, or
measurement on a GPU), and write one JSON file atomically.

Reproducible for a seed: the candidate set is a seeded permutation cut at `max_candidates`; the
time budget only stops a run early (the provenance then says `budget_hit: true`).
"""
from __future__ import annotations

import concurrent.futures as cf
import datetime
import itertools
import math
import multiprocessing as mp
import os
import sys
import time
from typing import Any

from kdsl.targets import Target, get_target

from . import costmodel
from .buckets import ANY, bucket_for, bucket_m, bucket_order, parse_bucket
from .problems import (LAUNCH_ONLY_KEYS, MODEL_DIMS, launch_only_keys, extra_bytes, full_dims, loop_iters, model_for, problem_key, required_dims,
                       shared_bytes, strip_m)
from .space import build
from .store import (CONFIG_DIR, SCHEMA_VERSION, file_name, file_path, helpers_hash, kernel_helpers, kernel_source_hash,
                    load_file, save_file)

DEFAULT_MAX_CANDIDATES = 32
GRACE_S = 15.0  # how long compiles already running may finish after the budget


def _worker_report(name: str, arch: str, config: dict[str, Any], problem: dict[str, Any]) -> dict[str, Any]:
    """Child process: compile one candidate and return its report as a dict (never raises)."""
    import warnings

    warnings.simplefilter("ignore")
    from kdsl import aot
    from kdsl.kernel import REGISTRY

    try:
        return aot.report(REGISTRY[name], arch, config, problem).to_dict()
    except Exception as e:  # noqa: BLE001 - a candidate failing must not stop the search
        return {"ok": False, "errors": [f"{type(e).__name__}: {e}"[:300]], "config": config}


# M enters the compiled code only as the `M == 1` constant and a divisibility-by-16 hint; both
# barely move the resource report, so each candidate is compiled once, at this M, for all buckets.
REPORT_M = 16


def _run_job(name: str, arch: str, config: dict[str, Any], problem: dict[str, Any]) -> dict[str, Any]:
    return _worker_report(name, arch, config, problem)  # looked up at call time (tests spy on it)


def compile_m(kernel: Any, problem: dict[str, Any], m: int, target: Target) -> int:
    """The M a candidate of the bucket of M=m is compiled at: REPORT_M, unless M reaches a static dim
    of the kernel (`moe_route_align`'s token tile MB = p2(M), say: a different program per M), then m."""
    def static_at(x: int) -> dict[str, Any]:
        return {d: v for d, v in full_dims(kernel, problem, x, None, target).items() if d in kernel.static}
    return REPORT_M if static_at(m) == static_at(REPORT_M) else m


def _cfg_key(cfg: dict[str, Any]) -> tuple:
    return tuple(sorted(cfg.items()))


def _numerics(cfg: dict[str, Any], kernel: Any = None) -> tuple:
    """The part of a config that sets a float kernel's rounding: all but its launch-only keys
    (problems.launch_only_keys; LAUNCH_ONLY_KEYS without a kernel)."""
    keys = LAUNCH_ONLY_KEYS if kernel is None else launch_only_keys(kernel, cfg)
    return tuple(sorted((k, v) for k, v in cfg.items() if k not in keys))


def _shared_numerics(kernel: Any, target: Target, prob: dict[str, Any], buckets: list[Any],
                     jobs: dict[tuple, tuple[dict, dict]], reports: dict[tuple, dict[str, Any]]) -> tuple | None:
    """For a kernel whose batch-invariant launches take their numerics keys from the M=1 entry at
    every M (ProblemModel.shared_numerics): the numerics tile, among every compiled candidate, with
    the least summed slowdown over the buckets (each bucket's time with that tile and its best launch
    keys, over the bucket's best time with any tile). Picking the M=1 bucket's favourite instead can
    cost the verify rows twice their floor (a 1-row tile re-reads the weights per row)."""
    total, per = _tile_totals(kernel, target, prob, buckets, jobs, reports)
    if not total:
        return None
    first = buckets[0]
    return min(total, key=lambda nk: (total[nk], per[nk][first], nk))


def _tile_totals(kernel: Any, target: Target, prob: dict[str, Any], buckets: list[Any],
                 jobs: dict[tuple, tuple[dict, dict]], reports: dict[tuple, dict[str, Any]]
                 ) -> tuple[dict[tuple, float], dict[tuple, dict[Any, float]]]:
    """Per numerics tile: its summed slowdown over the buckets (tiles compiled for every bucket) and
    its best time at each bucket, among the compiled candidates."""
    best: dict[Any, float] = {}
    per: dict[tuple, dict[Any, float]] = {}
    for (ck, cm), (c, _) in jobs.items():
        rep = reports.get((ck, cm))
        if rep is None:
            continue
        nk = _numerics(c, kernel)
        for b in buckets:
            if compile_m(kernel, prob, bucket_m(b), target) != cm:
                continue
            t = float(score(kernel, target, prob, bucket_m(b), c, rep)["predicted_us"])
            if not math.isfinite(t):
                continue
            d = per.setdefault(nk, {})
            d[b] = min(d.get(b, math.inf), t)
            best[b] = min(best.get(b, math.inf), t)
    total = {nk: sum(d[b] / best[b] for b in buckets) for nk, d in per.items() if all(b in d for b in buckets)}
    return total, per


def _tile_best_at(kernel: Any, target: Target, prob: dict[str, Any], scored_prob: dict[str, Any], m: int,
                  jobs: dict[tuple, tuple[dict, dict]], reports: dict[tuple, dict[str, Any]],
                  numerics: tuple) -> dict[str, Any] | None:
    """The compiled config with numerics tile `numerics` that scores best at M=m (None: none)."""
    best = None
    cm = compile_m(kernel, prob, m, target)
    for (ck, jm), (c, _) in jobs.items():
        rep = reports.get((ck, jm))
        if rep is None or jm != cm or _numerics(c, kernel) != numerics:
            continue
        t = float(score(kernel, target, scored_prob, m, c, rep)["predicted_us"])
        if math.isfinite(t) and (best is None or t < best[0]):
            best = (t, c)
    return None if best is None else best[1]


LAUNCH_TUNABLE_TILES = 2  # tiles (joint favourites, then the first bucket's) whose launch tunables are compiled


def _launch_tunable_jobs(kernel: Any, target: Target, prob: dict[str, Any], scored_prob: dict[str, Any],
                         buckets: list[Any], spaces: dict[Any, Any], jobs: dict[tuple, tuple[dict, dict]],
                         reports: dict[tuple, dict[str, Any]], tunables: tuple[str, ...]) -> dict[tuple, tuple[dict, dict]]:
    """Jobs that give the leading numerics tiles every combination of the kernel's launch-only
    tunables (a BLOCK_M, gemm_bf16_swiglu's N_TILES) in each bucket's domain, before the joint pick:
    the sample held each tile with random values of them, so a tile the first bucket favours could
    lose the joint pick on a bucket where it only ran with a poor one. The leading tiles: the
    LAUNCH_TUNABLE_TILES best by summed slowdown and as many best at the first bucket; each keeps
    the other keys of its best config at the first bucket."""
    total, per = _tile_totals(kernel, target, scored_prob, buckets, jobs, reports)
    first = buckets[0]
    lead = sorted(total, key=lambda nk: (total[nk], nk))[:LAUNCH_TUNABLE_TILES]
    lead += [nk for nk in sorted(per, key=lambda nk: (per[nk].get(first, math.inf), nk)) if nk not in lead][
        :LAUNCH_TUNABLE_TILES]
    new: dict[tuple, tuple[dict, dict]] = {}
    for nk in lead:
        base = _tile_best_at(kernel, target, prob, scored_prob, bucket_m(first), jobs, reports, nk)
        if base is None:
            continue
        for b in buckets:
            cm = compile_m(kernel, prob, bucket_m(b), target)
            for vals in itertools.product(*(spaces[b].domains[n] for n in tunables)):
                _add_traced(kernel, target, prob, cm, {**base, **dict(zip(tunables, vals))}, jobs, new)
    return new


def with_numerics(candidates: list[dict[str, Any]], numerics: tuple, kernel: Any = None) -> list[dict[str, Any]]:
    """Each candidate's launch keys with the given numerics keys, without repeats, in order."""
    seen, out = set(), []
    for c in candidates:
        keys = LAUNCH_ONLY_KEYS if kernel is None else launch_only_keys(kernel, dict(numerics))
        c2 = {**{k: v for k, v in c.items() if k in keys}, **dict(numerics)}
        if _cfg_key(c2) not in seen:
            seen.add(_cfg_key(c2))
            out.append(c2)
    return out


def _reference_numerics(kernel: Any, target: Target, prob: dict[str, Any], pm: Any, out: str | None
                        ) -> tuple | None:
    """The numerics keys of the M=1 entry of the problem `pm.numerics_ref` names, when that is
    another problem (a verify's q_len-1 decode): its launches run with them whatever this file says.
    Tune the reference problem first; without its file this problem picks its own tile (warned)."""
    if pm.numerics_ref is None:
        return None
    ref = strip_m(kernel, pm.numerics_ref(dict(prob)))
    if ref == prob:
        return None
    path = os.path.join(out, target.name, os.path.basename(file_path(kernel, target.name, ref))) if out else \
        file_path(kernel, target.name, ref)
    if not os.path.exists(path):
        import warnings

        warnings.warn(f"{kernel.name}: no tuned file for the reference problem {ref} ({path}); tune it first, "
                      "its M=1 numerics keys are what this problem's launches run with", stacklevel=3)
        return None
    return file_numerics(kernel, load_file(path))


def file_numerics(kernel: Any, doc: dict[str, Any]) -> tuple | None:
    """The numerics keys a batch-invariant launch of this file runs with at any M: those of the
    entry a lookup at M=1 selects (bucket 1, else the smallest; ops._common.invariant_config)."""
    entries = sorted(doc.get("entries", []), key=lambda e: bucket_order(parse_bucket(e["bucket"])))
    return _numerics(entries[0]["config"], kernel) if entries else None


def target_identity(target: Target, measured: bool) -> dict[str, Any]:
    import triton

    dev = target.device_names[0] if target.device_names else target.name
    if measured:
        import torch

        dev = torch.cuda.get_device_name(0)
    else:
        dev += " (data-sheet figures; static model)"
    return {"arch": target.name, "device_name": dev, "cu_count": target.cu_count,
            "triton_version": triton.__version__}


def score(kernel: Any, target: Target, problem: dict[str, Any], m: int, config: dict[str, Any],
          report: dict[str, Any]) -> dict[str, Any]:
    """The cost model's figures for one launch of `config` at M=m from its AOT report: the grid,
    loop trips, bytes and flops come from the kernel's problem model (the tuner ranks with this;
    the benches report it). `problem` may carry model-only dims such as an attention context `CTX`."""
    pm = model_for(kernel)
    static = {d: v for d, v in full_dims(kernel, problem, m, None, target).items() if d in kernel.static}
    sp = kernel.specialize(config, target, static)
    dims = full_dims(kernel, problem, m, sp.config, target)
    nbytes = pm.bytes_fn(problem, m) if pm.bytes_fn else 0.0
    flops = pm.flops_fn(problem, m) if pm.flops_fn else 0.0
    m_frac = 1.0 - shared_bytes(kernel, problem, m) / nbytes if nbytes else 1.0
    gs = sp.grid_size(dims)
    reuse = pm.reuse_dim or pm.m_dim
    reuse = (reuse,) if isinstance(reuse, str) else tuple(reuse)
    m_tiles = math.prod(p.count(dims) for e in sp.grid for p in e.leaves() if p.dim in reuse) or 1
    extra = extra_bytes(kernel, problem, m, dims)
    tail = pm.tail_fn(problem, m, dims) if pm.tail_fn else (0.0, 0)
    fig = costmodel.predict(report, target, math.prod(gs), loop_iters(kernel, dims, sp.config), nbytes, flops,
                            pm.peak_dtype, m_tiles, m_frac, extra, tail_bytes=tail[0], tail_tickets=tail[1],
                            extra_written=pm.extra_written)
    fig["resources"] = {k: report.get(k) for k in ("vgpr", "agpr", "spills", "lds_bytes", "occupancy")}
    return fig


def predict_config(kernel: Any, arch: str | Target, problem: dict[str, Any], m: int,
                   config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Static figures of one launch: `config` (default: the tuned one the op would look up) compiled
    for `arch` at M=m and scored like the tuner scores it. Adds "config" and "report"."""
    from kdsl import aot

    from .store import lookup_config

    target = get_target(arch)
    prob = strip_m(kernel, problem)
    if config is None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = lookup_config(kernel, target.name, prob, m)
    rep = aot.report(kernel, target, dict(config), full_dims(kernel, prob, m, config, target)).to_dict()
    fig = score(kernel, target, prob, m, dict(config), rep)
    fig.update(config=rep.get("config", dict(config)), report=rep)
    return fig


def _bucket_configs(path: str) -> dict[Any, dict[str, Any]]:
    """bucket -> config of an existing tuned file ({} when there is none or it does not load)."""
    try:
        return {e["bucket"]: e["config"] for e in load_file(path)["entries"]} if os.path.exists(path) else {}
    except Exception:  # noqa: BLE001 - a bad old file has nothing to offer
        return {}


def _prior_configs(kernel: Any, target: Target, static: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """The tunable + option part of every entry of an existing file at `path` that still specializes."""
    if not os.path.exists(path):
        return []
    try:
        doc = load_file(path)
    except Exception:  # noqa: BLE001 - a bad old file has nothing to offer
        return []
    names = set(kernel.tunables(target, static)) | {o.name for o in target.options}
    out: list[dict[str, Any]] = []
    for e in doc["entries"]:
        c = {k: v for k, v in e["config"].items() if k in names}
        try:
            kernel.specialize(c, target, static)
        except Exception:  # noqa: BLE001
            continue
        if c not in out:
            out.append(c)
    return out


def _in_option_domains(cfg: dict[str, Any], space: Any, options: set[str]) -> dict[str, Any]:
    """`cfg` with each launch option outside the space's domain set to the domain's first value. A
    recorded config holds the options its specialization applied (`kd.compile_option`: the MLA
    split's PV_T sets matrix_instr_nonkdim 16 where the domain holds only the target default), or
    another arch's; the tile keeps them, the option polish re-tries the rest."""
    return {k: (space.domains[k][0] if k in options and k in space.domains and v not in space.domains[k] else v)
            for k, v in cfg.items()}


def _warm_start_files(kernel: Any, target: Target, prob: dict[str, Any], out: str | None) -> list[str]:
    """Tuned files (under `out` and in the package) whose configs join the warm start where they
    specialize for `target`: the same kernel and problem tuned for other arches, and any arch's files
    of the kernels it shares its tiles with (`ProblemModel.tiles_from`, at their key dims of `prob`).
    A tile another search found is often a good one here (gfx950's 64-head MLA split tile, P.V
    transposed over 32-token steps, is gfx942's best at q_len 1 too; gfx942's 48-config sample never
    held it; gemm_bf16_swiglu's TP8 tile runs its rank-end variant 10-25% faster from 4 rows on than
    that variant's own 32-config sample found)."""
    names = [(file_name(kernel, prob), False)]
    names += [(file_name(other, prob), True) for other in model_for(kernel).tiles_from]
    found: list[str] = []
    for root in (r for r in (out, CONFIG_DIR) if r and os.path.isdir(r)):
        for arch in sorted(os.listdir(root)):
            for name, any_arch in names:
                path = os.path.join(root, arch, name)
                if (any_arch or arch != target.name) and os.path.isfile(path) and path not in found:
                    found.append(path)
    return found


def _compile(kernel: Any, target: Target, jobs: dict[tuple, tuple[dict, dict]], reports: dict[tuple, dict[str, Any]],
             workers: int, deadline: float | None, progress: bool) -> bool:
    """AOT-compile `jobs` ((config key, compile M) -> (config, dims)) in worker processes, in order,
    filling `reports`; returns whether the budget `deadline` stopped it early."""
    budget_hit = False
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(jobs), file=sys.stderr, desc=f"compile {kernel.name}@{target.name}", unit="cfg")
        except ImportError:
            bar = None
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    ex = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    futs: dict[cf.Future, tuple] = {}
    it = iter(list(jobs))

    def submit_next() -> bool:
        k = next(it, None)
        if k is None:
            return False
        c, p = jobs[k]
        futs[ex.submit(_run_job, kernel.name, target.name, c, p)] = k
        return True

    try:
        for _ in range(2 * workers):  # at most 2 x workers in flight, so a budget stop wastes little
            if not submit_next():
                break
        while futs:
            if deadline is not None and time.monotonic() > deadline + GRACE_S:
                budget_hit = True
                break  # compiles still running past the budget are abandoned (workers killed below)
            done, _ = cf.wait(list(futs), timeout=1.0, return_when=cf.FIRST_COMPLETED)
            for f in done:
                k = futs.pop(f)
                reports[k] = f.result()
                if bar:
                    bar.update(1)
                if deadline is not None and time.monotonic() > deadline:
                    budget_hit = True
                if not budget_hit:
                    submit_next()
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)
        for p in list((getattr(ex, "_processes", None) or {}).values()):
            p.terminate()
        raise
    finally:
        if bar:
            bar.close()
    if futs:
        for p in list((getattr(ex, "_processes", None) or {}).values()):
            p.terminate()
        ex.shutdown(wait=False, cancel_futures=True)
    else:
        ex.shutdown(wait=True)
    return budget_hit


def _launch_polish(kernel: Any, target: Target, prob: dict[str, Any], scored_prob: dict[str, Any], buckets: list[Any],
                   spaces: dict[Any, Any], jobs: dict[tuple, tuple[dict, dict]], reports: dict[tuple, dict[str, Any]],
                   shared: tuple | None, tunables: tuple[str, ...] = ()) -> dict[tuple, tuple[dict, dict]]:
    """Jobs not yet compiled: every combination of the target's option domains (warps, stages,
    occupancy, ...) for the best compiled config of each bucket (with `shared`: the best one with
    that numerics tile). A sampled space rarely holds all of them for the winning tile (the
    mla_combine_uv file tuned from 128 samples ran 4 warps where 8 halve its time). `tunables`:
    vary these kernel tunables (launch-only ones of a shared tile, ProblemModel.launch_keys) over the
    bucket's domain instead of the options."""
    from .space import option_domains

    opts = {n: spaces[b].domains[n] for b in buckets[:1] for n in tunables} if tunables else option_domains(target)
    # a shared tile keeps its numerics: only the launch-only options may vary (kpack or the
    # matrix instruction shape can change the rounding)
    names = [n for n in opts if shared is None or n in launch_only_keys(kernel, dict(shared))]
    new: dict[tuple, tuple[dict, dict]] = {}
    for b in buckets:
        m = bucket_m(b)
        cm = compile_m(kernel, prob, m, target)
        best = None
        for (ck, jm), (c, _) in jobs.items():
            rep = reports.get((ck, jm))
            if jm != cm or rep is None or not (spaces[b].admits(c) if shared is None else _numerics(c, kernel) == shared):
                continue
            rk = costmodel.rank_key(score(kernel, target, scored_prob, m, c, rep))
            if math.isfinite(rk[1]) and (best is None or rk < best[0]):
                best = (rk, c)
        if best is None:
            continue
        doms = [spaces[b].domains[n] if tunables else opts[n] for n in names]
        for vals in itertools.product(*doms):
            c2 = {**best[1], **dict(zip(names, vals))}
            key = (_cfg_key(c2), cm)
            if key in jobs or key in new:
                continue
            dims = full_dims(kernel, prob, cm, c2, target)
            if tunables and not _traces(kernel, target, c2, dims):
                continue  # a tunable value the tile's rules refuse (kd.require), pruned as the space is
            new[key] = (c2, dims)
    return new


NEIGHBOR_ROUNDS = 3  # rounds of the one-key-away search around the picked numerics tile


def _numerics_neighbors(kernel: Any, target: Target, prob: dict[str, Any], scored_prob: dict[str, Any],
                        buckets: list[Any], spaces: dict[Any, Any], jobs: dict[tuple, tuple[dict, dict]],
                        reports: dict[tuple, dict[str, Any]], shared: tuple,
                        tunables: tuple[str, ...]) -> dict[tuple, tuple[dict, dict]]:
    """Jobs not yet compiled: the tiles one numerics key away from `shared` (each other value of
    each key in the first bucket's domain), each with the other keys of `shared`'s best config at
    the first bucket and every combination of the launch-only `tunables`. A seeded sample of a
    large space holds few tiles, and a tile that differs from the winner in one key (the value
    product's orientation, the split size) is the likeliest better one: the gfx950 MLA split
    sample never held the winner with its score orientation flipped, which was 12% faster."""
    first = buckets[0]
    base = _tile_best_at(kernel, target, prob, scored_prob, bucket_m(first), jobs, reports, shared)
    if base is None:
        return {}
    dom = spaces[first].domains
    names = [n for n in tunables if n in dom]
    new: dict[tuple, tuple[dict, dict]] = {}
    for key, cur in shared:
        for v in dom.get(key, ()):
            if v == cur:
                continue
            for vals in itertools.product(*(dom[n] for n in names)):
                c2 = {**base, key: v, **dict(zip(names, vals))}
                for b in buckets:
                    _add_traced(kernel, target, prob, compile_m(kernel, prob, bucket_m(b), target), c2, jobs, new)
    return new


def _add_traced(kernel: Any, target: Target, prob: dict[str, Any], cm: int, config: dict[str, Any],
                jobs: dict[tuple, tuple[dict, dict]], new: dict[tuple, tuple[dict, dict]]) -> None:
    """Add the job (config at compile M `cm`) to `new` unless it is known or the tile's rules refuse
    it (pruned by tracing, as the space is)."""
    key = (_cfg_key(config), cm)
    if key in jobs or key in new:
        return
    dims = full_dims(kernel, prob, cm, config, target)
    if _traces(kernel, target, config, dims):
        new[key] = (config, dims)


def _traces(kernel: Any, target: Target, config: dict[str, Any], dims: dict[str, Any]) -> bool:
    """Whether `config` passes the kernel's rules at `dims` (the space's pruning by tracing)."""
    from kdsl.errors import KdslError

    try:
        kernel.specialize(config, target, {d: v for d, v in dims.items() if d in kernel.static})
    except KdslError:
        return False
    return True


def _configs_of_numerics(kernel: Any, base_name: str, target: Target, prob: dict[str, Any], buckets: list,
                         out: str | None) -> tuple[list, tuple, dict[Any, dict[str, Any]]]:
    """A `configs_of` kernel's numerics: those of its base kernel's tuned file (under `out`, else the
    package's), which every bucket keeps while its launch keys are searched. Returns (the buckets the
    base file has an entry at, the numerics tile, bucket -> the base's config there: a candidate of
    that bucket whatever the sampled space holds); a ValueError when there is no file (tune the base
    first)."""
    from kdsl.kernel import REGISTRY

    from .store import load_file, select_entry

    base = REGISTRY[base_name]
    bprob = strip_m(base, prob)
    path = file_path(base, target.name, bprob)
    if out and os.path.exists(os.path.join(out, target.name, os.path.basename(path))):
        path = os.path.join(out, target.name, os.path.basename(path))
    if not os.path.exists(path):
        raise ValueError(f"{kernel.name} keeps {base_name}'s tuned numerics: no file {path} (tune {base_name} first)")
    doc = load_file(path)
    tile = file_numerics(base, doc)
    kept, configs = [], {}
    for b in buckets:
        e = select_entry(doc, bucket_m(b))
        if e is not None and e["bucket"] == b:
            kept.append(b)
            configs[b] = dict(e["config"])
    if not kept or tile is None:
        raise ValueError(f"{kernel.name}: none of the buckets {buckets} has an entry in {path}")
    return kept, tile, configs


def parse_ms(items: list[Any]) -> list[int | str]:
    """M values or buckets (ints, "any") -> sorted distinct buckets."""
    out = set()
    for it in items:
        if it == ANY:
            out.add(ANY)
        else:
            out.add(bucket_for(int(it)))
    return sorted(out, key=bucket_order)


def tune(kernel: Any, arch: str | Target, problem: dict[str, Any], ms: list[Any], mode: str = "static",
         budget_s: float | None = None, seed: int = 0, out: str | None = None,
         max_candidates: int | None = DEFAULT_MAX_CANDIDATES, workers: int | None = None,
         progress: bool = True, write: bool = True, cu_count: int | None = None,
         keep_numerics: bool = False, numerics: tuple | None = None) -> tuple[str, dict[str, Any]]:
    """Tune `kernel` at `problem` for the buckets of `ms`; returns (path, document). `cu_count`: tune
    for a device of the arch with that many CUs (the file goes to <arch>/cu<N>/ unless it is the
    arch's reference count). `keep_numerics` (shared-numerics kernels): the existing file's numerics
    tile (the one its launches run at every M) is kept, only launch keys are tuned, so re-tuning some
    buckets of a file cannot leave entries of another tile in it; `numerics` forces a given tile. A
    batch-invariant file written over one whose other buckets hold another tile re-tunes those
    buckets under the new tile (their launches run it)."""
    if mode not in ("static", "measured"):
        raise ValueError(f"mode must be 'static' or 'measured', got {mode!r}")
    target = get_target(arch)
    ref_cu = target.cu_count
    if cu_count is not None:
        if cu_count < 1:
            raise ValueError(f"cu_count must be >= 1, got {cu_count}")
        import dataclasses

        target = dataclasses.replace(target, cu_count=int(cu_count))
    bad = {k: v for k, v in problem.items() if isinstance(v, int) and not isinstance(v, bool) and v < 1}
    if bad:
        k0 = next(iter(bad))
        raise ValueError(f"problem dim {k0}={bad[k0]} must be a positive integer")
    if target.backend == "interpret":
        raise ValueError("cannot tune for the interpret target: pass --arch gfx942|gfx950|sm90 (or current on a GPU)")
    if mode == "measured":
        from .measure import require_gpu

        require_gpu(target)
    pm = model_for(kernel)
    prob = strip_m(kernel, problem)
    # model-only dims (MODEL_DIMS: a context length, an expert-parallel rank's share) shape the score,
    # not the file: the lookup key stays `prob`
    scored_prob = {**prob, **{d: problem[d] for d in MODEL_DIMS if d in problem}}
    need = [d for d in required_dims(kernel) if d not in prob]
    if need:
        raise ValueError(f"problem for kernel {kernel.name} is missing {need} (got {prob}); e.g. --problem "
                         + ",".join(f"{d}={kernel.example.get(d, 1024)}" for d in need))
    static = {d: v for d, v in full_dims(kernel, prob, 1, None, target).items() if d in kernel.static}
    buckets = parse_ms(ms)
    t0 = time.monotonic()
    deadline = t0 + budget_s if budget_s else None
    workers = workers or max(1, min(os.cpu_count() or 1, 16))

    spaces = {}
    for b in buckets:
        spaces[b] = build(kernel, target, static, bucket_m(b), seed, max_candidates, pm.m_block)
    # warm start: the configs of the file being replaced compete too (a smaller sample never loses
    # a config an earlier, larger search found; the cost model re-ranks them): the one under `out`,
    # else the package's (a first tune into an empty --out folder still starts from it)
    prior_path = file_path(kernel, target.name, prob)
    if out and os.path.exists(os.path.join(out, target.name, os.path.basename(prior_path))):
        prior_path = os.path.join(out, target.name, os.path.basename(prior_path))
    priors = _prior_configs(kernel, target, static, prior_path) if pm.configs_of is None else []
    for other in _warm_start_files(kernel, target, prob, out) if pm.configs_of is None else ():
        priors += [c for c in _prior_configs(kernel, target, static, other) if c not in priors]
    base_tile, own = None, {}
    if pm.configs_of is not None:  # the base file's numerics at every bucket
        buckets, base_tile, own = _configs_of_numerics(kernel, pm.configs_of, target, prob, buckets, out)
    options = {o.name for o in target.options}
    for b in buckets:
        for c in priors:
            c = _in_option_domains(c, spaces[b], options)
            if spaces[b].admits(c) and c not in spaces[b].candidates:
                spaces[b].candidates.insert(1, c)
    forced = _reference_numerics(kernel, target, prob, pm, out) if pm.shared_numerics else None
    if keep_numerics:
        if not pm.shared_numerics:
            raise ValueError(f"keep_numerics: {kernel.name} picks its tile per bucket (no shared numerics tile to keep)")
        if not os.path.exists(prior_path):
            raise ValueError(f"keep_numerics: no tuned file {prior_path} whose numerics tile to keep")
        forced = forced or file_numerics(kernel, load_file(prior_path))
    if numerics is not None:
        forced = numerics
    if base_tile is not None:
        forced = base_tile
    if forced is not None:  # every candidate takes the reference tile; only launch keys vary, within its rules
        for b in buckets:       # (a kept ROW_SQUARES=0 tile admits no BLOCK_M under 16: kd.require)
            cm = compile_m(kernel, prob, bucket_m(b), target)
            spaces[b].candidates[:] = [c for c in with_numerics(spaces[b].candidates, forced, kernel)
                                       if _traces(kernel, target, c, full_dims(kernel, prob, cm, c, target))]
    # a configs_of kernel's bucket first tries the config its base runs there and the one its own
    # file holds (with the base's numerics), whatever the sampled space holds (a base's BLOCK_M of 2
    # at bucket 1 lies outside that bucket's domain): re-tuning never loses either
    mine = _bucket_configs(prior_path) if own else {}
    for b in own:
        for c in (own[b], mine.get(b)):
            if c is None:
                continue
            try:
                c = with_numerics([dict(kernel.specialize(c, target, static).config)], forced, kernel)[0]
            except Exception:  # noqa: BLE001 - none there, or an old entry this kernel no longer takes
                continue
            cm = compile_m(kernel, prob, bucket_m(b), target)
            if c not in spaces[b].candidates and _traces(kernel, target, c, full_dims(kernel, prob, cm, c, target)):
                spaces[b].candidates.insert(0, c)
    # unique compiles: (config, signature class of M)
    # round robin over the buckets, so a budget stop still leaves every bucket candidates
    jobs: dict[tuple, tuple[dict, dict]] = {}
    for i in range(max(len(spaces[b].candidates) for b in buckets)):
        for b in buckets:
            if i < len(spaces[b].candidates):
                c = spaces[b].candidates[i]
                cm = compile_m(kernel, prob, bucket_m(b), target)
                jobs.setdefault((_cfg_key(c), cm), (c, full_dims(kernel, prob, cm, c, target)))
    reports: dict[tuple, dict[str, Any]] = {}
    budget_hit = _compile(kernel, target, jobs, reports, workers, deadline, progress)
    tun = tuple(n for n in pm.launch_keys if pm.shared_numerics and all(n in spaces[b].domains for b in buckets))
    if tun and forced is None and mode == "static" and not budget_hit:
        lead = _launch_tunable_jobs(kernel, target, prob, scored_prob, buckets, spaces, jobs, reports, tun)
        jobs.update(lead)
        budget_hit = _compile(kernel, target, lead, reports, workers, deadline, progress)
    shared = forced if forced is not None else _shared_numerics(kernel, target, scored_prob, buckets, jobs, reports) \
        if pm.shared_numerics and mode == "static" else None
    # then a local search: the tiles one numerics key away, until the pick stands
    for _ in range(NEIGHBOR_ROUNDS if shared is not None and forced is None and not budget_hit else 0):
        near = _numerics_neighbors(kernel, target, prob, scored_prob, buckets, spaces, jobs, reports, shared, tun)
        if not near:
            break
        jobs.update(near)
        budget_hit = _compile(kernel, target, near, reports, workers, deadline, progress)
        picked = _shared_numerics(kernel, target, scored_prob, buckets, jobs, reports)
        stands = picked in (None, shared)
        shared = picked or shared
        if stands or budget_hit:
            break
    # the sampled space holds few launch-option combinations of any one tile: compile them all for
    # each bucket's best tile (a cheap local search)
    # a launch-only tunable of the shared tile (a BLOCK_M that changes no bit) was sampled with the
    # tile at random: each bucket's best first tries every value of its domain, then the options
    # where the buckets pick independently, each one's best tries the model's launch_keys the same way
    # (lowering choices that change no bit, e.g. the int4 unpack of the exact W4A8 stages)
    if shared is None or pm.configs_of is not None:
        tun = () if pm.shared_numerics else \
            tuple(n for n in pm.launch_keys if all(n in spaces[b].domains for b in buckets))
    if tun and not budget_hit:
        first = _launch_polish(kernel, target, prob, scored_prob, buckets, spaces, jobs, reports, shared, tun)
        jobs.update(first)
        budget_hit = _compile(kernel, target, first, reports, workers, deadline, progress)
    polish = {} if budget_hit else \
        _launch_polish(kernel, target, prob, scored_prob, buckets, spaces, jobs, reports, shared)
    if polish:
        jobs.update(polish)
        budget_hit = _compile(kernel, target, polish, reports, workers, deadline, progress)
    entries = []
    for b in buckets:
        m = bucket_m(b)
        if shared is not None:        # one numerics tile for every bucket, launch keys per bucket
            pool = [c for c, _ in jobs.values() if _numerics(c, kernel) == shared]
        scored = []
        # its own candidates, plus those compiled for other buckets that lie in its space
        if shared is None:
            pool = list(spaces[b].candidates)
            seen = {_cfg_key(c) for c in pool}
            for key, (c, _) in jobs.items():
                if key[0] not in seen and spaces[b].admits(c):
                    pool.append(c)
                    seen.add(key[0])
        for c in pool:
            rep = reports.get((_cfg_key(c), compile_m(kernel, prob, m, target)))
            if rep is None:
                continue  # not compiled (budget)
            fig = score(kernel, target, scored_prob, m, c, rep)
            scored.append((costmodel.rank_key(fig), c, fig))
        if not scored:
            continue
        scored.sort(key=lambda s: s[0])
        if mode == "measured":
            from .measure import measure_bucket

            best_cfg, fig = measure_bucket(kernel, target, scored_prob, m, [s[1] for s in scored if math.isfinite(s[0][1])],
                                           pm, seed)
            fig["predicted_us"] = next(s[2]["predicted_us"] for s in scored if s[1] == best_cfg)
        else:
            _, best_cfg, fig = scored[0]
            if not math.isfinite(fig["predicted_us"]):
                continue  # nothing compiled cleanly: no entry rather than a bad one
        sp = kernel.specialize(best_cfg, target, static)
        fig = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in fig.items()}
        fig.update(candidates=len(pool), compiled=len(scored),
                   pruned_before_compile=sum(spaces[b].pruned.values()), m=m)
        entries.append({"bucket": b, "config": dict(sp.config), "figures": fig})

    doc = {
        "schema_version": SCHEMA_VERSION, "kernel": kernel.name, "arch": target.name, "problem": prob,
        "target": target_identity(target, mode == "measured"),
        "entries": entries,
        "provenance": {
            "kernel_source_hash": kernel_source_hash(kernel),
            "helpers_hash": helpers_hash(kernel), "helpers": kernel_helpers(kernel),
            "search_space_hash": {str(b): spaces[b].hash for b in buckets},
            "seed": seed, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "triton_version": target_identity(target, False)["triton_version"], "mode": mode,
            "max_candidates": max_candidates, "budget_s": budget_s, "budget_hit": budget_hit,
            "elapsed_s": round(time.monotonic() - t0, 1),
            "cost_model": costmodel.VERSION if mode == "static" else "measured (CUDA/HIP events)",
            "problem_key": problem_key(kernel, prob),
            **({"model_dims": {d: scored_prob[d] for d in MODEL_DIMS if d in scored_prob}}
               if scored_prob != prob else {}),
            **({"shared_numerics": dict(shared)} if shared is not None else {}),
        },
    }
    sub = (target.name,) if target.cu_count == ref_cu else (target.name, f"cu{target.cu_count}")
    path = os.path.join(out or os.path.dirname(os.path.dirname(file_path(kernel, target.name, prob))), *sub,
                        os.path.basename(file_path(kernel, target.name, prob)))
    if write:
        if not entries:
            raise RuntimeError(f"no candidate of {kernel.name} compiled cleanly for {target.name}; nothing written")
        try:
            old = load_file(path) if os.path.exists(path) else None
        except Exception:  # noqa: BLE001 - a bad old file is simply replaced
            old = None
        if old is not None and old["provenance"].get("kernel_source_hash") == doc["provenance"]["kernel_source_hash"]:
            have = {parse_bucket(e["bucket"]) for e in entries}
            rest = [e for e in old["entries"] if parse_bucket(e["bucket"]) not in have]
            other = [parse_bucket(e["bucket"]) for e in rest if shared is not None and _numerics(e["config"], kernel) != shared]
            if other:  # kept buckets of another tile: their launches run the new one, tune them for it
                _, sub = tune(kernel, arch, problem, other, mode, budget_s, seed, out, max_candidates, workers, progress,
                              write=False, cu_count=cu_count, numerics=shared)
                rest = [e for e in rest if parse_bucket(e["bucket"]) not in other] + sub["entries"]
            doc["entries"] = entries + rest
        save_file(doc, path)
    return path, doc
