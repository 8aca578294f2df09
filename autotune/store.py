"""Tuned-config lookup (minimal: kernel defaults until tuned files exist)."""
from __future__ import annotations

from typing import Any


def lookup_config(kernel: Any, arch: str, problem: dict[str, int], m: int, strict: bool = False) -> dict[str, Any]:
    """The tuned config for `kernel` on `arch` at `problem` and row count `m`; the kernel's
    defaults when nothing is tuned."""
    return {}
