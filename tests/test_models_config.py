"""Config parsing: Kimi-K2.5 nesting, yarn defaults, quant config lookup, EAGLE-3 aux-id convention, errors."""
from __future__ import annotations

import copy
import math

import pytest

from models.config import (ConfigError, DeepseekV3Config, Eagle3Config, check_draft_matches_target,
                           default_aux_layer_ids, parse_config)
from models.fixtures import KINDS, build_fixture

KIMI_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.827, "rms_norm_eps": 1e-5, "vocab_size": 163840,
    "tie_word_embeddings": False, "rope_theta": 50000.0, "max_position_embeddings": 262144,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
    "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839,
    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int",
                                                                      "group_size": 32}}}},
}
KIMI = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": KIMI_TEXT, "vision_config": {}}


def test_kimi_k25_config_fields():
    c = parse_config(KIMI)
    assert isinstance(c, DeepseekV3Config)
    assert c.architecture == "KimiK25ForConditionalGeneration" and c.tensor_prefix == "language_model."
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (7168, 61, 64)
    assert (c.qk_head_dim, c.kv_cache_dim) == (192, 576)
    assert [c.is_moe_layer(i) for i in (0, 1, 60)] == [False, True, True]
    rs = c.rope_scaling
    assert rs is not None and (rs.beta_fast, rs.beta_slow) == (32.0, 1.0)   # defaults when absent
    mscale = 0.1 * math.log(64.0) + 1.0
    assert c.mscale == pytest.approx(mscale) and c.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    assert c.softmax_scale / 192 ** -0.5 == pytest.approx(2.0048, abs=1e-4)
    assert c.quantization is not None and c.quantization.method == "compressed-tensors"
    assert (c.quantization.int4_pack, c.quantization.group_size) == ("ct", 32)
    assert c.capture_layer_ids == (2, 30, 58)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (163584, 163585, 163839)


def test_quant_config_text_first_then_top():
    d = copy.deepcopy(KIMI)
    d["quantization_config"] = {"quant_method": "quark", "export": {"pack_method": "order"}}
    assert parse_config(d).quantization.method == "compressed-tensors"      # text_config wins
    del d["text_config"]["quantization_config"]
    q = parse_config(d).quantization
    assert q.method == "quark" and q.int4_pack == "quark_order"


def test_plain_deepseek_v3_and_explicit_yarn_betas():
    d = copy.deepcopy(KIMI_TEXT)
    del d["quantization_config"]
    d["rope_scaling"] = dict(d["rope_scaling"], beta_fast=1, beta_slow=1)
    c = parse_config(d)
    assert c.tensor_prefix == "" and c.quantization is None and c.architecture == "DeepseekV3ForCausalLM"
    assert (c.rope_scaling.beta_fast, c.rope_scaling.beta_slow) == (1.0, 1.0)
    d["rope_scaling"] = None
    assert parse_config(d).softmax_scale == pytest.approx(192 ** -0.5)


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", None, "'text_config.hidden_size' is missing"),
    ("hidden_size", "big", "'text_config.hidden_size' must be int"),
    ("num_experts_per_tok", 999, "num_experts_per_tok"),
    ("n_group", 5, "n_group"),
    ("rope_scaling", {"type": "ntk", "factor": 2.0}, "text_config.rope_scaling.type"),
    ("rope_scaling", {"type": "yarn"}, "text_config.rope_scaling.factor"),
])
def test_target_config_errors_name_field(field, value, match):
    d = copy.deepcopy(KIMI)
    if value is None:
        del d["text_config"][field]
    else:
        d["text_config"][field] = value
    with pytest.raises(ConfigError, match=match.replace(".", r"\.").replace("(", r"\(")):
        parse_config(d)


def test_unknown_quant_method_and_pack_method_name_field():
    d = copy.deepcopy(KIMI)
    d["text_config"]["quantization_config"] = {"quant_method": "awq"}
    with pytest.raises(ConfigError, match=r"text_config\.quantization_config\.quant_method.*awq"):
        parse_config(d)
    d["text_config"]["quantization_config"] = {"quant_method": "quark", "export": {"pack_method": "zigzag"}}
    with pytest.raises(ConfigError, match=r"export\.pack_method.*zigzag"):
        parse_config(d)


EAGLE = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 7168, "num_attention_heads": 64,
         "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 163840,
         "draft_vocab_size": 163840, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}


def test_eagle3_aux_ids_plus_one_convention():
    c = parse_config(EAGLE)
    assert isinstance(c, Eagle3Config) and c.kind == "mha" and c.head_dim == 128
    # checkpoint [1, 29, 57] ("output of layer j") == ours (2, 30, 58) ("INPUT of layer i") == default
    assert c.aux_layer_ids == (2, 30, 58) == default_aux_layer_ids(61)
    assert c.capture_layer_ids(61) == (2, 30, 58)
    d = dict(EAGLE)
    del d["eagle_config"]
    assert parse_config(d).capture_layer_ids(61) == (2, 30, 58)
    assert parse_config(d).capture_layer_ids(8) == (2, 4, 5)
    # repeated ids are well defined (issue 11.6): the list is captured literally, in list order
    assert parse_config(d).capture_layer_ids(4) == (2, 2, 1)
    with pytest.raises(ConfigError, match="outside"):
        parse_config(EAGLE).capture_layer_ids(40)


def test_eagle3_head_dim_required_and_vocab_checks():
    d = dict(EAGLE)
    del d["head_dim"]
    with pytest.raises(ConfigError, match="'head_dim' is missing"):
        parse_config(d)
    with pytest.raises(ConfigError, match="'draft_vocab_size'"):
        parse_config(dict(EAGLE, draft_vocab_size=10 ** 6))


def test_mla_draft_and_target_match():
    d = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "hidden_size": 7168, "num_attention_heads": 64,
         "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
         "v_head_dim": 128, "intermediate_size": 18432, "vocab_size": 163840,
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    c = parse_config(d)
    assert c.kind == "mla" and c.qk_head_dim == 192 and c.aux_layer_ids == (2, 30, 58)
    tgt = parse_config(KIMI)
    check_draft_matches_target(c, tgt)
    check_draft_matches_target(parse_config(EAGLE), tgt)
    with pytest.raises(ConfigError, match="draft hidden size mismatch.*7168"):
        check_draft_matches_target(parse_config(dict(EAGLE, hidden_size=4096)), tgt)
    with pytest.raises(ConfigError, match="draft vocab mismatch.*'vocab_size'"):
        check_draft_matches_target(parse_config(dict(EAGLE, vocab_size=1000, draft_vocab_size=1000)), tgt)


@pytest.mark.parametrize("kind", KINDS)
def test_fixture_configs_parse(kind):
    c = parse_config(build_fixture(kind).config)
    if kind.startswith("kimi"):
        assert isinstance(c, DeepseekV3Config) and c.capture_layer_ids == (2, 4, 5)
        assert c.quantization is None if kind == "kimi-k25-bf16" else c.quantization is not None
    else:
        assert isinstance(c, Eagle3Config) and c.capture_layer_ids(8) == (2, 4, 5)
        if kind != "eagle3-mla":
            assert c.head_dim == 32 != c.hidden_size // c.num_attention_heads
