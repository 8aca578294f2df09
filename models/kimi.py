"""Kimi-K2.5 / DeepSeek-V3 target model built from the ops (REFERENCE §1).

Two entry points:
- `step(cache, tokens [B, q_len], ...)`: the device path. Token ids, positions, slots, block tables
  and lengths are device tensors (models.step); no device->host read, no host->device copy, one
  batched attention launch per layer for the whole batch (uniform q_len: decode, verify, draft), the
  cache's lengths advanced on the device. This is what the engine runs and what graphs capture.
- `forward(cache, [(slot b, tokens)], trees)`: the ragged list API (prefill, tests). The new tokens of
  slot b sit at positions [len_b, len_b + n_b); it reserves pages on the host and calls `step` per
  group of equal-length entries (chunks of at most ops.mla.MAX_Q_LEN rows on the triton backend).
The new rows' latent KV rows are appended to the paged cache and attention is causal among them
(prefill, decode and the speculative verify are the same code: q_len = n_b).

MLA uses the absorbed form everywhere: q_nope is folded through W_UK into a kv_lora_rank-wide latent
query and attention runs over the 576-wide (for Kimi) latent cache, W_UV is applied afterwards.
With backend="triton" the MLA half is 6 launches (the q_a|kv_a GEMM split along K into f32 partials, the
split sum and q_a norm in the q_b GEMM's prologue reading the partials in place, W_UK with the q rope
and the kv split sum, norm, k rope and cache append in one, the split combine with W_UV in one;
ops.mla_fused, see `_MLA._fused`); with "torch" it is the same math in the model dtype over every row
the block table reaches (masked).

Aux hidden states (models.config docstring): for every processed token, the residual stream
ENTERING each layer of `capture_ids` (id N = the output of the last layer, before the final norm),
concatenated in list order to [T, len(ids) * H].
"""
from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from models.config import DeepseekV3Config
from models.formats import QuantLinear, dequantize
from models.kv_cache import LatentCache
from models.layers import MLP, Linear, NormTail, PendingGemm, RMSNorm, act_dtype, check_backend, concat_weights
from models.loader import Checkpoint, stack_experts
from models.parallel import Comm, single
from models.step import RopeTable, StepCtx, advance, begin_step, paged_rows, visibility

if TYPE_CHECKING:
    from ops.gemm_addnorm import RouteTail

__all__ = ["KimiModel", "TargetOutput", "StepOutput", "RoutingTrace", "default_device"]


