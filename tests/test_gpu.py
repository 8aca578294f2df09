"""GPU tier (marked `gpu`, skipped without one): every op the decode step launches at Kimi-K2.5 shapes on
the GPU against its torch reference, and the tiny model end to end on the device: no sync inside a
forward (torch.cuda.set_sync_debug_mode("error")), graphs on == graphs off token for token, greedy
spec == plain greedy, and the CLI with --device cuda.

Tolerances (bf16 outputs, f32 accumulation in both): GEMMs and norms 2e-2 x max|ref| absolute (one bf16
ulp of the largest output, a different summation order); attention 2e-2 absolute on outputs of
magnitude ~1 (softmax-weighted means of N(0,1) latents); MoE 1e-2 x max|ref| (tests/test_moe.py).
Fresh random data every test, outputs written into NaN-poisoned buffers where the op takes one.
Kimi shapes: hidden 7168, q_lora 1536, kv_lora 512 + rope 64, 64 heads x (128 nope + 64 rope), v 128,
expert intermediate 2048 (32 experts here, not 384, to keep memory small: the per-expert GEMMs are
the same), top-k 8, page size 64 (the tuned configs' page).
"""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

DEV = "cuda"
H, QA, KVA, R, NH, NOPE, V, I = 7168, 1536, 512, 64, 64, 128, 128, 2048


def _g(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _close(y: torch.Tensor, ref: torch.Tensor, rel: float = 2e-2) -> None:
    y, ref = y.float().cpu(), ref.float().cpu()          # some references compute on the host
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, ref, atol=rel * float(ref.abs().max()) + 1e-6, rtol=0)


@pytest.mark.parametrize("M", [1, 4, 32])
@pytest.mark.parametrize("N,K", [(QA + KVA + R, H), (NH * (NOPE + R), QA), (H, NH * V), (2 * I, H), (H, I)])
def test_gemm_bf16_kimi(M, N, K):
    from ops.gemm import gemm_bf16

    g = _g(M * 7 + N)
    x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
    w = (torch.randn(N, K, device=DEV, generator=g) / K ** 0.5).bfloat16()
    _close(gemm_bf16(x, w), gemm_bf16(x, w, backend="torch"))


@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("fmt", ["w4a8", "w4a16"])
def test_quantized_linears_kimi(M, fmt):
    from ops import gemm
    from ops.packing import pack_int4, quantize_int4_grouped, quantize_int4_per_channel

    g = _g(M + 100)
    N, K = 2 * I, H
    x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
    w = torch.randn(N, K, device=DEV, generator=g) * 0.05
    if fmt == "w4a8":
        q, s = quantize_int4_per_channel(w)
        wp = pack_int4(q.cpu(), "quark_reorder").to(DEV)
        y, ref = gemm.linear_w4a8(x, wp, s), gemm.linear_w4a8(x, wp, s, backend="torch")
    else:
        q, s = quantize_int4_grouped(w)
        wp = pack_int4(q.cpu(), "ct").to(DEV)
        y, ref = gemm.linear_w4a16(x, wp, s.bfloat16()), gemm.linear_w4a16(x, wp, s.bfloat16(), backend="torch")
    _close(y, ref)


