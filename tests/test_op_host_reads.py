"""No op launch path reads the device on the host (issue 12.2, ops side).

Every op the decode step launches runs under a TorchFunctionMode that raises on each way a tensor's
data can reach the host (item, tolist, bool/int/index/float conversions, cpu, numpy, nonzero,
unique) and on tensors made from host data (torch.tensor). A launch that passes is free of
device -> host syncs, so it can be captured in a CUDA graph. The triton backend must pass; the
torch backend's references loop over sequences on the host and are not meant to be captured.
"""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ops import gemm, mha, mla, moe, norm, quant, rope
from ops.packing import pack_int4

FORBIDDEN = {"item", "tolist", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy", "nonzero",
             "unique", "unique_consecutive", "tensor", "masked_select", "argwhere", "equal", "allclose"}


class HostReadError(AssertionError):
    pass


class NoHostReads(TorchFunctionMode):
    """Raise on any device -> host read of tensor data, and on torch.tensor(host data)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in FORBIDDEN:
            raise HostReadError(f"host read inside an op launch: {name}")
        return func(*args, **(kwargs or {}))


def _rand(*shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def test_probe_catches_reads() -> None:
    t = torch.tensor([3])
    for read in (lambda: t.item(), lambda: int(t), lambda: bool(t), lambda: t.tolist(), lambda: t.cpu(),
                 lambda: [0, 1, 2, 3][t], lambda: torch.tensor([1, 2]), lambda: t.nonzero()):
        with NoHostReads(), pytest.raises(HostReadError):
            read()


def _paged(B=2, QL=1, H=4, D=48, PS=8, MP=4):
    g = torch.Generator().manual_seed(1)
    NP = B * MP + 1
    bt = torch.randperm(NP, generator=g)[: B * MP].view(B, MP).to(torch.int32)
    lens = (torch.arange(B, dtype=torch.int32) * 5 + 7 + QL)
    return bt, lens, NP, PS


@pytest.mark.parametrize("q_len,tree,tw", [(1, False, 0), (4, False, 0), (4, True, 4), (2, True, 5)])
def test_mla_decode_and_append(q_len: int, tree: bool, tw: int) -> None:
    bt, lens, NP, PS = _paged(QL=q_len)
    kv = _rand(NP, PS, 48, seed=2)
    q = _rand(2, q_len, 4, 48, seed=3)
    new = _rand(3, 48, seed=4)
    slots = torch.tensor([1, -1, 9])
    tm = torch.ones(2, q_len, tw, dtype=torch.int8).tril(tw - q_len) if tree else None   # tw > q_len: a draft tree step
    with NoHostReads():
        mla.append_latent(kv, new, slots)
        out = mla.mla_decode(q, kv, bt, lens, 0.3, latent_dim=32, tree_mask=tm)
        mla.mla_decode(q, kv, bt, lens, 0.3, latent_dim=32, tree_mask=tm, invariant=False, cu_count=304)
    assert out.shape == (2, q_len, 4, 32)


@pytest.mark.parametrize("q_len,tree", [(1, False), (3, False), (2, True)])
def test_paged_mha_and_append(q_len: int, tree: bool) -> None:
    bt, lens, NP, PS = _paged(QL=q_len)
    kc, vc = _rand(NP, PS, 2, 16, seed=5), _rand(NP, PS, 2, 16, seed=6)
    q = _rand(2, q_len, 4, 16, seed=7)
    kn, vn = _rand(3, 2, 16, seed=8), _rand(3, 2, 16, seed=9)
    slots = torch.tensor([0, 5, -1])
    tm = torch.ones(2, q_len, q_len + 1, dtype=torch.int8) if tree else None
    with NoHostReads():
        mha.append_kv(kc, vc, kn, vn, slots)
        out = mha.paged_mha_decode(q, kc, vc, bt, lens, 0.25, tree_mask=tm)
        mha.paged_mha_decode(q, kc, vc, bt, lens, 0.25, tree_mask=tm, invariant=False, cu_count=132)
    assert out.shape == (2, q_len, 4, 16)


@pytest.mark.parametrize("fmt", ["w4a8", "bf16"])
def test_route_and_fused_moe(fmt: str) -> None:
    E, H, I, M = 8, 64, 32, 3
    x = _rand(M, H, seed=10)
    wg = _rand(E, H, seed=11, dtype=torch.float32) * 0.1
    bias = _rand(E, seed=12, dtype=torch.float32) * 0.01
    if fmt == "bf16":
        w = moe.MoEWeights("bf16", _rand(E, 2 * I, H, seed=13) * 0.1, _rand(E, H, I, seed=14) * 0.1)
    else:
        g = torch.Generator().manual_seed(15)
        q13 = torch.randint(-8, 8, (E, 2 * I, H), generator=g, dtype=torch.int32)
        q2 = torch.randint(-8, 8, (E, H, I), generator=g, dtype=torch.int32)
        w = moe.MoEWeights("w4a8", pack_int4(q13, "quark_reorder"), pack_int4(q2, "quark_reorder"),
                           torch.rand(E, 2 * I, generator=g) * 0.01, torch.rand(E, H, generator=g) * 0.01)
    cfg = moe.MoEConfig(top_k=2, routed_scaling_factor=1.5)
    with NoHostReads():
        ids, wts = moe.route(x, wg, bias, 2)
        moe.fused_experts(x, ids, wts, w, check_ids=False)
        moe.fused_experts(x, ids, wts, w, check_ids=False, invariant=False)
        y = moe.fused_moe(x, wg.to(torch.bfloat16), bias, w, cfg=cfg)
    assert y.shape == (M, H)


def test_gemm_norm_rope_quant() -> None:
    M, N, K = 3, 32, 64
    x = _rand(M, K, seed=20)
    w = _rand(N, K, seed=21)
    g = torch.Generator().manual_seed(22)
    w4 = pack_int4(torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int32), "quark_reorder")
    ws = torch.rand(N, generator=g)
    xr = _rand(5, 2, 16, seed=23)
    pos = torch.arange(5)
    with NoHostReads():
        gemm.gemm_bf16(x, w)
        gemm.linear_w4a8(x, w4, ws)
        quant.quantize_int8(x)
        norm.rms_norm(x, _rand(K, seed=24), 1e-6)
        norm.rms_norm(x, _rand(K, seed=24), 1e-6, residual=_rand(M, K, seed=25))
        norm.silu_and_mul(x)
        cos, sin = rope.cos_sin(pos, 16, 10000.0)
        rope.apply_rope(xr, cos, sin, "interleaved")
        rope.apply_rope(xr, cos, sin, "neox")
