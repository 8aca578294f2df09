"""bench/ settings: which GEMM problems to run, and the end-of-run tables and JSON.

Options (after `python -m pytest bench`):
  --bench-full         all Kimi shapes and M in {1, 4, 16, 64, 256} (default: M in {1, 4}, two shapes)
  --bench-arch A [..]  static arches (default gfx942 gfx950)
  --bench-json PATH    where the static / measured records go (default .benchmarks/gemm_{static,gpu}.json)
"""
from __future__ import annotations

import json
import os

import pytest

from bench import roofline as R

_STATIC: list = []
_GPU: list = []


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("kdsl bench")
    g.addoption("--bench-full", action="store_true", default=False, help="all Kimi shapes and M values")
    g.addoption("--bench-arch", nargs="+", default=list(R.STATIC_ARCHES), help="arches for the static figures")
    g.addoption("--bench-json", default=None, help="path of the JSON with this run's records")


def _problems(config: pytest.Config) -> list[tuple[str, int]]:
    full = config.getoption("--bench-full")
    shapes = list(R.KIMI_SHAPES) if full else list(R.SHAPES_QUICK)
    ms = R.M_ALL if full else R.M_QUICK
    return [(s, m) for s in shapes for m in ms]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = [n for n in ("gemm_kernel", "arch", "problem") if n in metafunc.fixturenames]
    if not names:
        return
    kernels = list(R.gemm_kernels())
    probs = _problems(metafunc.config)
    if "arch" in metafunc.fixturenames:
        arches = metafunc.config.getoption("--bench-arch")
        combos = [(k, a, p) for k in kernels for a in arches for p in probs]
        ids = [f"{k}-{a}-{p[0]}-M{p[1]}" for k, a, p in combos]
        metafunc.parametrize("gemm_kernel,arch,problem", combos, ids=ids)
    else:
        combos = [(k, p) for k in kernels for p in probs]
        ids = [f"{k}-{p[0]}-M{p[1]}" for k, p in combos]
        metafunc.parametrize("gemm_kernel,problem", combos, ids=ids)


@pytest.fixture
def static_records() -> list:
    return _STATIC


@pytest.fixture
def gpu_records() -> list:
    return _GPU


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    from bench.gemm import gpu_table

    path = config.getoption("--bench-json")
    for recs, mode, table in ((_STATIC, "static", lambda r: R.static_table(r)), (_GPU, "gpu", gpu_table)):
        if not recs:
            continue
        rows = [r.to_dict() if hasattr(r, "to_dict") else r for r in recs]
        terminalreporter.write_sep("=", f"GEMM {'static figures (compile-only)' if mode == 'static' else 'measured on GPU'}")
        terminalreporter.write_line(table(recs))
        out = path if path and not (_STATIC and _GPU) else os.path.join(
            os.path.dirname(path) if path else ".benchmarks", f"gemm_{mode}.json")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump({"mode": mode, "rows": rows}, f, indent=1, default=str)
        terminalreporter.write_line(f"wrote {out}")
