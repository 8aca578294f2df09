"""`python -m kdsl`: list, show (triton / report --json), and clear errors with a non-zero exit."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kdsl.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "docs", "my_kernels.py")


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(["-m", EXAMPLE, *argv])
    except SystemExit as e:  # argparse and the registry exit with a message
        rc = e.code if isinstance(e.code, int) else 1
        out, err = capsys.readouterr()
        return rc, out, err + ("" if isinstance(e.code, int) else str(e.code))
    out, err = capsys.readouterr()
    return rc, out, err


def test_list_subprocess():
    r = subprocess.run([sys.executable, "-m", "kdsl", "-m", EXAMPLE, "list"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    names = r.stdout.split()
    assert {"gemm_i8", "scale_rows", "softmax_rows"} <= set(names) and names == sorted(names)


def test_show_triton(capsys):
    rc, out, _ = run_main(capsys, "show", "softmax_rows", "--arch", "gfx950", "--emit", "triton")
    assert rc == 0
    assert "@triton.jit" in out and "def softmax_rows(" in out
    assert "# my_kernels.py:" in out and "kdsl kernel softmax_rows for gfx950" in out


def test_show_triton_config(capsys):
    rc, out, _ = run_main(capsys, "show", "gemm_i8", "--arch", "gfx942", "--emit", "triton",
                          "--config", '{"BLOCK_N": 32, "BLOCK_K": 128}')
    assert rc == 0 and "'BLOCK_N': 32" in out and "'BLOCK_K': 128" in out and "acc=" in out


@pytest.mark.aot
def test_show_report_json(capsys):
    rc, out, _ = run_main(capsys, "show", "gemm_i8", "--arch", "gfx950", "--emit", "report", "--json",
                          "--config", '{"BLOCK_N": 32}', "--problem", "M=16,N=256,K=512")
    assert rc == 0
    d = json.loads(out)
    assert d["kernel"] == "gemm_i8" and d["arch"] == "gfx950" and d["ok"] is True
    assert d["problem"]["K"] == 512 and d["config"]["BLOCK_N"] == 32
    assert any(k.startswith("v_mfma_i32_") for k in d["matrix_instructions"])


def test_unknown_kernel(capsys):
    rc, _, err = run_main(capsys, "show", "gemm_i9", "--emit", "triton")
    assert rc != 0 and "unknown kernel 'gemm_i9'" in err and "gemm_i8" in err


def test_bad_config_json(capsys):
    rc, _, err = run_main(capsys, "show", "gemm_i8", "--emit", "triton", "--config", "{BLOCK_N: 32}")
    assert rc != 0 and "--config must be a JSON object" in err


def test_unknown_option(capsys):
    rc, _, err = run_main(capsys, "show", "gemm_i8", "--emit", "triton", "--config", '{"num_wraps": 4}')
    assert rc == 2 and "kernel 'gemm_i8', parameter 'num_wraps'" in err and "unknown option" in err


def test_bad_problem(capsys):
    rc, _, err = run_main(capsys, "show", "gemm_i8", "--emit", "triton", "--problem", "M=x")
    assert rc != 0 and "must be an integer" in err


def test_unknown_arch(capsys):
    rc, _, err = run_main(capsys, "show", "gemm_i8", "--arch", "gfx90a", "--emit", "triton")
    assert rc != 0 and "gfx90a" in err


def test_readme_writing_a_kernel_snippet(monkeypatch):
    """The interpreter snippet in README "## Writing a kernel" runs as written (from the repo root)."""
    import re

    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## Writing a kernel", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    snippet = next(b for b in blocks if "torch.testing.assert_close" in b)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    exec(compile(snippet, "README.md", "exec"), {"__name__": "readme_snippet"})
