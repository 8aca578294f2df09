"""Build the real Kimi-K2.5 model path on meta tensors and run its forward without any data.

Two pieces, kept apart from the bench's cost accounting (bench/step.py):

* `meta_checkpoint(cfg, experts)`: a `models.loader.Checkpoint` whose every tensor is a meta
  tensor of the shape the config implies (`models.loader.expected_shapes`), routed experts as
  `QuantLinear`s in the W4A8 (Quark int4 per-channel), W4A16 (compressed-tensors int4 g32) or
  MXFP4 (Quark OCP MX, W4A4) layout, everything else bf16 as in the published checkpoints. No weight memory is allocated.
* `HostShadowMode`: a TorchDispatchMode under which the forward runs with meta as the default
  device. The model still reads the host in places (token lists, page tables, `.tolist()` of
  lengths): small tensors built from host data keep a CPU "shadow" that every op on shadowed
  inputs updates, so those reads return the true values. Every other op is counted as a device
  launch (views, allocations and metadata ops are not), with the bytes it moves and its flops.
  Reads of unshadowed device values (a real device->host sync in the forward) are counted and
  answered with zeros.

`build_model(...)` is the one place that constructs the model (rank 0 of a tensor-parallel deployment
when tp > 1, its collectives recorded, not run): when models/kimi.py changes its constructor, adapt it here.
`build_draft(cfg)` is the same one place for the EAGLE-3 draft (`models.eagle3.Eagle3Draft`), and
`run_draft_step(...)` runs its device step as `run_step` runs the target's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

# Kimi-K2.5 text config (REFERENCE section 1), as its config.json's text_config spells it.
KIMI_K25_TEXT = {
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.827, "rms_norm_eps": 1e-5, "vocab_size": 163840,
    "tie_word_embeddings": False, "rope_theta": 50000.0, "max_position_embeddings": 262144,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839, "hidden_act": "silu",
}
KIMI_K25_CONFIG = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                   "text_config": KIMI_K25_TEXT}

EXPERT_FORMATS = ("w4a8", "w4a16", "mxfp4")
# the quantization_config of an OCP MXFP4 (W4A4) checkpoint as AMD Quark writes it (amd/Kimi-K2.5-MXFP4):
# E2M1 weights with E8M0 scales per 32 inputs, activations quantized to MXFP4 per 32 at run time
_MX_SPEC = {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1, "group_size": 32, "scale_format": "e8m0",
            "scale_calculation_mode": "even"}
MXFP4_QUANT = {"quant_method": "quark", "export": {"pack_method": "reorder"},
               "global_quant_config": {"weight": {**_MX_SPEC, "is_dynamic": False},
                                       "input_tensors": {**_MX_SPEC, "is_dynamic": True}}}
SHADOW_MAX_NUMEL = 1 << 16  # host-built tensors up to this size keep a CPU shadow


# ---------------------------------------------------------------------------------------------
# config and checkpoint

def limit_layers(cfg: Any, layers: int | None) -> Any:
    """`cfg` with only its first `layers` layers (at least one MoE layer when it has experts)."""
    if layers is None:
        return cfg
    first = cfg.first_k_dense_replace
    layers = max(layers, first + 1 if cfg.n_routed_experts else 1)
    return dataclasses.replace(cfg, num_hidden_layers=min(layers, cfg.num_hidden_layers))


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _expert_linear(n: int, k: int, experts: str) -> Any:
    from models.formats import QuantLinear

    packed = _meta((n, k // 8), torch.int32)
    if experts == "w4a8":
        return QuantLinear("int4", packed, _meta((n,), torch.float32), 0, "quark_reorder", (n, k), "quark-w4a8")
    if experts == "w4a16":
        return QuantLinear("int4", packed, _meta((n, k // 32), torch.bfloat16), 32, "ct", (n, k),
                           "compressed-tensors")
    if experts == "mxfp4":
        return QuantLinear("mxfp4", _meta((n, k // 2), torch.uint8), _meta((n, k // 32), torch.uint8), 32, "e2m1",
                           (n, k), "quark-mxfp4")
    raise ValueError(f"experts format must be one of {EXPERT_FORMATS}, got {experts!r}")


def meta_checkpoint(cfg: Any, experts: str = "w4a8", plan: Any = None) -> Any:
    """A Checkpoint of meta tensors with the shapes `cfg` implies (routed experts quantized); with a
    `models.parallel.ShardPlan`, the shapes rank `plan.rank` loads (`models.loader.load_sharded`: split
    dims divided by the world size, other ranks' experts absent)."""
    from pathlib import Path

    from models.loader import Checkpoint, expected_shapes

    if experts == "mxfp4":   # the activation format comes from the checkpoint's quantization_config
        from models.config import QuantConfig

        cfg = dataclasses.replace(cfg, quantization=QuantConfig.parse(MXFP4_QUANT, "quantization_config"))
    E = getattr(cfg, "n_routed_experts", 0)
    weights: dict[str, Any] = {}
    for name, shape in expected_shapes(cfg).items():
        if shape is None or (plan is not None and not plan.keeps(name, E)):
            continue
        d = plan.split_dim(name) if plan is not None else None
        if d is not None and d < len(shape):
            shape = tuple(x // plan.world if i == d else x for i, x in enumerate(shape))
        if ".mlp.experts." in name:
            weights[name] = _expert_linear(shape[0], shape[1], experts)
        elif name.endswith("e_score_correction_bias"):
            weights[name] = _meta(shape, torch.float32)
        else:
            weights[name] = _meta(shape, torch.bfloat16)
    return Checkpoint(Path("<meta>"), cfg, weights)


# ---------------------------------------------------------------------------------------------
# host shadows and torch-op accounting

_NOT_LAUNCHES = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view",
    "reshape", "alias", "as_strided", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
    "squeeze", "detach", "split", "split_with_sizes", "unbind", "chunk", "narrow", "view_as_real",
    "view_as_complex", "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
    "is_same_size", "_reshape_alias", "diagonal", "unfold", "movedim", "_to_copy_meta",
}
_MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "dot", "addmv", "mv"}
_GATHERS = {"index", "gather", "index_select", "embedding"}
_SCATTERS = {"index_put", "index_put_", "_index_put_impl_", "scatter", "scatter_", "index_add", "index_add_",
             "index_copy_", "index_copy"}


