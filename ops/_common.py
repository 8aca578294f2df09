"""Helpers shared by the attention and norm ops."""
from __future__ import annotations

from typing import Any

from kdsl.targets import current_target


def config_for(kernel: Any, problem: dict[str, int], m: int, config: dict[str, Any] | None) -> dict[str, Any]:
    """An explicit config wins; otherwise the tuned config for this arch/problem (or {} = defaults)."""
    if config is not None:
        return config
    from autotune import lookup_config

    return lookup_config(kernel, current_target().name, problem, m)
