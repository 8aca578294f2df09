"""Model configs parsed from a checkpoint's `config.json` (REFERENCE §1, §2, §3).

Three model families:
- `DeepseekV3Config`: the Kimi-K2.5 target (`KimiK25ForConditionalGeneration`, text model nested under
  `text_config`, tensors under `language_model.`) and plain DeepSeek-V3 style checkpoints (flat config).
- `Eagle3Config`: EAGLE-3 drafts, `kind="mha"` (`LlamaForCausalLMEagle3`) or `kind="mla"`
  (`Eagle3DeepseekV2ForCausalLM`, the midlayer is an MLA block).
- `QuantConfig`: the checkpoint's `quantization_config` (compressed-tensors or AMD Quark), looked up in
  `text_config` first, then at top level.

Every dimension comes from the config (and is cross-checked against tensor shapes by the loader);
nothing is hard-coded to Kimi-K2.5's sizes. Missing or ill-typed fields raise `ConfigError` naming the
field (with its path, e.g. `text_config.hidden_size`).

Aux hidden-state layer index convention (used everywhere in this project)
-------------------------------------------------------------------------
`aux_layer_ids` are indices of TARGET layers whose INPUT residual stream (`hidden + residual` entering
that layer, i.e. the output of layer i-1; id N = the output of the last layer) is captured. Default
`(2, N//2, N-3)`, = (2, 30, 58) for Kimi-K2.5 (N=61). A draft's
`eagle_config.eagle_aux_hidden_state_layer_ids` is read with the rule vLLM, ATOM and SGLang agree on
(REFERENCE §8): the ids are taken as given (pre-layer ids), except when the first id is 1, when they
were written as post-layer outputs by training code and 1 is added to every id: [1, 29, 57] ->
(2, 30, 58), [2, 30, 58] -> (2, 30, 58) (`resolve_aux_ids`). The list is taken literally: capture order
= list order = concatenation order to len(ids) x H; repeated ids are allowed (N=4 gives the default
(2, 2, 1)); every id must lie in [1, N].

Domain checks (every numeric field, errors name the field): floats must be finite; eps in (0, 1);
rope_theta > 1; yarn factor >= 1; sizes > 0 and at most `MAX_SIZES[field]` (sane maxima far above any
released model, so a typo or a hostile config cannot make the loader or a CLI allocate without bound;
the loader then checks the config's parameter count against the bytes the shards really hold).
`rope_parameters` (transformers 5: the rope type, its parameters and `rope_theta` in one object) is
read as `rope_scaling` + `rope_theta`. A yarn config without `mscale_all_dim` means 0 (HF DeepSeek
default): the softmax scale is then not multiplied, and cos/sin are multiplied by mscale(factor, mscale).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

__all__ = [
    "ConfigError", "RopeScaling", "QuantConfig", "DeepseekV3Config", "Eagle3Config",
    "default_aux_layer_ids", "resolve_aux_ids", "parse_aux_ids", "check_aux_ids", "load_config", "parse_config",
    "check_draft_matches_target", "MAX_SIZES", "KNOWN_MODEL_TYPES", "available_memory_bytes",
]


class ConfigError(ValueError):
    """A config field is missing, of the wrong type, or has an unsupported value (message names it)."""


_MISSING = object()


def _get(d: Mapping[str, Any], key: str, where: str, typ: Any, default: Any = _MISSING) -> Any:
    """Read d[key] as `typ` (int/float/bool/str), or default; errors name `where.key`."""
    name = f"{where}.{key}" if where else key
    v = d.get(key, _MISSING)
    if v is _MISSING or v is None:
        if default is _MISSING:
            raise ConfigError(f"config field {name!r} is missing")
        return default
    try:
        if typ is bool:
            if not isinstance(v, bool):
                raise TypeError
            return v
        if typ is int:
            if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
                raise TypeError
            return int(v)
        if typ is float:
            if isinstance(v, bool) or isinstance(v, str):
                raise TypeError
            f = float(v)
            if math.isfinite(f):
                return f
        if typ is str:
            if not isinstance(v, str):
                raise TypeError
            return v
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"config field {name!r} must be {typ.__name__}, got {v!r}") from None
    if typ is float:
        raise ConfigError(f"config field {name!r} must be a finite number, got {v!r}")
    return v


def _positive(v: int, name: str) -> int:
    if v <= 0:
        raise ConfigError(f"config field {name!r} must be > 0, got {v}")
    return _bounded(v, name)


# Sane maxima per field (by the field's last name). They are far above any released model (Kimi-K2.5:
# hidden 7168, 61 layers, 384 experts, vocab 163840, intermediate 18432) and keep every product the
# loader or a CLI forms from them finite and allocatable; a real parameter budget is then checked by
# the loader against the shard bytes (models.loader).
MAX_SIZES: dict[str, int] = {
    "hidden_size": 1 << 17, "target_hidden_size": 1 << 17, "intermediate_size": 1 << 19,
    "moe_intermediate_size": 1 << 19, "num_hidden_layers": 1024, "num_attention_heads": 4096,
    "num_key_value_heads": 4096, "head_dim": 4096, "q_lora_rank": 1 << 16, "kv_lora_rank": 1 << 16,
    "qk_nope_head_dim": 4096, "qk_rope_head_dim": 4096, "v_head_dim": 4096, "n_routed_experts": 1 << 14,
    "num_experts_per_tok": 1 << 14, "n_shared_experts": 1 << 10, "first_k_dense_replace": 1024,
    "moe_layer_freq": 1024, "n_group": 1 << 14, "topk_group": 1 << 14, "vocab_size": 1 << 24,
    "draft_vocab_size": 1 << 24, "max_position_embeddings": (1 << 31) - 1,
    "original_max_position_embeddings": (1 << 31) - 1,
}


def _bounded(v: int, name: str, lo: Optional[int] = None) -> int:
    """v must be <= MAX_SIZES[last part of name] (and >= lo when given); errors name the field."""
    if lo is not None and v < lo:
        raise ConfigError(f"config field {name!r} must be >= {lo}, got {v}")
    hi = MAX_SIZES.get(name.rsplit(".", 1)[-1])
    if hi is not None and v > hi:
        raise ConfigError(f"config field {name!r} = {v} exceeds the sane maximum {hi}")
    return v


def _in_range(v: float, name: str, lo: float, hi: float = math.inf, lo_open: bool = True,
              hi_open: bool = True) -> float:
    """A finite float inside (lo, hi) (bounds open or closed as asked); errors name the field."""
    ok_lo = v > lo if lo_open else v >= lo
    ok_hi = v < hi if hi_open else v <= hi
    if not (ok_lo and ok_hi):
        lb, rb = ("(" if lo_open else "["), (")" if hi_open else "]")
        raise ConfigError(f"config field {name!r} must be in {lb}{lo:g}, {hi:g}{rb}, got {v!r}")
    return v


def available_memory_bytes() -> int:
    """Memory the process may still take (MemAvailable from /proc/meminfo, else physical pages); the
    CLIs bound the counts they allocate by it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return 1 << 34