@pytest.mark.parametrize("M", [1, 4, 64])
def test_norms_quant_rope_kimi(M):
    from ops.norm import rms_norm, silu_and_mul
    from ops.quant import quantize_int8
    from ops.rope import apply_rope, cos_sin

    g = _g(M + 200)
    x = torch.randn(M, H, device=DEV, generator=g).bfloat16()
    res = torch.randn(M, H, device=DEV, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(H, device=DEV, generator=g)).bfloat16()
    _close(rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6, backend="torch"))
    (y, r), (yr, rr) = rms_norm(x, w, 1e-6, residual=res), rms_norm(x, w, 1e-6, residual=res, backend="torch")
    _close(y, yr)
    _close(r, rr)
    gu = torch.randn(M, 2 * I, device=DEV, generator=g).bfloat16()
    _close(silu_and_mul(gu), silu_and_mul(gu, backend="torch"))
    q, s = quantize_int8(x)
    qr, sr = quantize_int8(x, backend="torch")
    assert (q.int() - qr.int()).abs().max() <= 1
    _close(s, sr, 1e-6)
    pos = torch.randint(0, 8192, (M,), device=DEV, generator=g)
    cos, sin = cos_sin(pos, R, 50000.0, {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                          "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    xr = torch.randn(M, NH, R, device=DEV, generator=g).bfloat16()
    for style in ("interleaved", "neox"):
        _close(apply_rope(xr, cos, sin, style), apply_rope(xr, cos, sin, style, backend="torch"))


@pytest.mark.parametrize("B,QL,r2", [(1, 1, R // 2), (4, 4, R // 2), (2, 4, 64)])
def test_step_prologue_kimi(B, QL, r2):
    """The step's bookkeeping launch (ops.step_prologue) against models.step.make_ctx + the rope
    table + the embedding + rmsnorm: indices and copied rows exact, the normed rows as a norm."""
    from models.kv_cache import PageTable
    from models.step import RopeTable, make_ctx
    from ops.norm import rms_norm
    from ops.step_prologue import run_prologue

    g = _g(B * 10 + QL)
    tab = PageTable(B + 1, 512, 64, device=DEV, max_pages=130)
    tab.lens.copy_(torch.randint(0, 8000, (B + 1,), device=DEV, generator=g).int())
    tab.bt.copy_(torch.randint(0, 512, (B + 1, 130), device=DEV, generator=g).int())
    rope = RopeTable(2 * r2, 50000.0, None, torch.device(DEV))
    rope.ensure(8192)
    emb = torch.randn(4096, H, device=DEV, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(H, device=DEV, generator=g)).bfloat16()
    tok = torch.randint(0, 4096, (B, QL), device=DEV, generator=g)
    seqs = torch.randperm(B + 1, device=DEV, generator=g)[:B]
    ctx = make_ctx(tab, B, QL, seqs)
    o = run_prologue(tok, tab.lens, tab.bt, 64, emb, rope.cos, rope.sin, seqs=seqs, norm_w=w, eps=1e-6)
    c, s = rope(ctx.positions)
    assert torch.equal(o["positions"], ctx.positions) and torch.equal(o["slots"], ctx.slots)
    assert torch.equal(o["seq_lens"], ctx.seq_lens) and torch.equal(o["cos"], c) and torch.equal(o["sin"], s)
    h = emb[tok.reshape(-1)]
    assert torch.equal(o["h"], h)
    _close(o["x"], rms_norm(h, w, 1e-6, backend="torch"))


def _paged(B: int, ctx: list[int], ps: int, width: int, g: torch.Generator):
    """A shuffled block table over enough pages for ctx, and the lengths."""
    per = -(-max(ctx) // ps)
    pages = torch.randperm(B * per + 3, device=DEV, generator=g)[: B * per].view(B, per).int()
    return pages, torch.tensor(ctx, dtype=torch.int32, device=DEV), B * per + 3


@pytest.mark.parametrize("B,QL,ctx", [(1, 1, [8192]), (4, 4, [300, 1000, 64, 4096]), (32, 1, [777] * 32)])
def test_mla_decode_and_append_kimi(B, QL, ctx):
    from ops.mla import append_latent, mla_decode

    g = _g(B * 31 + QL)
    ps = 64
    bt, lens, npages = _paged(B, ctx, ps, 0, g)
    kv = torch.randn(npages, ps, KVA + R, device=DEV, generator=g).bfloat16()
    new = torch.randn(B * QL, KVA + R, device=DEV, generator=g).bfloat16()
    pos = (lens.long()[:, None] - QL + torch.arange(QL, device=DEV)).reshape(-1)
    rows = pos.view(B, QL)
    slots = (bt.long().gather(1, rows // ps) * ps + rows % ps).reshape(-1)
    append_latent(kv, new, slots)
    torch.testing.assert_close(kv.view(-1, KVA + R)[slots], new, atol=0, rtol=0)
    q = torch.randn(B, QL, NH, KVA + R, device=DEV, generator=g).bfloat16()
    sc = (NOPE + R) ** -0.5
    out = mla_decode(q, kv, bt, lens, sc, latent_dim=KVA, out_dtype=torch.float32)
    ref = mla_decode(q, kv, bt, lens, sc, latent_dim=KVA, backend="torch", out_dtype=torch.float32)
    assert out.device.type == torch.device(DEV).type and torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu(), ref.float().cpu(), atol=2e-2, rtol=0)
    if QL > 1:                                           # tree verify: a chain mask == causal
        tm = torch.ones(QL, QL, device=DEV, dtype=torch.int8).tril()[None].expand(B, QL, QL).contiguous()
        tree = mla_decode(q, kv, bt, lens, sc, latent_dim=KVA, tree_mask=tm, out_dtype=torch.float32)
        torch.testing.assert_close(tree.cpu(), ref.float().cpu(), atol=2e-2, rtol=0)
        # a draft tree step's window over 5 earlier cached rows too (TW > q_len), against the torch backend
        win = (torch.rand(B, QL, QL + 5, device=DEV, generator=g) < 0.5).to(torch.int8)
        win[:, :, 5:] = tm
        wt = mla_decode(q, kv, bt, lens, sc, latent_dim=KVA, tree_mask=win, out_dtype=torch.float32)
        wr = mla_decode(q, kv, bt, lens, sc, latent_dim=KVA, tree_mask=win, backend="torch", out_dtype=torch.float32)
        torch.testing.assert_close(wt.cpu(), wr.float().cpu(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("B,QL,ctx", [(1, 1, [4096]), (8, 4, [100, 2000, 64, 4096, 5, 9, 300, 700])])
def test_paged_mha_decode_and_append_draft_shapes(B, QL, ctx):
    """The EAGLE-3 draft's attention: 64 q heads, 8 KV heads, head dim 128 (the K2.5 draft)."""
    from ops.mha import append_kv, paged_mha_decode

    g = _g(B * 13 + QL)
    ps, HQ, KVH, D = 64, 64, 8, 128
    bt, lens, npages = _paged(B, ctx, ps, 0, g)
    kc = torch.randn(npages, ps, KVH, D, device=DEV, generator=g).bfloat16()
    vc = torch.randn(npages, ps, KVH, D, device=DEV, generator=g).bfloat16()
    kn = torch.randn(B * QL, KVH, D, device=DEV, generator=g).bfloat16()
    vn = torch.randn(B * QL, KVH, D, device=DEV, generator=g).bfloat16()
    rows = lens.long()[:, None] - QL + torch.arange(QL, device=DEV)
    slots = (bt.long().gather(1, rows // ps) * ps + rows % ps).reshape(-1)
    append_kv(kc, vc, kn, vn, slots)
    torch.testing.assert_close(kc.view(-1, KVH, D)[slots], kn, atol=0, rtol=0)
    q = torch.randn(B, QL, HQ, D, device=DEV, generator=g).bfloat16()
    out = paged_mha_decode(q, kc, vc, bt, lens, D ** -0.5)
    ref = paged_mha_decode(q, kc, vc, bt, lens, D ** -0.5, backend="torch")
    assert out.device.type == torch.device(DEV).type and torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("fmt", ["w4a8", "w4a16"])
@pytest.mark.parametrize("M", [1, 8, 32])
def test_route_and_experts_kimi(fmt, M):
    from ops import moe
    from ops.packing import pack_int4, quantize_int4_grouped, quantize_int4_per_channel

    E, K = 32, 8
    g = torch.Generator().manual_seed(M)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.02
    w2 = torch.randn(E, H, I, generator=g) * 0.02
    if fmt == "w4a8":
        (q13, s13), (q2, s2) = quantize_int4_per_channel(w13), quantize_int4_per_channel(w2)
        W = moe.MoEWeights("w4a8", pack_int4(q13, "quark_reorder").to(DEV), pack_int4(q2, "quark_reorder").to(DEV),
                           s13.to(DEV), s2.to(DEV))
    else:
        (q13, s13), (q2, s2) = quantize_int4_grouped(w13), quantize_int4_grouped(w2)
        W = moe.MoEWeights("w4a16", pack_int4(q13, "ct_reorder").to(DEV), pack_int4(q2, "ct_reorder").to(DEV),
                           s13.bfloat16().to(DEV), s2.bfloat16().to(DEV))
    x = torch.randn(M, H, generator=g).bfloat16().to(DEV)
    wg = (torch.randn(E, H, generator=g) * 0.02).bfloat16().to(DEV)
    bias = (torch.randn(E, generator=g) * 0.01).to(DEV)
    ids, wts = moe.route(x, wg, bias, K, routed_scaling_factor=2.827)
    rids, rw = moe.route(x, wg, bias, K, routed_scaling_factor=2.827, backend="torch")
    same = (ids.sort(-1).values.cpu() == rids.sort(-1).values.cpu()).float().mean()
    assert same > 0.99                                                         # near-ties may swap
    y = moe.fused_experts(x, rids, rw, W, check_ids=False)
    ref = moe.fused_experts(x, rids, rw, W, backend="torch")
    torch.testing.assert_close(y.cpu(), ref.float().cpu(), atol=1e-2 * float(ref.abs().max()), rtol=0)


# ---------------------------------------------------------------------------------------------
# the tiny model end to end on the device

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from models.eagle3 import Eagle3Draft
    from models.fixtures import write_fixture
    from models.kimi import KimiModel
    from models.loader import load_draft, load_target

    root = tmp_path_factory.mktemp("gpu_fx")
    write_fixture("kimi-k25", root / "t", seed=0)
    write_fixture("eagle3", root / "d", seed=1)
    tk = load_target(root / "t")
    dk = load_draft(root / "d", tk.config)
    out = {}
    for backend in ("triton", "torch"):
        out[backend] = (KimiModel(tk, backend=backend, device=DEV),
                        Eagle3Draft(dk, target_hidden=tk.config.hidden_size, backend=backend, device=DEV))
    return out


PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 41)), [100], [7, 300, 12, 44, 91, 2, 18, 250]]


class _SyncChecked:
    """Wraps a model so that every `step` runs under torch.cuda.set_sync_debug_mode("error")."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return self.inner.step(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_steps_make_no_sync(tiny, backend):
    """Decode, verify and draft steps on the device under sync-debug 'error' (any sync raises)."""
    from models.spec import Engine, SpecParams

    m, d = tiny[backend]
    r = Engine(_SyncChecked(m), _SyncChecked(d)).generate(PROMPTS, 10, "spec", SpecParams(steps=3))
    p = Engine(_SyncChecked(m), d).generate(PROMPTS, 10, "plain")
    t = Engine(_SyncChecked(m), _SyncChecked(d)).generate(PROMPTS, 10, "spec", SpecParams(steps=3, topk=2, draft_tokens=6))
    assert r.outputs == p.outputs == t.outputs


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("mode", ["plain", "spec", "tree"])
def test_graphs_on_equals_off(tiny, backend, mode):
    from models.spec import Engine, SpecParams

    m, d = tiny[backend]
    params = SpecParams(steps=3, topk=2, draft_tokens=6) if mode == "tree" else SpecParams(steps=3)
    mode = "spec" if mode == "tree" else mode
    off = Engine(m, d, graphs="off").generate(PROMPTS[:3], 12, mode, params)
    e = Engine(m, d, graphs="on")
    on = e.generate(PROMPTS[:3], 12, mode, params)
    assert on.outputs == off.outputs
    assert e.last_graphs.captures >= 1 and e.last_graphs.replays >= 2
    assert {key[1] for key in e.last_graphs.entries} == {4}          # batch 3 -> bucket 4


@pytest.mark.parametrize("steps", [1, 3])
def test_spec_equals_plain_greedy_on_device(tiny, steps):
    from models.spec import Engine, SpecParams

    m, d = tiny["triton"]
    plain = Engine(m, d, graphs="on").generate(PROMPTS, 14, "plain")
    spec = Engine(m, d, graphs="on").generate(PROMPTS, 14, "spec", SpecParams(steps=steps))
    assert spec.outputs == plain.outputs


def test_cli_on_cuda(tmp_path, monkeypatch, capsys):
    from models import generate as G

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for backend in ("triton", "torch"):
        assert G.main(["--json", "--device", "cuda", "--backend", backend, "--max-new-tokens", "8", "--batch", "3"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["lossless"] is True and r["device"] == "cuda" and r["graphs"] == "on"
