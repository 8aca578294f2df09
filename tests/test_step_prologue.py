"""ops.step_prologue: a step's bookkeeping, rope rows, embeddings and first norm in one launch equal
models.step.make_ctx + the rope table + the embedding + ops.norm, bit for bit on the interpreter;
bad sequence indices, positions and token ids read nothing outside their tensors (the tables sit
inside bigger poisoned buffers) and give the documented values; every output element is written."""
from __future__ import annotations

import pytest
import torch

from models.kv_cache import PageTable
from models.step import RopeTable, make_ctx
from ops.norm import rms_norm
from ops.step_prologue import POS_ROWS, run_prologue, step_prologue

V, H, PS, MP, NS = 50, 64, 4, 8, 3


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tab = PageTable(NS, 40, PS, max_pages=MP)
    tab.lens.copy_(torch.tensor([5, 13, 0], dtype=torch.int32))
    tab.bt.copy_(torch.randint(0, 40, (NS, MP), generator=g, dtype=torch.int32))
    rope = RopeTable(8, 10000.0, None, torch.device("cpu"))
    rope.ensure(64)
    emb = torch.randn(V, H, generator=g).to(torch.bfloat16)
    w = torch.randn(H, generator=g).to(torch.bfloat16)
    return g, tab, rope, emb, w


