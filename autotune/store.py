"""Tuned configs as JSON, one file per (kernel, arch, problem), and the run-time lookup.

File: autotune/configs/<arch>/<kernel>__<problem-key>.json, e.g. gfx942/gemm_w4a8__N2048_K7168.json

    {"schema_version": 1, "kernel": ..., "arch": ..., "problem": {"N": 2048, "K": 7168},
     "target": {"arch", "device_name", "cu_count", "triton_version"},
     "entries": [{"bucket": 1 | ... | "any", "config": {...}, "figures": {...}}],
     "provenance": {"kernel_source_hash", "search_space_hash", "seed", "date", "triton_version", "mode", ...}}

Lookup (on every op launch, so loaded files are cached in memory): the smallest bucket >= M, then
"any", then the kernel's defaults ({}), with a one-time warning naming the files searched; strict
mode raises instead. Writes are atomic (temp file + os.replace); a temp file left by a killed
writer (its pid no longer alive) is removed by the next write into that folder.

Where files are searched, first hit wins:
  1. $KDSL_TUNED_CONFIG_DIR (an override folder, same layout), then the package's configs/ (or `root`);
  2. in each: <arch>/cu<N>/<file> for a device with N compute units, then <arch>/<file>.
The <arch>/ folder holds configs for the arch's reference device (the data-sheet CU count of
kdsl.targets: 304 for gfx942, 256 for gfx950, 132 for sm90); a cu<N>/ subfolder holds configs tuned
for another CU count of the same arch (e.g. an 80-CU MI308X: gfx942/cu80/). A device whose CU count
has no subfolder uses the arch folder. A file tuned under another Triton version than the running one
is used with a one-time warning (re-tune it).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
import threading
import warnings
from typing import Any

from .buckets import ANY, bucket_for, bucket_order, parse_bucket
from .problems import problem_key, strip_m

SCHEMA_VERSION = 1
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
KNOWN_ARCHS = ("gfx942", "gfx950", "sm90")


class ConfigFileError(ValueError):
    """A tuned-config file that is malformed; names the file and the field."""

    def __init__(self, path: str, field: str, rule: str) -> None:
        self.path, self.field, self.rule = path, field, rule
        super().__init__(f"{path}: field {field!r}: {rule}")


class NoTunedConfig(LookupError):
    """Strict lookup found no tuned entry."""


def kernel_name(kernel: Any) -> str:
    return kernel if isinstance(kernel, str) else kernel.name


def kernel_source_hash(kernel: Any) -> str:
    """sha256 of the DSL function's source: a changed kernel flags its tuned files as stale."""
    src = inspect.getsource(kernel.fn)
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def _code_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            names |= _code_names(c)
    return names


def kernel_helpers(kernel: Any) -> dict[str, str]:
    """Every module-level function and class the kernel's DSL function reaches (names it uses,
    recursively, through a class's methods too) in its own package (e.g. ops.*): qualified name ->
    sha256 of its source (16 hex digits)."""
    fn = kernel.fn
    top = (fn.__module__ or "").split(".")[0]
    out: dict[str, str] = {}
    todo = [fn]
    seen = {id(fn)}
    while todo:
        f = todo.pop()
        g = getattr(f, "__globals__", {})
        for n in sorted(_code_names(f.__code__)):
            obj = g.get(n)
            obj = getattr(obj, "fn", obj)  # a kdsl Kernel used as a helper: its function
            if not (inspect.isfunction(obj) or inspect.isclass(obj)) or id(obj) in seen:
                continue
            if (obj.__module__ or "").split(".")[0] != top:
                continue
            seen.add(id(obj))
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            out[f"{obj.__module__}.{obj.__qualname__}"] = hashlib.sha256(src.encode()).hexdigest()[:16]
            if inspect.isclass(obj):  # a view or wrapper class (ops.gemm_addnorm._Segment): what its methods use
                todo += [m for m in vars(obj).values() if inspect.isfunction(m) and id(m) not in seen]
            else:
                todo.append(obj)
    return dict(sorted(out.items()))


