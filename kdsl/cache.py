"""Where generated sources live: one real `.py` file per specialization (Triton needs a file to
compile for a GPU), named by a hash of its source so identical code is shared.

The cache is not trusted (issue 11.8): a file is imported only after its bytes were read back and
found equal to the source, and what runs is that verified text (compiled here, no bytecode cache), so
a corrupt, truncated or foreign file, or a stale `.pyc`, is never executed; a mismatching file, or one
that fails to import, is rewritten from the source once. Writes go to a temp file replaced atomically;
`*.tmp` files older than `STALE_TMP_S` (writers killed mid-write) are removed on first use. An
unwritable cache location falls back to a private per-user temp directory, with one warning; if that
fails too the error names both places.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import stat
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import ModuleType

from .errors import CompileError

__all__ = ["cache_dir", "source_hash", "write_and_import", "STALE_TMP_S"]

STALE_TMP_S = 600            # a temp file older than this belongs to a writer that was killed

_loaded: dict[str, ModuleType] = {}
_dir: Path | None = None     # the directory in use (after any fallback), fixed per process and location
_dir_for: str | None = None


def _configured() -> Path:
    base = os.environ.get("KDSL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kdsl")
    return Path(base) / "src"


def _writable(p: Path) -> None:
    """Create `p` and prove a file can be written there (raises OSError otherwise)."""
    p.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=p, prefix=".probe-", suffix=".tmp")
    os.close(fd)
    os.unlink(probe)


def _private_tmp() -> Path:
    """A per-user directory under the system temp dir, mode 0700 and owned by us (else a fresh one)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    p = Path(tempfile.gettempdir()) / f"kdsl-src-{uid if uid is not None else 'user'}"
    try:
        p.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(p)
        ok = stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o022 and (uid is None or st.st_uid == uid)
    except OSError:
        ok = False
    return p if ok else Path(tempfile.mkdtemp(prefix="kdsl-src-"))


def _clean_stale(p: Path) -> None:
    now = time.time()
    for f in p.glob("*.tmp"):
        try:
            if now - f.lstat().st_mtime > STALE_TMP_S:
                f.unlink()
        except OSError:
            pass


def cache_dir() -> Path:
    """The source cache directory: the configured one if writable, else a private temp directory."""
    global _dir, _dir_for
    want = _configured()
    if _dir is not None and _dir_for == str(want):
        return _dir
    try:
        _writable(want)
        got = want
    except OSError as e:
        alt = _private_tmp()
        try:
            _writable(alt)
        except OSError as e2:
            raise CompileError(None, None, f"source cache {want} is not writable ({e.strerror or e}) and neither "
                                           f"is {alt} ({e2.strerror or e2}); set KDSL_CACHE_DIR") from None
        warnings.warn(f"kdsl: source cache {want} is not writable ({e.strerror or e}); using {alt}",
                      RuntimeWarning, stacklevel=2)
        got = alt
    _clean_stale(got)
    _dir, _dir_for = got, str(want)
    return got


def source_hash(src: str) -> str:
    return hashlib.sha256(src.encode()).hexdigest()[:20]


def _holds(path: Path, data: bytes) -> bool:
    """True when `path` is a regular file (not a link) whose bytes are exactly `data`."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != len(data):
            return False
        with open(path, "rb") as f:
            return f.read(len(data) + 1) == data
    except OSError:
        return False


def _write(path: Path, data: bytes) -> None:
    """Atomic replace through a temp file in the same directory; no temp file survives a failure."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem[:40] + "-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _exec(modname: str, path: Path, src: str) -> ModuleType:
    """Run the verified source text as module `modname` whose file is `path` (no bytecode cache)."""
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    try:
        exec(compile(src, str(path), "exec"), mod.__dict__)
    except BaseException:
        sys.modules.pop(modname, None)
        raise
    return mod


def write_and_import(name: str, src: str) -> tuple[ModuleType, Path]:
    """Write `src` atomically (unless the file already holds exactly it) and import it as a module."""
    h = source_hash(src)
    modname = f"kdsl_gen_{name}_{h}"
    if modname in _loaded:
        return _loaded[modname], Path(_loaded[modname].__file__)
    data = src.encode()
    path = cache_dir() / f"{modname}.py"
    for attempt in (0, 1):
        if not _holds(path, data):
            try:
                _write(path, data)
            except OSError as e:
                raise CompileError(name, None, f"cannot write generated source {path}: {e.strerror or e}") from None
            if not _holds(path, data):
                raise CompileError(name, None, f"generated source {path} changed while it was written "
                                               "(another writer with different content?)")
        try:
            mod = _exec(modname, path, src)
            break
        except Exception:
            if attempt:
                raise
            try:
                os.unlink(path)          # rebuild once: the next round writes it afresh
            except OSError:
                pass
    _loaded[modname] = mod
    return mod, path
