"""RoPE kernels (interleaved for MLA, neox for the draft) and the YaRN cache against references."""
from __future__ import annotations

import math

import pytest
import torch

from ops import rope
from tests.conftest import poisoned

KIMI_YARN = {"type": "yarn", "factor": 64, "original_max_position_embeddings": 4096, "mscale": 1.0,
             "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
BF16_TOL = dict(atol=1e-2, rtol=2 ** -7)


@pytest.mark.parametrize("style", ["interleaved", "neox"])
@pytest.mark.parametrize("T,H,R", [(3, 5, 16), (1, 2, 8)])
def test_rope_matches_ref(style: str, T: int, H: int, R: int) -> None:
    g = torch.Generator().manual_seed(T * H * R)
    x = torch.randn(T, H, R, generator=g).bfloat16()
    pos = torch.randint(0, 200000, (T,), generator=g)
    c, s = rope.cos_sin(pos, R, 50000.0, KIMI_YARN)
    out = poisoned((T, H, R), torch.bfloat16)
    rope.apply_rope(x, c, s, style, out=out, config={"BLOCK_H": 4})
    torch.testing.assert_close(out.float(), rope.rope_ref(x, c, s, style).float(), **BF16_TOL)


def test_rope_in_place_on_a_strided_slice() -> None:
    """MLA ropes the last 16 of 48 per-head values in place (q_pe inside q)."""
    q = torch.randn(3, 4, 48).bfloat16()
    want = q.clone()
    c, s = rope.cos_sin(torch.tensor([0, 5, 9]), 16, 10000.0)
    want[..., 32:] = rope.rope_ref(q[..., 32:], c, s, "interleaved")
    rope.apply_rope(q[..., 32:], c, s, "interleaved", out=q[..., 32:])
    torch.testing.assert_close(q.float(), want.float(), **BF16_TOL)


def test_interleaved_and_neox_are_the_same_rotation_up_to_layout() -> None:
    x = torch.randn(2, 3, 16).bfloat16()
    c, s = rope.cos_sin(torch.tensor([3, 11]), 16, 10000.0)
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])  # interleaved -> halves
    a = rope.apply_rope(x, c, s, "interleaved")[..., perm]
    b = rope.apply_rope(x[..., perm].contiguous(), c, s, "neox")
    assert torch.equal(a, b)


def test_yarn_values() -> None:
    inv, mult = rope.inv_freq(64, 50000.0, KIMI_YARN)
    assert mult == 1.0  # mscale == mscale_all_dim for Kimi
    plain, _ = rope.inv_freq(64, 50000.0)
    assert torch.allclose(inv[:8], plain[:8])            # high frequencies extrapolated
    assert torch.allclose(inv[-4:], plain[-4:] / 64)     # low frequencies interpolated by the factor
    m = rope.yarn_softmax_mscale(64, 1.0)
    assert abs(m * m - 1.0 / 1.0 * (0.1 * math.log(64) + 1) ** 2) < 1e-12 and abs(m * m - 2.0048) < 1e-3


def test_rope_bad_shapes() -> None:
    x = torch.randn(2, 3, 16).bfloat16()
    with pytest.raises(ValueError, match="cos/sin"):
        rope.apply_rope(x, torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="style"):
        rope.apply_rope(x, torch.randn(2, 8), torch.randn(2, 8), "gptj")


@pytest.mark.aot
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm90"])
def test_aot_rope(arch: str) -> None:
    from kdsl import aot

    for k in (rope.rope_interleaved, rope.rope_neox):
        assert aot.check(k, arch).spills == 0
