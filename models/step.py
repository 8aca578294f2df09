"""What one forward step needs on the device: positions, cache slots, lengths, masks, rope tables.

A step processes the same number of new rows (q_len) for each of B sequences: decode (q_len 1), the
speculative verify (q_len k + 1 or the tree size) and every draft step. Everything here is computed
from device tensors the cache holds (`PageTable.lens`, `PageTable.bt`) with device ops, so a step
makes no device->host read and can be captured as a graph: shapes depend only on (B, q_len) and the
cache's block-table width. `begin_step` is what the models call: on triton it runs `make_ctx`, the rope
rows, the embedding and the first norm as one launch (ops.step_prologue), `make_ctx` being its reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from models.kv_cache import PageTable

__all__ = ["StepCtx", "make_ctx", "begin_step", "advance", "RopeTable", "paged_rows", "visibility"]


@dataclass
class StepCtx:
    """One uniform step: B sequences x QL new rows (T = B * QL rows, sequence-major)."""
    B: int
    QL: int
    positions: torch.Tensor            # long [T]: rope positions
    slots: torch.Tensor                # long [T]: flat cache slot (page * page_size + offset) of each new row
    bt: torch.Tensor                   # int32 [B, max_pages]
    seq_lens: torch.Tensor             # int32 [B]: visible rows after the append (new rows included)
    window: Optional[torch.Tensor]     # bool [B, QL, TW] over the last TW rows (None: causal among the new rows)
    capacity: int                      # tokens one sequence can hold (block-table width x page size)
    seqs: Optional[torch.Tensor]       # long [B] cache slot per batch row (None: slots 0..B-1)


def make_ctx(table: PageTable, B: int, QL: int, seqs: Optional[torch.Tensor] = None,
             offsets: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
             window: Optional[torch.Tensor] = None) -> StepCtx:
    """The new rows sit at cache rows [len_b, len_b + QL) of their sequence; their rope positions are
    len_b + offsets (default 0..QL-1; a tree passes its depths) or `positions` [B, QL] when given."""
    if seqs is None:
        lens, bt = table.lens[:B], table.bt[:B]
    else:
        lens, bt = table.lens[seqs], table.bt[seqs]
    dev = lens.device
    ar = torch.arange(QL, device=dev)
    rows = lens.long()[:, None] + ar[None, :]                          # [B, QL]
    ps = table.page_size
    page_idx = (rows // ps).clamp(max=table.max_pages - 1)             # reserved by the caller; never past the table
    page = bt.long().gather(1, page_idx)
    slots = (page * ps + rows % ps).reshape(-1)
    if positions is not None:
        pos = positions.long().reshape(-1)
    elif offsets is not None:
        pos = (lens.long()[:, None] + offsets.long()).reshape(-1)
    else:
        pos = rows.reshape(-1)
    return StepCtx(B, QL, pos, slots, bt, lens + QL, None if window is None else window.bool(), table.capacity, seqs)


def begin_step(table: PageTable, tokens: torch.Tensor, rope: "RopeTable", embed: torch.Tensor, backend: str,
               seqs: Optional[torch.Tensor] = None, offsets: Optional[torch.Tensor] = None,
               positions: Optional[torch.Tensor] = None, window: Optional[torch.Tensor] = None,
               norm: Any = None, x_out: Optional[torch.Tensor] = None
               ) -> tuple[StepCtx, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A step's start for tokens [B, QL]: (make_ctx's StepCtx, cos, sin [T, dim/2] at its positions,
    the embedding rows h [T, hidden], norm(h) or None). `norm`: an RMSNorm (models.layers) of the
    embedding rows, e.g. the first layer's input norm; `x_out` [T, hidden] (any row stride): where
    norm(h) goes (then returned). On triton with a bf16 embedding all of it runs
    in one launch (ops.step_prologue: the same values; a sequence-indexed step still gathers its
    block-table rows with torch); otherwise as torch ops, make_ctx and indexing."""
    B, QL = tokens.shape
    if backend != "triton" or embed.dtype != torch.bfloat16 or (norm is not None and norm.w.dtype != torch.bfloat16):
        ctx = make_ctx(table, B, QL, seqs, offsets=offsets, positions=positions, window=window)
        cos, sin = rope(ctx.positions)
        h = embed[tokens.reshape(-1)]
        return ctx, cos, sin, h, (norm(h, out=x_out) if norm is not None else None)
    from ops.step_prologue import run_prologue

    o = run_prologue(tokens.long(), table.lens, table.bt, table.page_size, embed, rope.cos, rope.sin,
                     seqs=None if seqs is None else seqs.long(), offsets=None if offsets is None else offsets.long(),
                     positions=None if positions is None else positions.long(), norm_w=None if norm is None else norm.w,
                     eps=1e-6 if norm is None else norm.eps, backend="triton", x_out=x_out)
    bt = table.bt[:B] if seqs is None else table.bt[seqs]
    ctx = StepCtx(B, QL, o["positions"], o["slots"], bt, o["seq_lens"], None if window is None else window.bool(),
                  table.capacity, seqs)
    return ctx, o["cos"], o["sin"], o["h"], o.get("x")


def advance(table: PageTable, ctx: StepCtx) -> None:
    """Lengths after the step (in place on the device: a captured graph replays it)."""
    if ctx.seqs is None:
        table.lens[:ctx.B].copy_(ctx.seq_lens)
    else:
        table.lens.index_copy_(0, ctx.seqs, ctx.seq_lens)


class RopeTable:
    """cos/sin [n, dim/2] float32 on the device, built on the host once (float64 math, ops.rope.cos_sin)
    and grown between steps (`ensure`); a step only indexes them by position."""

    def __init__(self, dim: int, base: float, scaling: Optional[dict[str, Any]], device: torch.device):
        self.dim, self.base, self.scaling, self.device = dim, base, scaling, device
        self.cos = torch.zeros(0, dim // 2, device=device)
        self.sin = torch.zeros(0, dim // 2, device=device)

    def ensure(self, n: int) -> None:
        """Cover positions [0, n) (host work: call it when a cache is made, never inside a step)."""
        if n <= self.cos.shape[0]:
            return
        from ops.rope import cos_sin

        m = max(64, 1 << (n - 1).bit_length())
        c, s = cos_sin(torch.arange(m), self.dim, self.base, self.scaling)
        self.cos, self.sin = c.to(self.device), s.to(self.device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def paged_rows(cache_layer: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """Every row a block table can reach: [B, max_pages * page_size, ...] (torch reference path)."""
    g = cache_layer[bt.long()]                                          # [B, P, PS, ...]
    return g.reshape(g.shape[0], g.shape[1] * g.shape[2], *g.shape[3:])


def visibility(ctx: StepCtx, S: int) -> torch.Tensor:
    """bool [B, QL, S]: which of the S table rows each new row attends to (causal among the new rows,
    or the window mask over the last TW rows with everything before them visible)."""
    dev = ctx.seq_lens.device
    pos = torch.arange(S, device=dev)[None, None, :]
    sl = ctx.seq_lens.long()[:, None, None]
    if ctx.window is None:
        last = sl - ctx.QL + torch.arange(ctx.QL, device=dev)[None, :, None]
        return pos <= last
    TW = ctx.window.shape[-1]
    wb = sl - TW
    j = (pos - wb).clamp(0, TW - 1).expand(ctx.B, ctx.QL, S)
    inwin = ctx.window.gather(2, j) & (pos >= wb) & (pos < sl)
    return (pos < wb) | inwin
