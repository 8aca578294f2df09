"""python -m autotune tune|show|check: tune kernels, print a tuned file, check committed files."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import warnings
from typing import Any

from .buckets import ANY


class UsageError(Exception):
    """A bad input: printed as one line naming the flag, field or file; exit status 2."""


def _fail(msg: str) -> None:
    raise UsageError(msg)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage + message)
        raise UsageError(f"{self.prog}: {message}")


def _kernels(extra: list[str] | None = None) -> dict[str, Any]:
    """kdsl's registry after loading the kernel packages and every submodule of them (a package's
    __init__ need not import its op modules); a module that fails to import is reported, not fatal."""
    import importlib
    import pkgutil
    from importlib.metadata import entry_points

    from kdsl.registry import DEFAULT_MODULES, discover

    reg = discover(extra)
    mods = [ep.value for ep in entry_points(group="kdsl.kernels")] or list(DEFAULT_MODULES)
    for name in mods:
        try:
            pkg = importlib.import_module(name)
        except Exception:  # noqa: BLE001
            continue
        for info in pkgutil.iter_modules(getattr(pkg, "__path__", []), prefix=name + "."):
            try:
                importlib.import_module(info.name)
            except Exception as e:  # noqa: BLE001
                print(f"autotune: warning: cannot import {info.name}: {type(e).__name__}: {e}", file=sys.stderr)
    return reg


def _get_kernel(name: str, extra: list[str] | None = None) -> Any:
    reg = _kernels(extra)
    if name not in reg:
        import difflib

        close = difflib.get_close_matches(name, reg, n=3)
        _fail(f"autotune: unknown kernel {name!r}" + (f"; did you mean {', '.join(close)}?" if close else "")
              + " (`python -m kdsl list` shows them)")
    return reg[name]


def _out_dir(a: argparse.Namespace) -> str | None:
    """--out, or the package's config folder with --in-place; neither is an error (never write
    into the installed package unasked)."""
    if a.out and a.in_place:
        _fail("autotune: --out and --in-place exclude each other")
    if not a.out and not a.in_place:
        _fail("autotune: --out DIR is required (or --in-place to write into the package's autotune/configs)")
    if a.out:
        if os.path.exists(a.out) and not os.path.isdir(a.out):
            _fail(f"autotune: --out {a.out!r} is not a folder")
        return a.out
    return None


def _ms(text: str, flag: str = "--m") -> list[Any]:
    ms = [s.strip() for s in text.split(",") if s.strip()]
    if not ms:
        _fail(f"autotune: {flag} is empty")
    out: list[Any] = []
    for s in ms:
        if s == ANY:
            out.append(ANY)
            continue
        try:
            v = int(s)
        except ValueError:
            _fail(f"autotune: {flag} takes positive ints and 'any', got {s!r}")
        if v < 1 or v > 1 << 20:
            _fail(f"autotune: {flag} values must be in 1..{1 << 20}, got {v}")
        out.append(v)
    return out


def _common_checks(a: argparse.Namespace) -> None:
    from kdsl.targets import get_target

    try:
        t = get_target(a.arch)
    except Exception as e:  # noqa: BLE001
        _fail(f"autotune: --arch {a.arch!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    if t.backend == "interpret":
        _fail("autotune: --arch: cannot tune for the interpret target (use gfx942, gfx950, sm90 or current on a GPU)")
    if a.budget_s is not None and not (a.budget_s > 0 and math.isfinite(a.budget_s)):
        _fail(f"autotune: --budget-s must be a positive finite number, got {a.budget_s}")
    if a.max_candidates is not None and a.max_candidates < 0:
        _fail(f"autotune: --max-candidates must be >= 0, got {a.max_candidates}")
    if a.workers is not None and not 1 <= a.workers <= 256:
        _fail(f"autotune: --workers must be in 1..256, got {a.workers}")
    if getattr(a, "cu_count", None) is not None and not 1 <= a.cu_count <= 4096:
        _fail(f"autotune: --cu-count must be in 1..4096, got {a.cu_count}")


def cmd_tune(a: argparse.Namespace) -> int:
    from .problems import MODEL_DIMS, parse_problem
    from .search import tune

    _common_checks(a)
    out = _out_dir(a)
    k = _get_kernel(a.kernel, a.module)
    try:
        problem = parse_problem(a.problem)
    except ValueError as e:
        _fail(f"autotune: --problem: {e}")
    for d, v in problem.items():
        if not isinstance(v, int) or v < 1:
            _fail(f"autotune: --problem: dim {d}={v!r} must be a positive integer")
        if d not in k.signature.all_dims() and d not in MODEL_DIMS:
            _fail(f"autotune: --problem: {d!r} is not a dim of kernel {k.name} (dims: {', '.join(k.signature.all_dims())}; "
                  f"model-only dims: {', '.join(MODEL_DIMS)})")
    ms = _ms(a.m)
    try:
        path, doc = tune(k, a.arch, problem, ms, mode=a.mode, budget_s=a.budget_s, seed=a.seed, out=out,
                         max_candidates=a.max_candidates, workers=a.workers, progress=not a.quiet,
                         cu_count=a.cu_count, keep_numerics=a.keep_numerics)
    except (ValueError, RuntimeError, OSError) as e:
        _fail(f"autotune: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    print(f"wrote {path}")
    print(table(doc))
    print(paste_lines(doc))
    return 0


def paste_lines(doc: dict[str, Any]) -> str:
    """One line per bucket that can be pasted as a `config=` argument of the op (or `--config` JSON)."""
    lines = [f"# {doc['kernel']} {doc['arch']} " + ",".join(f"{k}={v}" for k, v in doc["problem"].items())]
    for e in doc["entries"]:
        lines.append(f"M<={e['bucket']}: config=" + json.dumps(e["config"], sort_keys=True))
    return "\n".join(lines)


def table(doc: dict[str, Any]) -> str:
    lines = [f"{doc['kernel']} on {doc['arch']} ({doc['target'].get('device_name', '')}) problem "
             + ",".join(f"{k}={v}" for k, v in doc["problem"].items())
             + f"  mode={doc['provenance'].get('mode')} seed={doc['provenance'].get('seed')} "
               f"source={doc['provenance'].get('kernel_source_hash')}"]
    hdr = f"{'bucket':>7} {'time us':>10} {'floor us':>9} {'roofline':>8} {'bound':>7}  config"
    lines.append(hdr)
    for e in doc["entries"]:
        f = e["figures"]
        t = f.get("measured_us", f.get("predicted_us", math.nan))
        kind = "" if "measured_us" in f else "*"
        tun = {k: v for k, v in e["config"].items()}
        lines.append(f"{str(e['bucket']):>7} {t:>9.2f}{kind} {f.get('floor_us', math.nan):>9.2f} "
                     f"{f.get('roofline_fraction', 0):>8.1%} {f.get('bound', ''):>7}  "
                     + " ".join(f"{k}={v}" for k, v in tun.items()))
    lines.append("(* = predicted by the static cost model)")
    return "\n".join(lines)


def cmd_show(a: argparse.Namespace) -> int:
    from .store import ConfigFileError, load_file

    try:
        doc = load_file(a.file)
    except ConfigFileError as e:
        _fail(f"autotune: {e}")
    print(json.dumps(doc, indent=1) if a.json else table(doc))
    return 0


# `check` re-scores each entry from its compiled report: a figure this far (relative) from the
# recorded one marks the file stale (the model is deterministic; the slack absorbs float rounding)
RESCORE_TOLERANCE = 0.02


def check_files(root: str | None, compile: bool = True, sample: int | None = None, extra: list[str] | None = None,
                log=print, workers: int | None = None) -> tuple[int, int, int]:
    """(files, problems, stale) over `root`; problems are logged as they are found. Compiles each
    distinct (kernel, arch, problem, config) once, in parallel over the cores."""
    import concurrent.futures as cf
    import multiprocessing as mp

    from kdsl.targets import get_target

    from .problems import full_dims, model_for
    from .buckets import bucket_m
    from .search import _numerics, _reference_numerics, _run_job, compile_m, file_numerics, score, strip_m
    from .costmodel import VERSION
    from .store import ConfigFileError, helpers_hash, iter_files, kernel_source_hash, load_file

    reg = _kernels(extra)
    files = iter_files(root)
    bad = stale = 0
    jobs: dict[tuple, list[tuple]] = {}
    for path in files:
        try:
            doc = load_file(path, known_kernels=reg)
        except ConfigFileError as e:
            log(f"FAIL {e}")
            bad += 1
            continue
        k = reg[doc["kernel"]]
        h = kernel_source_hash(k)
        if doc["provenance"].get("kernel_source_hash") != h:
            log(f"STALE {path}: kernel source hash {doc['provenance'].get('kernel_source_hash')} != current {h} "
                f"(re-tune: python -m autotune tune {k.name} ...)")
            stale += 1
        elif "helpers_hash" not in doc["provenance"]:
            log(f"STALE {path}: tuned before helper hashes were recorded (a helper change would go unseen; re-tune)")
            stale += 1
        elif doc["provenance"]["helpers_hash"] != helpers_hash(k):
            log(f"STALE {path}: a helper of {k.name} changed (helpers hash {doc['provenance']['helpers_hash']} != "
                f"current {helpers_hash(k)}; re-tune)")
            stale += 1
        elif doc["provenance"].get("mode", "static") == "static" and doc["provenance"].get("cost_model") != VERSION:
            log(f"STALE {path}: ranked by {doc['provenance'].get('cost_model')!r}, the cost model is now {VERSION!r} "
                f"(re-tune)")
            stale += 1
        pm = model_for(k)
        if pm.configs_of is not None:   # its launches keep the base kernel's numerics: they must still be the base's
            moved = _configs_of_moved(k, pm.configs_of, doc, root, reg)
            if moved:
                log(f"STALE {path}: {moved} (re-tune it after {pm.configs_of}: python -m autotune tune {k.name} ...)")
                stale += 1
        if pm.shared_numerics:  # a batch-invariant launch runs the M=1 lookup's numerics at any M (that of
            # its reference problem's file where it has one: a verify takes the decode's)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # no reference file: the file's own tile
                ref = _reference_numerics(k, get_target(doc["arch"]), strip_m(k, doc["problem"]), pm, root)
            ref = ref or file_numerics(k, doc)
            other = [e["bucket"] for e in doc["entries"] if _numerics(e["config"], k) != ref]
            if other:
                log(f"FAIL {path}: buckets {other} hold another numerics tile than the one every launch runs "
                    f"({dict(ref)}): their figures describe a tile that never runs (re-tune them with "
                    f"`python -m autotune tune {k.name} --m {','.join(map(str, other))} --keep-numerics ...`)")
                bad += 1
        entries = doc["entries"] if sample is None else doc["entries"][:sample]
        for e in entries:
            t = get_target(doc["arch"])
            dims = full_dims(k, doc["problem"], compile_m(k, doc["problem"], bucket_m(e["bucket"]), t), e["config"], t)
            key = (k.name, doc["arch"], json.dumps(dims, sort_keys=True), json.dumps(e["config"], sort_keys=True))
            scored = {**doc["problem"], **doc["provenance"].get("model_dims", {})}
            static = doc["provenance"].get("mode", "static") == "static" and "predicted_us" in e["figures"]
            jobs.setdefault(key, []).append((f"{path}: bucket {e['bucket']}", scored, bucket_m(e["bucket"]),
                                             e["figures"]["predicted_us"] if static else None,
                                             doc["target"].get("cu_count")))
    if not compile or not jobs:
        return len(files), bad, stale
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    with cf.ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1, mp_context=ctx) as ex:
        futs = {ex.submit(_run_job, kn, arch, json.loads(cfg), json.loads(dims)): (kn, arch, dims, cfg)
                for kn, arch, dims, cfg in jobs}
        for f in cf.as_completed(futs):
            r = f.result()
            # a configs_of kernel's spills are recorded, not chosen (its figures tell the op not to take it)
            if not r.get("ok") or (r.get("spills") and model_for(reg[futs[f][0]]).configs_of is None):
                for where, *_ in jobs[futs[f]]:
                    log(f"FAIL {where}: ok={r.get('ok')} spills={r.get('spills')} "
                        f"LDS={r.get('lds_bytes')}/{r.get('lds_limit')} " + "; ".join(r.get("errors", [])))
                    bad += 1
                continue
            # the recorded figure, re-scored from today's code: a kdsl lowering change (same kernel and
            # helpers, other generated code) or a cost model change moves it
            kn, arch, _, cfg = futs[f]
            for where, scored, m, recorded, cu in jobs[futs[f]]:
                if recorded is None:
                    continue
                t = get_target(arch)
                t = dataclasses.replace(t, cu_count=cu) if cu and cu != t.cu_count else t  # a cu<N>/ file
                now = score(reg[kn], t, scored, m, json.loads(cfg), r)["predicted_us"]
                if abs(now - recorded) > RESCORE_TOLERANCE * recorded + 0.01:
                    log(f"STALE {where}: recorded {recorded:.2f} us, today's generated code scores {now:.2f} us "
                        f"(a kdsl lowering or cost model change since tuning; re-tune)")
                    stale += 1
    log(f"compiled {len(jobs)} distinct configs")
    return len(files), bad, stale


def _configs_of_moved(kernel: Any, base_name: str, doc: dict[str, Any], root: str | None, reg: dict) -> str:
    """Why a `configs_of` kernel's file no longer keeps its base's numerics ('' when it does): every
    bucket's numerics keys must be the base file's tile (the base was re-tuned to another, or is gone)."""
    from .problems import strip_m
    from .search import file_numerics
    from .store import file_path, load_file

    base = reg[base_name]
    path = file_path(base, doc["arch"], strip_m(base, doc["problem"]))
    if root is not None and os.path.exists(os.path.join(root, doc["arch"], os.path.basename(path))):
        path = os.path.join(root, doc["arch"], os.path.basename(path))
    if not os.path.exists(path):
        return f"no file of {base_name} at its problem ({path})"
    tile = dict(file_numerics(base, load_file(path, known_kernels=reg)) or ())
    moved = [e["bucket"] for e in doc["entries"] if any(e["config"].get(k) != v for k, v in tile.items())]
    return f"buckets {moved} hold other numerics than {path}" if moved else ""


def cmd_check(a: argparse.Namespace) -> int:
    if a.dir is not None and not os.path.isdir(a.dir):
        _fail(f"autotune: check: {a.dir!r} is not a folder")
    if a.workers is not None and not 1 <= a.workers <= 256:
        _fail(f"autotune: --workers must be in 1..256, got {a.workers}")
    n, bad, stale = check_files(a.dir, compile=not a.no_compile, extra=a.module, workers=a.workers)
    print(f"checked {n} files: {bad} problems, {stale} stale (re-tune them)")
    if bad or (stale and a.strict_hash):
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m autotune",
                                description="Shape-aware tuning of kdsl kernels: one JSON per (kernel, arch, problem) "
                                            "with a config per M bucket (1, 2, 4, ..., 8192, any).")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    t = sub.add_parser("tune", help="tune a kernel at a problem for some M buckets and write its JSON file")
    t.add_argument("kernel", help="kernel name (`python -m kdsl list`)")
    t.add_argument("--problem", required=True, help="dims other than M, e.g. N=2048,K=7168")
    t.add_argument("--m", default="1,2,4,8,16,32,64,128,256,any",
                   help="M values (each maps to its bucket) and/or 'any', comma separated (default: 1..256,any)")
    t.add_argument("--arch", default="current", help="gfx942 | gfx950 | sm90 | current (the local GPU)")
    t.add_argument("--mode", choices=("static", "measured"), default="static",
                   help="static: rank by the AOT cost model (any machine); measured: time on the local GPU")
    t.add_argument("--budget-s", type=float, default=None,
                   help="stop compiling new candidates after this many seconds (the file says budget_hit)")
    t.add_argument("--seed", type=int, default=0, help="seed of the candidate sampling (same seed, same result)")
    t.add_argument("--max-candidates", type=int, default=32,
                   help="candidates per bucket after pruning (seeded sample when the space is larger; 0 = all); "
                        "each bucket's best then runs with every launch-option combination")
    t.add_argument("--workers", type=int, default=None, help="parallel compiles (default: all cores)")
    t.add_argument("--out", default=None, help="root folder; the file goes to OUT/<arch>/ (OUT/<arch>/cu<N>/ with --cu-count)")
    t.add_argument("--in-place", action="store_true",
                   help="write into the package's autotune/configs instead of --out (one of the two is required)")
    t.add_argument("--cu-count", type=int, default=None,
                   help="tune for a device of the arch with this many CUs (e.g. 80 for an MI308X)")
    t.add_argument("--module", action="append", help="extra kernel module or .py file to load")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--keep-numerics", action="store_true",
                   help="batch-invariant kernels: keep the existing file's numerics tile (the one its launches run "
                        "at every M) and tune only the launch keys of these buckets")
    t.set_defaults(func=cmd_tune)
    s = sub.add_parser("show", help="print a tuned file as a table")
    s.add_argument("file")
    s.add_argument("--json", action="store_true", help="print the validated JSON instead")
    s.set_defaults(func=cmd_show)
    c = sub.add_parser("check", help="every file parses, its kernel exists, a batch-invariant file holds one numerics "
                                     "tile, its configs compile and fit; stale files are flagged: a kernel or helper "
                                     "changed, an older cost model, or a figure today's generated code no longer gives")
    c.add_argument("dir", nargs="?", default=None, help="folder (default: autotune/configs)")
    c.add_argument("--no-compile", action="store_true", help="only parse and hash (fast)")
    c.add_argument("--workers", type=int, default=None, help="parallel compiles (default: all cores)")
    c.add_argument("--strict-hash", action="store_true", help="a stale file fails the check")
    c.add_argument("--module", action="append", help="extra kernel module or .py file to load")
    c.set_defaults(func=cmd_check)
    _add_tune_model(sub)
    try:
        a = p.parse_args(argv)
        if getattr(a, "max_candidates", None) == 0:
            a.max_candidates = None
        return a.func(a)
    except UsageError as e:
        print(str(e).replace("\n", " "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `autotune show FILE | head`: the reader left, nothing is wrong
        sys.stdout = open(os.devnull, "w")
        return 0


def _add_tune_model(sub: Any) -> None:
    m = sub.add_parser("tune-model", help="tune every kernel one decode and verify step of a model launches "
                                          "(found by recording the step on meta tensors), M buckets 1..128")
    m.add_argument("--config", default=None, help="the model's config.json (Kimi-K2.5 / DeepSeek-V3), or 'kimi-k2.5' "
                                                "(required for --model target)")
    m.add_argument("--experts", default="w4a8", help="routed-expert format: w4a8 | w4a16 | mxfp4 (default w4a8)")
    m.add_argument("--tp", type=int, default=1, help="per-GPU shapes of tensor parallelism N (heads, intermediate / N)")
    m.add_argument("--moe-parallel", default="tp", help="tp (intermediate / N) or ep (experts / N) with --tp")
    m.add_argument("--arch", required=True, help="gfx942 | gfx950 | sm90")
    m.add_argument("--m", default="1,2,4,8,16,32,64,128",
                   help="M buckets (default 1..128); the step is also recorded at the largest one's tokens, and a "
                        "launch whose own M outgrows them (routed pairs) gets the buckets up to its M too")
    m.add_argument("--q-lens", default="1,4", help="step q_lens to record (decode 1, verify 4)")
    m.add_argument("--out", default=None, help="root folder for the files (required unless --in-place)")
    m.add_argument("--in-place", action="store_true", help="write into the package's autotune/configs")
    m.add_argument("--cu-count", type=int, default=None, help="tune for a device with this many CUs")
    m.add_argument("--max-candidates", type=int, default=24, help="candidates per bucket (0 = all)")
    m.add_argument("--budget-s", type=float, default=None, help="per kernel problem: stop compiling after this long")
    m.add_argument("--workers", type=int, default=None, help="parallel compiles (default: all cores)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--only", default=None, help="comma-separated kernel names to tune (default: all launched)")
    m.add_argument("--skip-tuned", action="store_true", help="skip problems that already have a file with every bucket")
    m.add_argument("--dry-run", action="store_true", help="list the problems, tune nothing")
    m.add_argument("--quiet", action="store_true")
    _add_tune_model_draft(m)
    m.set_defaults(func=cmd_tune_model, mode="static", module=None)


def cmd_tune_model(a: argparse.Namespace) -> int:
    """Record the model's steps, collect the distinct (kernel, problem) launches, tune each."""
    if a.model == "draft":
        return cmd_tune_model_draft(a)
    if a.config is None:
        _fail("autotune: tune-model: --config is required (the target's config.json or 'kimi-k2.5')")
    _common_checks(a)
    out = None if a.dry_run else _out_dir(a)
    ms = _ms(a.m)
    qls = _ms(a.q_lens, "--q-lens")
    if a.experts not in ("w4a8", "w4a16", "mxfp4"):
        _fail(f"autotune: --experts must be w4a8, w4a16 or mxfp4, got {a.experts!r}")
    if not 1 <= a.tp <= 64:
        _fail(f"autotune: --tp must be in 1..64, got {a.tp}")
    try:
        from bench.step import load_model_config, step_problem_spans
    except ImportError as e:
        _fail(f"autotune: tune-model needs the bench package of a checkout (run from the repository root): {e}")
    try:
        # 3 layers: the dense first, a MoE layer followed by another (at TP1 it ends with moe_combine_add
        # and the next q_a|kv_a GEMM norms its rows) and the last (moe_combine_norm with the final norm)
        cfg = load_model_config(a.config, a.tp, a.moe_parallel, layers=3)
    except (ValueError, OSError) as e:
        _fail(f"autotune: --config {a.config!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    tokens = max([m for m in ms if m != ANY] or [1])
    probs = step_problem_spans(cfg, a.experts, a.arch, [int(q) for q in qls if q != ANY], tokens, tp=a.tp,
                               moe_parallel=a.moe_parallel)
    print(f"{len(probs)} distinct kernel problems in the step ({a.experts}, tp {a.tp}, {a.arch})")
    return _tune_problems(a, probs, out, ms)


def _add_tune_model_draft(m: argparse.ArgumentParser) -> None:
    m.add_argument("--model", default="target", choices=("target", "draft"),
                   help="target (default): the target's steps from --config; draft: the EAGLE-3 draft's steps "
                        "(TP1, bf16) from --draft-config")
    m.add_argument("--draft-config", default="kimi-k2.5-eagle3",
                   help="with --model draft: the draft's config.json, or 'kimi-k2.5-eagle3' (default)")
    m.add_argument("--include-shared", action="store_true",
                   help="with --model draft: tune also the problems the target's step launches (default: left to "
                        "--model target, which owns those files)")


def cmd_tune_model_draft(a: argparse.Namespace) -> int:
    """tune-model --model draft: record the draft's steps (q_len 1: carried state; q_len > 1: the
    extend over the target's aux rows), and tune each distinct (kernel, problem) at the M buckets.
    Problems the target's TP1 step also launches (e.g. lm_head, o_proj, rmsnorm at the same shapes) are
    skipped unless --include-shared: one owner per file."""
    _common_checks(a)
    out = None if a.dry_run else _out_dir(a)
    ms = _ms(a.m)
    qls = [int(q) for q in _ms(a.q_lens, "--q-lens") if q != ANY]
    if not qls or any(q > 16 for q in qls):
        _fail(f"autotune: --q-lens must be ints in 1..16 for the draft, got {a.q_lens!r}")
    if a.tp != 1:
        _fail("autotune: --tp: the draft runs replicated at TP1 on every rank; tune it without --tp")
    try:
        from bench.step import draft_step_problems, load_draft_config, load_model_config, step_problems
    except ImportError as e:
        _fail(f"autotune: tune-model needs the bench package of a checkout (run from the repository root): {e}")
    try:
        dcfg = load_draft_config(a.draft_config)
    except (ValueError, OSError) as e:
        _fail(f"autotune: --draft-config {a.draft_config!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    probs = draft_step_problems(dcfg, a.arch, qls)
    print(f"{len(probs)} distinct kernel problems in the draft step ({dcfg.architecture}, tp 1, {a.arch})")
    if not a.include_shared:
        spec = a.config or "kimi-k2.5"
        try:
            tcfg = load_model_config(spec, layers=3)
        except (ValueError, OSError) as e:
            _fail(f"autotune: --config {spec!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        target = {(k.name, json.dumps(p, sort_keys=True)) for k, p, _ in step_problems(tcfg, a.experts, a.arch, qls)}
        kept = []
        for k, p, m in probs:
            if (k.name, json.dumps(p, sort_keys=True)) in target:
                print(f"  shared with the target step, left to --model target: {k.name} "
                      + ",".join(f"{d}={v}" for d, v in p.items()))
            else:
                kept.append((k, p, m))
        probs = kept
    return _tune_problems(a, probs, out, ms)



def _takes_numerics_from_another(kernel: Any, prob: dict[str, Any]) -> bool:
    """Whether `prob` runs with another problem's numerics keys (a verify's q_len-1 decode file) or
    another kernel's numerics (`configs_of`): those reference problems are tuned first (a stable
    sort keeps the rest in step order)."""
    from .problems import model_for, strip_m

    pm = model_for(kernel)
    if pm.configs_of is not None:   # keeps its base kernel's tuned numerics: tuned after it
        return True
    ref = pm.numerics_ref
    return ref is not None and strip_m(kernel, ref(dict(prob))) != strip_m(kernel, prob)


def _tune_problems(a: argparse.Namespace, probs: list, out: str | None, ms: list[Any]) -> int:
    """Tune each (kernel, problem, smallest M[, largest M]) of a recorded step (target or draft) at the
    M buckets it can use: buckets below the smallest M of the launch (q_len 4 attention, the draft's
    extend: M >= 4) are never used, and a launch whose own M outgrows the step's tokens (routed pairs)
    gets the ladder's buckets up to its largest M as well; one problem failing does not stop the others."""
    from .buckets import LADDER, bucket_for
    from .problems import model_for
    from .search import tune
    from .store import file_path, load_file

    only = set(x.strip() for x in a.only.split(",")) if a.only else None
    top = max([m for m in ms if m != ANY] or [0])
    for kern, prob, m_min, *m_max in sorted(probs, key=lambda t: _takes_numerics_from_another(t[0], t[1])):
        if only and kern.name not in only:
            continue
        lo = bucket_for(max(1, m_min))       # the extend's launches (q_len k+1) never run below M = k+1
        if model_for(kern).configs_of is not None:   # its figures decide at any M whether it runs: all buckets
            lo = 1
        want = [m for m in ms if m == ANY or bucket_for(m) >= lo] or [lo, ANY]
        hi = bucket_for(max([top, *m_max]))
        extra = [b for b in LADDER if top < b and (hi == ANY or b <= hi) and b >= lo and b not in want]
        want += extra + ([ANY] if hi == ANY and ANY not in want else [])
        label = f"{kern.name} " + ",".join(f"{k}={v}" for k, v in prob.items()) + \
            (f"  (+ buckets {','.join(map(str, extra))}: up to {m_max[0]} rows)" if extra else "")
        if a.dry_run:
            print("  " + label)
            continue
        path = file_path(kern, a.arch, prob, out)
        if a.skip_tuned and os.path.exists(path):
            try:
                if all(m in {e["bucket"] for e in load_file(path)["entries"]} for m in want):
                    print(f"  skip {label}: {path} has every bucket")
                    continue
            except Exception:  # noqa: BLE001 - an unreadable file is tuned again
                pass
        print(f"  tune {label}", flush=True)
        try:
            p, doc = tune(kern, a.arch, prob, want, budget_s=a.budget_s, seed=a.seed, out=out,
                          max_candidates=a.max_candidates, workers=a.workers, progress=not a.quiet,
                          cu_count=a.cu_count)
        except Exception as e:  # noqa: BLE001 - one problem failing does not stop the others
            print(f"  FAILED {label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        print(f"  wrote {p}" + ("  (budget hit)" if doc["provenance"].get("budget_hit") else ""))
        print(paste_lines(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
