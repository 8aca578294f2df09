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


# ----------------------------------------------------------------------------------------------
# issue 11.5 / 11.8: directories the writer owns, completion marker, size bounds


def test_rewrite_clears_stale_shards(tmp_path):
    """A 4-shard fixture rewritten with 1 shard into the same directory leaves no old shard or index."""
    from models.fixtures import MARKER, verify_fixture
    from models.loader import load_checkpoint

    d = tmp_path / "f"
    write_fixture("eagle3", d, seed=1, shards=4)
    assert len(list(d.glob("*.safetensors"))) == 4 and verify_fixture(d, "eagle3") is None
    write_fixture("eagle3", d, seed=1, shards=1)
    assert sorted(p.name for p in d.iterdir()) == sorted([MARKER, "config.json", "model.safetensors"])
    assert verify_fixture(d, "eagle3") is None
    load_checkpoint(d)


def test_refuses_foreign_directory(tmp_path):
    from models.fixtures import FixtureError

    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    with pytest.raises(FixtureError, match="not empty and holds no .kdsl-fixture marker"):
        write_fixture("eagle3", d)
    assert (d / "notes.txt").read_text() == "keep me"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(FixtureError, match="not a directory"):
        write_fixture("eagle3", f)


def test_verify_fixture_detects_damage(tmp_path):
    from models.fixtures import MARKER, verify_fixture

    d = write_fixture("eagle3", tmp_path / "v", seed=1)
    assert verify_fixture(d) is None and verify_fixture(d, "eagle3") is None
    assert "not 'kimi-k25'" in verify_fixture(d, "kimi-k25")
    shard = sorted(d.glob("*.safetensors"))[0]
    b = shard.read_bytes()
    shard.write_bytes(b[:-1] + bytes([b[-1] ^ 1]))
    assert "changed" in verify_fixture(d)
    shard.write_bytes(b)
    (d / "extra.safetensors").write_bytes(b"x")
    assert "extra" in verify_fixture(d)
    (d / "extra.safetensors").unlink()
    m = json.loads((d / MARKER).read_text())
    (d / MARKER).write_text(json.dumps(dict(m, complete=False)))
    assert "incomplete" in verify_fixture(d)
    (d / MARKER).unlink()
    assert "no .kdsl-fixture" in verify_fixture(d)


def test_size_bounds(tmp_path):
    from models.fixtures import FixtureError

    for kw, msg in ((dict(hidden=0), "--hidden must be >= 1"), (dict(layers=-3), "--layers must be >= 1"),
                    (dict(experts=8, topk=9), "--topk"), (dict(kv_heads=3), "--kv-heads"),
                    (dict(rope_dim=15), "--rope-dim must be even"), (dict(group=24), "--group"),
                    (dict(layers=1000, experts=1024, hidden=4096), "fixture budget"),
                    (dict(vocab=8), "--vocab must be >= 16"), (dict(shards=10 ** 6), "--shards"),
                    (dict(pack_method="zigzag"), "--pack-method")):
        with pytest.raises(FixtureError, match=msg):
            write_fixture("kimi-k25", tmp_path / "s", **kw)
    assert not (tmp_path / "s").exists()          # refused before anything was written
