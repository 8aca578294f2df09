"""Tiny checkpoints with the real key names, dtypes, packing and config layout (REFERENCE §1-3).

CLI:  python -m models.fixtures --kind KIND --out DIR [--seed S] [--hidden 64 --layers 8 ...]
API:  write_fixture(kind, out_dir, seed=0, **sizes) -> Path
      build_fixture(kind, seed=0, **sizes) -> Fixture (config dict, stored tensors, and `reference`:
      the float32 weight every loaded tensor stands for, keyed by the loader's normalized names)

Kinds:
  kimi-k25        Kimi-K2.5 layout: top-level KimiK25ForConditionalGeneration config with `text_config`
                  (quantization_config inside it), `language_model.` prefix, a few vision tensors
                  (skipped by the loader), routed experts compressed-tensors INT4 group 32, rest BF16,
                  `e_score_correction_bias` F32.
  kimi-k25-bf16   the same, all dense BF16, no quantization_config.
  kimi-k25-w4a8   AMD Quark W4A8 experts: `weight` int32 (reorder), `weight_scale` F32 [] (a power of
                  two, so the folded scale is exact), `weight_scale_2` F32 [out]; quantization_config
                  at top level.
  kimi-k25-mxfp4  AMD Quark MXFP4 (OCP MX, as amd/Kimi-K2.5-MXFP4): routed experts and routers `weight`
                  uint8 [out, in/2] (two E2M1 codes per byte) + `weight_scale` uint8 E8M0 [out, in/32];
                  activations dynamic MXFP4 per 32 (`input_tensors`); quantization_config at top level.
  eagle3          LlamaForCausalLMEagle3, BF16, pruned draft vocab with `d2t`/`t2d`, head_dim from
                  config (!= hidden/heads), GQA.
  eagle3-fp8      Quark ptpc FP8 on the seven midlayer projections; fc/lm_head/embed/norms F16; full
                  draft vocab; stored with `layers.0.` instead of `midlayer.`.
  eagle3-int4     Quark INT4 per-channel on the seven projections (`--pack-method reorder|order`).
  eagle3-mla      Eagle3DeepseekV2ForCausalLM: MLA midlayer taking the 2H concatenation.
Target kinds optionally get a Kimi-layout tokenizer (`--tokenizer`, `write_tokenizer`): a
`tiktoken.model` with the 256 bytes and BPE merges learnt on a fixed text (vocab - 256 ranks), then the
256 special ids, named in `tokenizer_config.json` at the config's bos / eos / pad ids.
Drafts carry `eagle_config.eagle_aux_hidden_state_layer_ids = [1, L//2 - 1, L - 4]` ("+1" checkpoint
convention) for a target of L = --layers layers, i.e. (2, L//2, L-3) in ours (models.config).
Values are deterministic for a seed (torch.Generator); int4 values cover the whole [-8, 7] grid.

Directories: a fixture directory carries `.kdsl-fixture`, written first as "incomplete" and rewritten
last (atomically) with the SHA-256 of every file: `verify_fixture` tells a complete fixture from a
partial or corrupt one (a killed writer, an edited shard), and a new write into a directory clears
the files of the fixture it held before (no stale shard survives). A non-empty directory without the
marker is someone else's and is refused. Sizes are bounded: every count >= 1, and the estimated
memory of the build (8 bytes per parameter: stored copy, f32 reference, temporaries) at most
min(8 GiB, half the available memory).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors.torch import save_file

from ops.packing import pack_int4

__all__ = ["KINDS", "DEFAULT_SIZES", "Fixture", "build_fixture", "write_fixture", "save_fixture", "write_tokenizer",
           "verify_fixture", "FixtureError", "MARKER", "main"]


class FixtureError(ValueError):
    """A fixture cannot be built or written as asked (message names the option or the directory)."""


MARKER = ".kdsl-fixture"

KINDS = ("kimi-k25", "kimi-k25-bf16", "kimi-k25-w4a8", "kimi-k25-mxfp4", "eagle3", "eagle3-fp8", "eagle3-int4", "eagle3-mla")

DEFAULT_SIZES: dict[str, Any] = dict(
    hidden=64, layers=8, experts=16, topk=4, n_group=1, topk_group=1, moe_intermediate=32,
    intermediate=128, vocab=512, heads=4, kv_lora=32, q_lora=48, rope_dim=16, nope_dim=32, v_dim=32,
    kv_heads=2, head_dim=32, draft_intermediate=128, draft_vocab=256, group=32, shards=2,
    pack_method="reorder",
)


@dataclass
class Fixture:
    kind: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]                       # stored name -> stored tensor
    reference: dict[str, torch.Tensor] = field(default_factory=dict)   # loader name -> f32 logical value

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class _Gen:
    """Deterministic tensor factory writing the stored tensors and their f32 reference."""

    def __init__(self, seed: int, prefix: str, fx: Fixture):
        self.g = torch.Generator().manual_seed(seed)
        self.prefix = prefix
        self.fx = fx

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g)

    def _put(self, ref_name: str, stored_name: Optional[str], t: torch.Tensor) -> None:
        self.fx.tensors[self.prefix + (stored_name or ref_name)] = t.contiguous()

    def dense(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16,
              std: Optional[float] = None, stored: Optional[str] = None) -> None:
        std = std if std is not None else shape[-1] ** -0.5
        t = (self._randn(*shape) * std).to(dtype)
        self._put(name, stored, t)
        self.fx.reference[name] = t.float()

    def norm(self, name: str, n: int, dtype: torch.dtype = torch.bfloat16, stored: Optional[str] = None) -> None:
        t = (1.0 + 0.1 * self._randn(n)).to(dtype)
        self._put(name, stored, t)
        self.fx.reference[name] = t.float()

    def _q(self, n: int, k: int) -> torch.Tensor:
        return torch.randint(-8, 8, (n, k), generator=self.g, dtype=torch.int8)

    def _scale(self, *shape: int, k: int) -> torch.Tensor:
        return (0.5 + torch.rand(*shape, generator=self.g)) * (k ** -0.5) / 4.0

    def ct_int4(self, base: str, n: int, k: int, group: int) -> None:
        q = self._q(n, k)
        scale = self._scale(n, k // group, k=k).to(torch.bfloat16)
        self._put("", base + ".weight_packed", pack_int4(q, "ct"))
        self._put("", base + ".weight_scale", scale)
        self._put("", base + ".weight_shape", torch.tensor([n, k], dtype=torch.int32))
        self.fx.reference[base + ".weight"] = (q.float().reshape(n, k // group, group)
                                              * scale.float()[:, :, None]).reshape(n, k)

    def quark_int4(self, base: str, n: int, k: int, pack: str, stored: Optional[str] = None) -> None:
        q = self._q(n, k)
        scale = self._scale(n, k=k).float()
        sb = stored or base
        self._put("", sb + ".weight", pack_int4(q, pack))
        self._put("", sb + ".weight_scale", scale)
        self.fx.reference[base + ".weight"] = q.float() * scale[:, None]

    def quark_w4a8(self, base: str, n: int, k: int) -> None:
        q = self._q(n, k)
        s1 = torch.tensor(2.0 ** -3, dtype=torch.float32)          # per-tensor stage (power of two)
        s2 = self._scale(n, k=k).float() * 8.0
        self._put("", base + ".weight", pack_int4(q, "quark_reorder"))
        self._put("", base + ".weight_scale", s1)
        self._put("", base + ".weight_scale_2", s2)
        self.fx.reference[base + ".weight"] = q.float() * (s2 * s1)[:, None]

    def quark_fp8(self, base: str, n: int, k: int, stored: Optional[str] = None) -> None:
        w = (self._randn(n, k) * 2.0).to(torch.float8_e4m3fn)
        w.view(torch.int8)[0, 0] = -128                        # a -0.0 (0x80): must become +0 in fnuz
        scale = self._scale(n, k=k).float()
        sb = stored or base
        self._put("", sb + ".weight", w)
        self._put("", sb + ".weight_scale", scale)
        self.fx.reference[base + ".weight"] = w.float() * scale[:, None]

    def quark_mxfp4(self, base: str, n: int, k: int) -> None:
        """Quark MXFP4: uint8 [n, k/2] (two E2M1 codes per byte, low nibble first) + uint8 E8M0 [n, k/32].
        Every code occurs; scales 2^(e-127) around k^-0.5 / 4 so values have the dense weights' size."""
        from ops.mxfp4 import dequant_mxfp4_ref, pack_fp4

        codes = torch.randint(0, 16, (n, k), generator=self.g, dtype=torch.uint8)
        e0 = 127 + round(math.log2(k ** -0.5 / 4.0))
        scale = (e0 + torch.randint(-1, 2, (n, k // 32), generator=self.g)).to(torch.uint8)
        packed = pack_fp4(codes)
        self._put("", base + ".weight", packed)
        self._put("", base + ".weight_scale", scale)
        self.fx.reference[base + ".weight"] = dequant_mxfp4_ref(packed, scale)


# ----------------------------------------------------------------------------------------------
# configs


def _text_config(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": s["hidden"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["heads"], "q_lora_rank": s["q_lora"], "kv_lora_rank": s["kv_lora"],
        "qk_nope_head_dim": s["nope_dim"], "qk_rope_head_dim": s["rope_dim"], "v_head_dim": s["v_dim"],
        "intermediate_size": s["intermediate"], "moe_intermediate_size": s["moe_intermediate"],
        "n_routed_experts": s["experts"], "num_experts_per_tok": s["topk"], "n_shared_experts": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": s["n_group"], "topk_group": s["topk_group"],
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.827, "rms_norm_eps": 1e-5, "vocab_size": s["vocab"],
        "tie_word_embeddings": False, "rope_theta": 50000.0, "max_position_embeddings": 262144,
        # beta_fast / beta_slow absent on purpose: the parser's defaults (32 / 1) apply
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        "bos_token_id": s["vocab"] - 12, "eos_token_id": s["vocab"] - 11, "pad_token_id": s["vocab"] - 1,
        "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
    }


def _ct_quant(group: int) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": group, "dynamic": False,
                                                  "actorder": None, "observer": "minmax"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": None,
    }


def _quark_quant(weight: Any, inputs: Any, exclude: list[str], pack_method: str) -> dict[str, Any]:
    return {
        "quant_method": "quark", "quant_mode": "eager_mode", "version": "0.10",
        "global_quant_config": {"weight": weight, "input_tensors": inputs, "output_tensors": None, "bias": None},
        "layer_quant_config": {}, "layer_type_quant_config": {}, "exclude": exclude,
        "export": {"pack_method": pack_method, "weight_format": "real_quantized", "kv_cache_group": [],
                   "min_kv_scale": 0.0, "weight_merge_groups": None},
    }


_INT4_PC = {"dtype": "int4", "qscheme": "per_channel", "ch_axis": 0, "is_dynamic": False, "symmetric": True,
            "group_size": None, "round_method": "half_even", "scale_type": "float"}
_FP8_PT = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True}
_FP8_PC = {"dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": 0, "is_dynamic": False, "symmetric": True}
_MXFP4_SPEC = {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1, "group_size": 32, "is_dynamic": False,
               "symmetric": None, "round_method": "half_even", "scale_type": "float", "scale_format": "e8m0",
               "scale_calculation_mode": "even", "mx_element_dtype": None, "observer_cls": "PerBlockMXObserver"}
_FP8_PTOK = {"dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": 1, "is_dynamic": True, "symmetric": True}


# ----------------------------------------------------------------------------------------------
# builders


def _build_target(kind: str, s: dict[str, Any], seed: int) -> Fixture:
    text = _text_config(s)
    top: dict[str, Any] = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"model_type": "moonvit", "hidden_size": 32, "patch_size": 4},
        "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"], "tie_word_embeddings": False,
    }
    if kind == "kimi-k25":
        text["quantization_config"] = _ct_quant(s["group"])
    elif kind == "kimi-k25-w4a8":
        top["quantization_config"] = _quark_quant(
            [_FP8_PT, _INT4_PC], None,
            ["lm_head", "*self_attn*", "*shared_experts*", "*mlp.gate", "model.layers.0.mlp.*"], "reorder")
    elif kind == "kimi-k25-mxfp4":
        # AMD's MXFP4 recipe: routed experts and routers MXFP4, activations MXFP4 per 32 (dynamic)
        top["quantization_config"] = _quark_quant(
            _MXFP4_SPEC, {**_MXFP4_SPEC, "is_dynamic": True},
            ["lm_head", "*self_attn*", "*shared_experts*", "model.layers.0.mlp.*", "vision_tower*",
             "mm_projector*"], "reorder")
    fx = Fixture(kind, top, {})
    g = _Gen(seed, "language_model.", fx)
    H, V, heads = s["hidden"], s["vocab"], s["heads"]
    nope, rope, v = s["nope_dim"], s["rope_dim"], s["v_dim"]
    g.dense("model.embed_tokens.weight", (V, H), std=1.0)
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        g.norm(p + "input_layernorm.weight", H)
        g.norm(p + "post_attention_layernorm.weight", H)
        a = p + "self_attn."
        g.dense(a + "q_a_proj.weight", (s["q_lora"], H))
        g.norm(a + "q_a_layernorm.weight", s["q_lora"])
        g.dense(a + "q_b_proj.weight", (heads * (nope + rope), s["q_lora"]))
        g.dense(a + "kv_a_proj_with_mqa.weight", (s["kv_lora"] + rope, H))
        g.norm(a + "kv_a_layernorm.weight", s["kv_lora"])
        g.dense(a + "kv_b_proj.weight", (heads * (nope + v), s["kv_lora"]))
        g.dense(a + "o_proj.weight", (H, heads * v))
        if i == 0:
            for nm, shp in (("gate_proj", (s["intermediate"], H)), ("up_proj", (s["intermediate"], H)),
                            ("down_proj", (H, s["intermediate"]))):
                g.dense(f"{p}mlp.{nm}.weight", shp)
            continue
        E, M = s["experts"], s["moe_intermediate"]
        if kind == "kimi-k25-mxfp4":
            g.quark_mxfp4(p + "mlp.gate", E, H)
        else:
            g.dense(p + "mlp.gate.weight", (E, H))
        g.dense(p + "mlp.gate.e_score_correction_bias", (E,), dtype=torch.float32, std=0.01)
        for nm, shp in (("gate_proj", (M, H)), ("up_proj", (M, H)), ("down_proj", (H, M))):
            g.dense(f"{p}mlp.shared_experts.{nm}.weight", shp)
        for e in range(E):
            for nm, (n, k) in (("gate_proj", (M, H)), ("up_proj", (M, H)), ("down_proj", (H, M))):
                base = f"{p}mlp.experts.{e}.{nm}"
                if kind == "kimi-k25":
                    g.ct_int4(base, n, k, s["group"])
                elif kind == "kimi-k25-w4a8":
                    g.quark_w4a8(base, n, k)
                elif kind == "kimi-k25-mxfp4":
                    g.quark_mxfp4(base, n, k)
                else:
                    g.dense(base + ".weight", (n, k))
    g.norm("model.norm.weight", H)
    g.dense("lm_head.weight", (V, H))
    # vision tower / projector: stored without the language_model. prefix, skipped by the loader
    vg = _Gen(seed + 1, "", Fixture(kind, {}, fx.tensors))
    vg.dense("vision_tower.patch_embed.proj.weight", (32, 48))
    vg.dense("mm_projector.proj.0.weight", (H, 32))
    return fx