@dataclass
class TorchOp:
    """One torch op of the forward that would be a device launch."""
    name: str
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    nbytes: float
    flops: float
    layer: int | None


@dataclass
class HostShadowMode(TorchDispatchMode):
    """See the module docstring. `ops` collects device launches; `host_ops` the ops on host data only;
    `device_reads` the reads of device values the forward makes (each a sync on a GPU)."""
    ops: list[TorchOp] = field(default_factory=list)
    host_ops: int = 0
    device_reads: list[str] = field(default_factory=list)
    layer: int | None = None
    marks: list[tuple[int, int | None]] = field(default_factory=list)  # (kdsl launches so far, layer)
    collectives: list["Collective"] = field(default_factory=list)
    last_layer: int | None = None     # the layer whose part ran last (a collective after it belongs to it)

    def __post_init__(self) -> None:
        super().__init__()
        self.shadow = WeakIdKeyDictionary()

    # -- shadows
    def _sh(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            if t.device.type != "meta":
                return t
            return self.shadow.get(t)
        return t

    def _all_shadowed(self, args: Any, kwargs: Any) -> bool:
        flat, _ = tree_flatten((args, kwargs))
        ts = [a for a in flat if isinstance(a, torch.Tensor)]
        return all(t.device.type != "meta" or t in self.shadow for t in ts)

    def host_tensor(self, cpu: torch.Tensor) -> torch.Tensor:
        """A meta tensor standing for host data `cpu` (what torch.tensor(list) makes here)."""
        m = torch.empty(cpu.shape, dtype=cpu.dtype, device="meta")
        if cpu.numel() <= SHADOW_MAX_NUMEL:
            self.shadow[m] = cpu
        return m

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if func is torch.ops.aten._local_scalar_dense.default:
            s = self._sh(args[0])
            if s is not None:
                return s.item()
            self.device_reads.append(f"{name} of {tuple(args[0].shape)} {args[0].dtype}")
            return False if args[0].dtype == torch.bool else 0
        dev = kwargs.get("device")
        if name == "_to_copy" and dev is not None and torch.device(dev).type == "cpu" and args[0].device.type == "meta":
            s = self._sh(args[0])
            if s is None:
                self.device_reads.append(f"copy to host of {tuple(args[0].shape)} {args[0].dtype}")
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            return s.to(dtype=kwargs.get("dtype") or s.dtype).clone()
        shadowed = self._all_shadowed(args, kwargs)
        flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        to_meta = dev is not None and torch.device(dev).type == "meta"
        if shadowed and any(t.device.type != "meta" for t in flat_in) and not to_meta:
            # host data only, some of it a real CPU tensor: the model computes this on the host
            self.host_ops += name not in _NOT_LAUNCHES
            return func(*tree_map(self._sh, args), **{k: tree_map(self._sh, v) for k, v in kwargs.items()})
        out = func(*args, **kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        small = all(o.numel() <= SHADOW_MAX_NUMEL for o in outs)
        if shadowed and small and name not in ("empty", "empty_like", "empty_strided", "new_empty"):
            try:
                sargs = tree_map(self._sh, args)
                skw = {k: ("cpu" if k == "device" else tree_map(self._sh, v)) for k, v in kwargs.items()}
                sout = func(*sargs, **skw)
                for o, so in zip(outs, [x for x in tree_flatten(sout)[0] if isinstance(x, torch.Tensor)]):
                    if o.device.type == "meta":
                        self.shadow[o] = so
            except Exception:  # noqa: BLE001 - a shadow we cannot compute is simply absent
                pass
            if name not in _NOT_LAUNCHES:
                self.host_ops += 1
            return out
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor) and args[0] in self.shadow:
            del self.shadow[args[0]]  # written from device data: the shadow is stale
        if name.rstrip("_") in _NOT_LAUNCHES or name in _NOT_LAUNCHES:
            return out
        self.ops.append(self._account(name, args, kwargs, outs))
        return out

    def _account(self, name: str, args: Any, kwargs: Any, outs: list[torch.Tensor]) -> TorchOp:
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        nb = lambda t: t.numel() * t.element_size()  # noqa: E731
        out_b = sum(nb(o) for o in outs)
        base = name.rstrip("_")
        if base in _GATHERS:  # reads the gathered rows (= the output) and the indices, not the table
            nbytes = 2 * out_b + sum(nb(t) for t in ins[1:])
        elif name in _SCATTERS or base in _SCATTERS:  # reads and writes the scattered values
            vals = ins[-1] if ins else None
            nbytes = 2 * (nb(vals) if vals is not None else 0) + sum(nb(t) for t in ins[1:-1])
        else:
            seen: set[int] = set()
            nbytes = 0
            for t in ins + outs:
                if id(t) not in seen:
                    seen.add(id(t))
                    nbytes += nb(t)
        flops = 0.0
        if base in _MATMULS and len(ins) >= 2:
            a, b = ins[-2], ins[-1]
            k = a.shape[-1]
            flops = 2.0 * (outs[0].numel() if outs else 0) * k
        return TorchOp(name, [tuple(t.shape) for t in ins + outs], [str(t.dtype).replace("torch.", "") for t in ins],
                       float(nbytes), flops, self.layer)


@contextlib.contextmanager
def meta_forward(mode: HostShadowMode) -> Iterator[HostShadowMode]:
    """Meta as the default device, `torch.tensor(host data)` shadowed, `mode` active."""
    orig_tensor = torch.tensor

    def tensor(data: Any, *a: Any, **k: Any) -> torch.Tensor:
        k.pop("device", None)
        with torch.utils._python_dispatch._disable_current_modes():
            cpu = orig_tensor(data, *a, device="cpu", **k)
        return mode.host_tensor(cpu)

    torch.tensor = tensor  # type: ignore[assignment]
    try:
        with torch.device("meta"), mode:
            yield mode
    finally:
        torch.tensor = orig_tensor  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------
# the model

def _launches() -> int:
    from kdsl.record import active

    rec = active()
    return len(rec.launches) if rec is not None else 0


class _LayerTag:
    """A layer part (norm, attention, MLP) whose calls, and method calls (`add_norm`), tag the ops
    they launch with the layer index; other attributes pass through."""

    def __init__(self, mode: HostShadowMode, i: int, part: Any):
        self._mode, self._i, self._part = mode, i, part

    def _tagged(self, fn: Callable) -> Callable:
        mode, i = self._mode, self._i

        def call(*a: Any, **k: Any) -> Any:
            prev, mode.layer, mode.last_layer = mode.layer, i, i
            mode.marks.append((_launches(), i))
            try:
                return fn(*a, **k)
            finally:
                mode.layer = prev
                mode.marks.append((_launches(), prev))
        return call

    def __call__(self, *a: Any, **k: Any) -> Any:
        return self._tagged(self._part)(*a, **k)

    def __getattr__(self, name: str) -> Any:
        v = getattr(self._part, name)
        return self._tagged(v) if callable(v) and not isinstance(v, type) else v


def _layer_tag(mode: HostShadowMode, i: int, part: Any) -> Any:
    return _LayerTag(mode, i, part)


def launch_layers(mode: HostShadowMode, n: int) -> list[int | None]:
    """The layer of each of the first n recorded kdsl launches (from the marks the layer tags left)."""
    out: list[int | None] = []
    j, cur = 0, None
    marks = mode.marks
    for i in range(n):
        while j < len(marks) and marks[j][0] <= i:
            cur = marks[j][1]
            j += 1
        out.append(cur)
    return out


@dataclass
class Collective:
    """One collective the forward called: kind ("all_reduce" | "all_gather"), payload bytes per rank,
    the layer it ran in (None: outside the layers, e.g. the logits' all-gather)."""
    kind: str
    nbytes: int
    layer: int | None


def recording_comm(plan: Any, mode: HostShadowMode) -> Any:
    """A models.parallel.Comm for rank 0 of `plan` whose collectives run nowhere: each call is logged
    in `mode.collectives` (kind, bytes, layer) and returns a tensor of the right shape, so the real
    tensor-parallel forward runs on meta tensors in one process."""
    from models.parallel import Comm

    class RecordingComm(Comm):
        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            if self.world > 1:
                layer = mode.layer if mode.layer is not None else mode.last_layer   # after a layer's attention / MLP
                mode.collectives.append(Collective("all_reduce", x.numel() * x.element_size(), layer))
                self._count("all_reduce", x)
            return x

        def gather_last(self, x: torch.Tensor) -> torch.Tensor:
            if self.world == 1:
                return x
            mode.collectives.append(Collective("all_gather", x.numel() * x.element_size(), None))   # the logits
            self._count("all_gather", x)
            return torch.empty(*x.shape[:-1], self.world * x.shape[-1], dtype=x.dtype, device=x.device)

    return RecordingComm(plan)


def build_model(cfg: Any, experts: str, mode: HostShadowMode, tp: int = 1, moe_parallel: str = "ep") -> Any:
    """KimiModel (triton backend) over a meta checkpoint: rank 0 of a `tp`-way tensor-parallel
    deployment (models.parallel: MLA by heads, experts "ep" or "tp", vocab-parallel lm_head) whose
    collectives are recorded (`recording_comm`); each layer's callables tag the ops they launch with
    the layer index (the only bench-side hook into the model object)."""
    from models.kimi import KimiModel
    from models.parallel import ShardPlan

    plan = ShardPlan(0, tp, moe_parallel)
    plan.check(cfg)
    ck = meta_checkpoint(cfg, experts, plan)
    with torch.device("meta"):
        model = KimiModel(ck, backend="triton", dtype=torch.bfloat16, capture_ids=(), device=torch.device("meta"),
                          comm=recording_comm(plan, mode))
    model.layers = [tuple(_layer_tag(mode, i, f) for f in layer) for i, layer in enumerate(model.layers)]
    return model


def meta_cache(cfg: Any, batch: int, ctx: int, q_len: int, page_size: int = 64) -> Any:
    """A latent cache on meta for `batch` sequences at context `ctx` (pages reserved for ctx + q_len;
    its block-table width is one sequence's pages, so the ops' split plans see this context)."""
    from models.kv_cache import LatentCache

    cache = LatentCache.for_tokens(cfg.num_hidden_layers, batch, ctx + q_len, page_size, cfg.kv_cache_dim,
                                   dtype=torch.bfloat16, device="meta")
    cache.table.reserve_all(ctx + q_len)
    return cache


def run_step(model: Any, cfg: Any, mode: HostShadowMode, batch: int, ctx: int, q_len: int) -> None:
    """One decode (q_len 1) or verify (q_len > 1) step of `batch` sequences at context `ctx`: the
    model's device step (`KimiModel.step`) on meta token ids, exactly what the engine launches."""
    cache = meta_cache(cfg, batch, ctx, q_len)
    with meta_forward(mode):
        tokens = torch.ones(batch, q_len, dtype=torch.long)
        model.step(cache, tokens)


# ---------------------------------------------------------------------------------------------
# the EAGLE-3 draft (replicated at TP1 on every rank of a deployment)

# lightseekorg/kimi-k2.5-eagle3 (REFERENCE section 2), as a draft config.json spells it. Fields the
# reference leaves UNCONFIRMED, and the value chosen here: num_key_value_heads 64 (the 64 x 128 MHA cache
# the reference describes; 16 is the other candidate), intermediate_size 12288 (the training template),
# rope theta 50000 with the target's yarn scaling (the draft attends at the target's positions; the other
# candidate, theta 1e6 unscaled, changes only the host-built rope table, not a launch), aux ids
# [1, 29, 57] in the +1 convention. Full-vocab head (draft_vocab_size = vocab_size: no d2t), bf16 weights.
KIMI_K25_EAGLE3_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 7168,
    "target_hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128,
    "intermediate_size": 12288, "num_hidden_layers": 1, "vocab_size": 163840, "draft_vocab_size": 163840,
    "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 262144,
    "rope_scaling": dict(KIMI_K25_TEXT["rope_scaling"]), "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True},
}
DRAFT_PAGE_SIZE = 64   # the draft's MHA cache pages (as the target's latent cache in meta_cache)