def _guarded(inner: torch.Tensor, fill) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, buffer): `inner` in the middle of a bigger buffer along dim 0, the rest poisoned."""
    buf = torch.full((inner.shape[0] + 4, *inner.shape[1:]), fill, dtype=inner.dtype)
    buf[2:2 + inner.shape[0]] = inner
    return buf[2:2 + inner.shape[0]], buf


@pytest.mark.parametrize("kind", ["rows", "offsets", "positions"])
@pytest.mark.parametrize("indexed", [False, True])
def test_prologue_equals_the_torch_step_start(kind: str, indexed: bool) -> None:
    g, tab, rope, emb, w = _setup(1)
    B, QL = 2, 3
    seqs = torch.tensor([2, 0]) if indexed else None
    tok = torch.randint(0, V, (B, QL), generator=g)
    offs = torch.randint(0, 3, (B, QL), generator=g)
    kw = {"offsets": offs} if kind == "offsets" else ({"positions": offs + 7} if kind == "positions" else {})
    ctx = make_ctx(tab, B, QL, seqs, **kw)
    o = run_prologue(tok, tab.lens, tab.bt, PS, emb, rope.cos, rope.sin, seqs=seqs, norm_w=w, eps=1e-6, **kw)
    cos, sin = rope(ctx.positions)
    assert torch.equal(o["positions"], ctx.positions) and torch.equal(o["slots"], ctx.slots)
    assert torch.equal(o["seq_lens"], ctx.seq_lens)
    assert torch.equal(o["cos"], cos) and torch.equal(o["sin"], sin)
    h = emb[tok.reshape(-1)]
    assert torch.equal(o["h"], h)
    assert torch.equal(o["x"], rms_norm(h, w, 1e-6, backend="triton"))     # the rmsnorm kernel's bits
    ref = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(torch.bfloat16)
    torch.testing.assert_close(o["x"].float(), ref.float(), atol=0, rtol=2 ** -7)
    assert "x" not in run_prologue(tok, tab.lens, tab.bt, PS, emb, rope.cos, rope.sin, seqs=seqs, **kw)


def test_x_out_is_written_in_place_and_nothing_around_it() -> None:
    """x_out= the left half of a [T, 2H] row buffer inside a bigger poisoned one (the draft's
    attention input): the normed rows land there, bit for bit those of a new tensor; the right half
    and the guard rows stay poisoned."""
    g, tab, rope, emb, w = _setup(5)
    tok = torch.randint(0, V, (2, 3), generator=g)
    want = run_prologue(tok, tab.lens, tab.bt, PS, emb, rope.cos, rope.sin, norm_w=w)["x"]
    buf = torch.full((6 + 2, 2 * H), float("nan"), dtype=torch.bfloat16)
    rows = buf[1:7]
    o = run_prologue(tok, tab.lens, tab.bt, PS, emb, rope.cos, rope.sin, norm_w=w, x_out=rows[:, :H])
    assert o["x"].data_ptr() == rows.data_ptr() and torch.equal(rows[:, :H], want)
    assert rows[:, H:].isnan().all() and buf[0].isnan().all() and buf[7].isnan().all()


def test_bad_indices_read_nothing_outside_and_give_the_documented_values() -> None:
    """A sequence index outside the table: slot -1, length 0, position 0; a position past the rope
    table: cos = sin = 0; a token id outside the vocabulary: a zero row; a length past the table's
    width: the page lookup clamps to its last column (make_ctx's rule)."""
    g, tab, rope, emb, w = _setup(2)
    lens_v, lens_buf = _guarded(tab.lens, 777)
    bt_v, bt_buf = _guarded(tab.bt, 999)
    emb_v, _ = _guarded(emb, float("nan"))
    cos_v, _ = _guarded(rope.cos, float("nan"))
    sin_v, _ = _guarded(rope.sin, float("nan"))
    lens_v[1] = MP * PS + 5                                 # past the table's width
    tok = torch.tensor([[3, V + 4], [-2, 7]])
    seqs = torch.tensor([1, NS + 1])
    o = run_prologue(tok, lens_v, bt_v, PS, emb_v, cos_v, sin_v, seqs=seqs, norm_w=w,
                     positions=torch.tensor([[1, 200], [-3, 2]]))
    for k in ("cos", "sin", "h", "x"):
        assert not o[k].isnan().any(), k
    assert o["slots"][2:].tolist() == [-1, -1]                # the bad sequence index
    assert o["seq_lens"].tolist() == [MP * PS + 5 + 2, 0] and o["positions"][2:].tolist() == [0, 0]
    r = MP * PS + 5
    assert o["slots"][0].item() == tab.bt[1, MP - 1].item() * PS + r % PS    # clamped page lookup
    assert torch.equal(o["cos"][1], torch.zeros(4)) and torch.equal(o["sin"][1], torch.zeros(4))
    assert torch.equal(o["h"][1], torch.zeros(H, dtype=torch.bfloat16))      # token past the vocabulary
    assert torch.equal(o["h"][0], emb[3])
    assert torch.equal(lens_buf[:2], torch.full((2,), 777, dtype=torch.int32))  # inputs untouched
    assert (bt_buf[:2] == 999).all() and (bt_buf[-2:] == 999).all()


def test_every_output_element_is_written() -> None:
    """The kernel over outputs poisoned first: nothing is left poisoned."""
    g, tab, rope, emb, w = _setup(3)
    B, QL = 2, 2
    T = B * QL
    tok = torch.randint(0, V, (T,), generator=g)
    outs = [torch.full((T,), -7, dtype=torch.int64), torch.full((T,), -7, dtype=torch.int64),
            torch.full((B,), -7, dtype=torch.int32), torch.full((T, 4), float("nan")),
            torch.full((T, 4), float("nan")), torch.full((T, H), float("nan"), dtype=torch.bfloat16),
            torch.full((T, H), float("nan"), dtype=torch.bfloat16)]
    one = torch.zeros(1, dtype=torch.int64)
    step_prologue(tok, tab.lens, tab.bt, outs[0][:B], one, emb, rope.cos, rope.sin, w, *outs, QL, PS, 0, POS_ROWS, 1,
                  1e-6)
    assert all(not (o == -7).any() for o in outs[:3])
    assert all(not o.isnan().any() for o in outs[3:])


def test_argument_errors_name_the_argument() -> None:
    g, tab, rope, emb, w = _setup(4)
    tok = torch.zeros(1, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match="tokens"):
        run_prologue(tok.int(), tab.lens, tab.bt, PS, emb, rope.cos, rope.sin)
    with pytest.raises(ValueError, match="offsets or positions"):
        run_prologue(tok, tab.lens, tab.bt, PS, emb, rope.cos, rope.sin, offsets=tok, positions=tok)
    with pytest.raises(ValueError, match="positions must be"):
        run_prologue(tok, tab.lens, tab.bt, PS, emb, rope.cos, rope.sin, positions=tok[:, :1])
    with pytest.raises(ValueError, match="norm_w"):
        run_prologue(tok, tab.lens, tab.bt, PS, emb, rope.cos, rope.sin, norm_w=w[:3])
    with pytest.raises(ValueError, match="seqs"):
        run_prologue(tok, tab.lens, tab.bt, PS, emb, rope.cos, rope.sin, seqs=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="needs norm_w"):
        run_prologue(tok, tab.lens, tab.bt, PS, emb, rope.cos, rope.sin, x_out=torch.empty(2, H).bfloat16())
    with pytest.raises(ValueError, match="x_out must be"):
        run_prologue(tok, tab.lens, tab.bt, PS, emb, rope.cos, rope.sin, norm_w=w, x_out=torch.empty(2, 2 * H).bfloat16())
