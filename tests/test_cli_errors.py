"""Every CLI turns bad input into ONE line on stderr naming the flag, field or file, and exit status 2
(issue 11.7): tables of bad argument lists through models.generate, models.fixtures and kdsl, run
in-process (and a few as subprocesses, where a traceback would really show)."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdsl.__main__ import main as kdsl_main
from models import generate as G
from models.fixtures import main as fixtures_main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "docs" / "my_kernels.py")


def _call(main, argv, capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_one_line(rc: int, err: str, names: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (rc, err)
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert names in lines[0], (names, lines[0])


# ----------------------------------------------------------------------------------------------
# models.generate


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The embedded default checkpoints (built once into a private cache) and a few damaged copies."""
    base = tmp_path_factory.mktemp("cli")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(base / "xdg"))
    t, d = G.default_checkpoints()
    bad = {}
    for name, edit in (("nan_eps", lambda c: c["text_config"].__setitem__("rms_norm_eps", float("nan"))),
                       ("layers", lambda c: c["text_config"].__setitem__("num_hidden_layers", 1000)),
                       ("mtype", lambda c: c.__setitem__("model_type", "gpt2"))):
        p = base / name
        shutil.copytree(t, p)
        c = json.loads((p / "config.json").read_text())
        edit(c)
        (p / "config.json").write_text(json.dumps(c))
        bad[name] = p
    p = base / "corrupt"
    shutil.copytree(t, p)
    shard = sorted(p.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    bad["corrupt"] = p
    yield t, d, bad, base
    mp.undo()


def _gen_cases(t, d, bad, base):
    nodir = str(base / "nope")
    return [
        (["--steps", "0"], "--steps"), (["--steps", "x"], "--steps"), (["--steps", "1000"], "--steps"),
        (["--topk", "0"], "--topk"), (["--topk", "100000"], "--topk"),
        (["--draft-tokens", "1"], "--draft-tokens"), (["--draft-tokens", "99999"], "--draft-tokens"),
        (["--topk", "2", "--draft-tokens", "30"], "--draft-tokens"),
        (["--max-new-tokens", "0"], "--max-new-tokens"), (["--max-new-tokens", "9" * 30], "--max-new-tokens"),
        (["--max-new-tokens", "300000"], "--max-new-tokens"),
        (["--batch", "0"], "--batch"), (["--batch", "10000000"], "--batch"),
        (["--batch", "4096", "--max-new-tokens", "200000"], "--batch"),
        (["--threads", "0"], "--threads"), (["--threads", "1000000"], "--threads"),
        (["--temperature", "nan"], "--temperature"), (["--temperature", "inf"], "--temperature"),
        (["--temperature", "-1"], "--temperature"), (["--temperature", "1e-9"], "--temperature"),
        (["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"), (["--top-p", "nan"], "--top-p"),
        (["--seed", "-1"], "--seed"), (["--backend", "cuda"], "--backend"), (["--bogus"], "--bogus"),
        (["--prompt", ""], "--prompt"),
        (["--aux-ids", "1,2"], "--aux-ids"), (["--aux-ids", "a,b,c"], "--aux-ids"),
        (["--aux-ids", "2,4,99"], "--aux-ids"), (["--aux-ids", "0,4,5"], "--aux-ids"),
        (["--target", nodir], "--target"), (["--target", nodir, "--draft", nodir], "--target"),
        (["--target", str(base), "--draft", str(d)], "--target"),
        (["--target", str(d), "--draft", str(t)], "--target"),
        (["--target", str(bad["nan_eps"]), "--draft", str(d)], "rms_norm_eps"),
        (["--target", str(bad["layers"]), "--draft", str(d)], "num_hidden_layers"),
        (["--target", str(bad["mtype"]), "--draft", str(d)], "model_type"),
        (["--target", str(bad["corrupt"]), "--draft", str(d)], "shard"),
    ]


def test_generate_bad_inputs(ckpts, capsys):
    t, d, bad, base = ckpts
    threads = torch.get_num_threads()
    try:
        for argv, names in _gen_cases(t, d, bad, base):
            rc, _, err = _call(G.main, argv + ["--max-new-tokens", "2"] if "--max-new-tokens" not in argv else argv,
                               capsys)
            _assert_one_line(rc, err, names)
    finally:
        torch.set_num_threads(threads)


def test_generate_json_is_strict_and_names_aux_ids(ckpts, capsys, monkeypatch):
    t, d, _, base = ckpts
    monkeypatch.setenv("XDG_CACHE_HOME", str(base / "xdg"))
    n = torch.get_num_threads()
    try:
        rc, out, _ = _call(G.main, ["--json", "--max-new-tokens", "2", "--batch", "1", "--target", str(t), "--draft", str(d)], capsys)
        assert rc == 0
        r = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
        assert r["aux_ids"] == [2, 4, 5] and "eagle_aux_hidden_state_layer_ids [1, 3, 4]" in r["aux_ids_source"]
        rc, out, _ = _call(G.main, ["--max-new-tokens", "2", "--batch", "1", "--aux-ids", "2,2,1"], capsys)
        assert rc == 0 and "aux ids (target layers captured) [2, 2, 1]: --aux-ids" in out
    finally:
        torch.set_num_threads(n)
    assert G._json_safe({"a": [1.0, math.inf, {"b": math.nan}], "c": "x"}) == {"a": [1.0, None, {"b": None}], "c": "x"}


def test_generate_uses_the_drafts_aux_ids(ckpts, monkeypatch):
    """The target captures what the draft config names (not the target's default): a draft whose
    eagle_config says [3, 5, 6] (pre-layer, as given) makes the target capture (3, 5, 6)."""
    import argparse

    from models.config import load_config

    t, d, _, base = ckpts
    p = base / "draft356"
    if not p.exists():
        shutil.copytree(d, p)
        c = json.loads((p / "config.json").read_text())
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [3, 5, 6]
        (p / "config.json").write_text(json.dumps(c))
    a = argparse.Namespace(aux_ids_list=None)
    ids, src = G.resolve_capture_ids(a, load_config(t), load_config(p))
    assert ids == (3, 5, 6) and "as given" in src
    a.aux_ids_list = (2, 2, 1)
    assert G.resolve_capture_ids(a, load_config(t), load_config(p))[0] == (2, 2, 1)


def test_fixture_cache_rebuilds_a_damaged_default(tmp_path, monkeypatch):
    from models.fixtures import MARKER, verify_fixture

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    t, d = G.default_checkpoints()
    shard = sorted(t.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:50])             # a partial write
    (d / MARKER).unlink()                                  # a writer killed before finishing
    leftover = tmp_path / "kdsl" / "fixtures" / ".kimi-k25-dead"
    leftover.mkdir()
    old = 0
    os.utime(leftover, (old, old))
    t2, d2 = G.default_checkpoints()
    assert (t2, d2) == (t, d) and verify_fixture(t, "kimi-k25") is None and verify_fixture(d, "eagle3") is None
    assert not leftover.exists()


def test_fixture_cache_unwritable_falls_back(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(G.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    t, d = G.default_checkpoints()
    assert str(t).startswith(str(tmp_path / "tmp")) and "not writable" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# models.fixtures


def _fx_cases(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir(exist_ok=True)
    (foreign / "keep.txt").write_text("x")
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = str(tmp_path / "o")
    return [
        ([], "--kind"), (["--kind", "eagle3"], "--out"), (["--kind", "llama", "--out", out], "--kind"),
        (["--kind", "eagle3", "--out", out, "--hidden", "0"], "--hidden"),
        (["--kind", "eagle3", "--out", out, "--hidden", "abc"], "--hidden"),
        (["--kind", "eagle3", "--out", out, "--hidden", "33"], "--hidden"),
        (["--kind", "eagle3", "--out", out, "--layers", "4"], "--layers"),
        (["--kind", "kimi-k25", "--out", out, "--layers", "100000"], "--layers"),
        (["--kind", "kimi-k25", "--out", out, "--layers", "1000", "--experts", "1024", "--hidden", "4096"], "--layers"),
        (["--kind", "kimi-k25", "--out", out, "--vocab", str(1 << 40)], "--vocab"),
        (["--kind", "kimi-k25", "--out", out, "--topk", "64"], "--topk"),
        (["--kind", "kimi-k25", "--out", out, "--kv-heads", "3"], "--kv-heads"),
        (["--kind", "eagle3", "--out", out, "--draft-vocab", "100000"], "--draft-vocab"),
        (["--kind", "eagle3-int4", "--out", out, "--pack-method", "zigzag"], "--pack-method"),
        (["--kind", "eagle3", "--out", out, "--seed", "-1"], "--seed"),
        (["--kind", "eagle3", "--out", out, "--tokenizer"], "--tokenizer"),
        (["--kind", "kimi-k25", "--out", out, "--tokenizer", "--vocab", "300"], "--vocab"),
        (["--kind", "eagle3", "--out", str(foreign)], "--out"),
        (["--kind", "eagle3", "--out", str(afile)], "--out"),
        (["--kind", "eagle3", "--out", str(afile / "sub")], "--out"),
    ]


def test_fixtures_bad_inputs(tmp_path, capsys):
    for argv, names in _fx_cases(tmp_path):
        rc, _, err = _call(fixtures_main, argv, capsys)
        _assert_one_line(rc, err, names)
    assert (tmp_path / "foreign" / "keep.txt").exists()


# ----------------------------------------------------------------------------------------------
# kdsl


KDSL_CASES = [
    (["list", "-x"], "-x"), ([], "cmd"), (["bogus"], "bogus"),
    (["-m", "/nonexistent/k.py", "list"], "--module"), (["-m", "no_such_module_xyz", "list"], "--module"),
    (["-m", EXAMPLE, "show", "gemm_i9"], "gemm_i9"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--arch", "gfx1"], "--arch"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "bogus"], "--emit"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--arch", "interpret", "--emit", "asm"], "--arch"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--config", "{x"], "--config"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--config", "[1]"], "--config"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--config", '{"BLOCK_N": NaN}'], "--config"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--config", '{"BLOCK_N": 1e999}'], "--config"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--config", '{"BLOCK_N": 33}'], "BLOCK_N"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--config", '{"num_wraps": 4}'], "num_wraps"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--config", "[" * 100000], "--config"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--problem", "M=x"], "--problem"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--problem", "M"], "--problem"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--problem", "=3"], "--problem"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--problem", "M=1,M=2"], "--problem"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--problem", "Q=3"], "--problem"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--problem", "M=-1"], "--problem"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "triton", "--problem", "M=0"], "--problem"),
    (["-m", EXAMPLE, "show", "gemm_i8", "--emit", "report", "--problem", "N=" + "9" * 40], "--problem"),
]


def test_kdsl_bad_inputs(capsys, tmp_path):
    bad_syntax = tmp_path / "bad_syntax.py"
    bad_syntax.write_text("def f(:\n")
    bad_raise = tmp_path / "bad_raise.py"
    bad_raise.write_text("raise RuntimeError('boom')\n")
    cases = KDSL_CASES + [(["-m", str(bad_syntax), "list"], "--module"), (["-m", str(bad_raise), "list"], "--module")]
    for argv, names in cases:
        rc, _, err = _call(kdsl_main, argv, capsys)
        _assert_one_line(rc, err, names)


@pytest.mark.parametrize("cmd,names", [
    ([sys.executable, "-m", "models.generate", "--temperature", "nan"], "--temperature"),
    ([sys.executable, "-m", "models.generate", "--batch", "4096", "--max-new-tokens", "200000"], "--batch"),
    ([sys.executable, "-m", "models.fixtures", "--kind", "eagle3", "--out", "/proc/nope", "--hidden", "0"], "--hidden"),
    ([sys.executable, "-m", "kdsl", "-m", "/nonexistent/k.py", "list"], "--module"),
])
def test_subprocess_one_line(cmd, names, tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    _assert_one_line(r.returncode, r.stderr, names)
