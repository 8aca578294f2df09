"""Measured ranking on a GPU: correctness first, then timing.

Inputs are built from the kernel's signature at the problem's shape (fresh random data; packed
int4 as random int32 words), several sets rotated so a candidate never reads a cache-warm copy
(sets until their total passes 2 x a 256 MiB last-level cache). Outputs are poisoned before
every correctness run. The reference is the problem model's torch reference when it has one,
else the kernel at its default config (stated in the figures). Timing: CUDA/HIP events around
each launch, median of `repeats`; the top candidates are then re-timed interleaved (round
robin) so drift and clocks hit them alike.
"""
from __future__ import annotations

import math
import statistics
from typing import Any

from kdsl.targets import Target, current_target, resolve_dtype

CACHE_BYTES = 256 << 20


def require_gpu(target: Target) -> None:
    """Raise a clear error unless a GPU of `target`'s arch is present."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("measured mode needs a GPU, and torch sees none on this machine "
                           "(torch.cuda.is_available() is False); use --mode static here")
    cur = current_target()
    if cur.name != target.name:
        raise RuntimeError(f"measured mode times the local GPU ({cur.name}); --arch {target.name} does not match it: "
                           f"pass --arch current or --mode static")


def make_inputs(kernel: Any, target: Target, dims: dict[str, int], gen: Any) -> dict[str, Any]:
    import torch

    out = {}
    for pname, op in kernel.signature.operands.items():
        shape = [int(dims[d]) for d in op.dims]
        dt = resolve_dtype(op.dtype, target).torch
        if hasattr(op.dtype, "pack"):
            shape[-1] = max(1, shape[-1] // 8)
            t = torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)
        elif dt.is_floating_point:
            t = (torch.randn(shape, generator=gen) * 0.5).to(dt)
        else:
            info = torch.iinfo(dt)
            t = torch.randint(max(info.min, -100), min(info.max, 100), shape, generator=gen).to(dt)
        out[pname] = t.cuda()
    for d in kernel.signature.dim_params:
        out[d] = int(dims[d])
    return out


def _outputs(kernel: Any) -> list[str]:
    return [n for n, op in kernel.signature.operands.items() if op.kind in ("out", "inout")]


def _poison(t: Any) -> None:
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(-123)


def _close(a: Any, b: Any) -> bool:
    import torch

    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    a, b = a.float(), b.float()
    if torch.isnan(a).any():
        return False
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(b.dtype, 0.13)
    return bool(torch.allclose(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max()))))


def measure_bucket(kernel: Any, target: Target, problem: dict[str, Any], m: int, configs: list[dict[str, Any]],
                   pm: Any, seed: int, repeats: int = 25, top: int = 5, rounds: int = 10) -> tuple[dict, dict]:
    """Best config of `configs` (already ranked by the cost model) by measurement, and its figures."""
    import torch

    require_gpu(target)
    dims = {**problem, pm.m_dim: m}
    gen = torch.Generator().manual_seed(seed)
    first = make_inputs(kernel, target, dims, gen)
    set_bytes = sum(t.numel() * t.element_size() for t in first.values() if isinstance(t, torch.Tensor))
    nsets = max(2, min(32, math.ceil(2 * CACHE_BYTES / max(1, set_bytes))))
    sets = [first] + [make_inputs(kernel, target, dims, gen) for _ in range(nsets - 1)]
    outs = _outputs(kernel)

    def launch(cfg: dict, inp: dict) -> None:
        kernel(**inp, config=cfg, target=target)

    ref_inp = sets[0]
    if pm.reference is not None:
        expect = pm.reference(**{k: v for k, v in ref_inp.items()})
        expect = expect if isinstance(expect, dict) else {outs[0]: expect}
        ref_name = "torch reference"
    else:
        for o in outs:
            _poison(ref_inp[o])
        launch({}, ref_inp)
        expect = {o: ref_inp[o].clone() for o in outs}
        ref_name = "kernel default config"
    good = []
    for cfg in configs:
        for o in outs:
            _poison(ref_inp[o])
        try:
            launch(cfg, ref_inp)
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a candidate that fails to run is dropped
            continue
        if all(_close(ref_inp[o], expect[o]) for o in outs):
            good.append(cfg)
    if not good:
        raise RuntimeError(f"no candidate of {kernel.name} matched the {ref_name} at {dims}")

    def time_once(cfg: dict, i: int) -> float:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        inp = sets[i % len(sets)]
        s.record()
        launch(cfg, inp)
        e.record()
        e.synchronize()
        return s.elapsed_time(e) * 1e3  # µs

    med = {}
    for j, cfg in enumerate(good):
        for w in range(3):
            time_once(cfg, w)
        med[j] = statistics.median(time_once(cfg, r) for r in range(repeats))
    best = sorted(med, key=med.get)[:top]
    again: dict[int, list[float]] = {j: [] for j in best}
    for r in range(rounds):
        for j in best:
            again[j].append(time_once(good[j], r))
    final = {j: statistics.median(v) for j, v in again.items()}
    win = min(final, key=final.get)
    nbytes = pm.bytes_fn(problem, m) if pm.bytes_fn else 0.0
    flops = pm.flops_fn(problem, m) if pm.flops_fn else 0.0
    from .costmodel import roofline_floor_s

    floor_s, bound = roofline_floor_s(target, nbytes, flops, pm.peak_dtype)
    t = final[win]
    return good[win], {"measured_us": t, "roofline_fraction": min(1.0, floor_s * 1e6 / t), "floor_us": floor_s * 1e6,
                       "bound": bound, "correct_vs": ref_name, "timed": len(good), "repeats": repeats}
