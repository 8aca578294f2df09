"""Quark MXFP4 checkpoints: the `kimi-k25-mxfp4` fixture loads losslessly, its experts stack into
ops.mxfp4's weights and its MoE layer runs on both backends; bad tensors and configs are named."""
from __future__ import annotations

import json

import pytest
import torch

import ops.mxfp4 as X
from models.fixtures import build_fixture, main as fixtures_main, save_fixture
from models.formats import FormatError, QuantLinear, dequantize
from models.loader import LoadError, load_target, stack_experts
from ops.moe import MoEConfig


@pytest.fixture(scope="module")
def mx_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("mx") / "kimi-k25-mxfp4"
    assert fixtures_main(["--kind", "kimi-k25-mxfp4", "--out", str(d), "--seed", "3"]) == 0
    return d


def test_fixture_layout_and_lossless_load(mx_dir):
    cfg = json.loads((mx_dir / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "quark" and q["global_quant_config"]["weight"]["dtype"] == "fp4"
    assert q["global_quant_config"]["input_tensors"]["is_dynamic"] is True
    ref = build_fixture("kimi-k25-mxfp4", seed=3).reference
    ck = load_target(mx_dir)
    e0 = ck["model.layers.1.mlp.experts.0.gate_proj.weight"]
    assert isinstance(e0, QuantLinear) and e0.kind == "mxfp4" and e0.packed.dtype == torch.uint8
    assert e0.scale.dtype == torch.uint8 and e0.scale.shape == (e0.shape[0], e0.shape[1] // 32)
    gate = ck["model.layers.1.mlp.gate.weight"]  # the MXFP4 router, exactly in bf16
    assert isinstance(gate, torch.Tensor) and gate.dtype == torch.bfloat16
    n = 0
    for name, w in ck.weights.items():
        if name in ref:
            v = dequantize(w, torch.float32) if isinstance(w, QuantLinear) else w.float()
            assert torch.equal(v, ref[name]), name
            n += 1
    assert n == len(ref)


def test_experts_stack_and_moe_layer_on_both_backends(mx_dir):
    ck = load_target(mx_dir)
    w = X.experts_weights(stack_experts(ck, 1, pop=False))
    assert isinstance(w, X.MXFP4Weights) and (w.act, w.act_rule) == ("mxfp4", "even")
    E, H, I = w.dims()
    assert (E, H, I) == (ck.config.n_routed_experts, ck.config.hidden_size, ck.config.moe_intermediate_size)
    assert torch.equal(w.dequant("13")[0, :I], dequantize(ck["model.layers.1.mlp.experts.0.gate_proj.weight"]))
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    gate = ck["model.layers.1.mlp.gate.weight"]
    bias = ck["model.layers.1.mlp.gate.e_score_correction_bias"].float()
    mc = MoEConfig(top_k=ck.config.num_experts_per_tok)
    yt = X.fused_moe(x, gate, bias, w, cfg=mc, backend="triton").float()
    yr = X.fused_moe(x, gate, bias, w, cfg=mc, backend="torch").float()
    assert not yt.isnan().any()
    assert (yt - yr).abs().max().item() <= 2.0 ** -7 * yr.abs().max().item()
    # the dispatcher the model layer can call for every expert format
    ids = torch.tensor([[0, 1, 2, 3]] * 4, dtype=torch.int32)
    wts = torch.full((4, 4), 0.25)
    assert torch.equal(X.fused_experts_any(x, ids, wts, w), X.fused_experts(x, ids, wts, w))


def test_w4a8_fp8_variant_takes_static_input_scales(tmp_path):
    """The W4A8 scheme (fp8_e4m3 static per-tensor activations): input_scale per expert linear; the
    stacked weights carry the max over experts per stage."""
    fx = build_fixture("kimi-k25-mxfp4", seed=4, layers=2)
    g = fx.config["quantization_config"]["global_quant_config"]
    g["input_tensors"] = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True}
    for name in [n for n in fx.tensors if ".experts." in n and n.endswith(".weight")]:
        e = int(name.split(".experts.")[1].split(".")[0])
        fx.tensors[name[: -len("weight")] + "input_scale"] = torch.tensor(0.01 * (1 + e), dtype=torch.float32)
    save_fixture(fx, tmp_path / "w4a8")
    ck = load_target(tmp_path / "w4a8")
    st = stack_experts(ck, 1, pop=False)
    w = X.experts_weights(st)
    E = ck.config.n_routed_experts
    assert w.act == "fp8" and w.a13_scale.item() == pytest.approx(0.01 * E) and w.a2_scale.item() == pytest.approx(0.01 * E)
    x = torch.randn(2, w.dims()[1]).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)
    wts = torch.rand(2, 2)
    r = X.experts_ref(x, ids, wts, w)
    y = X.fused_experts(x, ids, wts, w)
    assert (y - r).abs().max().item() <= 1e-5 * r.abs().max().item()


def test_bad_tensors_and_configs_are_named(tmp_path):
    fx = build_fixture("kimi-k25-mxfp4", seed=5, layers=2)
    name = "language_model.model.layers.1.mlp.experts.2.up_proj.weight_scale"
    fx.tensors[name] = fx.tensors[name][:, :1].contiguous()
    save_fixture(fx, tmp_path / "bad")
    with pytest.raises(FormatError, match="experts.2.up_proj.weight_scale"):
        load_target(tmp_path / "bad")
    fx = build_fixture("kimi-k25-mxfp4", seed=5, layers=2)
    fx.config["quantization_config"]["global_quant_config"]["input_tensors"]["dtype"] = "int8"
    save_fixture(fx, tmp_path / "badcfg")
    ck = load_target(tmp_path / "badcfg")
    with pytest.raises(LoadError, match="input_tensors.dtype"):
        stack_experts(ck, 1, pop=False)
