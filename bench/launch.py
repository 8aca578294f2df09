"""Host time of one kdsl launch with the compiled kernel stubbed out (`python -m bench.launch`).

What is timed is `Kernel.__call__` alone: binding the arguments to dims, the checks, finding the
specialization, collecting strides and building the options, up to the call into the compiled
function, which is replaced by a no-op so nothing runs and Triton's own launch cost is left out.
Tensors are small CPU tensors (the interpreter target); the host work does not depend on their
size. Each kernel is launched repeatedly with the same shapes and config, as a decode step does.

`--no-cache` measures the uncached path (every launch binds, validates and looks up its
specialization from scratch: the path before launchers were cached), so one run prints both figures.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import time
from typing import Any, Callable, Iterator

import torch


def _problems() -> list[tuple[str, Callable[[], tuple[Any, tuple, dict]]]]:
    """(label, factory) pairs; a factory returns (kernel, positional args, config)."""
    import ops.gemm as gemm
    import ops.mla as mla
    import ops.moe as moe
    import ops.norm as norm
    import ops.quant as quant

    def w4a8():
        M, N, K = 4, 256, 512
        args = (torch.zeros(M, K, dtype=torch.int8), torch.ones(M), torch.zeros(N, K // 8, dtype=torch.int32),
                torch.ones(N), torch.empty(M, N, dtype=torch.bfloat16))
        return gemm.gemm_w4a8_kernel, args, {}

    def quant_i8():
        M, K = 4, 7168
        args = (torch.zeros(M, K, dtype=torch.bfloat16), torch.empty(M, K, dtype=torch.int8), torch.empty(M))
        return quant.quant_per_token_int8, args, {}

    def rms():
        M, D = 4, 7168
        args = (torch.zeros(M, D, dtype=torch.bfloat16), torch.ones(D, dtype=torch.bfloat16),
                torch.empty(M, D, dtype=torch.bfloat16), 1e-6)
        return norm.rmsnorm, args, {}

    def mla_split():
        B, QL, H, DL, DR, NP, PS, MP, S = 2, 1, 16, 512, 64, 64, 64, 8, 4
        args = (torch.zeros(B, QL, H, DL + DR, dtype=torch.bfloat16),
                torch.zeros(NP, PS, DL + DR, dtype=torch.bfloat16),
                torch.zeros(B, MP, dtype=torch.int32), torch.full((B,), 100, dtype=torch.int32),
                torch.empty(B, QL, H, S, DL), torch.empty(B, QL, H, S), 0.1, QL * H, DR)
        return mla.mla_decode_split, args, {"BLOCK_M": 16}

    def moe_s2():
        M, TOPK, E, H, I, BM = 4, 8, 16, 256, 128, 16
        T = M * TOPK
        NB = T + E
        S = NB * BM
        args = (torch.zeros(S, I, dtype=torch.bfloat16), torch.zeros(E, H, I // 8, dtype=torch.int32),
                torch.ones(E, H), torch.zeros(S, dtype=torch.int32), torch.zeros(NB, dtype=torch.int32),
                torch.ones(T), torch.zeros(M, H), torch.empty(T, H), TOPK)
        return moe.moe_stage2_w4a8, args, {"BLOCK_M": BM}

    return [("gemm_w4a8", w4a8), ("quant_per_token_int8", quant_i8), ("rmsnorm", rms),
            ("mla_decode_split", mla_split), ("moe_stage2_w4a8", moe_s2)]


class _Stub:
    """Stands for the compiled function: `stub[grid](*args, **opts)` does nothing."""

    calls = 0

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self._run

    def _run(self, *args: Any, **kwargs: Any) -> None:
        _Stub.calls += 1


@contextlib.contextmanager
def _stubbed() -> Iterator[None]:
    """Inside the block every specialization's compiled function is the stub (before and after
    launch caching, a launch reaches it through `Specialization.fn`). On exit the real one is back
    and the launchers bound to the stub are dropped."""
    kk = importlib.import_module("kdsl.kernel")
    stub = _Stub()
    saved = kk.Specialization.__dict__["fn"]

    def drop_launchers() -> None:
        for k in list(kk.REGISTRY.values()):
            getattr(k, "_launchers", {}).clear()

    drop_launchers()
    kk.Specialization.fn = property(lambda self: stub)  # type: ignore[assignment]
    try:
        yield
    finally:
        kk.Specialization.fn = saved  # type: ignore[assignment]
        drop_launchers()


def _set_cache(enabled: bool) -> bool:
    """Turn the launcher cache on or off; False where this checkout has none."""
    kk = importlib.import_module("kdsl.kernel")

    if not hasattr(kk, "LAUNCH_CACHE"):
        return False
    kk.LAUNCH_CACHE["enabled"] = enabled
    return True


def measure(kernel: Any, args: tuple, config: dict, n: int, rounds: int) -> float:
    """Host µs per launch: the best of `rounds` batches of `n` launches, after warm-up launches.
    Short batches and the minimum keep other processes' time slices out of the figure (the machine
    this runs on may be shared); the same method times both paths."""
    for _ in range(20):
        kernel(*args, config=config)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            kernel(*args, config=config)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=200, help="launches per timed batch (default 200)")
    ap.add_argument("--rounds", type=int, default=200, help="timed batches; the best counts (default 200)")
    ap.add_argument("--no-cache", action="store_true", help="only the uncached path")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = ap.parse_args(argv)
    if args.n < 1 or args.rounds < 1:
        print(f"bench.launch: {'-n' if args.n < 1 else '--rounds'} must be >= 1", file=sys.stderr)
        return 2
    has_cache = _set_cache(True)
    rows: dict[str, dict[str, float]] = {}
    with _stubbed():
        try:
            for label, make in _problems():
                k, a, cfg = make()
                row: dict[str, float] = {}
                if has_cache:
                    _set_cache(False)
                row["uncached_us"] = measure(k, a, cfg, args.n, args.rounds)
                if has_cache and not args.no_cache:
                    _set_cache(True)
                    row["cached_us"] = measure(k, a, cfg, args.n, args.rounds)
                rows[label] = row
        finally:
            _set_cache(True)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'kernel':<24}{'uncached µs':>14}{'cached µs':>12}")
    for label, row in rows.items():
        c = f"{row['cached_us']:.2f}" if "cached_us" in row else "-"
        print(f"{label:<24}{row['uncached_us']:>14.2f}{c:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
