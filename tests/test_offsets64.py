"""64-bit offsets: an operand whose largest element offset passes 2^31 gets 64-bit offset terms (a
specialization of its own), small problems keep their 32-bit code, and dims or grids that 32-bit
launches cannot hold are refused by name. Big problems use meta tensors (record mode) or
`specialize(dims=...)`: nothing of 2^31 elements is allocated."""
from __future__ import annotations

import re

import pytest
import torch

import kdsl as kd
from kdsl.kernel import wide_dims
from ops import mla, norm

BIG_NP = 65536  # 65536 pages x 64 x 576 = 2.4e9 elements > 2^31
EX = mla.mla_decode_split.example


def test_wide_dims_rule() -> None:
    assert wide_dims((2**15, 2**16), (2**16, 1)) == ()          # exactly 2^31 elements: offsets fit
    assert wide_dims((2**15 + 1, 2**16), (2**16, 1)) == (0,)    # one more row: the row term is 64-bit
    assert wide_dims((4, 2**31), (1, 4)) == (1,)                # the dim with the largest reach widens
    assert wide_dims((0, 2**40), (1, 1)) == ()                  # empty: nothing to address


def _meta_mla(np_: int):
    B, QL, H, DL, DR, PS, MP, S = 1, 1, 64, 512, 64, 64, 128, 8
    m = dict(device="meta")
    return (torch.empty(B, QL, H, DL + DR, dtype=torch.bfloat16, **m),
            torch.empty(np_, PS, DL + DR, dtype=torch.bfloat16, **m),
            torch.empty(B, MP, dtype=torch.int32, **m), torch.empty(B, dtype=torch.int32, **m),
            torch.empty(B, QL, H, S, DL, **m), torch.empty(B, QL, H, S, **m), 0.1, QL * H, DR)


def test_big_cache_gets_64bit_offsets_small_keeps_32bit() -> None:
    small = mla.mla_decode_split.source({}, "gfx942")
    assert "int64" not in small and "64-bit offsets" not in small
    assert mla.mla_decode_split.source({}, "gfx942", dims=EX) == small
    big = mla.mla_decode_split.source({}, "gfx942", dims={**EX, "NP": BIG_NP})
    assert "# 64-bit offsets: kv[NP]" in big
    assert "tl.cast(kv_s0, tl.int64)" in big and "tl.cast(kv_s1, tl.int64)" not in big  # only the page term
    assert "q_s0, tl.int64" not in big  # the other operands stay 32-bit


def test_launch_derives_64bit_from_shapes_and_strides() -> None:
    with kd.recording("gfx942") as rec:
        sp_small = mla.mla_decode_split(*_meta_mla(4096))
        sp_big = mla.mla_decode_split(*_meta_mla(BIG_NP))
    assert sp_small.wide == {} and sp_big.wide == {"kv": (0,)}
    assert sp_small is not sp_big and len(rec.launches) == 2
    # a strided view: the span (not the element count) decides
    x = torch.empty(4, 2**16, dtype=torch.bfloat16, device="meta").as_strided((4, 2**16), (2**30, 1))
    with kd.recording("gfx942"):
        sp = norm.rmsnorm(x, torch.empty(2**16, dtype=torch.bfloat16, device="meta"),
                          torch.empty(4, 2**16, dtype=torch.bfloat16, device="meta"), 1e-6)
    assert sp.wide == {"x": (0,)}


def test_show_problem_prints_64bit(capsys) -> None:
    from kdsl.__main__ import main

    assert main(["show", "mla_decode_split", "--emit", "triton", "--problem", f"NP={BIG_NP}"]) == 0
    out = capsys.readouterr().out
    assert "64-bit offsets: kv[NP]" in out and "tl.cast(kv_s0, tl.int64)" in out


@pytest.mark.aot
def test_aot_compile_of_the_64bit_specialization() -> None:
    """The 64-bit specialization compiles for gfx942 and its IR multiplies the page index in i64."""
    from kdsl import aot

    prob = {**EX, "NP": BIG_NP}
    sp = mla.mla_decode_split.specialize({}, "gfx942", {d: prob[d] for d in ("QL", "DL", "DR")}, dims=prob)
    ttir = aot.compile_spec(sp, prob).asm["ttir"]
    assert re.search(r"arith\.muli .*: tensor<[0-9x]+xi64>", ttir), "no 64-bit offset product in the IR"
    small = mla.mla_decode_split.specialize({}, "gfx942", {d: EX[d] for d in ("QL", "DL", "DR")})
    assert not re.search(r"arith\.muli .*: tensor<[0-9x]+xi64>", aot.compile_spec(small, EX).asm["ttir"])


def test_dims_and_grids_past_32_bits_are_named() -> None:
    m = dict(device="meta", dtype=torch.bfloat16)
    with kd.recording("gfx942"):
        with pytest.raises(kd.LaunchError, match=r"kernel 'rmsnorm', parameter 'M'.*below 2\^31"):
            norm.rmsnorm(torch.empty(2**31, 16, **m), torch.empty(16, **m), torch.empty(2**31, 16, **m), 1e-6)
        args = list(_meta_mla(64))
        args[4] = torch.empty(1, 1, 64, 70000, 512, device="meta")
        args[5] = torch.empty(1, 1, 64, 70000, device="meta")
        with pytest.raises(kd.LaunchError, match=r"kernel 'mla_decode_split', parameter 'S'.*grid axis 2.*65535"):
            mla.mla_decode_split(*args)


def test_empty_page_table_is_refused_where_it_is_read() -> None:
    """A page table read through a clamped index must have entries to clamp into."""
    args = list(_meta_mla(64))
    args[2] = torch.empty(1, 0, dtype=torch.int32, device="meta")
    with kd.recording("gfx942"), pytest.raises(kd.LaunchError, match=r"'block_table'.*dim MP is 0"):
        mla.mla_decode_split(*args)


def test_64bit_code_computes_the_same(monkeypatch) -> None:
    """With the 64-bit threshold lowered, small operands take the 64-bit specialization on the
    interpreter: same results as the 32-bit code, bit for bit."""
    import importlib

    from tests.test_mla import _setup

    kk = importlib.import_module("kdsl.kernel")
    q, kv, bt, lens = _setup([9, 20], 2, seed=5)
    B, QL, H, DQ = q.shape
    DL, S = 32, 2

    def run():
        part, lse = torch.full((B, QL, H, S, DL), float("nan")), torch.full((B, QL, H, S), float("nan"))
        sp = mla.mla_decode_split(q, kv, bt, lens, part, lse, 0.25, QL * H, DQ - DL, config={"BLOCK_N": 16})
        return sp, part, lse

    sp32, part32, lse32 = run()
    monkeypatch.setattr(kk, "I32_SPAN", 1024)  # kv has 10 x 8 x 48 elements: now "past" the limit
    mla.mla_decode_split._launchers.clear()      # launchers cached under the real limit
    mla.mla_decode_split._last = (None, None)
    sp64, part64, lse64 = run()
    mla.mla_decode_split._launchers.clear()
    mla.mla_decode_split._last = (None, None)
    assert sp32.wide == {} and "kv" in sp64.wide and "tl.int64" in sp64.source
    assert torch.equal(part32, part64) and torch.equal(lse32, lse64)
