"""Round-trip and layout tests for the int4 packings (REFERENCE §3)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from ops.packing import PACKINGS, pack_int4, quantize_int4_grouped, quantize_int4_per_channel, repack_int4, unpack_int4

PACKS = sorted(PACKINGS)


@given(pack=st.sampled_from(PACKS), n=st.integers(1, 5), kw=st.integers(1, 4), batch=st.integers(0, 2),
       seed=st.integers(0, 2 ** 16))
def test_round_trip(pack, n, kw, batch, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (2,) * batch + (n, 8 * kw)
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    words = pack_int4(q, pack)
    assert words.dtype == torch.int32 and words.shape == shape[:-1] + (kw,)
    assert torch.equal(unpack_int4(words, pack), q)


@given(pack=st.sampled_from(PACKS), seed=st.integers(0, 2 ** 16))
def test_words_round_trip(pack, seed):
    """Every int32 bit pattern is a valid packed word: unpack then pack is the identity."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 4), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(pack_int4(unpack_int4(words, pack), pack), words)


def test_layouts_bitwise():
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, -8]], dtype=torch.int8)
    # sequential two's complement: nibble i = element i; -8 -> 0x8
    assert pack_int4(q, "quark_order").item() == int.from_bytes(bytes.fromhex("87654321"), "big") - 2 ** 32
    # reorder: nibble i holds element order[i] = [0,2,4,6,1,3,5,7] -> nibbles 1,3,5,7,2,4,6,8(-8)
    assert (pack_int4(q, "quark_reorder").item() & 0xFFFFFFFF) == 0x86427531
    # compressed-tensors: nibble = q + 8, sequential
    assert (pack_int4(q, "ct").item() & 0xFFFFFFFF) == 0x0FEDCBA9
    # ct values in the reorder order: elements 2i, 2i+1 in nibbles i, i+4 (what kd.group_dot reads)
    assert (pack_int4(q, "ct_reorder").item() & 0xFFFFFFFF) == 0x0ECAFDB9
    assert (pack_int4(torch.full((1, 8), -1, dtype=torch.int8), "quark_order").item()) == -1


def test_repack_and_quantize():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (3, 64), generator=g, dtype=torch.int8)
    q[0, :16] = torch.arange(-8, 8, dtype=torch.int8)
    for src in PACKS:  # word arithmetic, every pair of layouts (and on meta tensors: no value reads)
        for dst in PACKS:
            assert torch.equal(repack_int4(pack_int4(q, src), src, dst), pack_int4(q, dst)), (src, dst)
    assert repack_int4(torch.empty(2, 8, dtype=torch.int32, device="meta"), "ct", "ct_reorder").shape == (2, 8)
    w = torch.randn(4, 64, generator=g)
    qc, sc = quantize_int4_per_channel(w)
    assert qc.abs().max() <= 8 and sc.shape == (4,)
    assert (qc.float() * sc[:, None] - w).abs().max() <= sc.max() / 2 + 1e-6
    qg, sg = quantize_int4_grouped(w, 32)
    assert sg.shape == (4, 2)
    assert (qg.float() * sg.repeat_interleave(32, dim=1) - w).abs().max() <= sg.max() / 2 + 1e-6


def test_errors():
    with pytest.raises(ValueError, match="unknown int4 packing"):
        pack_int4(torch.zeros(1, 8, dtype=torch.int8), "nope")
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(1, 7, dtype=torch.int8), "ct")
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.full((1, 8), 8, dtype=torch.int8), "ct")
    with pytest.raises(TypeError, match="int32"):
        unpack_int4(torch.zeros(1, 1, dtype=torch.int64), "ct")
