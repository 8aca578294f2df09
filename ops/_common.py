"""Helpers shared by the torch-facing ops: config choice, argument checks, batch-invariant configs.

Argument checks come in two kinds. Shape, dtype, device and contiguity checks and checks of host
ints run on every call: they read no tensor data, so they are free inside CUDA graph capture.
Checks of tensor *values* (sequence lengths against the block table, slot ranges, tree-mask
diagonals, expert ids) read the device and are opt-in: `validate=True` on the op, or
`set_validate(True)` for every op (a debugging switch; the model path leaves it off). Without
them, out-of-range values have a defined no-op meaning documented in each op's docstring.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from autotune.problems import launch_only_keys  # keys a batch-invariant launch keeps from its own bucket
from kdsl.targets import current_target

_VALIDATE = False



# Kernels whose reductions are exact (int8 x int4/int8 products summed in an i32 accumulator, row
# absmax): their result does not depend on the tiles, so batch-invariant mode keeps their tuned
# per-bucket configs (the float epilogue is elementwise).
EXACT_ACCUMULATION = frozenset({"gemm_w8a8", "gemm_w4a8", "gemm_w4a8_order", "gemm_w4a8_i32acc", "moe_stage1_w4a8",
                                "moe_stage1_w4a8_acc", "moe_stage1_w4a8_amax", "moe_stage2_w4a8",
                                "moe_stage2_w4a8_pq", "moe_stage2_w4a8_aq",
                                "quant_per_token_int8", "quant_per_token_fp8"})


def kernel_name(kernel: Any) -> str:
    return kernel if isinstance(kernel, str) else getattr(kernel, "name", str(kernel))


def set_validate(on: bool) -> None:
    """Turn the value checks (device reads) of every op on or off (default off)."""
    global _VALIDATE
    _VALIDATE = bool(on)


def validating(flag: bool | None) -> bool:
    """An op's `validate` argument, or the module switch when the op got None."""
    return _VALIDATE if flag is None else bool(flag)


def config_for(kernel: Any, problem: dict[str, int], m: int, config: dict[str, Any] | None) -> dict[str, Any]:
    """An explicit config wins; otherwise the tuned config for this arch/problem (or {} = defaults)."""
    if config is not None:
        return config
    from autotune import lookup_config

    return lookup_config(kernel, current_target().name, problem, max(m, 1))  # M=0: any config, nothing runs


def invariant_config(kernel: Any, problem: dict[str, int], m: int, config: dict[str, Any] | None,
                     ref_problem: dict[str, int] | None = None, arch: str | None = None) -> dict[str, Any]:
    """The config of a batch-invariant launch: every numerics-relevant key from the reference
    config (the tuned M=1 entry of `ref_problem`, e.g. the q_len-1 decode problem, or `problem`),
    the launch-only keys (stages, occupancy; warps unless the reference config adds floats across
    lanes: autotune.problems.launch_only_keys) from this launch's own bucket. A key the
    reference does not set is removed so the kernel default applies to every batch alike. An
    explicit `config` is used as given (the caller owns its numerics)."""
    if config is not None:
        return dict(config)
    from autotune import lookup_config

    arch = arch or current_target().name
    if kernel_name(kernel) in EXACT_ACCUMULATION:  # integer dot products: any tile gives the same bits
        return lookup_config(kernel, arch, problem, max(m, 1))
    own = lookup_config(kernel, arch, problem, max(m, 1))
    ref = lookup_config(kernel, arch, ref_problem or problem, 1)
    keys = launch_only_keys(kernel, ref)
    out = {k: v for k, v in own.items() if k in keys}
    out.update({k: v for k, v in ref.items() if k not in keys})
    return out


def check_backend(op: str, backend: str) -> None:
    if backend not in ("triton", "torch"):
        raise ValueError(f"{op}: backend must be 'triton' or 'torch', got {backend!r}")


def check_tensor(op: str, name: str, t: Any, dims: int | None = None, dtypes: Iterable[torch.dtype] | None = None,
                 device: torch.device | None = None, contiguous: bool = False, last_contiguous: bool = False) -> None:
    """Rules on one tensor argument, none of which reads its data: a tensor, its rank, dtype,
    device (that of the op's main input) and layout."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{op}: {name} must be {dims}-D, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{op}: {name} must be {want}, got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, the op runs on {device} (move it first: no implicit copies)")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")
    if last_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must be contiguous along its last dim (stride {t.stride(-1)})")


def check_paged(op: str, block_table: torch.Tensor, seq_lens: torch.Tensor, batch: int, device: torch.device) -> None:
    """Shape rules of the paged-cache decode ops (no data read): table [B, max_pages] and lengths
    [B], both integer tensors on the op's device."""
    check_tensor(op, "block_table", block_table, 2, (torch.int32, torch.int64), device)
    check_tensor(op, "seq_lens", seq_lens, 1, (torch.int32, torch.int64), device)
    if block_table.shape[0] != batch:
        raise ValueError(f"{op}: block_table must be [B={batch}, max_pages], got {tuple(block_table.shape)}")
    if block_table.shape[1] < 1:
        raise ValueError(f"{op}: block_table must have at least one page column, got {tuple(block_table.shape)}")
    if tuple(seq_lens.shape) != (batch,):
        raise ValueError(f"{op}: seq_lens must be [B={batch}], got {tuple(seq_lens.shape)}")


def check_paged_lengths(op: str, block_table: Any, seq_lens: Any, page_size: int, batch: int, q_len: int,
                        num_pages: int | None = None) -> None:
    """Value rules of the paged decode ops (reads the device: `validate=True` only): every length
    covers the new rows, the table holds enough pages for the longest sequence and every entry the
    lengths reach names a page of the cache."""
    lens = seq_lens.tolist()
    if lens and min(lens) < q_len:
        raise ValueError(f"{op}: every sequence length must be >= q_len={q_len} (the new rows are cached), got {lens}")
    cap = block_table.shape[1] * page_size
    if lens and max(lens) > cap:
        raise ValueError(f"{op}: block table too short: {block_table.shape[1]} pages x page size "
                         f"{page_size} = {cap} tokens < sequence length {max(lens)}")
    if num_pages is not None:
        for b, n in enumerate(lens):
            used = block_table[b, :-(-n // page_size)] if n > 0 else block_table[b, :0]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
                raise ValueError(f"{op}: block_table row {b} names page {int(used.min()) if int(used.min()) < 0 else int(used.max())} "
                                 f"outside the cache's {num_pages} pages")


def check_slots(op: str, slots: torch.Tensor, capacity: int) -> None:
    """Value rule of the cache appends (reads the device: `validate=True` only): slots < capacity."""
    if slots.numel() and int(slots.max()) >= capacity:
        raise ValueError(f"{op}: slot {int(slots.max())} is beyond the cache ({capacity} slots)")


def paged_positions(block_table: torch.Tensor, b: int, n: int, page_size: int, num_pages: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch-backend gather plan of sequence b's first n cached positions, with the kernels'
    no-op rule: positions past the table's capacity do not exist, and a position whose table
    entry is outside [0, num_pages) reads as zeros (its page index is replaced by 0 for the
    gather, never wrapped; the caller zeroes those rows with `ok`). Returns (pos, page, ok)."""
    n = max(0, min(n, block_table.shape[1] * page_size))
    pos = torch.arange(n, device=block_table.device)
    page = block_table[b].long()[pos // page_size]
    ok = (page >= 0) & (page < num_pages)
    return pos, torch.where(ok, page, torch.zeros_like(page)), ok