def _draft_config(kind: str, s: dict[str, Any]) -> dict[str, Any]:
    H, V, L = s["hidden"], s["vocab"], s["layers"]
    dv = s["draft_vocab"] if kind == "eagle3" else V
    cfg: dict[str, Any] = {
        "hidden_size": H, "num_attention_heads": s["heads"], "num_hidden_layers": 1,
        "intermediate_size": s["draft_intermediate"], "vocab_size": V, "draft_vocab_size": dv,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "float16" if kind == "eagle3-fp8" else "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, L // 2 - 1, L - 4], "use_aux_hidden_state": True},
        "bos_token_id": V - 12, "eos_token_id": V - 11, "pad_token_id": V - 1,
    }
    if kind == "eagle3-mla":
        cfg.update({"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                    "q_lora_rank": s["q_lora"], "kv_lora_rank": s["kv_lora"], "qk_nope_head_dim": s["nope_dim"],
                    "qk_rope_head_dim": s["rope_dim"], "v_head_dim": s["v_dim"], "num_key_value_heads": s["heads"],
                    "rope_theta": 50000.0,
                    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}})
    else:
        cfg.update({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                    "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "rope_theta": 1000000.0,
                    "rope_scaling": None})
    excl = ["fc", "lm_head", "embed_tokens"]
    if kind == "eagle3-fp8":
        cfg["quantization_config"] = _quark_quant(_FP8_PC, _FP8_PTOK, excl, "reorder")
    elif kind == "eagle3-int4":
        cfg["quantization_config"] = _quark_quant(_INT4_PC, None, excl, s["pack_method"])
    return cfg