# ----------------------------------------------------------------------------------------------
# rope scaling


@dataclass(frozen=True)
class RopeScaling:
    """YaRN rope scaling (DeepSeek-V3 style); defaults follow the HF DeepSeek implementation when absent
    (beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 0: a missing mscale_all_dim leaves the softmax
    scale unmultiplied)."""
    type: str = "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @staticmethod
    def parse(d: Optional[Mapping[str, Any]], where: str) -> Optional["RopeScaling"]:
        if d is None:
            return None
        if not isinstance(d, Mapping):
            raise ConfigError(f"config field {where!r} must be an object, got {d!r}")
        typ = d.get("type", d.get("rope_type"))
        if typ is None:
            raise ConfigError(f"config field {where + '.type'!r} (or rope_type) is missing")
        if typ == "default":
            return None
        if typ not in ("yarn", "deepseek_yarn"):
            raise ConfigError(f"config field {where + '.type'!r}: unsupported rope scaling {typ!r} "
                              "(supported: yarn)")
        w = lambda k: f"{where}.{k}"  # noqa: E731
        rs = RopeScaling(
            type="yarn",
            factor=_in_range(_get(d, "factor", where, float), w("factor"), 1.0, lo_open=False),
            original_max_position_embeddings=_positive(_get(d, "original_max_position_embeddings", where, int),
                                                       w("original_max_position_embeddings")),
            beta_fast=_in_range(_get(d, "beta_fast", where, float, 32.0), w("beta_fast"), 0.0),
            beta_slow=_in_range(_get(d, "beta_slow", where, float, 1.0), w("beta_slow"), 0.0),
            mscale=_in_range(_get(d, "mscale", where, float, 1.0), w("mscale"), 0.0, lo_open=False),
            mscale_all_dim=_in_range(_get(d, "mscale_all_dim", where, float, 0.0), w("mscale_all_dim"), 0.0,
                                     lo_open=False),
        )
        return rs