def default_device() -> torch.device:
    """The GPU when one is present (ROCm torch reports `cuda` too), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TargetOutput:
    """Per-sequence logits (float32 [n_b, V]) and aux hidden states ([n_b, len(ids) * H])."""

    def __init__(self, logits: list[torch.Tensor], aux: list[Optional[torch.Tensor]]):
        self.logits, self.aux = logits, aux


class StepOutput:
    """One uniform step: logits float32 [B, q_len, V], aux [B, q_len, len(ids) * H] (or None) and the
    final pre-norm hidden rows [B * q_len, H]."""

    def __init__(self, logits: torch.Tensor, aux: Optional[torch.Tensor], hidden: torch.Tensor):
        self.logits, self.aux, self.hidden = logits, aux, hidden


def _on(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    return None if t is None else t.to(device)


def _dense(w) -> torch.Tensor:
    return dequantize(w, torch.float32) if isinstance(w, QuantLinear) else w.float()


def rope_scaling_dict(rs) -> Optional[dict]:
    return None if rs is None else asdict(rs)


class RoutingTrace:
    """Record the expert ids every MoE layer chose (in call order), or replay recorded ids.

    Routing is numerically fragile (REFERENCE §1): to compare two backends, record one side's
    routing and replay it in the other (`KimiModel.routing = RoutingTrace("replay", log)`); the
    combine weights are still computed by the replaying side from its own scores."""

    def __init__(self, mode: str = "record", log: Optional[list[torch.Tensor]] = None):
        if mode not in ("record", "replay"):
            raise ValueError(f"RoutingTrace mode must be 'record' or 'replay', got {mode!r}")
        self.mode, self.log, self.pos = mode, (log if log is not None else []), 0

    def __call__(self, ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.mode == "record":
            self.log.append(ids.detach().long().clone())
            return None
        if self.pos >= len(self.log):
            raise RuntimeError("RoutingTrace: replay ran past the recorded routing")
        r = self.log[self.pos]
        self.pos += 1
        return r


def _splits(a: "torch.Tensor | PendingGemm") -> int:
    """The split-K partial count of an attention output at world size 1 (o_proj's SPLIT_K, run or
    not yet run), 0 for rows."""
    if isinstance(a, PendingGemm):
        from ops.gemm import SPLIT_K_DEFAULT, splitk_config

        return int(splitk_config(a.x.shape[0], a.w.shape[0], a.w.shape[1]).get("SPLIT_K", SPLIT_K_DEFAULT))
    return a.shape[0] if a.dim() == 3 else 0


class _MoE:
    def __init__(self, ck: Checkpoint, i: int, cfg: DeepseekV3Config, backend: str, dtype: torch.dtype,
                 owner: Optional["KimiModel"] = None, device: torch.device = torch.device("cpu")):
        p = f"model.layers.{i}.mlp."
        self.cfg, self.backend, self.dtype, self.owner = cfg, backend, dtype, owner
        self.gate = ck[p + "gate.weight"]
        self.bias = ck.get(p + "gate.e_score_correction_bias")
        E = cfg.n_routed_experts
        self.bias = (torch.zeros(E) if self.bias is None else self.bias.float()).to(device)
        comm = getattr(owner, "comm", None)                 # parallel: this rank's experts (all at world 1)
        self.comm: Comm = comm if comm is not None else single()
        self.local = self.comm.plan.expert_range(E)
        self.shared: Optional[MLP] = None
        self.gate_shared: Optional[torch.Tensor] = None
        if cfg.n_shared_experts:
            s = p + "shared_experts."
            self.shared = MLP(*(Linear(s + n, ck[s + n + ".weight"], backend, dtype, device)
                                for n in ("gate_proj", "up_proj", "down_proj")), backend=backend)
        if backend == "torch":
            self.gate = self.gate.float().to(device)
            self.w1 = torch.stack([_dense(ck[f"{p}experts.{e}.gate_proj.weight"]) for e in self.local]).to(dtype).to(device)
            self.w3 = torch.stack([_dense(ck[f"{p}experts.{e}.up_proj.weight"]) for e in self.local]).to(dtype).to(device)
            self.w2 = torch.stack([_dense(ck[f"{p}experts.{e}.down_proj.weight"]) for e in self.local]).to(dtype).to(device)
        else:
            from ops.moe import MoEConfig
            from ops.mxfp4 import experts_weights

            self.gate = self.gate.to(torch.bfloat16).contiguous().to(device)
            self.experts = experts_weights({k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                            for k, v in stack_experts(ck, i, pop=False, experts=self.local).items()})
            self.moe_cfg = MoEConfig(top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                                     norm_topk_prob=cfg.norm_topk_prob,
                                     routed_scaling_factor=cfg.routed_scaling_factor)
            if self.shared is not None and any(isinstance(l.raw, QuantLinear) for l in
                                               (self.shared.gate, self.shared.up, self.shared.down)):
                raise NotImplementedError("triton MoE: quantized shared experts are not supported yet")
            # the router rows stacked under the shared expert's gate|up rows (both read the normed
            # rows): one split-K GEMM feeds the route kernel (its router columns) and the shared
            # expert's down GEMM (the rest), so the decode step has no separate gate GEMM launch.
            # The two keep views of the one stacked weight.
            gu = self.shared.splitk_weights() if self.shared is not None else None
            if gu is not None and gu.shape[1] == self.gate.shape[1]:
                self.gate_shared = torch.cat([gu, self.gate], 0)
                self.shared.gate_up.dense = self.gate_shared[:gu.shape[0]]
                self.gate = self.gate_shared[gu.shape[0]:]

    def route(self, x: torch.Tensor, forced: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """noaux_tc routing in float32: top-k on sigmoid(scores) + bias, combine with unbiased scores
        (`forced`: replayed expert ids, weights still from these scores)."""
        c = self.cfg
        logits = x.float() @ self.gate.float().T
        scores = logits.sigmoid() if c.scoring_func == "sigmoid" else logits.softmax(-1)
        if forced is not None:
            w = scores.gather(1, forced)
            if c.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            return forced, w * c.routed_scaling_factor
        choose = scores + self.bias
        if c.n_group > 1:
            T, E = choose.shape
            g = choose.view(T, c.n_group, E // c.n_group).topk(2, -1).values.sum(-1)
            keep = torch.zeros_like(g).scatter_(1, g.topk(c.topk_group, -1).indices, 1.0)
            choose = choose.masked_fill(keep.repeat_interleave(E // c.n_group, 1) == 0, float("-inf"))
        ids = choose.topk(c.num_experts_per_tok, -1).indices
        w = scores.gather(1, ids)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * c.routed_scaling_factor

    def _replayed(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        trace = self.owner.routing if self.owner is not None else None
        if trace is None or trace.mode != "replay":
            return None
        return trace(None).to(x.device).long()

    def _record(self, ids: torch.Tensor) -> None:
        trace = self.owner.routing if self.owner is not None else None
        if trace is not None and trace.mode == "record":
            trace(ids)

    def _routed_ids(self, xb: torch.Tensor, block_m: Optional[int] = None,
                    logits: Optional[torch.Tensor] = None) -> tuple:
        """Triton routing (or replayed ids): int32 ids in this rank's local expert numbering and f32
        weights. Expert parallel: an id of another rank's expert becomes -1, which the align kernels
        and the top-k sums treat as a no-op (no block, a partial row never read); the route kernel
        emits those local ids itself (`route(..., local=...)`, no extra launch) unless the ids are
        replayed or recorded (global ids, mapped here). MXFP4 experts get a clamped id with weight
        0 instead. `block_m` (the experts' BLOCK_M): also the ids aligned for `fused_experts`
        (`route_align`: decode and verify route and align in one launch), returned third (None for
        replayed or mapped ids: fused_experts aligns them). `logits`: xb @ gate^T as split-K
        partials already computed (the router columns of `gate_shared`'s GEMM)."""
        from ops.moe import MoEWeights, local_ids, route, route_align

        c = self.moe_cfg
        forced = self._replayed(xb)
        split = len(self.local) != self.cfg.n_routed_experts
        trace = self.owner.routing if self.owner is not None else None
        in_kernel = (split and forced is None and isinstance(self.experts, MoEWeights)
                     and (trace is None or trace.mode != "record"))
        aligned = None
        if forced is None:
            args = (xb, self.gate, self.bias, c.top_k, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
            kw = dict(backend="triton", scoring_func=self.cfg.scoring_func,
                      local=(self.local.start, len(self.local)) if in_kernel else None, logits=logits)
            if block_m is not None and (in_kernel or not split):
                ids, w, *aligned = route_align(*args, block_m=block_m, **kw)
            else:
                ids, w = route(*args, **kw)
        else:
            ids, w = self.route(xb, forced)
        if not in_kernel:
            self._record(ids)
        if split and not in_kernel:
            if isinstance(self.experts, MoEWeights):
                ids = local_ids(ids, self.local.start, len(self.local))
            else:                                     # MXFP4 sums every partial row: other ranks' experts weigh 0
                loc = ids - self.local.start
                w = w * ((loc >= 0) & (loc < len(self.local)))
                ids = loc.clamp(0, len(self.local) - 1)
        if ids.dtype != torch.int32:                  # route gives int32 already; replayed ids do not
            ids = ids.to(torch.int32)
        if w.dtype != torch.float32:
            w = w.float()
        if block_m is None:
            return ids.contiguous(), w.contiguous()
        return ids.contiguous(), w.contiguous(), (tuple(aligned) if aligned else None)

    def _route_tail(self, rows: int, splits: int) -> Optional["RouteTail"]:
        """The routing the shared gate|up + router GEMM runs in its last program for `rows` tokens
        (ops.gemm_addnorm.RouteTail; the owner's `route_in_gemm`, "auto": where route_tail_pays at
        rows' bucket; `splits`: its split-K partials in, 0 for rows): Triton routing of MoEWeights
        experts, neither recorded nor replayed (RoutingTrace), few enough tokens for one program
        (route_tail_fits); else None (route_align's own launch)."""
        from ops.gemm_addnorm import RouteTail, route_tail_fits, route_tail_pays
        from ops.moe import MoEWeights, expert_block_m

        c, E = self.moe_cfg, self.cfg.n_routed_experts
        mode = getattr(self.owner, "route_in_gemm", False) if self.owner is not None else False
        if self.gate_shared is None or not isinstance(self.experts, MoEWeights) or mode is False \
                or self.owner.routing is not None or not route_tail_fits(rows, E, c.top_k):
            return None
        bm = expert_block_m(self.experts, c.top_k, rows)
        if mode == "auto":
            from kdsl.targets import current_target

            if not route_tail_pays(current_target().name, *self.gate_shared.shape, rows, self.add_norm_quant, splits,
                                   E, c.top_k, c.n_group, len(self.local), bm):
                return None
        split = len(self.local) != E
        return RouteTail(self.bias, c.top_k, bm, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor,
                         self.cfg.scoring_func, (self.local.start, len(self.local)) if split else None,
                         self.owner.route_counter)

    @property
    def add_norm_shape(self) -> Optional[tuple[int, int]]:
        """(N, K) of the shared gate|up + router GEMM where `fused_block` can run the post-attention
        residual add and norm in its prologue (gemm_bf16_addnorm_y, or _yq with the per-token int8
        quant W4A8 experts read; at world size 1 their _splitk_ forms over o_proj's partials: a
        split-K shared expert), else None."""
        from ops.moe import MoEWeights

        if self.backend != "triton" or self.gate_shared is None or not isinstance(self.experts, MoEWeights):
            return None
        return tuple(self.gate_shared.shape)

    @property
    def add_norm_quant(self) -> bool:
        """Whether the post-attention norm also quantizes the rows per token (W4A8 experts)."""
        return getattr(self.experts, "fmt", None) == "w4a8"

    def fused_block(self, a: torch.Tensor, h: torch.Tensor, n2: RMSNorm, nxt: RMSNorm, raw_next: bool = False,
                    add_first: bool = False) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The MoE half of a decoder layer on triton, from the (all-reduced) attention output `a` (at
        world size 1 o_proj's split-K partials, which the first norm adds) and the residual stream `h`
        (only read) to (the next norm's output, the new residual stream):
        rmsnorm_add(_quant) -> one split-K GEMM for the shared expert's gate|up and the router (its own
        gate GEMM when the shared expert is not dense bf16), route + align (one launch up to 4 tokens)
        -> stage 1 -> stage 2 (partial rows) -> the shared expert's SiLU*up and down in one GEMM -> at
        world size 1 combine_norm (top-k sum
        in k order + shared + residual add + the next RMSNorm); at world size > 1 combine_rank (the
        rank's top-k sum + shared, bf16), the all-reduce, then the next norm's rmsnorm_add writing the
        new residual (combine_norm updates the post-attention residual, a fresh tensor, in place). For W4A8 experts the post-attention norm emits the per-token int8
        activations stage 1 reads (no quant launch). None when this layer's experts take another
        path (MXFP4). `raw_next` (world size 1, a next layer whose attention `takes_raw_rows`): the
        layer ends with combine_add instead (the same sums, no norm, split over D: combine_norm's
        one program per token leaves the GPU idle at decode) and returns the new residual as f32
        rows [1, T, hidden] in place of the normed rows; the next attention applies `nxt`. With the
        split-K shared expert (and the owner's `combine_in_shared`, default) that combine_add runs in
        the shared down GEMM's epilogue (ops.swiglu.gemm_bf16_swiglu_combine): the layer ends in one
        launch, not two, with the same bits; at world size > 1 so does combine_rank
        (ops.swiglu.gemm_bf16_swiglu_rank). `raw_next` at world size > 1: the layer ends with the
        all-reduce and returns (its bf16 rows, the post-attention residual): the next attention's
        first GEMM adds them and norms (ops.gemm_addnorm), no rmsnorm_add launch. `add_first` (where
        `add_norm_shape`; at world size 1 over o_proj's split-K partials): the post-attention add and
        norm run in the prologue of the shared gate|up + router GEMM (gemm_bf16_addnorm_y / _yq, which
        also stores the normed rows the routed experts read, W4A8: with their int8 quant), no
        rmsnorm_add(_quant) launch either."""
        from ops.moe import MoEWeights, combine_add, combine_norm, combine_rank, expert_block_m, fused_experts

        if self.backend != "triton" or not isinstance(self.experts, MoEWeights) or h.dtype != torch.bfloat16 \
                or not h.is_contiguous():
            return None
        both = xq = routed = None
        if add_first and self.add_norm_shape is not None:   # the add and norm in the GEMM's prologue
            from ops.gemm_addnorm import gemm_bf16_addnorm

            src = a.partials() if isinstance(a, PendingGemm) else a      # world size 1: o_proj's partials
            if src.dim() == 2:
                src = src.to(torch.bfloat16).contiguous()
            tail = self._route_tail(h.shape[0], src.shape[0] if src.dim() == 3 else 0)   # and the routing
            out = gemm_bf16_addnorm(src, h, n2.w, self.gate_shared, n2.eps, partials=True, normed=True,
                                    quant=self.add_norm_quant, route=tail)
            both, h, x = out[:3]
            q = 3 + 2 * int(self.add_norm_quant)
            xq = out[3:q] if self.add_norm_quant else None
            if tail is not None:
                ids, w, *aligned = out[q:]
                routed = (ids, w, tuple(aligned))
        elif self.experts.fmt == "w4a8":
            x8, xs, x, h = n2.add_norm_quant(a, h)
            xq = (x8, xs)
        else:
            x, h = n2.add_norm(a, h)
        logits = shared_part = None
        if self.gate_shared is not None:        # shared gate|up and router rows: one split-K GEMM
            from ops.gemm import gemm_bf16_splitk

            if both is None:
                both = gemm_bf16_splitk(x, self.gate_shared, backend="triton")     # [S, T, 2I + E] f32
            n_gu = self.gate_shared.shape[0] - self.gate.shape[0]
            shared_part, logits = both[..., :n_gu], both[..., n_gu:]
        ids, w, aligned = routed or self._routed_ids(x, block_m=expert_block_m(self.experts, self.moe_cfg.top_k,
                                                                                x.shape[0]), logits=logits)
        part = fused_experts(x, ids, w, self.experts, backend="triton", check_ids=False, xq=xq, partials=True,
                             aligned=aligned)
        if self.comm.world == 1 and raw_next and shared_part is not None and \
                getattr(self.owner, "combine_in_shared", True):
            # the shared expert's down GEMM ends the layer: combine_add in its epilogue, one launch
            rows = self.shared.down_combine_of_partials(shared_part, part, ids, h, len(self.local))
            return rows.unsqueeze(0), h
        if self.comm.world > 1 and shared_part is not None and getattr(self.owner, "combine_in_shared", True):
            # the rank's share (combine_rank) in the shared down GEMM's epilogue, one launch
            mine = self.shared.down_rank_of_partials(shared_part, part, ids, len(self.local))
            return (self.comm.all_reduce(mine), h) if raw_next else nxt.add_norm(self.comm.all_reduce(mine), h)
        if shared_part is not None:
            s = self.shared.down_of_partials(shared_part)
        else:
            s = self.shared(x) if self.shared is not None else None
        if self.comm.world == 1 and raw_next:
            return combine_add(part, ids, s, h, len(self.local), backend="triton").unsqueeze(0), h
        if self.comm.world == 1:
            y = combine_norm(part, ids, s, h, nxt.w, nxt.eps, len(self.local), backend="triton")
            return y, h
        mine = combine_rank(part, ids, s, len(self.local), backend="triton")
        if raw_next:                # the next attention's first GEMM adds the residual and norms
            return self.comm.all_reduce(mine), h
        return nxt.add_norm(self.comm.all_reduce(mine), h)     # aux captures see full sums

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            from ops.mxfp4 import fused_experts_any as fused_experts

            xb = x.to(torch.bfloat16).contiguous()
            ids, w = self._routed_ids(xb)
            y = fused_experts(xb, ids, w, self.experts, backend="triton", check_ids=False)
            if self.shared is not None:
                y = y + self.shared(xb).float()        # shared expert: gemm_bf16_splitk + gemm_bf16_swiglu
            return y.to(torch.bfloat16)
        forced = self._replayed(x)
        ids, w = self.route(x, forced)
        self._record(ids)
        # every expert over every row, weighted by its combine weight (0 where not chosen): no host read
        # of the chosen ids, the same sum order (ascending expert id) as a per-expert gather
        xe = x.to(self.dtype)
        out = torch.zeros_like(x, dtype=self.dtype)
        for j, e in enumerate(self.local):
            we = (w * (ids == e)).sum(-1).to(self.dtype)            # [T]
            h = torch.nn.functional.silu(xe @ self.w1[j].T) * (xe @ self.w3[j].T)
            out = out + (h @ self.w2[j].T) * we[:, None]
        if self.shared is not None:
            out = out + self.shared(x)
        return out


class _MLA:
    def __init__(self, ck: Checkpoint, i: int, cfg, backend: str, dtype: torch.dtype, prefix: Optional[str] = None,
                 device: torch.device = torch.device("cpu")):
        """cfg: a DeepseekV3Config or an MLA Eagle3Config (same field names); prefix: tensor name prefix
        (default the target's `model.layers.{i}.self_attn.`)."""
        p = prefix if prefix is not None else f"model.layers.{i}.self_attn."
        self.cfg, self.backend, self.dtype = cfg, backend, dtype
        L = lambda n: Linear(p + n, ck[p + n + ".weight"], backend, dtype, device)  # noqa: E731
        self.qkv_a: Optional[Linear] = None          # q_a and kv_a as one GEMM (both read x)
        if cfg.q_lora_rank:
            self.q_b = L("q_b_proj")
            self.q_norm = RMSNorm(ck[p + "q_a_layernorm.weight"], cfg.rms_norm_eps, backend, dtype, device)
            both = concat_weights([ck[p + "q_a_proj.weight"], ck[p + "kv_a_proj_with_mqa.weight"]])
            if both is not None:
                self.qkv_a = Linear(p + "q_a_proj|kv_a_proj_with_mqa", both, backend, dtype, device)
            else:
                self.q_a = L("q_a_proj")
        else:
            self.q_proj = L("q_proj")
        if self.qkv_a is None:
            self.kv_a = L("kv_a_proj_with_mqa")
        self.kv_norm = RMSNorm(ck[p + "kv_a_layernorm.weight"], cfg.rms_norm_eps, backend, dtype, device)
        self.o_proj = L("o_proj")
        H, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        kvb = _dense(ck[p + "kv_b_proj.weight"]).view(H, nope + v, cfg.kv_lora_rank)
        # absorbed W_UK / W_UV, prepared once in the activation dtype in the layouts the batched GEMMs read
        adt = act_dtype(backend, dtype)
        self.w_uk = kvb[:, :nope].to(adt).contiguous().to(device)                  # [H, nope, C]
        self.w_uv_t = kvb[:, nope:].transpose(1, 2).to(adt).contiguous().to(device)  # [H, C, v]
        self.scale = cfg.softmax_scale
        self.fused = True        # triton: the fused MLA kernels (ops.mla_fused); False runs the unfused ops

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache, layer: int,
                 ctx: StepCtx, partials: bool | NormTail = False, x_norm: Optional[RMSNorm] = None,
                 residual: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor | PendingGemm:
        """The attention output [T, hidden]; `partials` lets the fused triton path return o_proj's f32
        split-K partials [S, T, hidden] instead (a dense bf16 o_proj: see `_fused`), which only the
        residual-add norms (RMSNorm.add_norm / add_norm_quant) may read; a `NormTail` returns o_proj
        itself, not run yet (a PendingGemm), which those norms run (with their tail where it pays).
        `x_norm` (only where `takes_raw_rows`): x is the residual stream as f32 rows [1, T, hidden],
        not yet normed; the q_a|kv_a GEMM applies x_norm in its prologue. With `residual` (world size
        > 1: (the residual stream, where its update goes)) x is the all-reduced output of the layer
        before, bf16 [T, hidden], and that GEMM adds the residual first and stores the sum."""
        from ops.rope import apply_rope, rope_ref

        c = self.cfg
        if x_norm is not None and not self.takes_raw_rows:
            raise ValueError("_MLA: un-normed rows need the fused triton path with dense bf16 q_a|kv_a and q_b")
        if residual is not None and x_norm is None:
            raise ValueError("_MLA: a pending residual add needs x_norm (the rows are normed after the add)")
        if self.backend == "triton" and self.fused:
            return self._fused(x, cos, sin, cache.kv[layer], ctx, partials, x_norm, residual)
        T = x.shape[0]
        H, nope, r, C = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        if self.qkv_a is not None:
            qkv = self.qkv_a(x)
            q = self.q_b(self.q_norm(qkv[:, :c.q_lora_rank].contiguous()))
            kv = qkv[:, c.q_lora_rank:]
        else:
            q = self.q_b(self.q_norm(self.q_a(x))) if c.q_lora_rank else self.q_proj(x)
            kv = self.kv_a(x)
        q = q.view(T, H, nope + r)
        lat = self.kv_norm(kv[:, :C].contiguous())
        k_pe = kv[:, C:].reshape(T, 1, r)
        if self.backend == "torch":
            q_pe = rope_ref(q[..., nope:], cos, sin, "interleaved")
            k_pe = rope_ref(k_pe, cos, sin, "interleaved")
        else:
            q_pe = apply_rope(q[..., nope:].contiguous(), cos, sin, "interleaved", backend="triton")
            k_pe = apply_rope(k_pe.contiguous(), cos, sin, "interleaved", backend="triton")
        adt = self.w_uk.dtype
        q_lat = torch.bmm(q[..., :nope].to(adt).transpose(0, 1), self.w_uk)          # [H, T, C]
        qf = torch.cat([q_lat.transpose(0, 1), q_pe.to(adt)], -1)                   # [T, H, C + r]
        new = torch.cat([lat, k_pe.reshape(T, r).to(lat.dtype)], -1)                # [T, C + r]
        out = self._attend(qf, new, cache.kv[layer], ctx)                           # [T, H, C]
        o = torch.bmm(out.to(adt).transpose(0, 1), self.w_uv_t)                     # [H, T, v]
        return self.o_proj(o.transpose(0, 1).reshape(T, H * c.v_head_dim))

    @property
    def takes_raw_rows(self) -> bool:
        """The fused triton path whose q_a|kv_a GEMM can normalize its input rows in its prologue
        (gemm_bf16_rmsnorm; dense bf16 q_a|kv_a and q_b): the layer before may then skip this
        layer's input norm (`x_norm` in __call__)."""
        return self.backend == "triton" and self.fused and self.qkv_a is not None and \
            self.qkv_a.dense is not None and self.qkv_a.dense.dtype == torch.bfloat16 and \
            self.q_b.dense is not None

    @property
    def qkv_a_shape(self) -> tuple[int, int]:
        """(N, K) of the dense q_a|kv_a weight (where `takes_raw_rows`): the GEMM that norms the rows."""
        return tuple(self.qkv_a.dense.shape)

    def _fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kvl: torch.Tensor,
               ctx: StepCtx, partials: bool | NormTail = False, x_norm: Optional[RMSNorm] = None,
               residual: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor | PendingGemm:
        """The triton path in 6 launches (q_a|kv_a as one bf16 GEMM, a bf16 q_b): the q_a|kv_a GEMM
        split along K (gemm_bf16_splitk: f32 partials [S, T, q_lora + C + r], S times the programs of
        the plain GEMM at its small N) -> q_b GEMM with the split sum and the q_a RMSNorm in its
        prologue (gemm_bf16_rmsnorm, reading the q_a columns of the partials in place, itself split
        along K into f32 partials: q_b's N is small at TP8) -> mla_q_absorb_kv (the q split sum, W_UK,
        the q rope, and the kv split sum, kv norm, k rope and cache append by one program per row) ->
        mla_decode_split -> mla_combine_uv (the split merge and W_UV, writing o_proj's input) -> o_proj
        GEMM. Both consumers add the partials in split order and round to
        bf16, the row the plain GEMM would have stored. `partials` (world size 1, a dense bf16 o_proj):
        o_proj is split along K too (gemm_bf16_splitk: at decode sizes its N=hidden tiles alone leave
        CUs idle) and its f32 partials are returned for the residual-add norm that follows, which adds
        them in split order and rounds to bf16 the same way. `x_norm`: x is the un-normed residual
        stream as f32 rows [1, T, hidden] and the q_a|kv_a GEMM is gemm_bf16_rmsnorm (the input norm
        in its prologue, split-K partials out), so the MoE layer before ends without a norm; with
        `residual` (world size > 1) x is the all-reduced bf16 rows of the layer before and the GEMM is
        gemm_bf16_addnorm (the residual add, its store and the norm in its prologue). A
        quantized q_a|kv_a or q_b, or separate q_a / kv_a take the 7-launch form (mla_prep, then the q_b GEMM and mla_q_absorb). Same math as the
        torch path below."""
        from ops.gemm import gemm_bf16_rmsnorm, gemm_bf16_splitk
        from ops.gemm_addnorm import gemm_bf16_addnorm
        from ops.mla_fused import mla_prep, q_absorb, q_absorb_append

        c = self.cfg
        T = x.shape[-2]
        H, nope, r = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        tree = self._tree(ctx)                     # refuse an unsupported window before the cache is written
        eps, wkv = self.kv_norm.eps, self.kv_norm.w
        ql = c.q_lora_rank
        if self.qkv_a is not None and self.qkv_a.dense is not None and self.q_b.dense is not None:
            if residual is not None:               # the residual add and the input norm in its prologue
                part, _ = gemm_bf16_addnorm(x, residual[0], x_norm.w, self.qkv_a.dense, x_norm.eps, partials=True,
                                            res_out=residual[1])
            elif x_norm is not None:               # the input norm in the GEMM's prologue
                part = gemm_bf16_rmsnorm(x, x_norm.w, self.qkv_a.dense, x_norm.eps, partials=True)
            else:
                part = gemm_bf16_splitk(x.to(torch.bfloat16), self.qkv_a.dense)   # [S, T, ql + C + r] f32
            q = gemm_bf16_rmsnorm(part[:, :, :ql], self.q_norm.w, self.q_b.dense, self.q_norm.eps, partials=True)
            qf = q_absorb_append(q.view(q.shape[0], T, H, nope + r), self.w_uk, cos, sin, part[:, :, ql:], wkv,
                                 ctx.slots, kvl, eps)
        else:
            if self.qkv_a is not None:
                q = self.q_b(mla_prep(self.qkv_a(x), self.q_norm.w, wkv, cos, sin, ctx.slots, kvl, eps, q_lora=ql))
            else:
                mla_prep(self.kv_a(x), None, wkv, cos, sin, ctx.slots, kvl, eps, q_lora=0)
                q = self.q_b(self.q_norm(self.q_a(x))) if ql else self.q_proj(x)
            qf = q_absorb(q.view(T, H, nope + r), self.w_uk, cos, sin)                # [T, H, C + r]
        o = self._decode(qf, kvl, ctx, tree, self.w_uv_t).view(T, H * c.v_head_dim)  # [T, H * v]
        if partials and self.o_proj.dense is not None and self.o_proj.dense.dtype == torch.bfloat16:
            if isinstance(partials, NormTail):            # the norm after it runs o_proj (with its tail)
                return PendingGemm(o, self.o_proj.dense, partials)
            return gemm_bf16_splitk(o, self.o_proj.dense)                             # [S, T, hidden] f32
        return self.o_proj(o)

    def _tree(self, ctx: StepCtx) -> Optional[torch.Tensor]:
        """The tree mask the triton decode takes (int8 [B, QL, TW] over the last TW cached rows: TW = QL
        for the target's tree verify, TW > QL for an MLA draft's tree step) or None; refuses what it
        cannot run."""
        from ops.mla import MAX_Q_LEN

        if ctx.window is None:
            return None
        QL = ctx.QL
        if QL > MAX_Q_LEN:
            raise NotImplementedError(f"triton MLA tree attention: {QL} tree rows per sequence > mla_decode's "
                                      f"q_len limit {MAX_Q_LEN}")
        return ctx.window.to(torch.int8)

    def _decode(self, qf: torch.Tensor, kvl: torch.Tensor, ctx: StepCtx, tree: Optional[torch.Tensor],
                w_uv: Optional[torch.Tensor] = None) -> torch.Tensor:
        """mla_decode over the appended cache for qf [T, H, C + r] bf16: one batched launch pair per
        chunk of MAX_Q_LEN rows -> [T, H, C] (or [T, H, v] through `w_uv`)."""
        from ops.mla import MAX_Q_LEN, mla_decode

        B, QL = ctx.B, ctx.QL
        H = qf.shape[1]
        qb = qf.view(B, QL, H, -1)
        outs = []
        for j in range(0, QL, MAX_Q_LEN):       # prefill: causal chunks of the kernel's q_len limit (QL is static)
            e = min(QL, j + MAX_Q_LEN)
            sl = ctx.seq_lens if e == QL else ctx.seq_lens - (QL - e)
            # the op's batch-invariant split plan: fixed-size KV chunks from the table capacity (a host
            # int), so the grid is fixed per cache and a row reduces in the same order at any batch or q_len
            outs.append(mla_decode(qb if e - j == QL else qb[:, j:e].contiguous(), kvl, ctx.bt, sl, self.scale,
                                   latent_dim=self.cfg.kv_lora_rank, tree_mask=tree, out_dtype=torch.bfloat16,
                                   backend="triton", w_uv=w_uv))
        o = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
        return o.reshape(B * QL, H, -1)

    def _attend(self, q: torch.Tensor, new: torch.Tensor, kvl: torch.Tensor, ctx: StepCtx) -> torch.Tensor:
        """Append the new latent rows at ctx.slots, then attend: one batched launch for all B sequences."""
        C = self.cfg.kv_lora_rank
        B, QL = ctx.B, ctx.QL
        H = q.shape[1]
        if self.backend == "torch":
            ps = kvl.shape[1]
            kvl[ctx.slots // ps, ctx.slots % ps] = new.to(kvl.dtype)
            rows = paged_rows(kvl, ctx.bt).to(self.dtype)                 # [B, S, C + r]
            s = torch.einsum("bqhd,bsd->bqhs", q.view(B, QL, H, -1).to(self.dtype), rows) * self.scale
            vis = visibility(ctx, rows.shape[1])
            s = s.masked_fill(~vis[:, :, None, :], float("-inf"))
            o = torch.einsum("bqhs,bsc->bqhc", s.softmax(-1), rows[..., :C])
            return o.reshape(B * QL, H, C).to(q.dtype)
        from ops.mla import append_latent

        tree = self._tree(ctx)
        append_latent(kvl, new.to(kvl.dtype).contiguous(), ctx.slots)
        return self._decode(q.to(torch.bfloat16), kvl, ctx, tree).to(q.dtype)


# rows up to which a step may run o_proj with its norm tail (ops.splitk_norm): the counters' size
O_PROJ_NORM_MAX_TOKENS = 256


class KimiModel:
    """The target: embed -> [attn + (dense MLP | MoE)] x N -> norm -> lm_head, with aux capture.

    device: where weights, caches and every step tensor live (default: models.kimi.default_device())."""

    def __init__(self, ck: Checkpoint, backend: str = "torch", dtype: torch.dtype = torch.float32,
                 capture_ids: Optional[Sequence[int]] = None, device: Optional[str | torch.device] = None,
                 comm: Optional[Comm] = None):
        """comm: models.parallel.Comm of a tensor / expert parallel rank (ck then holds that rank's shard,
        models.loader.load_sharded); default world size 1."""
        cfg = ck.config
        self.comm = comm if comm is not None else single()
        if not isinstance(cfg, DeepseekV3Config):
            raise TypeError(f"KimiModel needs a target checkpoint, got {type(cfg).__name__}")
        self.cfg, self.backend, self.dtype = cfg, check_backend(backend), dtype
        self.device = torch.device(device) if device is not None else default_device()
        dev = self.device
        self.adt = act_dtype(backend, dtype)
        self.routing: Optional[RoutingTrace] = None      # record / replay expert choices (tests, debugging)
        # triton: a MoE layer ends without the next input norm when the next attention norms its rows in
        # its first GEMM's prologue (_MLA.takes_raw_rows; at world size > 1 with the residual add too,
        # ops.gemm_addnorm); False: every layer ends normed
        self.norm_in_gemm = True
        # ... and such a layer's end (combine_add; at world size > 1 combine_rank) runs in the epilogue of
        # its shared expert's down GEMM (ops.swiglu.gemm_bf16_swiglu_combine / gemm_bf16_swiglu_rank: one
        # launch fewer, the same bits); False: the separate combine launch
        self.combine_in_shared = True
        # ... and o_proj's GEMM runs the residual-add norm after it in its last programs
        # (ops.splitk_norm, one launch fewer): "auto" where the tuned files say it pays at every decode
        # and verify size (ops.splitk_norm.fused_pays), True always (up to the counters' rows), False never
        self.o_proj_norm = "auto"
        self.o_proj_counters = None       # its ticket counters: allocated once, below (triton, world size 1)
        # the residual adds and norms run in the prologue of the GEMM that reads the normed rows: the
        # post-attention one in the shared gate|up + router GEMM (world size 1: over o_proj's partials),
        # at world size > 1 also the next layer's input norm in its q_a|kv_a GEMM (ops.gemm_addnorm, one
        # launch fewer each): "auto" where the tuned files say it pays at every size up to the cache's
        # slots x MAX_Q_LEN rows (addnorm_pays), True, False
        self.add_norm_in_gemm: bool | str = "auto"
        # ... and where the post-attention one does, the routing of a decode or verify step's few tokens
        # runs in that GEMM's last program (ops.gemm_addnorm.RouteTail: the same bits as moe_route_align,
        # one launch fewer): "auto" where the tuned files say it pays at the step's rows
        # (route_tail_pays), True, False (moe_route_align's own launch)
        self.route_in_gemm: bool | str = "auto"
        self.capture_ids = tuple(capture_ids) if capture_ids is not None else cfg.capture_layer_ids
        for i in self.capture_ids:
            if not 1 <= i <= cfg.num_hidden_layers:
                raise ValueError(f"capture id {i} outside [1, {cfg.num_hidden_layers}]")
        eps = cfg.rms_norm_eps
        self.embed = _dense(ck["model.embed_tokens.weight"]).to(self.adt).to(dev)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            if cfg.is_moe_layer(i):
                mlp = _MoE(ck, i, cfg, backend, dtype, owner=self, device=dev)
            else:
                mlp = MLP(*(Linear(p + "mlp." + n, ck[p + f"mlp.{n}.weight"], backend, dtype, dev)
                            for n in ("gate_proj", "up_proj", "down_proj")), backend=backend)
            self.layers.append((RMSNorm(ck[p + "input_layernorm.weight"], eps, backend, dtype, dev),
                                _MLA(ck, i, self.comm.plan.attn_config(cfg), backend, dtype, device=dev),
                                RMSNorm(ck[p + "post_attention_layernorm.weight"], eps, backend, dtype, dev), mlp))
        self.norm = RMSNorm(ck["model.norm.weight"], eps, backend, dtype, dev)
        head = ck.get("lm_head.weight")
        if head is None:
            if not cfg.tie_word_embeddings:
                raise KeyError("tensor 'lm_head.weight' is missing (and tie_word_embeddings is false)")
            head = ck["model.embed_tokens.weight"]
        self.lm_head = Linear("lm_head", head, backend, dtype, dev)
        self.rope_scaling = rope_scaling_dict(cfg.rope_scaling)
        self.rope = RopeTable(cfg.qk_rope_head_dim, cfg.rope_theta, self.rope_scaling, dev)
        # the route tail's ticket counter (route_in_gemm), allocated here: before any graph capture
        self.route_counter = torch.zeros(1, dtype=torch.int32, device=dev) if backend == "triton" else None
        if backend == "triton" and self.comm.world == 1:
            from ops.splitk_norm import counters_for

            self.o_proj_counters = counters_for(O_PROJ_NORM_MAX_TOKENS, cfg.hidden_size, dev)

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def new_cache(self, batch: int, max_tokens: int, page_size: int = 16) -> LatentCache:
        """A latent cache for `batch` sequences of up to `max_tokens` tokens each (on the model's device;
        the rope tables are grown to cover it here, outside any step)."""
        c = LatentCache.for_tokens(self.cfg.num_hidden_layers, batch, max_tokens, page_size, self.cfg.kv_cache_dim,
                                   self.adt, self.device)
        self.rope.ensure(c.table.capacity)
        return c

    def step(self, cache: LatentCache, tokens: torch.Tensor, seqs: Optional[torch.Tensor] = None,
             tree: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> StepOutput:
        """Process tokens [B, q_len] (device, long) for cache slots `seqs` [B] (default 0..B-1); their rows
        are appended at each slot's length, which then grows by q_len (on the device).

        tree (optional): (depths long [B, q_len], mask bool [B, q_len, q_len]): row j sits at position
        len_b + depths[j] and sees the cached prefix plus the new rows marked in mask[j]. The caller has
        reserved the pages (PageTable.reserve). No device->host read happens here."""
        B, QL = tokens.shape
        depths, mask = tree if tree is not None else (None, None)
        N = self.cfg.num_hidden_layers
        ctx, cos, sin, h, x = begin_step(cache.table, tokens, self.rope, self.embed, self.backend, seqs, offsets=depths,
                                         window=mask, norm=self.layers[0][0] if N else self.norm)
        caps: dict[int, torch.Tensor] = {}
        x_norm: Optional[RMSNorm] = None      # set: x is h as f32 rows (world size > 1: the all-reduced rows,
        #                                       added to h there), normed by attn's first GEMM
        fuse = self.backend == "triton"
        for i, (n1, attn, n2, mlp) in enumerate(self.layers):
            pending = None      # world size > 1, x un-normed: the residual add runs in attn's first GEMM
            if x_norm is not None and self.comm.world > 1:
                pending = (h, torch.empty_like(h))
                h = pending[1]
            if i in self.capture_ids:                         # the residual stream entering layer i: the
                caps[i] = h                                   # norms write each new sum to a new tensor
            if self.comm.world == 1:      # triton: o_proj's split-K partials, summed by the norm below
                a = attn(x, cos, sin, cache, i, ctx, partials=self._o_proj_partials(fuse), x_norm=x_norm)
            else:                         # row-parallel o_proj: sum the ranks
                a = self.comm.all_reduce(attn(x, cos, sin, cache, i, ctx, x_norm=x_norm, residual=pending))
            nxt = self.layers[i + 1][0] if i + 1 < N else self.norm
            fused = getattr(mlp, "fused_block", None) if fuse else None   # the MoE layers (_MoE)
            # the next attention may norm its input rows itself (no norm at the MoE end)
            nxt_attn = self.layers[i + 1][1] if i + 1 < N else None
            raw = self.norm_in_gemm and getattr(nxt_attn, "takes_raw_rows", False) and \
                (self.comm.world == 1 or self._add_norm_in_gemm(nxt_attn.qkv_a_shape, cache, h.shape[0]))
            first = getattr(mlp, "add_norm_shape", None) if fused is not None else None
            add_first = first is not None and self._add_norm_in_gemm(first, cache, h.shape[0], normed=True,
                                                                     quant=mlp.add_norm_quant, splits=_splits(a))
            done = fused(a, h, n2, nxt, raw_next=raw, add_first=add_first) if fused is not None else None
            x_norm = nxt if done is not None and raw else None
            if done is not None:                          # MoE half + next norm (or f32 rows), the new residual
                x, h = done
                continue
            x, h = n2.add_norm(a, h)                                      # residual add fused into the norm
            y = self.comm.all_reduce(mlp(x))                              # aux captures see full sums
            if raw and self.comm.world > 1:       # the next attention's first GEMM adds and norms
                x, x_norm = y.to(torch.bfloat16).contiguous(), nxt
            else:
                x, h = nxt.add_norm(y, h)
        if N in self.capture_ids:
            caps[N] = h
        advance(cache.table, ctx)
        logits = self.comm.gather_last(self.lm_head(x).float()).view(B, QL, -1)   # vocab-parallel head
        aux = torch.cat([caps[i] for i in self.capture_ids], -1).view(B, QL, -1) if self.capture_ids else None
        return StepOutput(logits, aux, h)

    def _add_norm_in_gemm(self, shape: tuple[int, int], cache: LatentCache, rows: int, normed: bool = False,
                          quant: bool = False, splits: int = 0) -> bool:
        """Whether a residual add and norm (after an all-reduce; at world size 1 after o_proj, over its
        `splits` split-K partials) run in the prologue of the GEMM of weight `shape` that reads the
        normed rows (`add_norm_in_gemm`; "auto": ops.gemm_addnorm.addnorm_pays for the most rows this
        cache's decode and verify steps run, and `rows` within them; `normed` / `quant`: the variant
        that stores the normed rows / and their int8 quant too)."""
        if self.add_norm_in_gemm != "auto":
            return bool(self.add_norm_in_gemm)
        from kdsl.targets import current_target
        from ops.gemm_addnorm import addnorm_pays
        from ops.mla import MAX_Q_LEN

        span = cache.table.batch * MAX_Q_LEN
        return rows <= span and addnorm_pays(current_target().name, *shape, span, normed, quant, splits)

    def _o_proj_partials(self, fuse: bool) -> bool | NormTail:
        """What the attention returns at world size 1: o_proj as a PendingGemm that the next norm
        runs (with its tail where `o_proj_norm` says so), or its split-K partials (`fuse`), or rows."""
        if fuse and self.o_proj_norm is not False and self.o_proj_counters is not None:
            return NormTail(self.o_proj_counters, self.o_proj_norm)
        return fuse

    def forward(self, cache: LatentCache, batch: Sequence[tuple[int, Sequence[int]]],
                keep_hidden: bool = False, trees: Optional[Sequence[Optional[tuple]]] = None) -> TargetOutput:
        """Ragged list API: process new tokens for each (slot, tokens); appends their KV rows and advances
        lengths (host-side bookkeeping, then `step` per group; for prefill and tests, not the decode loop).

        trees[i] (optional): (depths [n], mask bool [n, n]) for a token tree: row j sits at position
        len_b + depths[j] and sees the cached prefix plus the new rows marked in mask[j] (ancestors and
        itself). Returns float32 logits [n_b, V] and aux [n_b, len(capture_ids) * H] per entry."""
        entries = []
        lens = list(cache.table.lengths)
        for i, (b, t) in enumerate(batch):
            t = [int(x) for x in t]
            if not t:
                raise ValueError(f"forward: empty token list for sequence slot {b}")
            if min(t) < 0 or max(t) >= self.cfg.vocab_size:
                raise ValueError(f"token id out of range [0, {self.cfg.vocab_size})")
            tr = trees[i] if trees is not None else None
            if tr is not None:
                depths, mask = tr
                if len(depths) != len(t) or tuple(mask.shape) != (len(t), len(t)):
                    raise ValueError(f"forward: tree for slot {b} must have {len(t)} depths and a [{len(t)}, {len(t)}] mask")
            cache.table._check(b)
            entries.append((b, t, tr))
        dev = self.device
        res: list[Optional[StepOutput]] = [None] * len(entries)
        chunk = _chunk_len(self.backend)
        for group in _groups(entries, [lens[e[0]] for e in entries], cache.table.capacity):
            seqs = torch.tensor([entries[g][0] for g in group], dtype=torch.long, device=dev)
            lens = list(cache.table.lengths) if len(group) < len(entries) else lens
            for g in group:
                cache.table.reserve(entries[g][0], lens[entries[g][0]] + len(entries[g][1]))
            if entries[group[0]][2] is not None:
                trs = [entries[g][2] for g in group]
                toks = torch.tensor([entries[g][1] for g in group], dtype=torch.long, device=dev)
                d = torch.tensor([[int(x) for x in tr[0]] for tr in trs], dtype=torch.long, device=dev)
                mk = torch.stack([tr[1].bool().cpu() for tr in trs]).to(dev)
                outs = [self.step(cache, toks, seqs, (d, mk))]
            else:
                # right-padded to the longest entry: a padding row sits after its sequence's real rows, so
                # causal attention never shows it to them; the lengths are set to the real ones afterwards
                n = [len(entries[g][1]) for g in group]
                P = max(n)
                for g in group:
                    cache.table.reserve(entries[g][0], lens[entries[g][0]] + P)
                toks = torch.tensor([entries[g][1] + [0] * (P - len(entries[g][1])) for g in group], dtype=torch.long,
                                    device=dev)
                outs = [self.step(cache, toks[:, j:j + chunk], seqs) for j in range(0, P, chunk)]
                if min(n) < P:
                    cache.table.lens[seqs] = torch.tensor([lens[entries[g][0]] + len(entries[g][1]) for g in group],
                                                          dtype=torch.int32, device=dev)
            lg = torch.cat([o.logits for o in outs], 1)
            ax = None if outs[0].aux is None else torch.cat([o.aux for o in outs], 1)
            hs = torch.cat([o.hidden.view(len(group), -1, o.hidden.shape[-1]) for o in outs], 1)
            for r, g in enumerate(group):
                k = len(entries[g][1])
                res[g] = StepOutput(lg[r, :k], None if ax is None else ax[r, :k], hs[r, :k])
        out = TargetOutput([o.logits for o in res], [o.aux for o in res])
        if keep_hidden:
            out.hidden = torch.cat([o.hidden for o in res], 0)  # type: ignore[attr-defined]
        return out


def _chunk_len(backend: str) -> int:
    """Rows per sequence in one step of the ragged path: all of them (the triton attention walks a long
    prefill in causal chunks of the kernels' q_len limit inside the step)."""
    return 1 << 30


def _groups(entries: list, starts: list[int], capacity: int) -> list[list[int]]:
    """Indices of entries that share one step: every chain entry (right-padded to the longest, when each
    sequence has room for it), and the tree entries per tree size. A slot named twice keeps the call
    order, one entry per step."""
    if len({e[0] for e in entries}) < len(entries):
        return [[i] for i in range(len(entries))]
    chains = [i for i, e in enumerate(entries) if e[2] is None]
    out: list[list[int]] = []
    if chains:
        P = max(len(entries[i][1]) for i in chains)
        if all(starts[i] + P <= capacity for i in chains):
            out.append(chains)
        else:
            by_len: dict[int, list[int]] = {}
            for i in chains:
                by_len.setdefault(len(entries[i][1]), []).append(i)
            out.extend(by_len.values())
    trees: dict[int, list[int]] = {}
    for i, e in enumerate(entries):
        if e[2] is not None:
            trees.setdefault(len(e[1]), []).append(i)
    out.extend(trees.values())
    return sorted(out, key=lambda g: g[0])