def _build_draft(kind: str, s: dict[str, Any], seed: int) -> Fixture:
    H, V = s["hidden"], s["vocab"]
    if s["layers"] < 8:
        raise FixtureError(f"--layers (target layers) must be >= 8 for drafts' aux ids, got {s['layers']}")
    dv = s["draft_vocab"] if kind == "eagle3" else V
    cfg = _draft_config(kind, s)
    dense_dt = torch.float16 if kind == "eagle3-fp8" else torch.bfloat16
    fx = Fixture(kind, cfg, {})
    g = _Gen(seed, "", fx)
    st = (lambda n: n.replace("midlayer.", "layers.0.", 1)) if kind == "eagle3-fp8" else (lambda n: n)

    def lin(name: str, n: int, k: int) -> None:
        base = name[: -len(".weight")]
        if kind == "eagle3-fp8":
            g.quark_fp8(base, n, k, stored=st(base))
        elif kind == "eagle3-int4":
            pack = {"reorder": "quark_reorder", "order": "quark_order"}.get(s["pack_method"])
            if pack is None:
                raise ValueError(f"--pack-method must be reorder or order, got {s['pack_method']!r}")
            g.quark_int4(base, n, k, pack)
        else:
            g.dense(name, (n, k), dtype=dense_dt, stored=st(name))

    g.dense("embed_tokens.weight", (V, H), dtype=dense_dt, std=1.0)
    g.dense("fc.weight", (H, 3 * H), dtype=dense_dt)
    for nm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        g.norm(f"midlayer.{nm}.weight", H, dtype=dense_dt, stored=st(f"midlayer.{nm}.weight"))
    a = "midlayer.self_attn."
    if kind == "eagle3-mla":
        heads, nope, rope, v = s["heads"], s["nope_dim"], s["rope_dim"], s["v_dim"]
        lin(a + "q_a_proj.weight", s["q_lora"], 2 * H)
        g.norm(a + "q_a_layernorm.weight", s["q_lora"])
        lin(a + "q_b_proj.weight", heads * (nope + rope), s["q_lora"])
        lin(a + "kv_a_proj_with_mqa.weight", s["kv_lora"] + rope, 2 * H)
        g.norm(a + "kv_a_layernorm.weight", s["kv_lora"])
        lin(a + "kv_b_proj.weight", heads * (nope + v), s["kv_lora"])
        lin(a + "o_proj.weight", H, heads * v)
    else:
        hd = s["head_dim"]
        lin(a + "q_proj.weight", s["heads"] * hd, 2 * H)
        lin(a + "k_proj.weight", s["kv_heads"] * hd, 2 * H)
        lin(a + "v_proj.weight", s["kv_heads"] * hd, 2 * H)
        lin(a + "o_proj.weight", H, s["heads"] * hd)
    I = s["draft_intermediate"]  # noqa: E741
    lin("midlayer.mlp.gate_proj.weight", I, H)
    lin("midlayer.mlp.up_proj.weight", I, H)
    lin("midlayer.mlp.down_proj.weight", H, I)
    g.norm("norm.weight", H, dtype=dense_dt)
    g.dense("lm_head.weight", (dv, H), dtype=dense_dt)
    if dv != V:
        # a pruned vocab: draft id i -> target id t2d-selected, stored as the offset d2t[i] = target - i
        perm = torch.randperm(V, generator=g.g)[:dv].sort().values
        d2t = perm - torch.arange(dv)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[perm] = True
        fx.tensors["d2t"] = d2t.to(torch.int64)
        fx.tensors["t2d"] = t2d
        fx.reference["d2t"] = d2t.float()
        fx.reference["t2d"] = t2d.float()
    return fx


