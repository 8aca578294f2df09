"""GPU timing: CUDA events, median of repeats, A and B interleaved (A, B, A, B, ...) so clock or
thermal drift on a noisy machine hits both sides alike. Only ever used on a real GPU: interpreter
timings are not performance and are never reported."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def _flush_buffer(device: torch.device) -> torch.Tensor:
    # 256 MiB: larger than any L2 / MALL (MI300X Infinity Cache 256 MB), so every rep reads from HBM
    return torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=device)


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int = 50, warmup: int = 5,
                     flush_l2: bool = True, spin_cycles: int = 1_000_000) -> dict[str, float]:
    """Median time in µs of each callable, measured with CUDA events, calls interleaved per rep.

    With `flush_l2` a large buffer is zeroed before every call (outside the timed events), so a
    weight-streaming GEMM is timed cold, as in a decode step where each layer's weights are new.
    Before each start event the GPU spins (`torch.cuda._sleep`) so that the host has queued the
    call before the event fires: the figure is device time, not Python launch overhead (which
    decode hides with CUDA graphs, and which differs between a kdsl launch and a torch op)."""
    if not torch.cuda.is_available():
        raise RuntimeError("time_interleaved needs a GPU (interpreter timings are not performance)")
    dev = torch.device("cuda")
    flush = _flush_buffer(dev) if flush_l2 else None
    for _ in range(warmup):
        for f in fns.values():
            f()
    torch.cuda.synchronize()
    names = list(fns)
    spin = spin_cycles if hasattr(torch.cuda, "_sleep") else 0
    events = {n: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for n in names}
    for i in range(reps):
        order = names if i % 2 == 0 else names[::-1]  # A,B then B,A: neither side always goes first
        for n in order:
            if flush is not None:
                flush.zero_()
            if spin:
                torch.cuda._sleep(spin)
            s, e = events[n][i]
            s.record()
            fns[n]()
            e.record()
    torch.cuda.synchronize()
    return {n: statistics.median(s.elapsed_time(e) for s, e in events[n]) * 1e3 for n in names}