def _rope(d: Mapping[str, Any], where: str, default_theta: float) -> tuple[float, Optional[RopeScaling]]:
    """(rope_theta, rope scaling) from `rope_theta` + `rope_scaling` (transformers 4) or `rope_parameters`
    (transformers 5: the same keys plus `rope_theta` in one object); both spellings must agree."""
    p = lambda k: f"{where}.{k}" if where else k  # noqa: E731
    theta = _get(d, "rope_theta", where, float, None)
    scaling = d.get("rope_scaling")
    params = d.get("rope_parameters")
    rs_where = p("rope_scaling")
    if params is not None:
        if not isinstance(params, Mapping):
            raise ConfigError(f"config field {p('rope_parameters')!r} must be an object, got {params!r}")
        pt = _get(params, "rope_theta", p("rope_parameters"), float, None)
        if pt is not None:
            if theta is not None and theta != pt:
                raise ConfigError(f"config fields {p('rope_theta')!r} ({theta:g}) and "
                                  f"{p('rope_parameters.rope_theta')!r} ({pt:g}) disagree")
            theta = pt
        from_params = {k: v for k, v in params.items() if k != "rope_theta"}
        if "type" not in from_params and "rope_type" not in from_params:
            from_params["rope_type"] = "default"
        if scaling is not None:
            if RopeScaling.parse(scaling, rs_where) != RopeScaling.parse(from_params, p("rope_parameters")):
                raise ConfigError(f"config fields {rs_where!r} and {p('rope_parameters')!r} disagree")
        else:
            scaling, rs_where = from_params, p("rope_parameters")
    theta = default_theta if theta is None else theta
    _in_range(theta, p("rope_theta"), 1.0)
    return theta, RopeScaling.parse(scaling, rs_where)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN attention-magnitude factor: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# ----------------------------------------------------------------------------------------------
# quantization config

_QUARK_PACK = {"reorder": "quark_reorder", "order": "quark_order"}


@dataclass(frozen=True)
class QuantConfig:
    """The checkpoint-level quantization description.

    method: "compressed-tensors" | "quark". The per-tensor format is decided from the tensors present
    (models.formats); this config supplies what tensors cannot tell: the Quark int4 packing
    (`export.pack_method` -> `int4_pack`) and the compressed-tensors group size (cross-check).
    """
    method: str
    int4_pack: Optional[str] = None       # "ct" | "quark_order" | "quark_reorder"
    group_size: Optional[int] = None      # compressed-tensors weights.group_size
    exclude: tuple[str, ...] = ()         # Quark `exclude` / compressed-tensors `ignore` (cross-check only)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def parse(d: Optional[Mapping[str, Any]], where: str) -> Optional["QuantConfig"]:
        if d is None:
            return None
        method = _get(d, "quant_method", where, str)
        if method == "compressed-tensors":
            fmt = _get(d, "format", where, str, "pack-quantized")
            if fmt != "pack-quantized":
                raise ConfigError(f"config field {where + '.format'!r}: unsupported compressed-tensors "
                                  f"format {fmt!r} (supported: pack-quantized)")
            group = None
            for gname, grp in (d.get("config_groups") or {}).items():
                w = (grp or {}).get("weights") or {}
                gw = f"{where}.config_groups.{gname}.weights"
                bits = _get(w, "num_bits", gw, int, 4)
                if bits != 4:
                    raise ConfigError(f"config field {gw + '.num_bits'!r}: only 4-bit is supported, got {bits}")
                if w.get("type", "int") != "int":
                    raise ConfigError(f"config field {gw + '.type'!r}: only int is supported, got {w.get('type')!r}")
                group = _get(w, "group_size", gw, int, group)
            return QuantConfig("compressed-tensors", "ct", group, tuple(d.get("ignore") or ()), dict(d))
        if method == "quark":
            export = d.get("export") or {}
            pm = export.get("pack_method", "reorder")  # Quark's export default
            if pm not in _QUARK_PACK:
                raise ConfigError(f"config field {where + '.export.pack_method'!r}: unknown pack method "
                                  f"{pm!r} (known: {sorted(_QUARK_PACK)})")
            return QuantConfig("quark", _QUARK_PACK[pm], None, tuple(d.get("exclude") or ()), dict(d))
        raise ConfigError(f"config field {where + '.quant_method'!r}: unknown quant method {method!r} "
                          "(supported: compressed-tensors, quark)")


