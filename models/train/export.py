"""Configs of the tiny trained pair, and export / import between the trainer nets and checkpoints.

Target: the Kimi-K2.5 layout (top-level `KimiK25ForConditionalGeneration`, the DeepSeek-V3 text config
under `text_config` with its `quantization_config`, tensors under `language_model.`), routed experts
compressed-tensors pack-quantized INT4 group 32 (`weight_packed` / `weight_scale` bf16 / `weight_shape`),
`e_score_correction_bias` F32, everything else BF16 (REFERENCE §1, §3).
Draft: `LlamaForCausalLMEagle3` BF16 with `eagle_config.eagle_aux_hidden_state_layer_ids` in the
checkpoint ("output of layer j") convention, i.e. our capture ids - 1 (models.config).

`export_view(net)` is the net as the checkpoint stores it (weights rounded to BF16, experts
fake-quantized exactly as packed): what the loaded inference model computes.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Union

import torch
from safetensors.torch import save_file

from models.config import DeepseekV3Config, Eagle3Config, parse_config
from models.formats import QuantLinear, dequantize
from models.train.nets import DraftNet, MoE, TargetNet, quant_int4
from ops.packing import pack_int4

__all__ = ["TARGET_SIZES", "DRAFT_SIZES", "CAPTURE_IDS", "target_config", "draft_config", "export_target",
           "export_draft", "export_view", "target_from_checkpoint", "weights_hash", "GROUP"]

GROUP = 32
TARGET_SIZES: dict[str, Any] = dict(hidden=256, layers=4, heads=4, q_lora=128, kv_lora=64, nope=32, rope=16, v=32,
                                    intermediate=512, moe_intermediate=64, experts=16, topk=4)
DRAFT_SIZES: dict[str, Any] = dict(heads=4, kv_heads=2, head_dim=64, intermediate=512)
# target layers whose INPUT residual stream feeds the draft (ours; 4 = the last layer's output, before the
# final norm); the checkpoint's eagle_config holds them - 1. The default (2, N//2, N-3) degenerates for N=4.
CAPTURE_IDS = (2, 3, 4)


def target_config(vocab: int, bpe: int, s: dict[str, Any] = TARGET_SIZES) -> dict[str, Any]:
    """config.json of the target (Kimi-K2.5 nesting); bos/eos = the first special ids after the bpe ranks."""
    text = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": s["hidden"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["heads"], "q_lora_rank": s["q_lora"], "kv_lora_rank": s["kv_lora"],
        "qk_nope_head_dim": s["nope"], "qk_rope_head_dim": s["rope"], "v_head_dim": s["v"],
        "intermediate_size": s["intermediate"], "moe_intermediate_size": s["moe_intermediate"],
        "n_routed_experts": s["experts"], "num_experts_per_tok": s["topk"], "n_shared_experts": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.827, "rms_norm_eps": 1e-5, "vocab_size": vocab, "tie_word_embeddings": False,
        "rope_theta": 50000.0, "max_position_embeddings": 262144,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        "bos_token_id": bpe, "eos_token_id": bpe + 1, "pad_token_id": vocab - 1,
        "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": GROUP, "dynamic": False,
                                                      "actorder": None, "observer": "minmax"}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                       "re:.*mlp\\.gate$"],
            "kv_cache_scheme": None},
    }
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
            "bos_token_id": bpe, "eos_token_id": bpe + 1, "pad_token_id": vocab - 1, "tie_word_embeddings": False}


def draft_config(tc: dict[str, Any], s: dict[str, Any] = DRAFT_SIZES) -> dict[str, Any]:
    t = tc["text_config"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": t["hidden_size"], "target_hidden_size": t["hidden_size"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "num_hidden_layers": 1,
        "intermediate_size": s["intermediate"], "vocab_size": t["vocab_size"], "draft_vocab_size": t["vocab_size"],
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 262144,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in CAPTURE_IDS],
                         "use_aux_hidden_state": True},
        "bos_token_id": t["bos_token_id"], "eos_token_id": t["eos_token_id"], "pad_token_id": t["pad_token_id"],
    }


def _target_name(name: str) -> str:
    """TargetNet parameter name -> checkpoint name (without the language_model. prefix)."""
    return name if name.startswith("lm_head") else "model." + name


_MIDLAYER = ("hidden_norm", "input_layernorm", "post_attention_layernorm", "mlp.")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _draft_name(name: str) -> str:
    """DraftNet parameter name -> checkpoint name (midlayer.* / midlayer.self_attn.*)."""
    if name.startswith(_ATTN):
        return "midlayer.self_attn." + name
    if name.startswith(_MIDLAYER):
        return "midlayer." + name
    return name


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16).contiguous()


def _write(out: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def export_target(net: TargetNet, cfg: dict[str, Any], out: Union[str, Path]) -> Path:
    """Write the trained target as a Kimi-K2.5-layout checkpoint (module docstring)."""
    P = "language_model."
    t: dict[str, torch.Tensor] = {}
    for name, p in net.named_parameters():
        if ".mlp.w" not in name:
            t[P + _target_name(name)] = _bf16(p)
    for i, blk in enumerate(net.layers):
        if isinstance(blk.mlp, MoE):
            m = blk.mlp
            t[f"{P}model.layers.{i}.mlp.gate.e_score_correction_bias"] = m.e_score_correction_bias.float().clone()
            for e in range(net.c.n_routed_experts):
                for nm, w in (("gate_proj", m.w1[e]), ("up_proj", m.w3[e]), ("down_proj", m.w2[e])):
                    q, scale = quant_int4(w, GROUP)
                    base = f"{P}model.layers.{i}.mlp.experts.{e}.{nm}"
                    t[base + ".weight_packed"] = pack_int4(q, "ct")
                    t[base + ".weight_scale"] = scale.contiguous()
                    t[base + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
    return _write(Path(out), cfg, t)


def export_draft(net: DraftNet, cfg: dict[str, Any], out: Union[str, Path]) -> Path:
    """Write the trained draft as a BF16 `LlamaForCausalLMEagle3` checkpoint (keys without `model.`)."""
    t: dict[str, torch.Tensor] = {}
    for name, p in net.named_parameters():
        t[_draft_name(name)] = _bf16(p)
    return _write(Path(out), cfg, t)


@torch.no_grad()
def export_view(net: torch.nn.Module) -> torch.nn.Module:
    """A copy of `net` computing what its checkpoint computes: BF16-rounded weights, fake-quantized experts."""
    v = copy.deepcopy(net)
    for m in v.modules():
        if isinstance(m, MoE):
            for w in (m.w1, m.w3, m.w2):
                w.copy_(torch.stack([_dequant(*quant_int4(x, GROUP)) for x in w]))
            m.quant_group = 0
    experts = {id(w) for m in v.modules() if isinstance(m, MoE) for w in (m.w1, m.w3, m.w2)}
    for p in v.parameters():
        if id(p) not in experts:
            p.copy_(p.to(torch.bfloat16).float())
    return v.eval()


def _dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.float().reshape(n, -1, GROUP) * scale.float()[..., None]).reshape(n, k)


@torch.no_grad()
def target_from_checkpoint(ck, capture_ids: tuple[int, ...] = CAPTURE_IDS) -> TargetNet:
    """A TargetNet holding a loaded target checkpoint's weights (experts dequantized, float32)."""
    c: DeepseekV3Config = ck.config
    net = TargetNet(c, capture_ids)
    W = lambda n: (dequantize(ck[n], torch.float32) if isinstance(ck[n], QuantLinear)  # noqa: E731
                   else ck[n].float())
    sd = {}
    for name in net.state_dict():
        if ".mlp.w" in name or name.endswith("e_score_correction_bias"):
            continue
        sd[name] = W(_target_name(name))
    for i, blk in enumerate(net.layers):
        if isinstance(blk.mlp, MoE):
            p = f"model.layers.{i}.mlp."
            sd[f"layers.{i}.mlp.e_score_correction_bias"] = ck[p + "gate.e_score_correction_bias"].float()
            for attr, nm in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                sd[f"layers.{i}.mlp.{attr}"] = torch.stack([W(f"{p}experts.{e}.{nm}.weight")
                                                            for e in range(c.n_routed_experts)])
    net.load_state_dict(sd)
    return net.eval()


def weights_hash(net: torch.nn.Module) -> str:
    """sha256 over the state dict (sorted names, float32 bytes): equal for equal training runs."""
    h = hashlib.sha256()
    for n, t in sorted(net.state_dict().items()):
        h.update(n.encode())
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def parse(cfg: dict[str, Any]):
    """The parsed config (models.config) a net is built from: the loader's own reading of it."""
    c = parse_config(cfg)
    assert isinstance(c, (DeepseekV3Config, Eagle3Config))
    return c
