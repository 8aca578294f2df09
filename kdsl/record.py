"""Record mode: launches are captured, not run, so a whole forward can be costed without a GPU.

    with kd.recording("gfx942") as rec:      # current_target() reports gfx942 inside the block
        model.forward(...)                   # on meta (or any) tensors: no kernel runs
    for r in rec.launches: print(r.kernel.name, r.config, r.dims, r.grid)

Every kdsl launch inside the block binds and checks its arguments exactly as a real launch would,
resolves its specialization (config lookups see the recording target), appends a `LaunchRecord`
and returns without running. Tensors may live on any device, `meta` included.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

from .targets import Target, get_target


@dataclass(frozen=True)
class LaunchRecord:
    kernel: Any                 # the kdsl Kernel
    config: dict[str, Any]      # the full config the launch used (tunables + options)
    dims: dict[str, int]        # every bound dim
    grid: tuple[int, ...]       # programs per grid axis
    target: str


@dataclass
class Recorder:
    target: Target
    launches: list[LaunchRecord] = field(default_factory=list)


_ACTIVE: list[Recorder] = []


def active() -> Recorder | None:
    """The innermost recorder, or None outside record mode."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def recording(target: str | Target) -> Iterator[Recorder]:
    rec = Recorder(get_target(target))
    _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        _ACTIVE.remove(rec)
