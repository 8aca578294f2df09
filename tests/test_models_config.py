"""Config parsing: Kimi-K2.5 nesting, yarn defaults, quant config lookup, EAGLE-3 aux-id convention, errors."""
from __future__ import annotations

import copy
import json
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


# ----------------------------------------------------------------------------------------------
# issue 11.5: domain checks, model_type, rope_parameters, mscale_all_dim default


@pytest.mark.parametrize("field,value,match", [
    ("rms_norm_eps", float("nan"), "'text_config.rms_norm_eps' must be a finite number"),
    ("rms_norm_eps", float("inf"), "'text_config.rms_norm_eps' must be a finite number"),
    ("rms_norm_eps", 0.0, "'text_config.rms_norm_eps' must be in"),
    ("rms_norm_eps", -1e-5, "'text_config.rms_norm_eps' must be in"),
    ("rope_theta", float("inf"), "'text_config.rope_theta' must be a finite number"),
    ("rope_theta", 1.0, "'text_config.rope_theta' must be in"),
    ("rope_theta", -5.0, "'text_config.rope_theta' must be in"),
    ("routed_scaling_factor", float("nan"), "routed_scaling_factor"),
    ("rope_scaling", {"type": "yarn", "factor": float("nan"), "original_max_position_embeddings": 4096},
     "'text_config.rope_scaling.factor' must be a finite"),
    ("rope_scaling", {"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 4096},
     "'text_config.rope_scaling.factor' must be in"),
    ("rope_scaling", {"type": "yarn", "factor": 64, "original_max_position_embeddings": 0},
     "'text_config.rope_scaling.original_max_position_embeddings' must be > 0"),
    ("rope_scaling", {"type": "yarn", "factor": 64, "original_max_position_embeddings": 4096, "beta_fast": -1},
     "beta_fast"),
    ("rope_scaling", {"type": "yarn", "factor": 64, "original_max_position_embeddings": 4096, "mscale_all_dim": -1},
     "mscale_all_dim"),
    ("hidden_size", 10 ** 9, "'text_config.hidden_size' = 1000000000 exceeds the sane maximum"),
    ("num_hidden_layers", 10 ** 6, "'text_config.num_hidden_layers' = 1000000 exceeds"),
    ("n_routed_experts", 10 ** 7, "'text_config.n_routed_experts'"),
    ("vocab_size", 1 << 40, "'text_config.vocab_size'"),
    ("n_shared_experts", -1, "'text_config.n_shared_experts' must be >= 0"),
    ("first_k_dense_replace", 61, "first_k_dense_replace"),
    ("qk_rope_head_dim", 63, "'text_config.qk_rope_head_dim' must be even"),
    ("topk_method", "magic", "'text_config.topk_method': unsupported"),
    ("eos_token_id", 10 ** 6, "'text_config.eos_token_id' (1000000) is outside the vocab"),
    ("eos_token_id", "x", "'text_config.eos_token_id' must be an int"),
    ("model_type", "qwen3", "'text_config.model_type': unknown model_type 'qwen3'"),
    ("n_group", 384, "n_group"),          # one expert per group: group-limited top-2 undefined
])
def test_target_config_domain_errors_name_field(field, value, match):
    d = copy.deepcopy(KIMI)
    d["text_config"][field] = value
    with pytest.raises(ConfigError, match=match.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        parse_config(d)


def test_unknown_top_level_model_type_and_bad_architectures():
    with pytest.raises(ConfigError, match="'model_type': unknown model_type 'gpt2'"):
        parse_config(dict(KIMI, model_type="gpt2"))
    with pytest.raises(ConfigError, match="'architectures' must be a list"):
        parse_config(dict(KIMI, architectures="KimiK25"))
    with pytest.raises(ConfigError, match="unknown model_type 'bert'"):
        parse_config(dict(EAGLE, model_type="bert"))
    with pytest.raises(ConfigError, match="must be a JSON object"):
        parse_config([1, 2])


def test_config_json_file_errors_name_file(tmp_path):
    from models.config import load_config

    p = tmp_path / "config.json"
    p.write_text('{"hidden_size": NaN')
    with pytest.raises(ConfigError, match="config.json: not a readable JSON"):
        load_config(tmp_path)
    p.write_text(json.dumps(dict(KIMI, text_config=dict(KIMI_TEXT, rms_norm_eps=float("nan")))))
    with pytest.raises(ConfigError, match=r"config\.json: config field 'text_config\.rms_norm_eps'"):
        load_config(tmp_path)


def test_rope_parameters_means_rope_scaling_plus_theta():
    """transformers 5 spells rope as one object with rope_theta inside: parsed the same."""
    old = parse_config(KIMI)
    d = copy.deepcopy(KIMI)
    t = d["text_config"]
    t["rope_parameters"] = dict(t.pop("rope_scaling"), rope_theta=t.pop("rope_theta"))
    t["rope_parameters"]["rope_type"] = t["rope_parameters"].pop("type")
    new = parse_config(d)
    assert new.rope_theta == old.rope_theta == 50000.0 and new.rope_scaling == old.rope_scaling
    assert new.softmax_scale == old.softmax_scale
    # plain rope in the new spelling
    d2 = copy.deepcopy(KIMI)
    del d2["text_config"]["rope_scaling"], d2["text_config"]["rope_theta"]
    d2["text_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    c = parse_config(d2)
    assert c.rope_theta == 12345.0 and c.rope_scaling is None
    # both spellings present and disagreeing: refused by name
    d3 = copy.deepcopy(KIMI)
    d3["text_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="'text_config.rope_theta' .* 'text_config.rope_parameters.rope_theta'"):
        parse_config(d3)
    d3["text_config"]["rope_parameters"]["rope_theta"] = 50000.0
    with pytest.raises(ConfigError, match="'text_config.rope_scaling' and 'text_config.rope_parameters' disagree"):
        parse_config(d3)
    d4 = copy.deepcopy(d)
    d4["text_config"]["rope_parameters"]["rope_theta"] = float("inf")
    with pytest.raises(ConfigError, match="rope_parameters.rope_theta' must be a finite"):
        parse_config(d4)
    e = dict(EAGLE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    del e["rope_theta"]
    assert parse_config(e).rope_theta == 1e6


def test_missing_mscale_all_dim_is_zero():
    """HF DeepSeek default: no mscale_all_dim -> 0, so the softmax scale is not multiplied (mscale 1) and
    cos/sin carry mscale(factor, mscale) / 1 instead of 1 (REFERENCE §1)."""
    from models.kimi import rope_scaling_dict
    from ops.rope import inv_freq

    d = copy.deepcopy(KIMI)
    del d["text_config"]["rope_scaling"]["mscale_all_dim"]
    c = parse_config(d)
    assert c.rope_scaling.mscale_all_dim == 0.0
    assert c.mscale == 1.0 and c.softmax_scale == pytest.approx(192 ** -0.5)
    _, mult = inv_freq(64, c.rope_theta, rope_scaling_dict(c.rope_scaling))
    assert mult == pytest.approx(0.1 * math.log(64.0) + 1.0)
    # Kimi's explicit mscale_all_dim 1.0 keeps x2.0048 on the softmax scale and 1.0 on cos/sin
    k = parse_config(KIMI)
    assert inv_freq(64, k.rope_theta, rope_scaling_dict(k.rope_scaling))[1] == pytest.approx(1.0)
    assert k.softmax_scale / 192 ** -0.5 == pytest.approx(2.0048, abs=1e-4)


def test_param_count_is_kimi_size():
    assert 1.0e12 < parse_config(KIMI).param_count() < 1.1e12      # Kimi-K2.5: ~1T parameters
    assert 2.5e9 < parse_config(EAGLE).param_count() < 3.5e9        # the EAGLE-3 draft: ~3B (REFERENCE §2)


# ----------------------------------------------------------------------------------------------
# issue 11.6: EAGLE-3 aux-layer ids


@pytest.mark.parametrize("raw,want", [
    ([1, 29, 57], (2, 30, 58)),      # post-layer ids from training (first id 1): +1 each (SGLang rule)
    ([2, 30, 58], (2, 30, 58)),      # pre-layer ids: as given (vLLM, ATOM)
    ([3, 10, 20], (3, 10, 20)),
    ([1, 1, 0], (2, 2, 1)),          # repeats are kept, list order kept
    ([5, 2, 2], (5, 2, 2)),
])
def test_aux_ids_rule(raw, want):
    from models.config import resolve_aux_ids

    assert resolve_aux_ids(raw) == want
    c = parse_config(dict(EAGLE, eagle_config={"eagle_aux_hidden_state_layer_ids": raw}))
    assert c.aux_ids_config == tuple(raw) and c.capture_layer_ids(61) == want
    assert str(raw) in c.aux_ids_origin()
    assert ("+1" in c.aux_ids_origin()) == (raw[0] == 1)


def test_aux_ids_override_and_errors():
    from models.config import parse_aux_ids

    c = parse_config(EAGLE)
    assert c.capture_layer_ids(61, parse_aux_ids("2,4,5")) == (2, 4, 5)
    assert c.aux_ids_origin(True).startswith("--aux-ids")
    assert c.capture_layer_ids(8, (2, 2, 1)) == (2, 2, 1)
    with pytest.raises(ConfigError, match="--aux-ids: aux layer id 62 outside"):
        c.capture_layer_ids(61, (2, 30, 62))
    with pytest.raises(ConfigError, match="--aux-ids: aux layer id 0 outside"):
        c.capture_layer_ids(61, (0, 30, 58))
    with pytest.raises(ConfigError, match="--aux-ids: an EAGLE-3 draft's fc reads 3"):
        c.capture_layer_ids(61, (2, 30))
    for bad in ("", "2,,3", "a,b,c", "2.5,3,4"):
        with pytest.raises(ConfigError, match="--aux-ids"):
            parse_aux_ids(bad)
    for bad in ([], [True, 2, 3], ["1", 2, 3], [-1, 2, 3], 7):
        with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
            parse_config(dict(EAGLE, eagle_config={"eagle_aux_hidden_state_layer_ids": bad}))
    no_ids = dict(EAGLE)
    del no_ids["eagle_config"]
    assert parse_config(no_ids).aux_ids_origin().startswith("default")
    # a target check with an override: the config ids (outside a 40-layer target) are not used
    tgt = parse_config(copy.deepcopy(dict(KIMI, text_config=dict(KIMI_TEXT, num_hidden_layers=40))))
    with pytest.raises(ConfigError, match="outside"):
        check_draft_matches_target(c, tgt)
    check_draft_matches_target(c, tgt, (2, 20, 37))


@pytest.mark.parametrize("field,value,match", [
    ("rms_norm_eps", float("nan"), "'rms_norm_eps' must be a finite"),
    ("rope_theta", 0.5, "'rope_theta' must be in"),
    ("head_dim", 127, "'head_dim' must be even"),
    ("num_key_value_heads", 48, "'num_key_value_heads' (48) must divide"),
    ("intermediate_size", 1 << 30, "'intermediate_size' = 1073741824 exceeds"),
])
def test_draft_config_domain_errors(field, value, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        parse_config(dict(EAGLE, **{field: value}))
