"""MXFP4 (OCP MX): the format reference, the DSL's scaled dot, the quantizer, GEMM and MoE stages.

Tolerances: decoding, quantization and fp8 conversion are bit-exact; GEMM outputs (f32 accumulate,
bf16 store) are compared with the f64 reference rounded to bf16, allowed one bf16 ulp of the largest
|output| for the f32 summation order; fused experts within 1e-5 x max|reference| (f32 sums)."""
from __future__ import annotations

import pytest
import torch

import kdsl as kd
from kdsl import aot
from kdsl.errors import TraceError
import ops.mxfp4 as X


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


# ----------------------------------------------------------------------------------------------
# tier 0: the format

def test_e2m1_every_code_matches_the_ocp_table():
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    got = X.e2m1_to_f32(torch.arange(16, dtype=torch.uint8))
    assert got[:8].tolist() == want and (-got[8:]).tolist() == want
    assert torch.signbit(got[8]) and not torch.signbit(got[0])  # code 8 is -0


def test_e8m0_every_exponent_and_the_nan_code():
    v = X.e8m0_to_f32(torch.arange(256, dtype=torch.uint8))
    for e in range(255):
        assert v[e].item() == 2.0 ** (e - 127), e
    assert torch.isnan(v[255])


def test_pack_unpack_round_trip_low_nibble_first():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    p = X.pack_fp4(codes)
    assert p.shape == (3, 32) and torch.equal(X.unpack_fp4(p), codes)
    assert X.pack_fp4(torch.tensor([[1, 2]], dtype=torch.uint8)).item() == 0x21


@pytest.mark.parametrize("v,code", [(0.25, 0), (0.26, 1), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (2.6, 5),
                                    (3.5, 6), (5.0, 6), (5.1, 7), (6.0, 7), (1e9, 7), (-0.1, 8), (-6.5, 15)])
def test_e2m1_rounding_ties_to_even_and_saturates(v, code):
    assert X.e2m1_round_ref(torch.tensor([v])).item() == code


def test_scale_rules_even_rounds_the_absmax_up_floor_does_not():
    amax = torch.tensor([0.0, 1.0, 1.5, 1.75, 7.0, 6.0, float("inf"), 2.0 ** -130])
    assert X.mx_scale_exp_ref(amax, "floor").tolist() == [-127, -2, -2, -2, 0, 0, 127, -127]
    assert X.mx_scale_exp_ref(amax, "even").tolist() == [-127, -2, -2, -1, 1, 0, 127, -127]


def test_quant_ref_error_bound():
    x = torch.randn(4, 256) * torch.logspace(-3, 3, 4)[:, None]
    q, s = X.quant_mxfp4_ref(x)
    d = X.dequant_mxfp4_ref(q, s)
    step = X.e8m0_to_f32(s).repeat_interleave(32, -1)  # one unit of the coarsest e2m1 step (2)
    assert ((d - x).abs() <= step + 1e-30).all()


# ----------------------------------------------------------------------------------------------
# tier 1: interpreter

def test_decode_kernel_is_bit_exact_for_every_code_and_every_scale():
    N, K = 256, 512
    w = torch.arange(256, dtype=torch.uint8).repeat(N, 1)  # every byte = every pair of codes
    ws = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, K // 32)  # row n: scale byte n (255 = NaN)
    out = torch.full((N, K), float("nan"))
    X.dequant_mxfp4(w, ws, out)
    assert _same_bits(out, X.dequant_mxfp4_ref(w, ws))


