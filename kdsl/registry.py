"""Finding kernels for the CLI without kdsl importing its users: installed packages announce
their kernel modules under the `kdsl.kernels` entry-point group; `--module` adds a file or module."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from importlib.metadata import entry_points

from .kernel import REGISTRY, Kernel

DEFAULT_MODULES = ("ops",)  # this repository's kernels, when run from a checkout


def load_module(spec: str) -> None:
    if spec.endswith(".py") or os.path.sep in spec:
        path = os.path.abspath(spec)
        if not os.path.exists(path):
            raise SystemExit(f"kdsl: no such kernel file: {spec}")
        name = os.path.splitext(os.path.basename(path))[0]
        loaded = sys.modules.get(name)
        if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
            return  # already imported (a second discover() in one process): do not re-register
        sys.path.insert(0, os.path.dirname(path))
        mod_spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = mod
        mod_spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(spec)
        if hasattr(mod, "__path__"):  # a package: its kernels live in its submodules
            import pkgutil

            for info in pkgutil.iter_modules(mod.__path__, prefix=spec + "."):
                if not info.name.rsplit(".", 1)[-1].startswith("_") and info.name != spec + ".demo":
                    importlib.import_module(info.name)


def discover(extra: list[str] | None = None) -> dict[str, Kernel]:
    mods = [ep.value for ep in entry_points(group="kdsl.kernels")]
    if not mods:
        mods = list(DEFAULT_MODULES)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
    for m in mods:
        try:
            load_module(m)
        except ModuleNotFoundError:
            pass
    for m in extra or []:
        load_module(m)
    return REGISTRY


def get_kernel(name: str, extra: list[str] | None = None) -> Kernel:
    reg = discover(extra)
    if name not in reg:
        import difflib

        close = difflib.get_close_matches(name, reg, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise SystemExit(f"kdsl: unknown kernel {name!r}{hint} (`python -m kdsl list` shows them)")
    return reg[name]
