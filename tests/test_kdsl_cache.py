"""The generated-source cache (issue 11.8): foreign or corrupt files are rewritten and never run,
killed writers leave no temp files, an unwritable location falls back with one warning."""
from __future__ import annotations

import os
import time
import uuid
import warnings

import pytest

from kdsl import cache


@pytest.fixture()
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("KDSL_CACHE_DIR", str(tmp_path / "kc"))
    monkeypatch.setattr(cache, "_dir", None)
    monkeypatch.setattr(cache, "_dir_for", None)
    return tmp_path / "kc" / "src"


def _src(tag: str) -> str:
    return f"VALUE = {tag!r}\n\ndef f():\n    return VALUE\n"


def test_writes_once_and_imports(fresh):
    tag = uuid.uuid4().hex
    mod, path = cache.write_and_import("t", _src(tag))
    assert mod.f() == tag and path.parent == fresh and path.read_text() == _src(tag)
    assert not list(fresh.glob("*.tmp")) and not (fresh / "__pycache__").exists()


@pytest.mark.parametrize("bad", ["foreign", "truncated", "symlink", "binary"])
def test_foreign_or_corrupt_file_is_rewritten_not_run(fresh, tmp_path, bad):
    tag = uuid.uuid4().hex
    src = _src(tag)
    fresh.mkdir(parents=True, exist_ok=True)
    path = fresh / f"kdsl_gen_t_{cache.source_hash(src)}.py"
    evil = tmp_path / "evil_ran"
    payload = f"open({str(evil)!r}, 'w').write('x')\nVALUE = 'evil'\ndef f():\n    return VALUE\n"
    if bad == "foreign":
        path.write_text(payload)
    elif bad == "truncated":
        path.write_text(src[:10])
    elif bad == "binary":
        path.write_bytes(b"\xff\xfe\x00" * 10)
    else:
        other = tmp_path / "other.py"
        other.write_text(payload)
        path.symlink_to(other)
    mod, p = cache.write_and_import("t", src)
    assert mod.f() == tag and not evil.exists()
    assert not p.is_symlink() and p.read_text() == src


def test_stale_pyc_is_never_used(fresh):
    """What runs is the verified text itself: a planted bytecode file next to it is ignored."""
    import importlib.util
    import py_compile

    tag = uuid.uuid4().hex
    src = _src(tag)
    fresh.mkdir(parents=True, exist_ok=True)
    path = fresh / f"kdsl_gen_t_{cache.source_hash(src)}.py"
    path.write_text(src.replace(tag, "p" * len(tag)))          # same size
    st = os.stat(path)
    py_compile.compile(str(path), cfile=importlib.util.cache_from_source(str(path)))
    path.write_text(src)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))        # same mtime: the pyc looks valid
    mod, _ = cache.write_and_import("t", src)
    assert mod.f() == tag


def test_stale_tmp_files_are_removed(fresh):
    fresh.mkdir(parents=True, exist_ok=True)
    old, new = fresh / "a-1.tmp", fresh / "b-2.tmp"
    old.write_text("x")
    new.write_text("y")
    t = time.time() - cache.STALE_TMP_S - 60
    os.utime(old, (t, t))
    assert cache.cache_dir() == fresh
    assert not old.exists() and new.exists()      # a live writer's fresh temp file is left alone


def test_failed_write_leaves_no_temp_file(fresh, monkeypatch):
    from kdsl.errors import CompileError

    def boom(a, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache.os, "replace", boom)
    with pytest.raises(CompileError, match="cannot write generated source .*No space left"):
        cache.write_and_import("t", _src(uuid.uuid4().hex))
    assert not list(fresh.glob("*.tmp"))


def test_import_failure_rebuilds_once(fresh, monkeypatch):
    """An import that fails on a cached file rewrites it from the source and tries once more."""
    calls = []
    real = cache._exec

    def flaky(modname, path, src):
        calls.append(path.exists())
        if len(calls) == 1:
            raise ImportError("corrupt")
        return real(modname, path, src)

    monkeypatch.setattr(cache, "_exec", flaky)
    tag = uuid.uuid4().hex
    mod, _ = cache.write_and_import("t", _src(tag))
    assert mod.f() == tag and len(calls) == 2
    with pytest.raises(ZeroDivisionError):            # a source that itself fails still raises
        cache.write_and_import("t", "X = 1 / 0\n" + _src(uuid.uuid4().hex))


def test_unwritable_location_falls_back_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KDSL_CACHE_DIR", str(blocker / "sub"))
    monkeypatch.setattr(cache, "_dir", None)
    monkeypatch.setattr(cache, "_dir_for", None)
    with pytest.warns(RuntimeWarning, match="not writable"):
        d = cache.cache_dir()
    assert d != blocker / "sub" / "src" and d.is_dir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.cache_dir() == d                  # once per process
    tag = uuid.uuid4().hex
    mod, p = cache.write_and_import("t", _src(tag))
    assert mod.f() == tag and p.parent == d
