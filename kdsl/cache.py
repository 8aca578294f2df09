"""Where generated sources live: one real `.py` file per specialization (Triton needs a file to
compile for a GPU), named by a hash of its source so identical code is shared."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

_loaded: dict[str, ModuleType] = {}


def cache_dir() -> Path:
    base = os.environ.get("KDSL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kdsl")
    p = Path(base) / "src"
    p.mkdir(parents=True, exist_ok=True)
    return p


def source_hash(src: str) -> str:
    return hashlib.sha256(src.encode()).hexdigest()[:20]


def write_and_import(name: str, src: str) -> tuple[ModuleType, Path]:
    """Write `src` atomically (if not there yet) and import it as a module."""
    h = source_hash(src)
    modname = f"kdsl_gen_{name}_{h}"
    if modname in _loaded:
        return _loaded[modname], Path(_loaded[modname].__file__)
    path = cache_dir() / f"{modname}.py"
    if not path.exists() or path.read_text() != src:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(src)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    _loaded[modname] = mod
    return mod, path
