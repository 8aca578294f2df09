"""Checkpoint loading: every fixture kind round-trips exactly, format detection, fp8 fnuz, errors, memory."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from models.config import ConfigError, load_config
from models.fixtures import KINDS, build_fixture, save_fixture, write_fixture
from models.formats import FormatError, QuantLinear, build_linear, detect_format, dequantize, fp8_to_fnuz
from models.loader import load_checkpoint, load_draft, load_target, stack_experts
from ops.packing import pack_int4

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fx_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("fixtures")
    return {k: write_fixture(k, base / k, seed=3) for k in KINDS}


def _roundtrip(ck, fx):
    assert set(ck.weights) == set(fx.reference), set(ck.weights) ^ set(fx.reference)
    for name, ref in fx.reference.items():
        got = dequantize(ck.weights[name])
        assert got.shape == ref.shape, name
        assert torch.equal(got, ref), f"{name}: max diff {(got - ref).abs().max()}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", [None, "gfx942"])
def test_fixture_roundtrip_exact(fx_dir, kind, arch):
    """Dequantized loaded weights equal the writer's f32 reference exactly (int4 grid x scale, fp8 x scale)."""
    ck = load_checkpoint(fx_dir[kind], arch=arch)
    _roundtrip(ck, build_fixture(kind, seed=3))
    expect = {"kimi-k25": ("compressed-tensors", "ct", 32), "kimi-k25-w4a8": ("quark-w4a8", "quark_reorder", 0),
              "eagle3-int4": ("quark-int4", "quark_reorder", 0),
              "eagle3-fp8": ("quark-fp8", "e4m3fnuz" if arch == "gfx942" else "e4m3fn", 0)}
    expect["kimi-k25-mxfp4"] = ("quark-mxfp4", "e2m1", 32)
    q = [w for w in ck.weights.values() if isinstance(w, QuantLinear)]
    if kind in expect:
        assert q and {(w.source, w.pack, w.group) for w in q} == {expect[kind]}
        for w in q:   # per-channel scales f32; compressed-tensors group scales stay bf16 (as stored)
            if w.kind == "mxfp4":  # E8M0 scale bytes per 32, two fp4 codes per byte, as stored
                assert w.scale.dtype == w.packed.dtype == torch.uint8
                assert tuple(w.packed.shape) == (w.shape[0], w.shape[1] // 2)
                continue
            assert w.scale.dtype == (torch.bfloat16 if w.group else torch.float32)
            if w.kind == "int4":
                assert w.packed.dtype == torch.int32 and tuple(w.packed.shape) == (w.shape[0], w.shape[1] // 8)
    else:
        assert not q
    if kind.startswith("kimi"):
        assert sorted(ck.skipped) == ["mm_projector.proj.0.weight", "vision_tower.patch_embed.proj.weight"]
        assert ck["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_stored_bits_follow_reference_spec(fx_dir):
    """Independent of ops.packing: ct nibble i of word c = q[8c+i] + 8; Quark reorder nibble i = q[8c+order[i]]."""
    ck = load_checkpoint(fx_dir["kimi-k25"])
    ref = build_fixture("kimi-k25", seed=3).reference
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    w = ck[name]
    words = w.packed.to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([((words >> (4 * i)) & 0xF) - 8 for i in range(8)], -1).reshape(w.shape)
    scale = w.scale.repeat_interleave(32, dim=1)
    assert torch.equal(q.float() * scale, ref[name])
    ck = load_checkpoint(fx_dir["kimi-k25-w4a8"])
    w = ck[name]
    words = w.packed.to(torch.int64) & 0xFFFFFFFF
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    q = torch.empty(*words.shape, 8, dtype=torch.int64)
    for i, src in enumerate(order):
        nib = (words >> (4 * i)) & 0xF
        q[..., src] = torch.where(nib >= 8, nib - 16, nib)
    assert torch.equal(q.reshape(w.shape).float() * w.scale[:, None], build_fixture("kimi-k25-w4a8", seed=3).reference[name])


def test_repack_dtype_single_file_and_int4_order(tmp_path):
    """int4_pack repacks at load; dtype converts f16 -> bf16 by value; single-file + `layers.0.` names;
    Quark `pack_method: order`."""
    ck = load_checkpoint(write_fixture("kimi-k25", tmp_path / "k", seed=1), int4_pack="quark_order")
    assert {w.pack for w in ck.weights.values() if isinstance(w, QuantLinear)} == {"quark_order"}
    _roundtrip(ck, build_fixture("kimi-k25", seed=1))
    p = write_fixture("eagle3-fp8", tmp_path / "f", seed=1, shards=1)
    assert (p / "model.safetensors").exists() and not (p / "model.safetensors.index.json").exists()
    ck = load_checkpoint(p, dtype=torch.bfloat16)
    fref = build_fixture("eagle3-fp8", seed=1).reference
    e = ck["embed_tokens.weight"]
    assert e.dtype == torch.bfloat16 and torch.equal(e, fref["embed_tokens.weight"].half().to(torch.bfloat16))
    assert "midlayer.self_attn.q_proj.weight" in ck
    p = write_fixture("eagle3-int4", tmp_path / "o", seed=2, pack_method="order")
    ck = load_checkpoint(p)
    assert {w.pack for w in ck.weights.values() if isinstance(w, QuantLinear)} == {"quark_order"}
    _roundtrip(ck, build_fixture("eagle3-int4", seed=2, pack_method="order"))


def test_quark_per_group_transposed(tmp_path):
    """Quark per-group int4 is stored [in, out/8] + scale [in/g, out]; loaded as [out, in/8] + [out, in/g]."""
    fx = build_fixture("eagle3-int4", seed=4, pack_method="order")
    base = "midlayer.mlp.gate_proj"
    n, k, g = 128, 64, 32
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    scale = torch.rand(k // g, n) + 0.5
    fx.tensors[base + ".weight"] = pack_int4(q.t().contiguous(), "quark_order")
    fx.tensors[base + ".weight_scale"] = scale
    ck = load_checkpoint(save_fixture(fx, tmp_path / "g"))
    w = ck[base + ".weight"]
    assert (w.group, tuple(w.packed.shape), tuple(w.scale.shape)) == (32, (n, k // 8), (n, k // g))
    assert torch.equal(dequantize(w), q.float() * scale.t().repeat_interleave(g, dim=1))


def test_detect_format_from_tensors():
    def det(names: dict[str, torch.dtype]) -> str:
        return detect_format("x", lambda n: n in names, lambda n: names[n])
    assert det({"x.weight": torch.bfloat16}) == "dense"
    assert det({"x.weight": torch.float16}) == "dense"
    assert det({"x.weight_packed": torch.int32, "x.weight_scale": torch.bfloat16}) == "ct-int4"
    assert det({"x.weight": torch.int32, "x.weight_scale": torch.float32}) == "quark-int4"
    assert det({"x.weight": torch.int32, "x.weight_scale": torch.float32, "x.weight_scale_2": torch.float32}) == "quark-w4a8"
    assert det({"x.weight": torch.float8_e4m3fn, "x.weight_scale": torch.float32}) == "quark-fp8"
    with pytest.raises(FormatError, match="'x.weight'.*missing"):
        det({})
    with pytest.raises(FormatError, match="'x.weight'.*int8"):
        det({"x.weight": torch.int8})


def test_fp8_fnuz_conversion_values_equal():
    """All 256 e4m3fn bit patterns except NaN: fnuz value x 2 == fn value; -0 (0x80) becomes +0."""
    bits = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    w = bits.view(torch.float8_e4m3fn).reshape(16, 16)
    ok = ~torch.isnan(w.float())
    scale = torch.rand(16) + 0.25
    wz, sz = fp8_to_fnuz(w, scale)
    assert wz.dtype == torch.float8_e4m3fnuz and torch.equal(sz, scale * 2)
    assert torch.equal((wz.float() * sz[:, None])[ok], (w.float() * scale[:, None])[ok])
    assert not torch.isnan(wz.float()).any()          # 0x80 would be NaN in fnuz
    assert int(wz.view(torch.int8).reshape(-1)[0]) == 0


def _edit(tmp_path, kind, name, *, drop=None, put=None, cfg=None, shards=2):
    fx = build_fixture(kind, seed=5)
    if drop:
        del fx.tensors[drop]
    if put:
        fx.tensors.update(put)
    if cfg:
        cfg(fx.config)
    return save_fixture(fx, tmp_path / name, shards)


def test_error_missing_tensor(tmp_path):
    p = _edit(tmp_path, "kimi-k25-bf16", "a", drop="language_model.model.layers.3.self_attn.kv_b_proj.weight")
    with pytest.raises(FormatError, match=r"model\.layers\.3\.self_attn\.kv_b_proj\.weight.*missing"):
        load_checkpoint(p)
    p = _edit(tmp_path, "kimi-k25", "b", drop="language_model.model.layers.2.mlp.experts.7.down_proj.weight_scale")
    with pytest.raises(FormatError, match=r"experts\.7\.down_proj\.weight_scale.*missing"):
        load_checkpoint(p)
    p = _edit(tmp_path, "eagle3", "c", drop="fc.weight")
    with pytest.raises(FormatError, match=r"'fc\.weight'.*missing"):
        load_checkpoint(p)


def test_error_wrong_shape(tmp_path):
    p = _edit(tmp_path, "kimi-k25-bf16", "a",
              put={"language_model.model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 96, dtype=torch.bfloat16)})
    with pytest.raises(FormatError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight.*wrong shape \[64, 96\]"):
        load_checkpoint(p)
    p = _edit(tmp_path, "kimi-k25", "b", put={
        "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_scale": torch.ones(32, 3, dtype=torch.bfloat16)})
    with pytest.raises(FormatError, match=r"experts\.0\.gate_proj\.weight_scale.*wrong shape"):
        load_checkpoint(p)
    p = _edit(tmp_path, "eagle3-fp8", "c", put={"layers.0.self_attn.k_proj.weight_scale": torch.ones(5)})
    with pytest.raises(FormatError, match=r"k_proj\.weight_scale.*wrong shape \[5\]"):
        load_checkpoint(p)


def test_error_unknown_quant_and_pack_method(tmp_path):
    def qm(c):
        c["quantization_config"]["quant_method"] = "gptq"
    with pytest.raises(ConfigError, match=r"quantization_config\.quant_method.*gptq"):
        load_checkpoint(_edit(tmp_path, "eagle3-int4", "a", cfg=qm))

    def pm(c):
        c["quantization_config"]["export"]["pack_method"] = "zigzag"
    with pytest.raises(ConfigError, match=r"export\.pack_method.*zigzag"):
        load_checkpoint(_edit(tmp_path, "kimi-k25-w4a8", "b", cfg=pm))

    def noq(c):
        del c["quantization_config"]
    with pytest.raises(FormatError, match=r"midlayer\.self_attn\.q_proj\.weight.*quant method is None"):
        load_checkpoint(_edit(tmp_path, "eagle3-int4", "c", cfg=noq))


def test_draft_target_mismatch(tmp_path, fx_dir):
    tgt = load_config(fx_dir["kimi-k25"])
    ck = load_draft(fx_dir["eagle3"], target=tgt)
    assert ck["d2t"].dtype == torch.int64 and ck.config.capture_layer_ids(tgt.num_hidden_layers) == (2, 4, 5)
    load_draft(fx_dir["eagle3-mla"], target=tgt)
    with pytest.raises(ConfigError, match="draft hidden size mismatch"):
        load_draft(write_fixture("eagle3", tmp_path / "h", hidden=96), target=tgt)
    with pytest.raises(ConfigError, match="draft vocab mismatch"):
        load_draft(write_fixture("eagle3", tmp_path / "v", vocab=640), target=tgt)
    with pytest.raises(ConfigError, match="does not name an EAGLE-3 draft"):
        load_draft(fx_dir["kimi-k25"], target=tgt)
    with pytest.raises(ConfigError, match="not a target"):
        load_target(fx_dir["eagle3"])


def test_index_and_extra_layers(tmp_path):
    """A shard named in the index must exist; MTP layers (>= num_hidden_layers) are skipped."""
    p = _edit(tmp_path, "kimi-k25-bf16", "m",
              put={"language_model.model.layers.8.eh_proj.weight": torch.ones(4, 4, dtype=torch.bfloat16)})
    ck = load_checkpoint(p)
    assert "language_model.model.layers.8.eh_proj.weight" in ck.skipped
    idx = json.loads((p / "model.safetensors.index.json").read_text())
    idx["weight_map"]["language_model.model.norm.weight"] = "model-00009-of-00009.safetensors"
    (p / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(FormatError, match=r"model-00009-of-00009.*model\.norm\.weight"):
        load_checkpoint(p)


def test_build_linear_rejects_int4_in_ct_checkpoint():
    t = {"x.weight": torch.zeros(4, 1, dtype=torch.int32), "x.weight_scale": torch.ones(4)}
    with pytest.raises(FormatError, match=r"'x\.weight'.*compressed-tensors.*expected 'quark'"):
        build_linear("x", t.__getitem__, t.__contains__, lambda n: t[n].dtype, "compressed-tensors", "ct")


_PROBE = textwrap.dedent("""
    import sys
    from models.loader import load_checkpoint
    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    h0 = hwm()
    ck = load_checkpoint(sys.argv[1])
    print(ck.nbytes, hwm() - h0)
""")


def test_peak_memory_about_one_copy(tmp_path):
    """Peak RSS growth (VmHWM, includes mapped file pages) while loading stays <= 1.25 x weights + 4 MB (measured ~0.95 x).

    safetensors reads through private memory maps, so the dense weights ARE the mapped pages (one copy);
    a loader that materialized a second copy of the model would need >= 2 x weights. (The bf16 kind is
    used because it is the largest per second of writing; quantized kinds share the per-tensor path.)"""
    p = write_fixture("kimi-k25-bf16", tmp_path / "big", hidden=256, moe_intermediate=128, vocab=2048)
    r = subprocess.run([sys.executable, "-c", _PROBE, str(p)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    weights, peak = map(int, r.stdout.split())
    assert weights > 12e6
    assert peak <= 1.25 * weights + 4e6, f"peak growth {peak / 1e6:.1f} MB for {weights / 1e6:.1f} MB of weights"


def test_plain_deepseek_v3_layout(tmp_path):
    """A flat DeepSeek-V3 config with `model.layers.*` names (no text_config, no prefix) loads too."""
    fx = build_fixture("kimi-k25", seed=6)
    text = fx.config["text_config"]
    fx.config = dict(text, architectures=["DeepseekV3ForCausalLM"])
    fx.tensors = {n[len("language_model."):]: t for n, t in fx.tensors.items() if n.startswith("language_model.")}
    ck = load_target(save_fixture(fx, tmp_path / "flat"))
    assert ck.config.tensor_prefix == "" and ck.config.quantization.method == "compressed-tensors"
    assert not ck.skipped
    _roundtrip(ck, fx)


@pytest.mark.parametrize("kind,fmt", [("kimi-k25", "w4a16"), ("kimi-k25-w4a8", "w4a8"), ("kimi-k25-bf16", "bf16")])
def test_stack_experts_fused_moe_layout(fx_dir, kind, fmt):
    """Per-expert weights stacked into ops.moe.MoEWeights' layout, equal to the writer's values."""
    from ops.moe import MoEWeights
    from ops.packing import unpack_int4
    ck = load_checkpoint(fx_dir[kind])
    ref = build_fixture(kind, seed=3).reference
    d = stack_experts(ck, 2)
    assert d["fmt"] == fmt and MoEWeights(**d).dims() == (16, 64, 32)
    assert not any(n.startswith("model.layers.2.mlp.experts.") for n in ck.weights)
    p = "model.layers.2.mlp.experts.5."

    def deq(w, s):
        if fmt == "bf16":
            return w.float()
        q = unpack_int4(w, "ct_reorder" if fmt == "w4a16" else "quark_reorder").float()
        if s.dim() == 2:
            return (q.reshape(*s.shape, 32) * s.float()[..., None]).reshape(q.shape)
        return q * s[:, None]
    w13 = deq(d["w13"][5], None if d["s13"] is None else d["s13"][5])
    assert torch.equal(w13, torch.cat([ref[p + "gate_proj.weight"], ref[p + "up_proj.weight"]]))
    assert torch.equal(deq(d["w2"][5], None if d["s2"] is None else d["s2"][5]), ref[p + "down_proj.weight"])
    with pytest.raises(FormatError, match="layer 0 is not a MoE layer"):
        stack_experts(ck, 0)


# ----------------------------------------------------------------------------------------------
# issue 11.5: untrusted checkpoints


def _index(p: Path) -> dict:
    return json.loads((p / "model.safetensors.index.json").read_text())


def _write_index(p: Path, doc: dict) -> None:
    (p / "model.safetensors.index.json").write_text(json.dumps(doc))


def test_index_outside_directory_or_not_a_file(tmp_path):
    from models.loader import LoadError

    p = write_fixture("eagle3", tmp_path / "d", seed=1)
    doc = _index(p)
    name = next(iter(doc["weight_map"]))
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((p / doc["weight_map"][name]).read_bytes())
    for bad, why in ((str(outside), "points outside"), ("../outside.safetensors", "points outside"),
                     ("sub", "not a regular file"), ("/dev/zero", "points outside"), (7, "must be a file name"),
                     ("nope.safetensors", "does not exist")):
        (p / "sub").mkdir(exist_ok=True)
        d = json.loads(json.dumps(doc))
        d["weight_map"][name] = bad
        _write_index(p, d)
        with pytest.raises(LoadError, match=why):
            load_checkpoint(p)
    _write_index(p, {"weight_map": "x"})
    with pytest.raises(LoadError, match="weight_map"):
        load_checkpoint(p)
    (p / "model.safetensors.index.json").write_text('{"weight_map": {"a": "x", "a": "y"}}')
    with pytest.raises(LoadError, match="index.json.*'a' appears twice"):
        load_checkpoint(p)
    (p / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(LoadError, match="index.json: not a readable JSON"):
        load_checkpoint(p)


def test_tensor_in_two_shards(tmp_path):
    """A tensor stored twice (a stale shard, a hand-merged checkpoint) is refused naming both files."""
    from models.loader import LoadError
    from safetensors.torch import save_file

    p = write_fixture("eagle3", tmp_path / "a", seed=1, shards=1)
    save_file({"fc.weight": torch.zeros(64, 192, dtype=torch.bfloat16)}, str(p / "model-old.safetensors"))
    with pytest.raises(LoadError, match=r"'fc\.weight' is stored in two shards.*model"):
        load_checkpoint(p)
    # indexed: a shard of the index that also holds another shard's tensor
    q = write_fixture("eagle3", tmp_path / "b", seed=1)
    wm = _index(q)["weight_map"]
    first, second = sorted(set(wm.values()))
    victim = next(n for n, f in wm.items() if f == first)
    from safetensors.torch import load_file
    t = load_file(str(q / second))
    t[victim] = torch.zeros(1)
    save_file(t, str(q / second))
    with pytest.raises(LoadError, match="stored in two shards"):
        load_checkpoint(q)
    # index entry that its shard does not hold
    r = write_fixture("eagle3", tmp_path / "c", seed=1)
    doc = _index(r)
    doc["weight_map"]["ghost.weight"] = first
    _write_index(r, doc)
    with pytest.raises(LoadError, match=r"'ghost\.weight' is mapped to shard .* which does not hold it"):
        load_checkpoint(r)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "header"])
def test_safetensors_errors_name_the_shard(tmp_path, damage):
    from models.loader import LoadError

    p = write_fixture("eagle3", tmp_path / damage, seed=1)
    shard = sorted(p.glob("*.safetensors"))[-1]
    b = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(b[: len(b) // 2])
    elif damage == "garbage":
        shard.write_bytes(b"\xff" * 64)
    else:
        shard.write_bytes((10 ** 12).to_bytes(8, "little") + b[8:])
    with pytest.raises(LoadError, match=f"shard .*{shard.name}"):
        load_checkpoint(p)


def test_config_sizes_beyond_the_shards_fail_before_loading(tmp_path):
    """num_hidden_layers / n_routed_experts far beyond the stored tensors: refused in O(1), by name."""
    from models.loader import LoadError

    for field, value in (("num_hidden_layers", 1000), ("n_routed_experts", 16000), ("vocab_size", 1 << 23)):
        p = _edit(tmp_path, "kimi-k25-bf16", field, cfg=lambda c: c["text_config"].__setitem__(field, value))
        with pytest.raises(LoadError, match="config.json implies .* parameters .* shards hold"):
            load_checkpoint(p)


@pytest.mark.parametrize("name,kind", [
    ("language_model.model.layers.2.input_layernorm.weight", "kimi-k25-bf16"),
    ("language_model.model.layers.1.mlp.gate.e_score_correction_bias", "kimi-k25"),
    ("language_model.model.layers.1.mlp.experts.3.up_proj.weight_scale", "kimi-k25"),
    ("midlayer.hidden_norm.weight", "eagle3"),
])
def test_non_finite_cheap_tensors_refused(tmp_path, name, kind):
    from models.loader import LoadError

    fx = build_fixture(kind, seed=5)
    t = fx.tensors[name].clone()
    t.view(-1)[1] = float("nan")
    fx.tensors[name] = t
    p = save_fixture(fx, tmp_path / "x")
    base = name.removeprefix("language_model.").removesuffix("_scale")
    with pytest.raises(LoadError, match=f"tensor '{base}'.*(NaN or Inf)"):
        load_checkpoint(p)
    ck = load_checkpoint(p, check_finite=False)      # the check can be switched off
    assert ck is not None


def test_non_finite_large_weight_warns_with_name(tmp_path):
    from models.loader import NonFiniteWeightWarning

    fx = build_fixture("kimi-k25-bf16", seed=5)
    n = "language_model.model.layers.0.self_attn.o_proj.weight"
    t = fx.tensors[n].clone()
    t[3, 4] = float("inf")
    fx.tensors[n] = t
    p = save_fixture(fx, tmp_path / "w")
    for kw in (dict(check_finite="all"), dict(dtype=torch.float32)):   # read in full, or converted anyway
        with pytest.warns(NonFiniteWeightWarning, match=r"model\.layers\.0\.self_attn\.o_proj\.weight"):
            load_checkpoint(p, **kw)
    with pytest.raises(ValueError, match="check_finite must be"):
        load_checkpoint(p, check_finite="some")