@pytest.mark.parametrize("rule", X.SCALE_RULES)
@pytest.mark.parametrize("M,K", [(1, 32), (5, 96), (3, 256)])
def test_quant_kernel_bit_exact(rule, M, K):
    g = torch.Generator().manual_seed(M * K)
    x = torch.randn(M, K, generator=g) * torch.logspace(-20, 20, M * K // 32).repeat_interleave(32).reshape(M, K)
    # ties of the e2m1 grid and amax mantissas around the 0.75 rounding point, at powers of two
    x[0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0]) * 2.0 ** 5
    x = x.to(torch.bfloat16)
    q = torch.full((M, K // 2), 0xAA, dtype=torch.uint8)
    s = torch.full((M, K // 32), 0xAA, dtype=torch.uint8)
    X.quant_mxfp4(x, q, s, config={"SCALE_RULE": rule})
    rq, rs = X.quant_mxfp4_ref(x, rule)
    assert torch.equal(s, rs) and torch.equal(q, rq)


def test_quant_fp8_static_bit_exact():
    x = (torch.randn(3, 640) * 50).to(torch.bfloat16)
    sc = torch.tensor([0.07])
    q = torch.full((3, 640), float("nan")).to(torch.float8_e4m3fn)
    X.quant_fp8_static(x, sc, q)
    assert torch.equal(q.view(torch.uint8), X.quant_fp8_static_ref(x, sc).view(torch.uint8))
    qb = torch.full((3, 640), float("nan"), dtype=torch.bfloat16)
    X.quant_fp8_static_bf16(x, sc, qb)
    assert _same_bits(qb.float(), X.quant_fp8_static_ref(x, sc).float())


def _rand_mx(g: torch.Generator, rows: int, k: int, lo: int = 117, hi: int = 137) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8),
            torch.randint(lo, hi, (rows, k // 32), generator=g, dtype=torch.uint8))


def _close_bf16(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 2.0 ** -7 * ref.abs().max().item()  # one bf16 ulp of the largest value (f32 summation order)
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("M,N,K", [(1, 16, 64), (5, 40, 96), (17, 64, 384)])
def test_gemm_mxfp4_w4a4(M, N, K):
    g = torch.Generator().manual_seed(M + N + K)
    xq, xs = _rand_mx(g, M, K)
    wq, ws = _rand_mx(g, N, K)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    X.gemm_mxfp4(xq, xs, wq, ws, out)
    _close_bf16(out, X.gemm_mxfp4_ref(xq, xs, wq, ws))


@pytest.mark.parametrize("M,N,K", [(1, 16, 64), (6, 48, 160)])
def test_gemm_mxfp4_bf16_activations(M, N, K):
    g = torch.Generator().manual_seed(M * N)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    wq, ws = _rand_mx(g, N, K)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    X.gemm_mxfp4_bf16a(x, wq, ws, out)
    _close_bf16(out, X.gemm_mxfp4_ref(x, None, wq, ws))


def test_gemm_nan_scale_poisons_only_its_row_and_guards_are_not_read():
    """Scales and weights are views into bigger buffers whose guard regions hold NaN scales and
    codes: a read outside the operands would turn whole outputs to NaN."""
    g = torch.Generator().manual_seed(1)
    M, N, K = 3, 24, 96
    xq, xs = _rand_mx(g, M, K)
    wq, ws = _rand_mx(g, N, K)
    big_s = torch.full((N + 8, K // 32 + 5), X.E8M0_NAN, dtype=torch.uint8)
    big_s[4:4 + N, 2:2 + K // 32] = ws
    big_w = torch.full((N + 8, K // 2 + 40), 0xFF, dtype=torch.uint8)
    big_w[4:4 + N, 20:20 + K // 2] = wq
    ws_v, wq_v = big_s[4:4 + N, 2:2 + K // 32], big_w[4:4 + N, 20:20 + K // 2]
    ws_v[5, 1] = X.E8M0_NAN  # one NaN scale: column 5 becomes NaN, nothing else
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    X.gemm_mxfp4(xq, xs, wq_v, ws_v, out)
    assert out[:, 5].isnan().all()
    keep = [j for j in range(N) if j != 5]
    _close_bf16(out[:, keep], X.gemm_mxfp4_ref(xq, xs, wq, ws)[:, keep])


def test_dsl_rejects_misuse():
    @kd.kernel(name="_mx_bad_groups")
    def bad(x: kd.In["M", "K", kd.fp4_e2m1], xs: kd.In["M", "KG", kd.e8m0], out: kd.Out["M", "M2", kd.f32]):
        m, = kd.grid("M")
        k = kd.arange(64, label="k")
        out[m, m] = kd.dot_scaled(x[m, k], xs[m, kd.arange(4, label="g")], x[m, k], xs[m, kd.arange(2)])

    with pytest.raises(TraceError, match="groups"):
        bad.source(static=None, config={"BLOCK_M": 16})

    @kd.kernel(name="_mx_bad_arith")
    def arith(x: kd.In["M", "K", kd.fp4_e2m1], out: kd.Out["M", "K", kd.f32]):
        m, k = kd.grid("M", "K")
        out[m, k] = x[m, k] * 2.0

    with pytest.raises(TraceError, match="fp4"):
        arith.source()


# ----------------------------------------------------------------------------------------------
# MoE stages

def _experts(seed: int, E: int = 6, H: int = 64, I: int = 96, act: str = "mxfp4") -> X.MXFP4Weights:
    g = torch.Generator().manual_seed(seed)
    q13, s13 = X.quant_mxfp4_ref(torch.randn(E, 2 * I, H, generator=g))
    q2, s2 = X.quant_mxfp4_ref(torch.randn(E, H, I, generator=g) * 0.5)
    return X.MXFP4Weights(q13, s13, q2, s2, act=act, a13_scale=torch.tensor([0.02]), a2_scale=torch.tensor([0.05]))


def _routing(seed: int, M: int, E: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 64, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    return x, ids, torch.rand(M, K, generator=g)


@pytest.mark.parametrize("act,path", [("mxfp4", "native"), ("fp8", "native"), ("fp8", "upcast"), ("bf16", "native")])
@pytest.mark.parametrize("M", [1, 4])
def test_fused_experts_match_reference(act, path, M):
    w = _experts(M, act=act)
    x, ids, wts = _routing(M + 7, M, 6, 3)
    y = X.fused_experts(x, ids, wts, w, config={"path": path})
    r = X.experts_ref(x, ids, wts, w)
    assert (y - r).abs().max().item() <= 1e-5 * r.abs().max().item()


def test_stage1_w4a4_poisoned_output_valid_rows():
    w = _experts(3)
    x, ids, _ = _routing(4, 3, 6, 2)
    sorted_ids, bexp = X.moe_align(ids, 6, 16, backend="torch")
    S = sorted_ids.numel()
    inter = torch.full((S, 96), float("nan"), dtype=torch.bfloat16)
    xq, xs = X.quant_mxfp4_ref(x)
    X.moe_stage1_mxfp4(xq, xs, w.w13, w.s13, sorted_ids, bexp, inter, 2)
    valid = sorted_ids < 6
    a = X.dequant_mxfp4_ref(xq, xs)
    w13 = w.dequant("13")
    for r in valid.nonzero().flatten().tolist():
        t = sorted_ids[r].item()
        e = ids.reshape(-1)[t].item()
        gu = (a[t // 2].double() @ w13[e].double().t()).float()
        want = (torch.nn.functional.silu(gu[:96]) * gu[96:]).to(torch.bfloat16).float()
        got = inter[r].float()
        assert not got.isnan().any()
        assert (got - want).abs().max().item() <= 2.0 ** -7 * want.abs().max().item()


def test_weights_validation_names_the_field():
    w = _experts(0)
    with pytest.raises(ValueError, match="s13"):
        X.MXFP4Weights(w.w13, w.s13[:, :, :1], w.w2, w.s2).dims()
    with pytest.raises(ValueError, match="a13_scale"):
        X.MXFP4Weights(w.w13, w.s13, w.w2, w.s2, act="fp8").dims()


# ----------------------------------------------------------------------------------------------
# tier 2: AOT

def test_aot_stage1_gfx950_uses_the_scaled_mfma_without_spills():
    r = aot.report(X.moe_stage1_mxfp4, "gfx950")
    assert r.ok and r.spills == 0
    assert any(i.startswith("v_mfma_scale_f32") for i in r.matrix_instructions), r.matrix_instructions


def test_aot_gfx942_upcasts_to_bf16_mfma():
    r = aot.report(X.moe_stage1_mxfp4, "gfx942")
    assert r.ok and r.spills == 0
    assert any("bf16" in i for i in r.matrix_instructions) and not any("scale" in i for i in r.matrix_instructions)
    assert X.mx_path(kd.get_target("gfx942")) == "upcast" and X.mx_path(kd.get_target("gfx950")) == "native"


def test_aot_sm90_compiles_the_upcast():
    r = aot.report(X.moe_stage1_mxfp4, "sm90")
    assert r.ok and r.spills == 0 and r.matrix_instructions


@pytest.mark.parametrize("argv,msg", [(["--tp", "3"], "--tp 3"), (["--arch", "sm90"], "--arch"), (["--m", "0"], "--m")])
def test_bench_cli_bad_flags_one_line_exit_2(argv, msg, capsys):
    from bench.mxfp4 import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err