_MAX_FIXTURE_BYTES = 8 << 30
_FLAG_MAX = {"layers": 1024, "vocab": 1 << 24, "draft_vocab": 1 << 24, "shards": 256}


def _check_sizes(kind: str, s: dict[str, Any]) -> None:
    """Every size option in its domain, and the build's memory estimate within bounds (module docstring);
    errors name the CLI flag."""
    from models.config import ConfigError, available_memory_bytes, parse_config

    flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    if s["pack_method"] not in ("reorder", "order"):
        raise FixtureError(f"--pack-method must be reorder or order, got {s['pack_method']!r}")
    for k, v in s.items():
        if k == "pack_method":
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise FixtureError(f"{flag(k)} must be an integer, got {v!r}")
        if v < 1:
            raise FixtureError(f"{flag(k)} must be >= 1, got {v}")
        hi = _FLAG_MAX.get(k, 1 << 20)
        if v > hi:
            raise FixtureError(f"{flag(k)} must be <= {hi}, got {v}")
    if s["layers"] < 2:
        raise FixtureError(f"--layers must be >= 2 (dense layer 0 + MoE), got {s['layers']}")
    if s["hidden"] % 32 or s["moe_intermediate"] % 32:
        raise FixtureError("--hidden and --moe-intermediate must be multiples of 32 (int4 group 32)")
    for k in ("hidden", "moe_intermediate", "intermediate", "draft_intermediate"):
        if s[k] % s["group"]:
            raise FixtureError(f"--group ({s['group']}) must divide --{k.replace('_', '-')} ({s[k]})")
    if s["group"] % 8:
        raise FixtureError(f"--group must be a multiple of 8 (8 int4 values per word), got {s['group']}")
    for k in ("rope_dim", "head_dim"):
        if s[k] % 2:
            raise FixtureError(f"--{k.replace('_', '-')} must be even (rope rotates pairs), got {s[k]}")
    if s["vocab"] < 16:
        raise FixtureError(f"--vocab must be >= 16 (bos / eos / pad sit at the top ids), got {s['vocab']}")
    if kind == "eagle3" and s["draft_vocab"] > s["vocab"]:
        raise FixtureError(f"--draft-vocab ({s['draft_vocab']}) must be <= --vocab ({s['vocab']})")
    if s["heads"] % s["kv_heads"]:
        raise FixtureError(f"--kv-heads ({s['kv_heads']}) must divide --heads ({s['heads']})")
    if kind.startswith("kimi"):
        if s["topk"] > s["experts"]:
            raise FixtureError(f"--topk ({s['topk']}) must be <= --experts ({s['experts']})")
        if s["experts"] % s["n_group"] or s["topk_group"] > s["n_group"]:
            raise FixtureError(f"--n-group ({s['n_group']}) must divide --experts ({s['experts']}) and be >= "
                               f"--topk-group ({s['topk_group']})")
    try:
        cfg = parse_config(_text_config(s) if kind.startswith("kimi") else _draft_config(kind, s))
    except ConfigError as e:
        raise FixtureError(f"the sizes make an invalid config: {e}") from None
    need = 8 * cfg.param_count()
    budget = min(_MAX_FIXTURE_BYTES, available_memory_bytes() // 2)
    if need > budget:
        raise FixtureError(f"the sizes make a {cfg.param_count():,}-parameter model (~{need / 2 ** 30:.1f} GiB to "
                           f"build), over the fixture budget of {budget / 2 ** 30:.1f} GiB; lower --layers, "
                           "--hidden, --experts or --vocab")


def build_fixture(kind: str, seed: int = 0, **sizes: Any) -> Fixture:
    """The tensors, config and f32 reference of a tiny checkpoint (nothing written)."""
    if kind not in KINDS:
        raise FixtureError(f"unknown fixture kind {kind!r}; known: {', '.join(KINDS)}")
    unknown = set(sizes) - set(DEFAULT_SIZES)
    if unknown:
        raise FixtureError(f"unknown size option(s) {sorted(unknown)}; known: {sorted(DEFAULT_SIZES)}")
    s = {**DEFAULT_SIZES, **sizes}
    if not kind.startswith("kimi") and isinstance(s["layers"], int) and s["layers"] < 8:
        raise FixtureError(f"--layers (target layers) must be >= 8 for drafts' aux ids, got {s['layers']}")
    _check_sizes(kind, s)
    return _build_target(kind, s, seed) if kind.startswith("kimi") else _build_draft(kind, s, seed)


# ----------------------------------------------------------------------------------------------
# writing: marker, clearing, verification


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_marker(out: Path, doc: dict[str, Any]) -> None:
    """Atomic: a reader sees the old marker or the new one, never half of one."""
    tmp = out / (MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / MARKER)


def _prepare_dir(out: Path, kind: str) -> None:
    """Make `out` an empty fixture directory: create it, or clear the files of the fixture it held
    (marked); refuse a non-empty directory without the marker (someone else's files)."""
    if out.exists() and not out.is_dir():
        raise FixtureError(f"--out {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    entries = [e for e in out.iterdir()]
    if entries and not (out / MARKER).is_file():
        raise FixtureError(f"--out {out}: directory is not empty and holds no {MARKER} marker (not a fixture "
                           "directory); give an empty or new directory")
    for e in entries:
        if e.is_symlink() or e.is_file():
            e.unlink()
        elif e.is_dir():
            raise FixtureError(f"--out {out}: holds a subdirectory {e.name!r}; a fixture directory has only files")
    _write_marker(out, {"kind": kind, "complete": False})


def _finalize(out: Path, kind: Optional[str] = None) -> None:
    """Write the completion marker last: the kind and the SHA-256 of every file."""
    if kind is None:
        try:
            kind = json.loads((out / MARKER).read_text()).get("kind")
        except (OSError, ValueError, AttributeError):
            kind = None
    files = {p.name: _sha256(p) for p in sorted(out.iterdir()) if p.is_file() and not p.name.startswith(MARKER)}
    _write_marker(out, {"kind": kind, "complete": True, "files": files})


def verify_fixture(out_dir: Union[str, Path], kind: Optional[str] = None) -> Optional[str]:
    """None when `out_dir` holds a complete fixture (of `kind` if given) whose files all match the hashes
    of its marker and no other file; else the reason (missing / incomplete / changed / extra file)."""
    out = Path(out_dir)
    try:
        doc = json.loads((out / MARKER).read_text())
    except FileNotFoundError:
        return f"no {MARKER} marker"
    except (OSError, ValueError) as e:
        return f"unreadable {MARKER} marker ({e})"
    if not isinstance(doc, dict) or doc.get("complete") is not True or not isinstance(doc.get("files"), dict):
        return "incomplete (the writer did not finish)"
    if kind is not None and doc.get("kind") != kind:
        return f"holds kind {doc.get('kind')!r}, not {kind!r}"
    files = doc["files"]
    have = {p.name for p in out.iterdir() if p.is_file() and not p.name.startswith(MARKER)}
    if have != set(files):
        return f"files differ from the marker (extra {sorted(have - set(files))}, missing {sorted(set(files) - have)})"
    for name, h in files.items():
        if _sha256(out / name) != h:
            return f"file {name!r} changed since it was written"
    return None


def save_fixture(fx: Fixture, out_dir: Union[str, Path], shards: int = 2) -> Path:
    """Write a built (possibly edited) fixture: config.json + shards (+ index when shards > 1), then the
    completion marker. A directory that held a fixture is cleared first; a foreign non-empty one refused."""
    out = Path(out_dir)
    _prepare_dir(out, fx.kind)
    _write_files(fx, out, shards)
    _finalize(out, fx.kind)
    return out


def _write_files(fx: Fixture, out: Path, shards: int) -> None:
    with open(out / "config.json", "w") as f:
        json.dump(fx.config, f, indent=2)
    names = list(fx.tensors)
    if shards <= 1:
        save_file(fx.tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    total = fx.nbytes
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc = 0
    for n in names:
        t = fx.tensors[n]
        gi = min(shards - 1, acc * shards // max(total, 1))
        groups[gi].append(n)
        acc += t.numel() * t.element_size()
    wm: dict[str, str] = {}
    for i, grp in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: fx.tensors[n] for n in grp}, str(out / fn), metadata={"format": "pt"})
        wm.update({n: fn for n in grp})
    with open(out / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f, indent=2)


def write_fixture(kind: str, out_dir: Union[str, Path], seed: int = 0, tokenizer: bool = False, **sizes: Any) -> Path:
    """Write config.json + safetensors shards (+ index when shards > 1) for `kind`, and with
    `tokenizer` (target kinds) a Kimi-layout tiktoken tokenizer; the completion marker last; returns out_dir."""
    if tokenizer and not kind.startswith("kimi"):
        raise FixtureError(f"--tokenizer is for target kinds (kimi-*), not {kind!r}")
    fx = build_fixture(kind, seed, **sizes)
    out = Path(out_dir)
    _prepare_dir(out, kind)
    _write_files(fx, out, int({**DEFAULT_SIZES, **sizes}["shards"]))
    if tokenizer:
        t = fx.config["text_config"]
        eos = t["eos_token_id"]
        write_tokenizer(out, t["vocab_size"], {t["bos_token_id"]: "[BOS]", eos: "[EOS]", eos + 1: "<|im_end|>",
                                               eos + 2: "<|im_user|>", eos + 3: "<|im_assistant|>",
                                               t["pad_token_id"]: "[PAD]"})
    _finalize(out, kind)
    return out


# a fixed text the tiny tokenizer learns its merges from (English, code, digits, punctuation)
_BPE_TEXT = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs on. "
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Speculative decoding drafts tokens with a small model and verifies them with the target in one pass, "
    "so the output is the target's own. 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987. "
    "There is the theory of the thing, and then there is the thing itself: these three then thought it through. "
    "Is it lossless? It is: every token the target would pick, the engine picks."
)


def _learn_merges(text: str, count: int) -> list[bytes]:
    """Byte-level BPE on `text` split into words (leading space kept): the `count` most frequent
    adjacent pairs in turn (ties: the larger pair bytes, deterministic)."""
    seqs = [[bytes([c]) for c in w.encode("utf-8")] for w in re.findall(r" ?\S+|\s+", text)]
    out: list[bytes] = []
    known = {bytes([i]) for i in range(256)}
    while len(out) < count:
        pairs = Counter((a, b) for s in seqs for a, b in zip(s, s[1:]))
        if not pairs:
            raise ValueError(f"the tokenizer text has room for {len(out)} merges, {count} asked")
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if a + b not in known:
            known.add(a + b)
            out.append(a + b)
        for s in seqs:
            i = 0
            while i < len(s) - 1:
                if s[i] == a and s[i + 1] == b:
                    s[i:i + 2] = [a + b]
                i += 1
    return out


def write_tokenizer(out_dir: Union[str, Path], vocab_size: int, names: Optional[dict[int, str]] = None) -> Path:
    """Write `tiktoken.model` (256 bytes + vocab_size - 512 learnt merges = the BPE ranks) and
    `tokenizer_config.json` (the 256 special ids after them; `names` {id: name} in
    added_tokens_decoder, bos/eos named when "[BOS]"/"[EOS]" are among them)."""
    from models.tokenizer import NUM_RESERVED_SPECIAL

    n = vocab_size - NUM_RESERVED_SPECIAL
    if n < 256:
        raise ValueError(f"a tiktoken tokenizer needs vocab_size >= {256 + NUM_RESERVED_SPECIAL}, got {vocab_size}")
    names = dict(names or {n: "[BOS]", n + 1: "[EOS]"})
    bad = [i for i in names if not n <= i < vocab_size]
    if bad:
        raise ValueError(f"special ids must be in [{n}, {vocab_size}), got {sorted(bad)}")
    toks = [bytes([i]) for i in range(256)] + _learn_merges(_BPE_TEXT, n - 256)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "tiktoken.model", "w") as f:
        f.writelines(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(toks))
    cfg: dict[str, Any] = {
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, s in sorted(names.items())},
        "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576,
    }
    for key, s in (("bos_token", "[BOS]"), ("eos_token", "[EOS]")):
        if s in names.values():
            cfg[key] = s
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    if _marker_complete(out):
        _finalize(out)                       # keep a finished fixture's hashes true
    return out