def _find_quant(top: Mapping[str, Any], text: Optional[Mapping[str, Any]]) -> Optional[QuantConfig]:
    """quantization_config inside text_config first, then at top level (REFERENCE §1)."""
    if text is not None and text.get("quantization_config") is not None:
        return QuantConfig.parse(text["quantization_config"], "text_config.quantization_config")
    return QuantConfig.parse(top.get("quantization_config"), "quantization_config")


# ----------------------------------------------------------------------------------------------
# target


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """(2, N//2, N-3): target layers whose INPUT residual stream is captured (module docstring)."""
    return (2, num_layers // 2, num_layers - 3)


def resolve_aux_ids(raw: Sequence[int]) -> tuple[int, ...]:
    """A checkpoint's `eagle_aux_hidden_state_layer_ids` in our convention (module docstring): as given,
    except +1 on every id when the first id is 1 (post-layer ids written by training code)."""
    ids = tuple(int(i) for i in raw)
    return tuple(i + 1 for i in ids) if ids and ids[0] == 1 else ids


def check_aux_ids(ids: Sequence[int], num_layers: int, name: str) -> tuple[int, ...]:
    """Validate capture ids against a target of `num_layers` layers: at least one id, each in [1, N];
    repeated ids are allowed (the list is followed literally). Errors name `name`."""
    ids = tuple(ids)
    if not ids:
        raise ConfigError(f"{name}: no aux layer ids")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= num_layers:
            raise ConfigError(f"{name}: aux layer id {i!r} outside [1, {num_layers}] "
                              f"(ids index the target layer whose INPUT is captured; {num_layers} = the last "
                              "layer's output)")
    return ids


_check_aux = check_aux_ids


def parse_aux_ids(text: str, name: str = "--aux-ids") -> tuple[int, ...]:
    """'2,4,5' -> (2, 4, 5): the CLI spelling of capture ids (our convention, taken as given)."""
    parts = [t.strip() for t in str(text).split(",")]
    try:
        ids = tuple(int(t) for t in parts)
    except ValueError:
        raise ConfigError(f"{name} takes comma-separated layer ids like 2,4,5, got {text!r}") from None
    if not ids or len(ids) > 64:
        raise ConfigError(f"{name} takes 1 to 64 layer ids, got {len(ids)}")
    return ids


@dataclass(frozen=True)
class DeepseekV3Config:
    """DeepSeek-V3 / Kimi-K2.5 text model (MLA + MoE). Field names follow the HF config."""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: Optional[int]            # None: plain q_proj (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Optional[RopeScaling]
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    quantization: Optional[QuantConfig] = None
    architecture: str = "DeepseekV3ForCausalLM"
    model_type: str = "deepseek_v3"
    tensor_prefix: str = ""               # "language_model." for Kimi-K2.5 (nested text_config)
    aux_layer_ids: tuple[int, ...] = ()   # our convention; () = default_aux_layer_ids(N)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per-token latent cache width: kv_lora_rank + qk_rope_head_dim (576 for Kimi)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return (self.n_routed_experts > 0 and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(1 for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    def param_count(self) -> int:
        """Logical parameters the config implies (weights only, MTP layers and vision tower excluded):
        the loader bounds it by the bytes the shards hold, the CLIs by the memory available."""
        H, V, nh = self.hidden_size, self.vocab_size, self.num_attention_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        attn = (H * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * nh * qk if self.q_lora_rank
                else H * nh * qk)
        attn += H * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        attn += self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim) + nh * self.v_head_dim * H
        moe_l = self.num_moe_layers
        dense_l = self.num_hidden_layers - moe_l
        E, M = self.n_routed_experts, self.moe_intermediate_size
        moe = E * 3 * H * M + self.n_shared_experts * 3 * H * M + E * H + E
        n = self.num_hidden_layers * (attn + 2 * H) + dense_l * 3 * H * self.intermediate_size + moe_l * moe
        return n + V * H * (1 if self.tie_word_embeddings else 2) + H

    @property
    def mscale(self) -> float:
        rs = self.rope_scaling
        return 1.0 if rs is None else yarn_get_mscale(rs.factor, rs.mscale_all_dim)

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5 x mscale^2 (REFERENCE §1)."""
        return self.qk_head_dim ** -0.5 * self.mscale ** 2

    @property
    def capture_layer_ids(self) -> tuple[int, ...]:
        """Aux layer ids to capture (our INPUT-of-layer convention), default (2, N//2, N-3)."""
        ids = self.aux_layer_ids or default_aux_layer_ids(self.num_hidden_layers)
        return _check_aux(tuple(ids), self.num_hidden_layers, "aux_layer_ids")

    @staticmethod
    def from_dict(top: Mapping[str, Any]) -> "DeepseekV3Config":
        text = top.get("text_config")
        if text is not None and not isinstance(text, Mapping):
            raise ConfigError("config field 'text_config' must be an object")
        d = text if text is not None else top
        w = "text_config" if text is not None else ""
        arch = (top.get("architectures") or d.get("architectures") or ["DeepseekV3ForCausalLM"])[0]

        def g(k: str, typ: Any, default: Any = _MISSING) -> Any:
            return _get(d, k, w, typ, default)

        def pos(k: str, default: Any = _MISSING) -> int:
            return _positive(g(k, int, default), f"{w}.{k}" if w else k)

        p = lambda k: f"{w}.{k}" if w else k  # noqa: E731
        nonneg = lambda k, default: _bounded(g(k, int, default), p(k), 0)  # noqa: E731
        _check_model_type(top, "model_type", "target")
        if text is not None:
            _check_model_type(text, "text_config.model_type", "target")
        n_experts = nonneg("n_routed_experts", 0)
        q_lora = g("q_lora_rank", int, None)
        theta, rope_scaling = _rope(d, w, 10000.0)
        cfg = DeepseekV3Config(
            hidden_size=pos("hidden_size"),
            num_hidden_layers=pos("num_hidden_layers"),
            num_attention_heads=pos("num_attention_heads"),
            q_lora_rank=None if not q_lora else _positive(q_lora, p("q_lora_rank")),
            kv_lora_rank=pos("kv_lora_rank"),
            qk_nope_head_dim=pos("qk_nope_head_dim"),
            qk_rope_head_dim=pos("qk_rope_head_dim"),
            v_head_dim=pos("v_head_dim"),
            intermediate_size=pos("intermediate_size"),
            moe_intermediate_size=pos("moe_intermediate_size") if n_experts else nonneg("moe_intermediate_size", 0),
            n_routed_experts=n_experts,
            num_experts_per_tok=pos("num_experts_per_tok") if n_experts else nonneg("num_experts_per_tok", 0),
            n_shared_experts=nonneg("n_shared_experts", 0),
            first_k_dense_replace=nonneg("first_k_dense_replace", 0),
            moe_layer_freq=pos("moe_layer_freq", 1),
            n_group=pos("n_group", 1),
            topk_group=pos("topk_group", 1),
            topk_method=g("topk_method", str, "noaux_tc"),
            scoring_func=g("scoring_func", str, "sigmoid"),
            norm_topk_prob=g("norm_topk_prob", bool, True),
            routed_scaling_factor=_in_range(g("routed_scaling_factor", float, 1.0), p("routed_scaling_factor"),
                                            0.0, 1e6),
            rms_norm_eps=_in_range(g("rms_norm_eps", float, 1e-6), p("rms_norm_eps"), 0.0, 1.0),
            vocab_size=pos("vocab_size"),
            tie_word_embeddings=_get(d, "tie_word_embeddings", w, bool,
                                     _get(top, "tie_word_embeddings", "", bool, False)),
            rope_theta=theta,
            max_position_embeddings=pos("max_position_embeddings", 4096),
            rope_scaling=rope_scaling,
            bos_token_id=g("bos_token_id", int, _get(top, "bos_token_id", "", int, None)),
            eos_token_id=_eos(d.get("eos_token_id", top.get("eos_token_id")), p("eos_token_id")),
            pad_token_id=g("pad_token_id", int, _get(top, "pad_token_id", "", int, None)),
            quantization=_find_quant(top, text),
            architecture=arch,
            model_type=str(top.get("model_type", d.get("model_type", "deepseek_v3"))),
            tensor_prefix="language_model." if text is not None else "",
        )
        if n_experts:
            if cfg.num_experts_per_tok > n_experts:
                raise ConfigError(f"config field {p('num_experts_per_tok')!r} ({cfg.num_experts_per_tok}) "
                                  f"exceeds {p('n_routed_experts')!r} ({n_experts})")
            if n_experts % cfg.n_group or cfg.topk_group > cfg.n_group:
                raise ConfigError(f"config fields {p('n_group')!r}={cfg.n_group} / {p('topk_group')!r}="
                                  f"{cfg.topk_group} do not divide {n_experts} experts")
            per_group = n_experts // cfg.n_group
            if cfg.n_group > 1 and per_group < 2:
                raise ConfigError(f"config field {p('n_group')!r}={cfg.n_group}: group-limited routing needs "
                                  f">= 2 experts per group, {n_experts} experts give {per_group}")
            if cfg.num_experts_per_tok > cfg.topk_group * per_group:
                raise ConfigError(f"config field {p('num_experts_per_tok')!r} ({cfg.num_experts_per_tok}) exceeds "
                                  f"the experts of {p('topk_group')!r}={cfg.topk_group} groups "
                                  f"({cfg.topk_group * per_group})")
            if cfg.first_k_dense_replace >= cfg.num_hidden_layers:
                raise ConfigError(f"config field {p('first_k_dense_replace')!r} ({cfg.first_k_dense_replace}) "
                                  f"leaves no MoE layer among {cfg.num_hidden_layers}; set n_routed_experts 0")
        if cfg.scoring_func not in ("sigmoid", "softmax"):
            raise ConfigError(f"config field {p('scoring_func')!r}: unsupported {cfg.scoring_func!r}")
        if cfg.topk_method not in _TOPK_METHODS:
            raise ConfigError(f"config field {p('topk_method')!r}: unsupported {cfg.topk_method!r} "
                              f"(supported: {', '.join(_TOPK_METHODS)})")
        if cfg.qk_rope_head_dim % 2:
            raise ConfigError(f"config field {p('qk_rope_head_dim')!r} must be even (rope rotates pairs), "
                              f"got {cfg.qk_rope_head_dim}")
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(cfg, k)
            if v is not None and not 0 <= v < cfg.vocab_size:
                raise ConfigError(f"config field {p(k)!r} ({v}) is outside the vocab [0, {cfg.vocab_size})")
        return cfg


_TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")

# model_type values of the checkpoints this project reads (REFERENCE §1, §2); a missing model_type is
# allowed, an unknown one is refused by name so another family is not read with the wrong layout
KNOWN_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "target": ("kimi_k25", "kimi_k2", "deepseek_v3", "deepseek_v2"),
    "draft": ("llama", "eagle3", "llama_eagle3", "deepseek_v2", "deepseek_v3", "kimi_k2"),
}


