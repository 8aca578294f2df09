"""A probe for device->host reads and host-built tensors: `HostReadProbe` is a TorchFunctionMode that
records (or raises on) every tensor call that needs the host to see device data (item, tolist,
__bool__, __int__, __index__, __float__, cpu, numpy, nonzero, unique, unique_consecutive) and every tensor
built from host data (torch.tensor, as_tensor / new_tensor from non-tensors). On a GPU each is a sync
and a reason graph capture fails; on the CPU they show the same code paths.

Work done by the Triton interpreter while it runs a kernel (CPU stand-in for the GPU) is not counted:
on a GPU that is device work. Each event is attributed to the innermost frame in the project
(models/, ops/, kdsl/) so a test can tell the model's reads from an op's.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READS = {"item", "tolist", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy", "nonzero", "unique",
         "unique_consecutive", "__array__"}
BUILDS = {"tensor", "as_tensor", "new_tensor"}


class HostReadError(RuntimeError):
    pass


@dataclass(frozen=True)
class Event:
    what: str
    where: str          # "models/kimi.py:123 in step" (innermost project frame) or "?"
    area: str           # "models" | "ops" | "kdsl" | "other"


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def _host_data(args) -> bool:
    """True when the first argument holds no tensor (a list / number built on the host)."""
    if not args:
        return False
    a = args[0]
    if isinstance(a, torch.Tensor):
        return False
    if isinstance(a, (list, tuple)):
        return True
    return True


class HostReadProbe(TorchFunctionMode):
    """with HostReadProbe(raise_on=("models",)) as p: ...; p.events lists what was seen."""

    def __init__(self, raise_on: tuple[str, ...] = ()):
        super().__init__()
        self.raise_on = raise_on
        self.events: list[Event] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        n = _name(func)
        if n in READS or (n in BUILDS and _host_data(args if n != "new_tensor" else args[1:])):
            ev = self._event(n)
            if ev is not None:
                self.events.append(ev)
                if ev.area in self.raise_on:
                    raise HostReadError(f"host read {ev.what} at {ev.where}")
        return func(*args, **kwargs)

    def _event(self, what: str):
        frames = traceback.extract_stack()[:-2]
        if any(os.sep + "triton" + os.sep + "runtime" + os.sep + "interpreter" in f.filename for f in frames):
            return None                        # the interpreter executing a kernel: device work on a GPU
        for f in reversed(frames):
            fn = os.path.abspath(f.filename)
            if fn.startswith(ROOT + os.sep):
                rel = os.path.relpath(fn, ROOT)
                top = rel.split(os.sep)[0]
                if top in ("models", "ops", "kdsl"):
                    return Event(what, f"{rel}:{f.lineno} in {f.name}", top)
                if top == "tests":
                    return Event(what, f"{rel}:{f.lineno} in {f.name}", "tests")
        return Event(what, "?", "other")


def summary(events: list[Event]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events:
        k = f"{e.what} @ {e.where}"
        out[k] = out.get(k, 0) + 1
    return out
