"""`ops.quant._div_int8` (one residual step) gives the int8 codes of `_div_rn` (two steps, correctly
rounded) for every bf16 input: the claim `moe_stage2_w4a8_aq` relies on to match `quant_per_token_int8`
bit for bit. Exhaustive on the interpreter: every finite bf16 x against a divisor d = RN(absmax/127) for
every bf16 absmax mantissa in [1, 2) (both quotients scale exactly with a power-of-two change of x and
d, so one binade of absmax covers all normal ones), plus the MIN_ABSMAX floor and an inf absmax
(divisor FLT_MAX)."""
from __future__ import annotations

import torch

import kdsl as kd
from ops.quant import MIN_ABSMAX, _div_int8, _div_rn, _int8_code, _row_divider


@kd.kernel(name="test_div_int8_codes")
def _codes(x: kd.In["K", kd.bf16], s: kd.In["M", kd.f32], q_rn: kd.Out["M", "K", kd.i8],
           q_one: kd.Out["M", "K", kd.i8]):
    (m,) = kd.grid(kd.tile("M", "BLOCK_M", domain=(16,), default=16))
    d, r = _row_divider(s[m])

    def body(k, dummy):
        a = x[k].to(kd.f32)
        q_rn[m, k] = _int8_code(kd.minimum(kd.maximum(_div_rn(a, d, r), -127.0), 127.0))
        q_one[m, k] = _int8_code(kd.minimum(kd.maximum(_div_int8(a, d, r), -127.0), 127.0))
        return dummy

    kd.fold(kd.tiles("K", block="BLOCK_K", domain=(8192,), default=8192), kd.zeros((m,), kd.i32), body)


def test_div_int8_codes_equal_div_rn_for_all_bf16():
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16)  # every finite non-negative bf16
    pos = bits.view(torch.bfloat16)
    x = torch.cat([pos, -pos])
    mant = pos[(pos.float() >= 1.0) & (pos.float() < 2.0)].float()
    amax = torch.cat([mant, torch.tensor([0.0, 1e-12, MIN_ABSMAX, float("inf")])])
    s = torch.clamp(amax, min=MIN_ABSMAX) / 127.0
    m = s.numel()
    q_rn = torch.full((m, x.numel()), -128, dtype=torch.int8)  # no code is -128
    q_one = torch.full((m, x.numel()), -128, dtype=torch.int8)
    _codes(x, s, q_rn, q_one)
    assert (q_rn != -128).all()
    assert torch.equal(q_one, q_rn), f"{int((q_one != q_rn).sum())} codes differ"
    # and, over each row's own range |x| <= absmax, both are the codes of the IEEE quotient
    inside = x.float().abs()[None, :] <= amax[:-1, None]
    ref = torch.clamp(torch.round(x.float()[None, :] / s[:-1, None]), -127, 127).to(torch.int8)
    assert torch.equal(q_rn[:-1][inside], ref[inside])
