"""Paged KV caches for the target (MLA latent) and the EAGLE-3 draft (MHA K/V).

Both caches share one bookkeeping scheme (`PageTable`): a fixed batch of sequence slots, each with a
list of pages taken from a free list on demand, and a length = number of VISIBLE cached tokens.
Rows past a sequence's length are stale: attention only reads `[0, length)`, and the next write at
`length` overwrites them. Speculative decoding rejects draft rows by truncating the length
(`truncate`), so a rejected row is never visible again.

Layout (what ops.mla / ops.mha read):
- latent: `kv[layer]` [num_pages, page_size, kv_lora_rank + rope_dim]
- MHA:    `k[layer]`, `v[layer]` [num_pages, page_size, kv_heads, head_dim]
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["PageTable", "LatentCache", "MHACache", "CacheError"]


class CacheError(RuntimeError):
    """The cache is full, or a sequence slot / length is out of range."""


class PageTable:
    """Block tables and lengths for `batch` sequence slots over `num_pages` pages of `page_size`."""

    def __init__(self, batch: int, num_pages: int, page_size: int):
        if batch <= 0 or num_pages <= 0 or page_size <= 0:
            raise CacheError(f"batch ({batch}), num_pages ({num_pages}) and page_size ({page_size}) must be > 0")
        self.batch, self.num_pages, self.page_size = batch, num_pages, page_size
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        self.pages: list[list[int]] = [[] for _ in range(batch)]
        self.lengths: list[int] = [0] * batch

    def _check(self, b: int) -> None:
        if not 0 <= b < self.batch:
            raise CacheError(f"sequence slot {b} out of range [0, {self.batch})")

    def reserve(self, b: int, new_len: int) -> None:
        """Make sure slot b has pages for `new_len` tokens (pages are taken from the free list)."""
        self._check(b)
        need = -(-new_len // self.page_size)
        while len(self.pages[b]) < need:
            if not self.free:
                raise CacheError(f"KV cache full: {self.num_pages} pages of {self.page_size} tokens are all in use "
                                 f"(sequence {b} needs {new_len} tokens); raise num_pages")
            self.pages[b].append(self.free.pop())

    def slots(self, b: int, start: int, n: int) -> torch.Tensor:
        """Flat slot ids (page * page_size + offset) of positions [start, start + n) of slot b (reserving)."""
        self.reserve(b, start + n)
        pos = torch.arange(start, start + n)
        pg = torch.tensor(self.pages[b], dtype=torch.long)[pos // self.page_size]
        return pg * self.page_size + pos % self.page_size

    def append(self, b: int, n: int) -> tuple[int, torch.Tensor]:
        """Claim the next n rows of slot b: returns (start position, slots); length grows by n."""
        start = self.lengths[b]
        s = self.slots(b, start, n)
        self.lengths[b] = start + n
        return start, s

    def truncate(self, b: int, length: int) -> None:
        """Make rows >= length invisible (rejected drafts); pages beyond it are returned to the free list."""
        self._check(b)
        if not 0 <= length <= self.lengths[b]:
            raise CacheError(f"truncate: length {length} not in [0, {self.lengths[b]}] for sequence {b}")
        self.lengths[b] = length
        keep = -(-length // self.page_size)
        while len(self.pages[b]) > keep:
            self.free.append(self.pages[b].pop())

    def release(self, b: int) -> None:
        self.truncate(b, 0)

    def block_table(self, bs: list[int]) -> torch.Tensor:
        """int32 [len(bs), max_pages] block table of the given slots (unused entries 0)."""
        mp = max(1, max(len(self.pages[b]) for b in bs))
        t = torch.zeros(len(bs), mp, dtype=torch.int32)
        for i, b in enumerate(bs):
            if self.pages[b]:
                t[i, : len(self.pages[b])] = torch.tensor(self.pages[b], dtype=torch.int32)
        return t

    def positions(self, b: int) -> torch.Tensor:
        """Slot ids of the visible rows [0, length) of slot b."""
        return self.slots(b, 0, self.lengths[b]) if self.lengths[b] else torch.zeros(0, dtype=torch.long)


class LatentCache:
    """MLA latent cache: per layer [num_pages, page_size, dim] (dim = kv_lora_rank + rope_dim)."""

    def __init__(self, num_layers: int, batch: int, num_pages: int, page_size: int, dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.table = PageTable(batch, num_pages, page_size)
        self.dim = dim
        self.kv = [torch.zeros(num_pages, page_size, dim, dtype=dtype, device=device) for _ in range(num_layers)]

    def rows(self, layer: int, b: int, length: Optional[int] = None) -> torch.Tensor:
        """The visible (or first `length`) cached rows of slot b at `layer`: [n, dim]."""
        n = self.table.lengths[b] if length is None else length
        s = self.table.slots(b, 0, n) if n else torch.zeros(0, dtype=torch.long)
        ps = self.table.page_size
        return self.kv[layer][s // ps, s % ps]


class MHACache:
    """Draft K/V cache: per layer k, v [num_pages, page_size, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, batch: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.table = PageTable(batch, num_pages, page_size)
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def rows(self, layer: int, b: int, length: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.table.lengths[b] if length is None else length
        s = self.table.slots(b, 0, n) if n else torch.zeros(0, dtype=torch.long)
        ps = self.table.page_size
        return self.k[layer][s // ps, s % ps], self.v[layer][s // ps, s % ps]
