"""The tiny-checkpoint writer: CLI, determinism, real key names / dtypes / layout per kind."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.fixtures import KINDS, main, write_fixture
from models.loader import list_tensors

ROOT = Path(__file__).resolve().parents[1]
P = "language_model.model.layers.1.mlp."


def _bytes(p: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(p.iterdir())}


def test_cli_writes_and_is_deterministic(tmp_path):
    r = subprocess.run([sys.executable, "-m", "models.fixtures", "--kind", "eagle3", "--out", str(tmp_path / "a"),
                        "--seed", "7", "--hidden", "32"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert main(["--kind", "eagle3", "--out", str(tmp_path / "b"), "--seed", "7", "--hidden", "32"]) == 0
    assert main(["--kind", "eagle3", "--out", str(tmp_path / "c"), "--seed", "8", "--hidden", "32"]) == 0
    a, b, c = (_bytes(tmp_path / x) for x in "abc")
    assert a == b and a != c
    assert json.loads(a["config.json"])["hidden_size"] == 32


def test_bad_kind_and_sizes(tmp_path):
    with pytest.raises(ValueError, match="unknown fixture kind 'llama'"):
        write_fixture("llama", tmp_path)
    with pytest.raises(ValueError, match="unknown size option"):
        write_fixture("eagle3", tmp_path, hiden=3)
    with pytest.raises(ValueError, match="--layers"):
        write_fixture("eagle3", tmp_path, layers=4)


@pytest.fixture(scope="module")
def headers(tmp_path_factory):
    base = tmp_path_factory.mktemp("fxh")
    out = {}
    for k in KINDS:
        p = write_fixture(k, base / k)
        out[k] = (p, list_tensors(p))
    return out


def test_target_layout(headers):
    p, t = headers["kimi-k25"]
    cfg = json.loads((p / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert cfg["text_config"]["quantization_config"]["format"] == "pack-quantized"
    assert "quantization_config" not in cfg
    idx = json.loads((p / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) == 2 and set(idx["weight_map"]) == set(t)
    assert t[P + "experts.3.down_proj.weight_packed"] == ("I32", [64, 4])
    assert t[P + "experts.3.down_proj.weight_scale"] == ("BF16", [64, 1])
    assert t[P + "experts.3.down_proj.weight_shape"] == ("I32", [2])
    assert t[P + "gate.e_score_correction_bias"] == ("F32", [16])
    assert t[P + "shared_experts.up_proj.weight"] == ("BF16", [32, 64])
    assert t["language_model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == ("BF16", [48, 64])
    assert t["language_model.model.layers.0.mlp.gate_proj.weight"] == ("BF16", [128, 64])
    assert "vision_tower.patch_embed.proj.weight" in t
    _, w = headers["kimi-k25-w4a8"]
    assert w[P + "experts.0.up_proj.weight"] == ("I32", [32, 8])
    assert w[P + "experts.0.up_proj.weight_scale"] == ("F32", [])
    assert w[P + "experts.0.up_proj.weight_scale_2"] == ("F32", [32])
    _, b = headers["kimi-k25-bf16"]
    assert b[P + "experts.0.up_proj.weight"] == ("BF16", [32, 64])


def test_draft_layouts(headers):
    _, t = headers["eagle3"]
    assert t["fc.weight"] == ("BF16", [64, 192])
    assert t["midlayer.self_attn.q_proj.weight"] == ("BF16", [128, 128])     # heads 4 x head_dim 32, 2H in
    assert t["midlayer.self_attn.k_proj.weight"] == ("BF16", [64, 128])      # kv heads 2
    assert t["lm_head.weight"] == ("BF16", [256, 64]) and t["d2t"] == ("I64", [256])
    assert t["t2d"] == ("BOOL", [512])
    _, f = headers["eagle3-fp8"]
    assert f["layers.0.self_attn.o_proj.weight"] == ("F8_E4M3", [64, 128])
    assert f["layers.0.self_attn.o_proj.weight_scale"] == ("F32", [64])
    assert f["fc.weight"][0] == "F16" and f["layers.0.hidden_norm.weight"][0] == "F16"
    p, i = headers["eagle3-int4"]
    assert i["midlayer.mlp.down_proj.weight"] == ("I32", [64, 16]) and i["midlayer.mlp.down_proj.weight_scale"] == ("F32", [64])
    assert json.loads((p / "config.json").read_text())["quantization_config"]["export"]["pack_method"] == "reorder"
    p, m = headers["eagle3-mla"]
    assert json.loads((p / "config.json").read_text())["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert m["midlayer.self_attn.q_a_proj.weight"] == ("BF16", [48, 128])
    assert m["midlayer.self_attn.kv_a_proj_with_mqa.weight"] == ("BF16", [48, 128])
    for k in ("eagle3", "eagle3-mla"):
        cfg = json.loads((headers[k][0] / "config.json").read_text())
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
