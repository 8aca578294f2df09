"""Tensor / expert parallelism on torch.distributed (NCCL or RCCL on GPUs, gloo on CPU).

One process per GPU (`torchrun --nproc-per-node N -m models.generate --tp N`). What each rank holds:
- MLA by heads: q_b_proj and kv_b_proj (so the absorbed W_UK / W_UV) split by rows = by heads (H/N
  heads per rank), o_proj split by columns (row-parallel) and followed by an all-reduce; q_a, kv_a,
  their norms and the latent cache are replicated (every rank keeps the whole 576-wide latent rows);
- routed experts: "ep" (default) gives rank r the experts [r E/N, (r+1) E/N) whole (the router is
  replicated, a token's non-local experts contribute zero on that rank), "tp" gives every rank every
  expert at intermediate I/N (gate/up by rows, down by columns); the shared expert and the dense MLP
  are tensor-parallel the same way. The MoE block's output (routed + shared) is all-reduced once;
- lm_head vocab-parallel (V/N rows per rank) followed by an all-gather of the logits;
- embeddings, norms, the router and the EAGLE-3 draft replicated.
So a step makes two all-reduces per layer of [T, hidden] and one all-gather of the logits, inside
the forward, on device tensors (capturable on NCCL). `Comm` counts their bytes per call so a bench
can read them (`Comm.bytes`, `Comm.calls`); at world size 1 every collective is a no-op.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Optional

import torch

__all__ = ["MOE_MODES", "ShardPlan", "Comm", "single", "init_from_env", "ParallelError", "step_collective_bytes"]

MOE_MODES = ("ep", "tp")


class ParallelError(ValueError):
    """A tensor parallel layout cannot be built (a size not divisible by the world size, a bad mode)."""


_COL = ("self_attn.q_b_proj", "self_attn.kv_b_proj", "mlp.gate_proj", "mlp.up_proj",
        "shared_experts.gate_proj", "shared_experts.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj", "shared_experts.down_proj")
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.")


@dataclass(frozen=True)
class ShardPlan:
    """Which slice of each target tensor rank `rank` of `world` holds (names as the loader normalizes
    them, e.g. `model.layers.3.self_attn.o_proj.weight`)."""
    rank: int = 0
    world: int = 1
    moe: str = "ep"

    def __post_init__(self) -> None:
        if self.moe not in MOE_MODES:
            raise ParallelError(f"--moe-parallel must be one of {MOE_MODES}, got {self.moe!r}")
        if not 0 <= self.rank < self.world:
            raise ParallelError(f"rank {self.rank} outside world size {self.world}")

    def split_dim(self, name: str) -> Optional[int]:
        """0 (split the output rows), 1 (split the input columns) or None (replicated) for a linear's
        tensor (dense weight or a quantized part: packed words, scales)."""
        if self.world == 1:
            return None
        if name.startswith("lm_head."):
            return 0
        m = _EXPERT.match(name)
        if m is not None:
            if self.moe == "ep":
                return None
            return 1 if m.group(2) == "down_proj" else 0
        if ".mlp.experts." in name:
            return None
        base = name.rsplit(".", 1)[0]
        if base.endswith(_COL):
            return 0
        if base.endswith(_ROW):
            return 1
        return None

    def expert_range(self, n_experts: int) -> range:
        """The routed experts this rank holds: all (world 1 or "tp") or a contiguous E/N block ("ep")."""
        if self.world == 1 or self.moe == "tp":
            return range(n_experts)
        if n_experts % self.world:
            raise ParallelError(f"n_routed_experts {n_experts} is not divisible by the world size {self.world}")
        n = n_experts // self.world
        return range(self.rank * n, (self.rank + 1) * n)

    def keeps(self, name: str, n_experts: int) -> bool:
        """Whether this rank reads tensor `name` at all (EP skips the other ranks' experts)."""
        m = _EXPERT.match(name)
        return m is None or int(m.group(1)) in self.expert_range(n_experts)

    def check(self, cfg: Any) -> None:
        """Every split size must divide by the world size (errors name the config field)."""
        if self.world == 1:
            return
        sizes = {"num_attention_heads": cfg.num_attention_heads, "vocab_size": cfg.vocab_size,
                 "intermediate_size": cfg.intermediate_size}
        if cfg.n_routed_experts:
            sizes["n_routed_experts" if self.moe == "ep" else "moe_intermediate_size"] = (
                cfg.n_routed_experts if self.moe == "ep" else cfg.moe_intermediate_size)
            if cfg.n_shared_experts:
                sizes["moe_intermediate_size (shared experts)"] = cfg.moe_intermediate_size * cfg.n_shared_experts
        for k, v in sizes.items():
            if v % self.world:
                raise ParallelError(f"config field {k!r} = {v} is not divisible by --tp {self.world}")
        q = getattr(cfg, "quantization", None)
        g = getattr(q, "group_size", None) or 0
        if self.moe == "tp" and cfg.n_routed_experts and g and (cfg.moe_intermediate_size // self.world) % g:
            raise ParallelError(f"--moe-parallel tp: moe_intermediate_size {cfg.moe_intermediate_size} / {self.world} "
                                f"ranks is not a whole number of quantization groups ({g}); use --moe-parallel ep")

    def attn_config(self, cfg: Any) -> Any:
        """The config one rank's MLA runs with: H/N heads (every other field as given)."""
        if self.world == 1:
            return cfg
        return replace(cfg, num_attention_heads=cfg.num_attention_heads // self.world)


@dataclass
class Comm:
    """Collectives for one model replica set; no-ops at world size 1. `bytes` / `calls` count what each
    kind of collective moved (payload bytes per rank, counted on the host from shapes: no sync)."""
    plan: ShardPlan = field(default_factory=ShardPlan)
    group: Any = None
    bytes: dict[str, int] = field(default_factory=lambda: {"all_reduce": 0, "all_gather": 0, "broadcast": 0})
    calls: dict[str, int] = field(default_factory=lambda: {"all_reduce": 0, "all_gather": 0, "broadcast": 0})

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def world(self) -> int:
        return self.plan.world

    def _count(self, kind: str, t: torch.Tensor) -> None:
        self.bytes[kind] += t.numel() * t.element_size()
        self.calls[kind] += 1

    def reset_counts(self) -> None:
        for d in (self.bytes, self.calls):
            for k in d:
                d[k] = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial x (in place on a contiguous x; returns it)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        self._count("all_reduce", x)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' x along the last dim (vocab-parallel logits -> full logits)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        self._count("all_gather", x)
        if x.is_cuda:                          # one flat NCCL launch (capturable), then [N, ..., V/N] -> [..., V]
            flat = torch.empty((self.world, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(flat, x, group=self.group)
            return flat.movedim(0, -2).reshape(*x.shape[:-1], self.world * x.shape[-1])
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, -1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's x on every rank (token ids, accept lengths: keeps the ranks in lockstep)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        self._count("broadcast", x)
        dist.broadcast(x, src, group=self.group)
        return x

    def all_ok(self, ok: bool, device: torch.device) -> bool:
        """True when every rank passes ok=True (after loading: a failed rank makes all ranks stop)."""
        if self.world == 1:
            return ok
        import torch.distributed as dist

        t = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
        dist.all_reduce(t, group=self.group)
        return int(t.item()) == 0


def single() -> Comm:
    """World size 1: every collective is a no-op."""
    return Comm()


def init_from_env(tp: int, moe: str = "ep", device: Optional[torch.device] = None,
                  timeout_s: float = 120.0) -> Comm:
    """Join the process group torchrun describes (RANK / WORLD_SIZE / MASTER_ADDR env), NCCL when
    `device` is a GPU, else gloo, with a timeout so a dead rank cannot hang the others forever.
    tp must equal the launched world size."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp != world:
        raise ParallelError(f"--tp {tp} does not match the {world} launched process(es) "
                            f"(run `torchrun --nproc-per-node {tp} -m models.generate --tp {tp}`)")
    if world == 1:
        return Comm(ShardPlan(0, 1, moe))
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return Comm(ShardPlan(rank, world, moe))


def step_collective_bytes(cfg: Any, tokens: int, world: int, act_bytes: int = 2) -> dict[str, int]:
    """Bytes each rank hands to the collectives in one target step over `tokens` rows (B x q_len), as
    `Comm` counts them: two all-reduces of [tokens, hidden] per layer (after o_proj, after the MLP /
    MoE) in the activation dtype (`act_bytes`: 2 for bf16) and the all-gather of the float32 logits
    slice [tokens, V/N]. Zero at world size 1. For a bench's link-time estimate (an all-reduce moves
    about 2 (N-1)/N of its payload per rank over a ring)."""
    if world == 1:
        return {"all_reduce": 0, "all_gather": 0, "all_reduce_calls": 0}
    ar = 2 * cfg.num_hidden_layers * tokens * cfg.hidden_size * act_bytes
    ag = tokens * (cfg.vocab_size // world) * 4
    return {"all_reduce": ar, "all_gather": ag, "all_reduce_calls": 2 * cfg.num_hidden_layers}