def helpers_hash(kernel: Any) -> str:
    """One hash over `kernel_helpers`: a changed helper marks the kernel's tuned files stale."""
    blob = json.dumps(kernel_helpers(kernel), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def file_name(kernel: Any, problem: dict[str, Any]) -> str:
    return f"{kernel_name(kernel)}__{problem_key(kernel, strip_m(kernel, problem))}.json"


def file_path(kernel: Any, arch: str, problem: dict[str, Any], root: str | None = None) -> str:
    return os.path.join(root or CONFIG_DIR, arch, file_name(kernel, problem))


# ---------------------------------------------------------------------------------------------
# validation

def validate(doc: Any, path: str, known_kernels: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check a parsed file; ConfigFileError names the file and the offending field."""
    if not isinstance(doc, dict):
        raise ConfigFileError(path, "<root>", f"must be a JSON object, got {type(doc).__name__}")
    if "schema_version" not in doc:
        raise ConfigFileError(path, "schema_version", "missing")
    if doc["schema_version"] != SCHEMA_VERSION:
        raise ConfigFileError(path, "schema_version",
                              f"unknown schema version {doc['schema_version']!r}; this code reads {SCHEMA_VERSION}")
    for f, ty in (("kernel", str), ("arch", str), ("problem", dict), ("target", dict), ("entries", list),
                  ("provenance", dict)):
        if f not in doc:
            raise ConfigFileError(path, f, "missing")
        if not isinstance(doc[f], ty):
            raise ConfigFileError(path, f, f"must be a {ty.__name__}, got {type(doc[f]).__name__}")
    if doc["arch"] not in KNOWN_ARCHS:
        raise ConfigFileError(path, "arch", f"unknown arch {doc['arch']!r}; known: {', '.join(KNOWN_ARCHS)}")
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    if parent.startswith("cu") and parent[2:].isdigit():  # <arch>/cu<N>/: configs for N compute units
        cu = int(parent[2:])
        if doc["target"].get("cu_count") not in (None, cu):
            raise ConfigFileError(path, "target.cu_count", f"says {doc['target'].get('cu_count')} but the file lies under {parent}/")
        parent = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(path))))
    if parent in KNOWN_ARCHS and parent != doc["arch"]:
        raise ConfigFileError(path, "arch", f"says {doc['arch']!r} but the file lies under {parent}/")
    kern = None
    if known_kernels is not None:
        if doc["kernel"] not in known_kernels:
            raise ConfigFileError(path, "kernel", f"unknown kernel {doc['kernel']!r} (not in `python -m kdsl list`)")
        kern = known_kernels[doc["kernel"]]
    for k, v in doc["problem"].items():
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise ConfigFileError(path, f"problem.{k}", f"must be an int or a string, got {v!r}")
    if kern is not None:
        from .problems import required_dims

        need = required_dims(kern)
        missing = [d for d in need if d not in doc["problem"]]
        if missing:
            raise ConfigFileError(path, f"problem.{missing[0]}", f"missing problem field {missing[0]!r} "
                                                                   f"(kernel {kern.name} dims: {need})")
        unknown = [d for d in doc["problem"] if d not in kern.signature.all_dims()]
        if unknown:
            raise ConfigFileError(path, f"problem.{unknown[0]}", f"{unknown[0]!r} is not a dim of kernel {kern.name}")
    seen = set()
    for i, e in enumerate(doc["entries"]):
        where = f"entries[{i}]"
        if not isinstance(e, dict):
            raise ConfigFileError(path, where, "must be an object")
        for f in ("bucket", "config", "figures"):
            if f not in e:
                raise ConfigFileError(path, f"{where}.{f}", "missing")
        try:
            b = parse_bucket(e["bucket"])
        except ValueError as ex:
            raise ConfigFileError(path, f"{where}.bucket", str(ex)) from None
        if b in seen:
            raise ConfigFileError(path, f"{where}.bucket", f"bucket {b!r} appears twice")
        seen.add(b)
        if not isinstance(e["config"], dict):
            raise ConfigFileError(path, f"{where}.config", "must be an object")
        if not isinstance(e["figures"], dict):
            raise ConfigFileError(path, f"{where}.figures", "must be an object")
    for f in ("kernel_source_hash", "mode"):
        if f not in doc["provenance"]:
            raise ConfigFileError(path, f"provenance.{f}", "missing")
    return doc


def load_file(path: str, known_kernels: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read and validate one file."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ConfigFileError(path, "<file>", f"cannot read: {e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigFileError(path, "<json>", f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return validate(doc, path, known_kernels)


def clean_stale_temps(folder: str) -> list[str]:
    """Remove `.tmp-<pid>-*.json` files whose writer is no longer alive (killed mid-write) and
    unnamed-pid temps older than an hour; returns the removed paths."""
    import time

    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for n in names:
        if not (n.startswith(".tmp-") and n.endswith(".json")):
            continue
        p = os.path.join(folder, n)
        parts = n[len(".tmp-"):].split("-", 1)
        alive = False
        if parts[0].isdigit():
            try:
                os.kill(int(parts[0]), 0)
                alive = True
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
        else:
            try:
                alive = time.time() - os.path.getmtime(p) < 3600
            except OSError:
                continue
        if not alive:
            try:
                os.unlink(p)
                removed.append(p)
            except OSError:
                pass
    return removed


def save_file(doc: dict[str, Any], path: str) -> str:
    """Validate and write atomically: a temp file in the same folder, then os.replace. An
    exception (or Ctrl-C) before the replace leaves any existing file untouched and no partial one."""
    validate(doc, path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    doc = dict(doc)
    doc["entries"] = sorted(doc["entries"], key=lambda e: bucket_order(e["bucket"]))
    clean_stale_temps(d)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{os.getpid()}-", suffix=".json", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    clear_cache()
    return path


# ---------------------------------------------------------------------------------------------
# lookup

_LOCK = threading.Lock()
_FILES: dict[str, dict[str, Any] | None] = {}  # path -> parsed doc (None: absent)
_RESULTS: dict[tuple, dict[str, Any]] = {}  # (root, kernel, arch, problem, bucket, strict) -> config
_WARNED: set[tuple] = set()
_LOG: list[list[dict[str, Any]]] = []  # active lookup logs (lookup_log())
OVERRIDE_ENV = "KDSL_TUNED_CONFIG_DIR"


class lookup_log:
    """Context manager collecting every lookup: {"kernel", "arch", "problem", "m", "path", "hit",
    "launch_index"} (launch_index: the number of launches the active kdsl recorder holds, i.e. the
    index of the launch this lookup configures)."""

    def __enter__(self) -> list[dict[str, Any]]:
        self.entries: list[dict[str, Any]] = []
        _LOG.append(self.entries)
        return self.entries

    def __exit__(self, *exc: Any) -> None:
        _LOG.remove(self.entries)


def _log(name: str, arch: str, prob: dict[str, Any], m: int, path: str | None, hit: bool) -> None:
    if not _LOG:
        return
    try:
        from kdsl.record import active

        rec = active()
        idx = len(rec.launches) if rec is not None else None
    except Exception:  # noqa: BLE001
        idx = None
    for log in _LOG:
        log.append({"kernel": name, "arch": arch, "problem": dict(prob), "m": m, "path": path, "hit": hit,
                    "launch_index": idx})


def search_dirs(root: str | None = None) -> list[str]:
    """Roots searched, in order: $KDSL_TUNED_CONFIG_DIR (when set), then `root` or the package's."""
    out = []
    env = os.environ.get(OVERRIDE_ENV)
    if env:
        out.append(env)
    out.append(root or CONFIG_DIR)
    return out


def _cu_count(arch: str) -> int | None:
    """CU count of the device lookups serve: the current (or recording) target's, when its arch is `arch`."""
    try:
        from kdsl.targets import current_target, get_target

        t = current_target()
        if t.name == arch:
            ref = get_target(arch).cu_count
            return t.cu_count if t.cu_count != ref else None
    except Exception:  # noqa: BLE001
        return None
    return None


def candidate_paths(kernel: Any, arch: str, problem: dict[str, Any], root: str | None = None,
                    cu_count: int | None = None) -> list[str]:
    """Files a lookup tries, in order (see the module docstring)."""
    name = file_name(kernel, problem)
    out = []
    for d in search_dirs(root):
        if cu_count:
            out.append(os.path.join(d, arch, f"cu{cu_count}", name))
        out.append(os.path.join(d, arch, name))
    return out


def _check_triton(doc: dict[str, Any], path: str) -> None:
    want = doc.get("target", {}).get("triton_version") or doc.get("provenance", {}).get("triton_version")
    try:
        import triton

        have = triton.__version__
    except Exception:  # noqa: BLE001
        return
    key = ("triton", path)
    same = bool(want) and (have == want or have.startswith(want + ".") or want.startswith(have + "."))
    if want and not same and key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"{path} was tuned with Triton {want}, running {have}: its configs may no longer be the "
                      f"best (re-tune with `python -m autotune tune-model` or `tune`)", stacklevel=3)


def clear_cache() -> None:
    """Forget loaded files (after writing one, or when a test swaps the config folder)."""
    with _LOCK:
        _FILES.clear()
        _RESULTS.clear()
        _WARNED.clear()


def _cached_file(path: str) -> dict[str, Any] | None:
    with _LOCK:
        if path in _FILES:
            return _FILES[path]
    doc = load_file(path) if os.path.exists(path) else None
    with _LOCK:
        _FILES[path] = doc
    return doc


def _arch_name(arch: Any) -> str:
    if isinstance(arch, str):
        if arch == "current":
            from kdsl.targets import current_target

            return current_target().name
        return arch
    return arch.name  # a kdsl Target


def select_entry(doc: dict[str, Any], m: int) -> dict[str, Any] | None:
    """The entry for M: smallest bucket >= M, then "any"."""
    want = bucket_for(m)
    by = {parse_bucket(e["bucket"]): e for e in doc["entries"]}
    if want != ANY:
        ladder = sorted((b for b in by if b != ANY), key=bucket_order)
        for b in ladder:
            if b >= want:
                return by[b]
    return by.get(ANY)


def lookup_figures(kernel: Any, arch: Any, problem: dict[str, Any], m: int, root: str | None = None
                   ) -> dict[str, Any] | None:
    """The recorded figures (predicted_us, ...) of the entry `lookup_config` would pick, or None
    when no tuned file or bucket holds one: lets an op choose between kernel paths by their tuned
    times (a host lookup, no warning)."""
    arch = _arch_name(arch)
    if arch == "interpret":
        return None
    prob = strip_m(kernel, problem)
    for path in candidate_paths(kernel, arch, prob, root, _cu_count(arch)):
        doc = _cached_file(path)
        entry = select_entry(doc, m) if doc is not None and doc["kernel"] == kernel_name(kernel) else None
        if entry is not None:
            return entry.get("figures")
    return None


def lookup_config(kernel: Any, arch: Any, problem: dict[str, Any], m: int, strict: bool = False,
                  root: str | None = None) -> dict[str, Any]:
    """The tuned config for `kernel` (a kdsl Kernel or its name) on `arch` at `problem` (dims other
    than M; an M in it is ignored) and row count `m`. Smallest tuned bucket >= M, then "any", then
    {} (the kernel's defaults) with a one-time warning; `strict` raises NoTunedConfig instead."""
    arch = _arch_name(arch)
    name = kernel_name(kernel)
    if isinstance(kernel, str):
        from kdsl.kernel import REGISTRY

        kernel = REGISTRY.get(kernel, kernel)
    prob = strip_m(kernel, problem)
    pkey = tuple(sorted((k, str(v)) for k, v in prob.items()))
    cu = _cu_count(arch)
    rkey = (root, os.environ.get(OVERRIDE_ENV), cu, name, arch, pkey, bucket_for(m), strict)
    hit = _RESULTS.get(rkey)
    if hit is not None:
        cfg, path = hit
        _log(name, arch, prob, m, path, path is not None)
        return dict(cfg)
    if arch == "interpret":  # the CPU interpreter: nothing to tune, defaults silently
        return {}
    tried = []
    doc = entry = None
    path = None
    for path in candidate_paths(kernel, arch, prob, root, cu):
        doc = _cached_file(path)
        tried.append(f"{path} ({'absent' if doc is None else 'no bucket >= M and no any'})")
        if doc is None:
            continue
        if doc["kernel"] != name:
            raise ConfigFileError(path, "kernel", f"says {doc['kernel']!r}, expected {name!r}")
        entry = select_entry(doc, m)
        if entry is not None:
            _check_triton(doc, path)
            break
    if entry is None:
        path = None
        why = (f"no tuned config for kernel {name!r} on {arch} at {prob} M={m} (bucket {bucket_for(m)}); "
               f"searched " + "; ".join(tried))
        if strict:
            raise NoTunedConfig(why)
        wkey = (root, name, arch, pkey)
        if wkey not in _WARNED:
            _WARNED.add(wkey)
            warnings.warn(why + "; using the kernel defaults (tune with `python -m autotune tune`)", stacklevel=2)
        cfg: dict[str, Any] = {}
    else:
        cfg = dict(entry["config"])
    _RESULTS[rkey] = (cfg, path)
    _log(name, arch, prob, m, path, path is not None)
    return dict(cfg)


def iter_files(root: str | None = None) -> list[str]:
    root = root or CONFIG_DIR
    out = []
    for d, _, files in os.walk(root):
        out += [os.path.join(d, f) for f in files if f.endswith(".json") and not f.startswith(".tmp-")]
    return sorted(out)
