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


def check_paged_lengths(op: str, block_table: Any, seq_lens: Any, page_size: int, batch: int, q_len: int) -> None:
    """Paged-cache rules shared by the decode ops: table [B, max_pages], lengths [B], every length
    covers the new rows, and the table holds enough pages for the longest sequence."""
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"{op}: block_table must be [B={batch}, max_pages], got {tuple(block_table.shape)}")
    if tuple(seq_lens.shape) != (batch,):
        raise ValueError(f"{op}: seq_lens must be [B={batch}], got {tuple(seq_lens.shape)}")
    lens = seq_lens.tolist()
    if min(lens) < q_len:
        raise ValueError(f"{op}: every sequence length must be >= q_len={q_len} (the new rows are cached), got {lens}")
    cap = block_table.shape[1] * page_size
    if max(lens) > cap:
        raise ValueError(f"{op}: block table too short: {block_table.shape[1]} pages x page size "
                         f"{page_size} = {cap} tokens < sequence length {max(lens)}")