def _marker_complete(out: Path) -> bool:
    try:
        return json.loads((out / MARKER).read_text()).get("complete") is True
    except (OSError, ValueError, AttributeError):
        return False


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: Optional[list[str]] = None) -> int:
    """The CLI: every bad option, size or directory is one line on stderr naming it, exit status 2."""
    ap = _Parser(prog="python -m models.fixtures", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", required=True, choices=KINDS)
    ap.add_argument("--out", required=True, type=Path,
                    help="directory to write (created; a fixture directory written before is cleared, another "
                         "non-empty directory is refused)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", action="store_true",
                    help="also write a Kimi-layout tiktoken tokenizer (target kinds; merges need --vocab > 512)")
    for k, v in DEFAULT_SIZES.items():
        ap.add_argument("--" + k.replace("_", "-"), dest=k, type=type(v), default=v)
    a = vars(ap.parse_args(argv))
    kind, out, seed, tok = a.pop("kind"), a.pop("out"), a.pop("seed"), a.pop("tokenizer")
    if not 0 <= seed < 2 ** 63:
        ap.error(f"--seed must be in [0, 2**63), got {seed}")
    if tok:
        from models.tokenizer import NUM_RESERVED_SPECIAL

        if not kind.startswith("kimi"):
            ap.error(f"--tokenizer is for target kinds (kimi-*), not {kind!r}")
        if a["vocab"] < 256 + NUM_RESERVED_SPECIAL:
            ap.error(f"--vocab must be >= {256 + NUM_RESERVED_SPECIAL} with --tokenizer, got {a['vocab']}")
    try:
        p = write_fixture(kind, out, seed, tokenizer=tok, **a)
    except (ValueError, OSError, MemoryError) as e:   # FixtureError, ConfigError, a file system error
        msg = str(e) if not isinstance(e, OSError) else f"--out {out}: {e.strerror or e}"
        print(f"{ap.prog}: error: {msg or type(e).__name__}".splitlines()[0], file=sys.stderr)
        return 2
    fx_bytes = sum(f.stat().st_size for f in p.glob("*.safetensors"))
    print(f"wrote {kind} fixture to {p} ({fx_bytes / 1e6:.2f} MB of safetensors)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