def _check_model_type(d: Mapping[str, Any], name: str, family: str) -> None:
    mt = d.get("model_type")
    if mt is None:
        return
    if mt not in KNOWN_MODEL_TYPES[family]:
        raise ConfigError(f"config field {name!r}: unknown model_type {mt!r} for a {family} "
                          f"(known: {', '.join(KNOWN_MODEL_TYPES[family])})")


def _eos(v: Any, name: str) -> Optional[int]:
    if isinstance(v, list):
        v = v[0] if v else None
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"config field {name!r} must be an int or a list of ints, got {v!r}")
    return v


# ----------------------------------------------------------------------------------------------
# EAGLE-3 drafts


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 draft: one midlayer on concat(embed, fc(aux_0|aux_1|aux_2)).

    kind "mha": Llama midlayer, q/k/v take the 2H concatenation, head_dim from config.
    kind "mla": DeepSeek MLA midlayer (`q_a_proj`, `kv_a_proj_with_mqa` take 2H); mla fields set.
    aux_layer_ids: our convention (module docstring): indices of target layers whose INPUT residual
    stream is captured, `resolve_aux_ids(eagle_config.eagle_aux_hidden_state_layer_ids)`; () = the
    default for the target. aux_ids_config: the ids as the checkpoint wrote them (() when absent).
    vocab_size: the embedding vocab (= target vocab); draft_vocab_size: lm_head rows; d2t maps
    draft id -> target id (target = draft + d2t[draft]) when draft_vocab_size < vocab_size.
    """
    kind: str
    architecture: str
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Optional[RopeScaling]
    aux_layer_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    quantization: Optional[QuantConfig] = None
    aux_ids_config: tuple[int, ...] = ()
    # MLA variant only
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None

    @property
    def qk_head_dim(self) -> int:
        assert self.kind == "mla"
        return self.qk_nope_head_dim + self.qk_rope_head_dim  # type: ignore[operator]

    @property
    def mscale(self) -> float:
        rs = self.rope_scaling
        return 1.0 if rs is None else yarn_get_mscale(rs.factor, rs.mscale_all_dim)

    def param_count(self) -> int:
        """Logical parameters of the draft (embed counted whether stored or taken from the target)."""
        H, V, nh = self.hidden_size, self.vocab_size, self.num_attention_heads
        n = H * 3 * self.target_hidden_size + 5 * H + V * H + 3 * H * self.intermediate_size
        n += 0 if self.tie_word_embeddings else self.draft_vocab_size * H
        if self.kind == "mla":
            q, kv = self.q_lora_rank, self.kv_lora_rank or 0
            nope, rope, v = self.qk_nope_head_dim or 0, self.qk_rope_head_dim or 0, self.v_head_dim or 0
            n += (2 * H * q + q + q * nh * (nope + rope)) if q else 2 * H * nh * (nope + rope)
            n += 2 * H * (kv + rope) + kv + kv * nh * (nope + v) + nh * v * H
        else:
            hd, kvh = self.head_dim, self.num_key_value_heads
            n += 2 * H * (nh + 2 * kvh) * hd + nh * hd * H
        return n

    @property
    def softmax_scale(self) -> float:
        hd = self.qk_head_dim if self.kind == "mla" else self.head_dim
        return hd ** -0.5 * (self.mscale ** 2 if self.kind == "mla" else 1.0)

    def capture_layer_ids(self, num_target_layers: int, override: Optional[Sequence[int]] = None
                          ) -> tuple[int, ...]:
        """The target layers to capture for this draft (our convention), validated against N: `override`
        (e.g. --aux-ids, taken as given) if set, else the config's resolved ids, else the default. fc
        reads 3 x target hidden, so exactly 3 ids (repeats allowed)."""
        if override is not None:
            ids, name = tuple(override), "--aux-ids"
        else:
            ids = self.aux_layer_ids or default_aux_layer_ids(num_target_layers)
            name = "eagle_config.eagle_aux_hidden_state_layer_ids" if self.aux_layer_ids else "default aux ids"
        ids = check_aux_ids(ids, num_target_layers, name)
        if len(ids) != 3:
            raise ConfigError(f"{name}: an EAGLE-3 draft's fc reads 3 aux hidden states, got {len(ids)} ids "
                              f"{list(ids)}")
        return ids

    def aux_ids_origin(self, override: bool = False) -> str:
        """Where capture_layer_ids came from, for reports: the override, the config (and how it was
        read), or the default formula."""
        if override:
            return "--aux-ids (as given)"
        if not self.aux_ids_config:
            return "default (2, N//2, N-3) (no eagle_config.eagle_aux_hidden_state_layer_ids)"
        how = "first id 1: +1 each (post-layer ids)" if self.aux_ids_config[0] == 1 else "as given (pre-layer ids)"
        return f"eagle_config.eagle_aux_hidden_state_layer_ids {list(self.aux_ids_config)}, {how}"

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "Eagle3Config":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch == "LlamaForCausalLMEagle3" or (not arch and "kv_lora_rank" not in d):
            kind = "mha"
        elif arch in ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM") or "kv_lora_rank" in d:
            kind = "mla"
        else:
            raise ConfigError(f"config field 'architectures': unknown EAGLE-3 draft architecture {arch!r}")
        g = lambda k, t, default=_MISSING: _get(d, k, "", t, default)  # noqa: E731
        pos = lambda k, default=_MISSING: _positive(g(k, int, default), k)  # noqa: E731
        _check_model_type(d, "model_type", "draft")
        hidden = pos("hidden_size")
        heads = pos("num_attention_heads")
        vocab = pos("vocab_size")
        eagle = d.get("eagle_config") or {}
        if not isinstance(eagle, Mapping):
            raise ConfigError(f"config field 'eagle_config' must be an object, got {eagle!r}")
        raw_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if raw_ids is not None:
            if not isinstance(raw_ids, list) or not raw_ids or len(raw_ids) > 64 or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_SIZES["num_hidden_layers"]
                    for i in raw_ids):
                raise ConfigError("config field 'eagle_config.eagle_aux_hidden_state_layer_ids' must be a "
                                  f"non-empty list of layer ids (ints >= 0), got {raw_ids!r}")
            raw = tuple(raw_ids)
            aux = resolve_aux_ids(raw)
        else:
            raw, aux = (), ()
        mla: dict[str, Any] = {}
        if kind == "mla":
            q_lora = g("q_lora_rank", int, None)
            mla = dict(q_lora_rank=None if not q_lora else _positive(q_lora, "q_lora_rank"),
                       kv_lora_rank=pos("kv_lora_rank"),
                       qk_nope_head_dim=pos("qk_nope_head_dim"), qk_rope_head_dim=pos("qk_rope_head_dim"),
                       v_head_dim=pos("v_head_dim"))
            head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        else:
            if d.get("head_dim") is None:
                raise ConfigError("config field 'head_dim' is missing (EAGLE-3 MHA drafts must state it; "
                                  "it is not hidden_size / num_attention_heads in general)")
            head_dim = pos("head_dim")
        if (mla.get("qk_rope_head_dim") or head_dim) % 2:
            raise ConfigError(f"config field {'qk_rope_head_dim' if mla else 'head_dim'!r} must be even "
                              "(rope rotates pairs)")
        dv = pos("draft_vocab_size", vocab)
        if dv > vocab:
            raise ConfigError(f"config field 'draft_vocab_size' ({dv}) exceeds 'vocab_size' ({vocab})")
        theta, rope_scaling = _rope(d, "", 10000.0)
        kv_heads = pos("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(f"config field 'num_key_value_heads' ({kv_heads}) must divide "
                              f"'num_attention_heads' ({heads})")
        return Eagle3Config(
            kind=kind, architecture=arch or "LlamaForCausalLMEagle3", hidden_size=hidden,
            target_hidden_size=pos("target_hidden_size", hidden),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim, intermediate_size=pos("intermediate_size"), vocab_size=vocab,
            draft_vocab_size=dv,
            rms_norm_eps=_in_range(g("rms_norm_eps", float, 1e-6), "rms_norm_eps", 0.0, 1.0),
            rope_theta=theta,
            max_position_embeddings=pos("max_position_embeddings", 4096),
            rope_scaling=rope_scaling,
            aux_layer_ids=aux, aux_ids_config=raw, tie_word_embeddings=g("tie_word_embeddings", bool, False),
            quantization=QuantConfig.parse(d.get("quantization_config"), "quantization_config"),
            **mla,
        )


ModelConfig = Union[DeepseekV3Config, Eagle3Config]


def parse_config(d: Mapping[str, Any]) -> ModelConfig:
    """Pick the family from `architectures` / `model_type` / fields and parse it."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"a config must be a JSON object, got {type(d).__name__}")
    archs = d.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"config field 'architectures' must be a list of names, got {archs!r}")
    arch = archs[0] if archs else ""
    if "Eagle3" in arch or "eagle" in str(d.get("model_type", "")).lower() or "eagle_config" in d \
            or ("draft_vocab_size" in d and "text_config" not in d):
        return Eagle3Config.from_dict(d)
    return DeepseekV3Config.from_dict(d)


def load_config(path: Union[str, Path]) -> ModelConfig:
    """Parse `config.json` from a checkpoint directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {p}")
    try:
        with open(p, "rb") as f:
            raw = f.read((1 << 24) + 1)
        if len(raw) > 1 << 24:
            raise ConfigError(f"{p}: larger than 16 MiB; not a model config")
        d = json.loads(raw)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{p}: not a readable JSON config ({e})") from None
    try:
        return parse_config(d)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def check_draft_matches_target(draft: Eagle3Config, target: DeepseekV3Config,
                               aux_ids: Optional[Sequence[int]] = None) -> None:
    """A draft is usable with a target only if fc's input is 3 x target hidden, the vocabs agree and
    the capture ids (`aux_ids` when overridden, else the config's) fit the target's layers."""
    if draft.target_hidden_size != target.hidden_size:
        raise ConfigError(f"draft hidden size mismatch: draft 'target_hidden_size' (fc input / 3) = "
                          f"{draft.target_hidden_size}, target 'hidden_size' = {target.hidden_size}")
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"draft vocab mismatch: draft 'vocab_size' = {draft.vocab_size}, target "
                          f"'vocab_size' = {target.vocab_size}")
    draft.capture_layer_ids(target.num_hidden_layers, aux_ids)
