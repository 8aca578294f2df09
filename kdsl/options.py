"""Launch options: validated by name against the target, shimmed to the installed Triton.

Triton silently drops option names it does not know, so a misspelled `num_wraps` would tune
nothing. Here an unknown name is an error, and an option the installed Triton lacks (option sets
differ between 3.5 and 3.9) may only keep its default value.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from .errors import ConfigError
from .targets import Target


@functools.lru_cache(maxsize=None)
def installed_option_fields(backend: str) -> frozenset[str]:
    """Option field names of the installed Triton backend (empty for the interpreter)."""
    try:
        if backend == "hip":
            from triton.backends.amd.compiler import HIPOptions as O
        elif backend == "cuda":
            from triton.backends.nvidia.compiler import CUDAOptions as O
        else:
            return frozenset()
    except Exception:  # a Triton without that backend
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(O))


def split_config(kernel: str, target: Target, config: dict[str, Any], tunables: dict[str, Any]
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a flat config into (tunable values, launch options), defaults filled in; errors name
    the kernel, the option and what is allowed."""
    tun: dict[str, Any] = {}
    opts = {o.name: o.default for o in target.options}
    for k, v in config.items():
        if k in tunables:
            tun[k] = v
        elif target.option(k) is not None:
            spec = target.option(k)
            if v not in spec.domain:
                rule = f"{k}={v!r} is not allowed on {target.name}; allowed: {list(spec.domain)}"
                if k == "kpack" and target.name == "gfx950":
                    rule = f"kpack={v!r}: gfx950 supports only kpack=1"
                if k == "num_warps":
                    rule += " (num_warps must be a power of two)"
                raise ConfigError(kernel, k, rule)
            opts[k] = v
        else:
            known = sorted(set(tunables) | set(target.option_names()))
            raise ConfigError(kernel, k, f"unknown option {k!r} for {target.name}; known: {', '.join(known)}")
    return tun, opts


def backend_options(kernel: str, target: Target, opts: dict[str, Any]) -> dict[str, Any]:
    """The options to hand to the installed Triton for this target."""
    if target.backend == "interpret":
        return {}
    fields = installed_option_fields(target.backend)
    out: dict[str, Any] = {}
    for k, v in opts.items():
        if k in fields:
            out[k] = v
        elif v != target.option(k).default:
            import triton

            raise ConfigError(kernel, k, f"option {k}={v!r} is not supported by the installed Triton "
                                         f"{triton.__version__}; leave it at {target.option(k).default!r}")
    return out