def meta_draft_checkpoint(cfg: Any) -> Any:
    """A draft Checkpoint of bf16 meta tensors with the shapes the Eagle3Config implies, its own
    `embed_tokens` included (the released draft ships one); no weight memory is allocated."""
    from pathlib import Path

    from models.loader import Checkpoint, expected_shapes

    weights: dict[str, Any] = {n: _meta(s, torch.int64 if n == "d2t" else torch.bfloat16)
                               for n, s in expected_shapes(cfg).items() if s is not None}
    weights["embed_tokens.weight"] = _meta((cfg.vocab_size, cfg.hidden_size), torch.bfloat16)
    return Checkpoint(Path("<meta>"), cfg, weights)


def build_draft(cfg: Any) -> Any:
    """The one place that constructs the draft: `models.eagle3.Eagle3Draft` (backend "triton") over a
    meta checkpoint. When models/eagle3.py changes its constructor, adapt it here."""
    from models.config import Eagle3Config
    from models.eagle3 import Eagle3Draft

    if not isinstance(cfg, Eagle3Config):
        raise ValueError(f"not an EAGLE-3 draft config ({type(cfg).__name__})")
    if cfg.quantization is not None:
        raise ValueError("quantized drafts are not modelled here (the released Kimi-K2.5 draft is bf16)")
    with torch.device("meta"):
        return Eagle3Draft(meta_draft_checkpoint(cfg), backend="triton", dtype=torch.bfloat16,
                           device=torch.device("meta"))


