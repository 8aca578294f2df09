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
that layer, i.e. the output of layer i-1) is captured. Default `(2, N//2, N-3)`, = (2, 30, 58) for
Kimi-K2.5 (N=61). Checkpoints' `eagle_config.eagle_aux_hidden_state_layer_ids` use the other convention
("output of layer j", [1, 29, 57] for Kimi), so they are converted by ADDING 1: ours = config id + 1.
The list is taken literally (capture order = list order = concatenation order to 3H); duplicate ids or
ids outside [1, N] are errors (N=4 would make the default (2, 2, 1): use N >= 8 in fixtures).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

__all__ = [
    "ConfigError", "RopeScaling", "QuantConfig", "DeepseekV3Config", "Eagle3Config",
    "default_aux_layer_ids", "load_config", "parse_config", "check_draft_matches_target",
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
            if isinstance(v, bool):
                raise TypeError
            return float(v)
        if typ is str:
            if not isinstance(v, str):
                raise TypeError
            return v
    except (TypeError, ValueError):
        raise ConfigError(f"config field {name!r} must be {typ.__name__}, got {v!r}") from None
    return v


def _positive(v: int, name: str) -> int:
    if v <= 0:
        raise ConfigError(f"config field {name!r} must be > 0, got {v}")
    return v


# ----------------------------------------------------------------------------------------------
# rope scaling


@dataclass(frozen=True)
class RopeScaling:
    """YaRN rope scaling (DeepSeek-V3 style); defaults follow the reference implementation when absent."""
    type: str = "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

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
        return RopeScaling(
            type="yarn",
            factor=_get(d, "factor", where, float),
            original_max_position_embeddings=_get(d, "original_max_position_embeddings", where, int),
            beta_fast=_get(d, "beta_fast", where, float, 32.0),
            beta_slow=_get(d, "beta_slow", where, float, 1.0),
            mscale=_get(d, "mscale", where, float, 1.0),
            mscale_all_dim=_get(d, "mscale_all_dim", where, float, 1.0),
        )


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


def _check_aux(ids: tuple[int, ...], num_layers: int, name: str) -> tuple[int, ...]:
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{name}: duplicate aux layer ids {list(ids)} (num target layers {num_layers}; "
                          "use N >= 8 or give the ids explicitly)")
    for i in ids:
        if not 1 <= i <= num_layers:
            raise ConfigError(f"{name}: aux layer id {i} outside [1, {num_layers}] "
                              "(ids index the layer whose INPUT is captured)")
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

        n_experts = g("n_routed_experts", int, 0)
        cfg = DeepseekV3Config(
            hidden_size=pos("hidden_size"),
            num_hidden_layers=pos("num_hidden_layers"),
            num_attention_heads=pos("num_attention_heads"),
            q_lora_rank=g("q_lora_rank", int, None),
            kv_lora_rank=pos("kv_lora_rank"),
            qk_nope_head_dim=pos("qk_nope_head_dim"),
            qk_rope_head_dim=pos("qk_rope_head_dim"),
            v_head_dim=pos("v_head_dim"),
            intermediate_size=pos("intermediate_size"),
            moe_intermediate_size=pos("moe_intermediate_size") if n_experts else g("moe_intermediate_size", int, 0),
            n_routed_experts=n_experts,
            num_experts_per_tok=pos("num_experts_per_tok") if n_experts else g("num_experts_per_tok", int, 0),
            n_shared_experts=g("n_shared_experts", int, 0),
            first_k_dense_replace=g("first_k_dense_replace", int, 0),
            moe_layer_freq=pos("moe_layer_freq", 1),
            n_group=pos("n_group", 1),
            topk_group=pos("topk_group", 1),
            topk_method=g("topk_method", str, "noaux_tc"),
            scoring_func=g("scoring_func", str, "sigmoid"),
            norm_topk_prob=g("norm_topk_prob", bool, True),
            routed_scaling_factor=g("routed_scaling_factor", float, 1.0),
            rms_norm_eps=g("rms_norm_eps", float, 1e-6),
            vocab_size=pos("vocab_size"),
            tie_word_embeddings=_get(d, "tie_word_embeddings", w, bool,
                                     _get(top, "tie_word_embeddings", "", bool, False)),
            rope_theta=g("rope_theta", float, 10000.0),
            max_position_embeddings=pos("max_position_embeddings", 4096),
            rope_scaling=RopeScaling.parse(d.get("rope_scaling"), f"{w}.rope_scaling" if w else "rope_scaling"),
            bos_token_id=g("bos_token_id", int, _get(top, "bos_token_id", "", int, None)),
            eos_token_id=_eos(d.get("eos_token_id", top.get("eos_token_id"))),
            pad_token_id=g("pad_token_id", int, _get(top, "pad_token_id", "", int, None)),
            quantization=_find_quant(top, text),
            architecture=arch,
            model_type=str(top.get("model_type", d.get("model_type", "deepseek_v3"))),
            tensor_prefix="language_model." if text is not None else "",
        )
        p = lambda k: f"{w}.{k}" if w else k  # noqa: E731
        if n_experts:
            if cfg.num_experts_per_tok > n_experts:
                raise ConfigError(f"config field {p('num_experts_per_tok')!r} ({cfg.num_experts_per_tok}) "
                                  f"exceeds {p('n_routed_experts')!r} ({n_experts})")
            if n_experts % cfg.n_group or cfg.topk_group > cfg.n_group:
                raise ConfigError(f"config fields {p('n_group')!r}={cfg.n_group} / {p('topk_group')!r}="
                                  f"{cfg.topk_group} do not divide {n_experts} experts")
        if cfg.scoring_func not in ("sigmoid", "softmax"):
            raise ConfigError(f"config field {p('scoring_func')!r}: unsupported {cfg.scoring_func!r}")
        return cfg


def _eos(v: Any) -> Optional[int]:
    if isinstance(v, list):
        return int(v[0]) if v else None
    return None if v is None else int(v)


# ----------------------------------------------------------------------------------------------
# EAGLE-3 drafts


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 draft: one midlayer on concat(embed, fc(aux_0|aux_1|aux_2)).

    kind "mha": Llama midlayer, q/k/v take the 2H concatenation, head_dim from config.
    kind "mla": DeepSeek MLA midlayer (`q_a_proj`, `kv_a_proj_with_mqa` take 2H); mla fields set.
    aux_layer_ids: our convention (module docstring): indices of target layers whose INPUT residual
    stream is captured; `eagle_config.eagle_aux_hidden_state_layer_ids` + 1; () = default for the target.
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

    @property
    def softmax_scale(self) -> float:
        hd = self.qk_head_dim if self.kind == "mla" else self.head_dim
        return hd ** -0.5 * (self.mscale ** 2 if self.kind == "mla" else 1.0)

    def capture_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers to capture for this draft (our convention), validated against N."""
        ids = self.aux_layer_ids or default_aux_layer_ids(num_target_layers)
        return _check_aux(tuple(ids), num_target_layers, "eagle_config.eagle_aux_hidden_state_layer_ids")

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
        hidden = pos("hidden_size")
        heads = pos("num_attention_heads")
        vocab = pos("vocab_size")
        eagle = d.get("eagle_config") or {}
        raw_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if raw_ids is not None:
            if not isinstance(raw_ids, list) or not all(isinstance(i, int) for i in raw_ids):
                raise ConfigError("config field 'eagle_config.eagle_aux_hidden_state_layer_ids' must be a "
                                  f"list of ints, got {raw_ids!r}")
            aux = tuple(i + 1 for i in raw_ids)  # "+1 convention" -> INPUT-of-layer ids
        else:
            aux = ()
        mla: dict[str, Any] = {}
        if kind == "mla":
            mla = dict(q_lora_rank=g("q_lora_rank", int, None), kv_lora_rank=pos("kv_lora_rank"),
                       qk_nope_head_dim=pos("qk_nope_head_dim"), qk_rope_head_dim=pos("qk_rope_head_dim"),
                       v_head_dim=pos("v_head_dim"))
            head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        else:
            if d.get("head_dim") is None:
                raise ConfigError("config field 'head_dim' is missing (EAGLE-3 MHA drafts must state it; "
                                  "it is not hidden_size / num_attention_heads in general)")
            head_dim = pos("head_dim")
        dv = pos("draft_vocab_size", vocab)
        if dv > vocab:
            raise ConfigError(f"config field 'draft_vocab_size' ({dv}) exceeds 'vocab_size' ({vocab})")
        return Eagle3Config(
            kind=kind, architecture=arch or "LlamaForCausalLMEagle3", hidden_size=hidden,
            target_hidden_size=pos("target_hidden_size", hidden),
            num_attention_heads=heads,
            num_key_value_heads=pos("num_key_value_heads", heads),
            head_dim=head_dim, intermediate_size=pos("intermediate_size"), vocab_size=vocab,
            draft_vocab_size=dv, rms_norm_eps=g("rms_norm_eps", float, 1e-6),
            rope_theta=g("rope_theta", float, 10000.0),
            max_position_embeddings=pos("max_position_embeddings", 4096),
            rope_scaling=RopeScaling.parse(d.get("rope_scaling"), "rope_scaling"),
            aux_layer_ids=aux, tie_word_embeddings=g("tie_word_embeddings", bool, False),
            quantization=QuantConfig.parse(d.get("quantization_config"), "quantization_config"),
            **mla,
        )


ModelConfig = Union[DeepseekV3Config, Eagle3Config]


def parse_config(d: Mapping[str, Any]) -> ModelConfig:
    """Pick the family from `architectures` / `model_type` / fields and parse it."""
    archs = d.get("architectures") or []
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
    if not p.exists():
        raise FileNotFoundError(f"no config.json at {p}")
    with open(p) as f:
        return parse_config(json.load(f))


def check_draft_matches_target(draft: Eagle3Config, target: DeepseekV3Config) -> None:
    """A draft is usable with a target only if fc's input is 3 x target hidden and the vocabs agree."""
    if draft.target_hidden_size != target.hidden_size:
        raise ConfigError(f"draft hidden size mismatch: draft 'target_hidden_size' (fc input / 3) = "
                          f"{draft.target_hidden_size}, target 'hidden_size' = {target.hidden_size}")
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"draft vocab mismatch: draft 'vocab_size' = {draft.vocab_size}, target "
                          f"'vocab_size' = {target.vocab_size}")
    draft.capture_layer_ids(target.num_hidden_layers)
