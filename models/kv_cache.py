"""Paged KV caches for the target (MLA latent) and the EAGLE-3 draft (MHA K/V).

Both caches share one bookkeeping scheme (`PageTable`): a fixed batch of sequence slots, each with a
list of pages taken from a free list on demand, and a length = number of VISIBLE cached tokens.
Rows past a sequence's length are stale: attention only reads `[0, length)`, and the next write at
`length` overwrites them. Speculative decoding rejects draft rows by lowering the length, so a
rejected row is never visible again.

The state a forward reads lives on the cache's device: `lens` (int32 [batch]) and the block table
`bt` (int32 [batch, max_pages]). A forward derives positions and slots from them and advances `lens`
on the device; page allocation (`reserve`) is host work done between forwards, e.g. once for the
whole generation (`reserve_all`). The host-side helpers (`lengths`, `append`, `truncate`, `slots`,
`rows`) read the device state back and are meant for tests, stubs and the ragged prefill wrapper,
never for the decode step.

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


class _Lengths:
    """Read-only view of PageTable.lens: lengths[b] reads one element, iteration reads them all once."""

    def __init__(self, lens: torch.Tensor):
        self._lens = lens

    def __getitem__(self, b: int) -> int:
        return int(self._lens[b])

    def __len__(self) -> int:
        return self._lens.shape[0]

    def __iter__(self):
        return iter([int(x) for x in self._lens.tolist()])

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, tuple, _Lengths)) else NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


class PageTable:
    """Block tables and lengths for `batch` sequence slots over `num_pages` pages of `page_size`.

    `max_pages` is the block-table width (pages one sequence may hold; default num_pages)."""

    def __init__(self, batch: int, num_pages: int, page_size: int, device: str | torch.device = "cpu",
                 max_pages: Optional[int] = None):
        if batch <= 0 or num_pages <= 0 or page_size <= 0:
            raise CacheError(f"batch ({batch}), num_pages ({num_pages}) and page_size ({page_size}) must be > 0")
        self.batch, self.num_pages, self.page_size = batch, num_pages, page_size
        self.max_pages = max_pages or num_pages
        self.device = torch.device(device)
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        self.pages: list[list[int]] = [[] for _ in range(batch)]
        self.lens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.bt = torch.zeros(batch, self.max_pages, dtype=torch.int32, device=self.device)

    @property
    def capacity(self) -> int:
        """Most tokens one sequence can hold (block-table width x page size)."""
        return self.max_pages * self.page_size

    def _check(self, b: int) -> None:
        if not 0 <= b < self.batch:
            raise CacheError(f"sequence slot {b} out of range [0, {self.batch})")

    @property
    def lengths(self) -> "_Lengths":
        """The visible lengths as a read-only host sequence (each access is a device read: not for the
        decode step); `list(table.lengths)` copies them all at once."""
        return _Lengths(self.lens)

    def reserve(self, b: int, new_len: int) -> None:
        """Make sure slot b has pages for `new_len` tokens (pages are taken from the free list)."""
        self._check(b)
        need = -(-new_len // self.page_size)
        if need > self.max_pages:
            raise CacheError(f"sequence {b} needs {new_len} tokens but a block table holds {self.max_pages} pages "
                             f"of {self.page_size} tokens")
        have = len(self.pages[b])
        while len(self.pages[b]) < need:
            if not self.free:
                raise CacheError(f"KV cache full: {self.num_pages} pages of {self.page_size} tokens are all in use "
                                 f"(sequence {b} needs {new_len} tokens); raise num_pages")
            self.pages[b].append(self.free.pop())
        if len(self.pages[b]) > have:
            self.bt[b, have:len(self.pages[b])] = torch.tensor(self.pages[b][have:], dtype=torch.int32,
                                                               device=self.device)

    def reserve_all(self, new_len: int) -> None:
        """Reserve `new_len` tokens for every slot (the block table is then static for the run)."""
        for b in range(self.batch):
            self.reserve(b, new_len)

    def slots(self, b: int, start: int, n: int) -> torch.Tensor:
        """Flat slot ids (page * page_size + offset) of positions [start, start + n) of slot b (reserving)."""
        self.reserve(b, start + n)
        pos = torch.arange(start, start + n)
        pg = torch.tensor(self.pages[b], dtype=torch.long)[pos // self.page_size]
        return (pg * self.page_size + pos % self.page_size).to(self.device)

    def append(self, b: int, n: int) -> int:
        """Claim the next n rows of slot b (reserving pages): returns the start position; length grows by n
        (their slots: `slots(b, start, n)`)."""
        self._check(b)
        start = int(self.lens[b])
        self.reserve(b, start + n)
        self.lens[b] = start + n
        return start

    def truncate(self, b: int, length: int) -> None:
        """Make rows >= length invisible (rejected drafts); pages beyond it are returned to the free list."""
        self._check(b)
        cur = int(self.lens[b])
        if not 0 <= length <= cur:
            raise CacheError(f"truncate: length {length} not in [0, {cur}] for sequence {b}")
        self.lens[b] = length
        keep = -(-length // self.page_size)
        while len(self.pages[b]) > keep:
            self.free.append(self.pages[b].pop())

    def release(self, b: int) -> None:
        self.truncate(b, 0)

    def block_table(self, bs: list[int]) -> torch.Tensor:
        """int32 [len(bs), max_pages] block table of the given slots (entries past a slot's pages are stale)."""
        return self.bt[torch.tensor(bs, dtype=torch.long, device=self.device)]

    def positions(self, b: int) -> torch.Tensor:
        """Slot ids of the visible rows [0, length) of slot b."""
        n = int(self.lens[b])
        return self.slots(b, 0, n) if n else torch.zeros(0, dtype=torch.long, device=self.device)


class LatentCache:
    """MLA latent cache: per layer [num_pages, page_size, dim] (dim = kv_lora_rank + rope_dim)."""

    def __init__(self, num_layers: int, batch: int, num_pages: int, page_size: int, dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 max_pages: Optional[int] = None):
        self.table = PageTable(batch, num_pages, page_size, device=device, max_pages=max_pages)
        self.dim = dim
        self.kv = [torch.zeros(num_pages, page_size, dim, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_tokens(cls, num_layers: int, batch: int, max_tokens: int, page_size: int, dim: int,
                   dtype: torch.dtype, device: str | torch.device) -> "LatentCache":
        """A cache for `batch` sequences of up to `max_tokens` tokens each."""
        per_seq = -(-max_tokens // page_size)
        return cls(num_layers, batch, batch * per_seq + 1, page_size, dim, dtype, device, max_pages=per_seq)

    def rows(self, layer: int, b: int, length: Optional[int] = None) -> torch.Tensor:
        """The visible (or first `length`) cached rows of slot b at `layer`: [n, dim]."""
        n = int(self.table.lens[b]) if length is None else length
        s = self.table.slots(b, 0, n) if n else torch.zeros(0, dtype=torch.long, device=self.table.device)
        ps = self.table.page_size
        return self.kv[layer][s // ps, s % ps]


class MHACache:
    """Draft K/V cache: per layer k, v [num_pages, page_size, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, batch: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 max_pages: Optional[int] = None):
        self.table = PageTable(batch, num_pages, page_size, device=device, max_pages=max_pages)
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_tokens(cls, num_layers: int, batch: int, max_tokens: int, page_size: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype, device: str | torch.device) -> "MHACache":
        per_seq = -(-max_tokens // page_size)
        return cls(num_layers, batch, batch * per_seq + 1, page_size, kv_heads, head_dim, dtype, device,
                   max_pages=per_seq)

    def rows(self, layer: int, b: int, length: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(self.table.lens[b]) if length is None else length
        s = self.table.slots(b, 0, n) if n else torch.zeros(0, dtype=torch.long, device=self.table.device)
        ps = self.table.page_size
        return self.k[layer][s // ps, s % ps], self.v[layer][s // ps, s % ps]
