"""Graph capture of the decode, verify and draft steps, one graph per (step kind, padded batch, q_len).

`StepGraphs(mode)` runs a step function `fn(*inputs) -> outputs` (tensors in, tensors out):
- "off": eager, fn(*inputs).
- "on" (a GPU): the first call for a key copies the inputs into static buffers, warms fn up twice on a
  side stream (kernels compiled, allocations settled), restores the state tensors it was given (cache
  lengths: the warm-up advanced them; the KV rows it wrote lie past the lengths, so they are stale),
  then captures fn with torch.cuda.CUDAGraph (the HIP graph API on ROCm). Every call copies the inputs
  into the static buffers and replays; the outputs are the graph's static tensors, overwritten by the
  next replay of that key, so the caller reads (or copies) them before that.
- "static": the same static-buffer protocol with fn run eagerly on the buffers, so the buffer and
  bucketing logic runs in CPU tests.
A captured step may not depend on host values other than its key: the grids of the kernels it
launches depend only on (batch bucket, q_len) and the cache's shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

__all__ = ["StepGraphs", "bucket", "MODES"]

MODES = ("off", "on", "static")


def bucket(n: int) -> int:
    """Padded batch size of a graph: the next power of two (1, 2, 4, 8, 16, 32, 64, ...)."""
    if n < 1:
        raise ValueError(f"batch must be >= 1, got {n}")
    return 1 << (n - 1).bit_length()


@dataclass
class _Entry:
    inputs: list[torch.Tensor]
    outputs: Any
    graph: Optional[Any]


class StepGraphs:
    """Captured (or static-buffer eager) steps keyed by the caller; see the module docstring."""

    def __init__(self, mode: str = "off", state: Sequence[torch.Tensor] = ()):
        if mode not in MODES:
            raise ValueError(f"graphs mode must be one of {MODES}, got {mode!r}")
        if mode == "on" and not torch.cuda.is_available():
            raise ValueError("graphs 'on' needs a GPU (use 'off' or 'static' on the CPU)")
        self.mode, self.state = mode, list(state)
        self.entries: dict[Hashable, _Entry] = {}
        self.pool: Any = None
        self.captures = 0
        self.replays = 0

    @property
    def pads(self) -> bool:
        """Whether callers pad the batch to a bucket (every mode but eager)."""
        return self.mode != "off"

    def __call__(self, key: Hashable, fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:
        if self.mode == "off":
            return fn(*inputs)
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = self._capture(fn, inputs)
        else:
            for s, x in zip(e.inputs, inputs):
                s.copy_(x)
        if self.mode == "static":
            e.outputs = fn(*e.inputs)
            return e.outputs
        e.graph.replay()
        self.replays += 1
        return e.outputs

    def _capture(self, fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> _Entry:
        static = [x.clone() for x in inputs]
        if self.mode == "static":
            return _Entry(static, None, None)
        saved = [s.clone() for s in self.state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*static)
                for s, v in zip(self.state, saved):
                    s.copy_(v)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = fn(*static)
        if self.pool is None:
            self.pool = g.pool()
        for s, v in zip(self.state, saved):      # capture runs nothing; keep the state exact anyway
            s.copy_(v)
        self.captures += 1
        return _Entry(static, out, g)