def meta_draft_cache(draft: Any, batch: int, ctx: int, q_len: int) -> Any:
    """The draft's own cache on meta (`Eagle3Draft.new_cache`, as the engine makes it) with pages
    reserved for ctx + q_len, so its block-table width (and the attention's split plan) is this context."""
    cache = draft.new_cache(batch, ctx + q_len, DRAFT_PAGE_SIZE)
    cache.table.reserve_all(ctx + q_len)
    return cache


def run_draft_step(draft: Any, mode: HostShadowMode, batch: int, ctx: int, q_len: int,
                   hidden: str | None = None) -> None:
    """One `Eagle3Draft.step` (the device step models/spec.py's chain loop runs) of `batch` x `q_len`
    rows at context `ctx` on meta inputs. `hidden`: "carry" feeds the draft's own pre-norm state
    [B, q_len, H] (the single-row draft steps), "aux" the target's three captured rows [B, q_len, 3H]
    (the extend after verify, q_len k+1: fc runs); default carry at q_len 1, aux above."""
    hidden = hidden or ("carry" if q_len == 1 else "aux")
    if hidden not in ("carry", "aux"):
        raise ValueError(f"hidden must be 'carry' or 'aux', got {hidden!r}")
    width = draft.cfg.hidden_size if hidden == "carry" else 3 * draft.target_hidden
    cache = meta_draft_cache(draft, batch, ctx, q_len)
    with meta_forward(mode):
        tokens = torch.ones(batch, q_len, dtype=torch.long)
        states = torch.empty(batch, q_len, width, dtype=torch.bfloat16)
        draft.step(cache, tokens, states)
