"""A decode / verify step's bookkeeping in one launch: where the new rows go, their rope rows, their
embeddings and the first norm.

Before its first layer a step needs, for its T = B x QL new rows (sequence-major): each row's cache
slot (page table lookup at the sequence's length), its rope position and cos/sin rows, the
sequences' lengths after the step, the embedding rows of the tokens and (the target's first input
norm, the draft's embedding norm) their RMSNorm. As torch ops that is a dozen tiny launches (casts,
adds, divisions, a gather, three indexings), each one a launch gap in a graph-replayed step; here
one program per new row does all of it (`step_prologue`). `models.step.make_ctx` is the same math
in torch (the reference, and the torch backend's path).

Bad inputs read nothing outside their tensors: a sequence index outside the page table's slots
gives slot -1 (the cache appends skip it), position 0 and length 0 after the step (its rows attend
to nothing); the page table lookup is clamped to the table's width as in make_ctx; a position
outside the rope table reads cos = sin = 0; a token id outside the vocabulary embeds as a zero row.
Slots past the cache are left to the appends, which drop them.
"""
from __future__ import annotations

from typing import Optional

import torch

import kdsl as kd
from ops._common import check_backend, check_tensor, invariant_config

# where a row's rope position comes from (the kernel's static POS)
POS_ROWS, POS_OFFSETS, POS_GIVEN = 0, 1, 2

_EXAMPLE = {"T": 4, "B": 1, "QL": 4, "NS": 1, "MP": 129, "TO": 4, "V": 163840, "H": 7168, "R": 16384, "R2": 32,
            "PS": 64, "SQ": 0, "POS": POS_ROWS, "NORM": 1}
_CHECKS = [
    ("tokens", lambda d: d["T"] == d["B"] * d["QL"], "tokens must hold B x QL rows"),
    ("offs", lambda d: d["POS"] == POS_ROWS or d["TO"] == d["T"], "offsets / positions must hold B x QL rows"),
]


@kd.kernel(static=("QL", "H", "R2", "PS", "SQ", "POS", "NORM"), example=_EXAMPLE, checks=_CHECKS)
def step_prologue(tokens: kd.In["T", kd.i64], lens: kd.In["NS", kd.i32], bt: kd.In["NS", "MP", kd.i32],
                  seqs: kd.In["B", kd.i64], offs: kd.In["TO", kd.i64], embed: kd.In["V", "H", kd.bf16],
                  cos_t: kd.In["R", "R2", kd.f32], sin_t: kd.In["R", "R2", kd.f32], w: kd.In["H", kd.bf16],
                  pos: kd.Out["T", kd.i64], slots: kd.Out["T", kd.i64], seq_lens: kd.Out["B", kd.i32],
                  cos: kd.Out["T", "R2", kd.f32], sin: kd.Out["T", "R2", kd.f32], h: kd.Out["T", "H", kd.bf16],
                  x: kd.Out["T", "H", kd.bf16], QL: kd.Dim, PS: kd.Dim, SQ: kd.Dim, POS: kd.Dim, NORM: kd.Dim,
                  eps: kd.Scalar[kd.f32]):
    """Row t = b * QL + j of sequence s = seqs[b] (SQ=1; else b): row index r = lens[s] + j, slot
    bt[s, min(r // PS, MP - 1)] * PS + r % PS, position r (POS 0), lens[s] + offs[t] (1) or offs[t]
    (2), cos/sin rows at the position, seq_lens[b] = lens[s] + QL (written by j = 0; 0 for an s
    outside the table), h = embed[token], x = rmsnorm(h) * w (NORM=1; the f32 expression of
    ops.norm.rmsnorm)."""
    (t,) = kd.grid(kd.each("T"))
    ql = kd.static("QL")
    ps = kd.static("PS")
    b = t // ql
    j = t % ql
    s = seqs[b] if kd.static("SQ") else b
    ok = (s >= 0) & (s < kd.dim("NS"))
    length = kd.where(ok, lens.load(s, mask=ok), 0).to(kd.i64)
    r = length + j
    page = bt.load(s, kd.minimum(r // ps, kd.dim("MP") - 1), mask=ok).to(kd.i64)
    slots[t] = kd.where(ok, page * ps + r % ps, -1)
    mode = kd.static("POS")
    p = r if mode == POS_ROWS else (length + offs[t] if mode == POS_OFFSETS else offs[t])
    p = kd.where(ok, p, 0)
    pos[t] = p
    seq_lens.store(b, value=kd.where(ok, length + ql, 0).to(kd.i32), mask=j < 1)
    i = kd.full_range("R2")
    cos[t, i] = cos_t[p, i]
    sin[t, i] = sin_t[p, i]
    d = kd.full_range("H")
    e = embed[tokens[t], d]
    h[t, d] = e
    if kd.static("NORM"):
        ef = e.to(kd.f32)
        ms = kd.sum(ef * ef, axis=d) / kd.static("H")
        x[t, d] = ef * kd.rsqrt(ms + eps) * w[d].to(kd.f32)


def run_prologue(tokens: torch.Tensor, lens: torch.Tensor, bt: torch.Tensor, page_size: int, embed: torch.Tensor,
                 cos_table: torch.Tensor, sin_table: torch.Tensor, seqs: Optional[torch.Tensor] = None,
                 offsets: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                 norm_w: Optional[torch.Tensor] = None, eps: float = 1e-6, backend: str = "triton",
                 config: dict | None = None, x_out: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """`step_prologue` for tokens [B, QL] (long) of cache slots `seqs` [B] (default 0..B-1), with a
    page table's `lens` [NS] int32 and `bt` [NS, MP] int32, rope positions from the rows (default),
    lens + `offsets` [B, QL] or `positions` [B, QL]; returns positions / slots (long [T]), seq_lens
    (int32 [B]), cos / sin (f32 [T, R2]), h (embedding rows [T, H]) and x (rmsnorm(h) * norm_w, when
    norm_w is given; `x_out` [T, H] bf16 with a contiguous last dim and any row stride, e.g. one half
    of a wider row buffer: written instead of a new tensor). No device read."""
    check_backend("step_prologue", backend)
    if backend != "triton":
        raise ValueError("step_prologue: the torch path is models.step.make_ctx")
    op = "step_prologue"
    check_tensor(op, "tokens", tokens, 2, (torch.int64,))
    dev = tokens.device
    check_tensor(op, "lens", lens, 1, (torch.int32,), dev, contiguous=True)
    check_tensor(op, "bt", bt, 2, (torch.int32,), dev, contiguous=True)
    check_tensor(op, "embed", embed, 2, (torch.bfloat16,), dev, contiguous=True)
    check_tensor(op, "cos_table", cos_table, 2, (torch.float32,), dev, contiguous=True)
    check_tensor(op, "sin_table", sin_table, 2, (torch.float32,), dev, contiguous=True)
    if sin_table.shape != cos_table.shape:
        raise ValueError(f"{op}: cos and sin tables differ in shape: {tuple(cos_table.shape)} vs {tuple(sin_table.shape)}")
    if offsets is not None and positions is not None:
        raise ValueError(f"{op}: give offsets or positions, not both")
    if lens.shape[0] != bt.shape[0]:
        raise ValueError(f"{op}: lens [{lens.shape[0]}] and bt [{bt.shape[0]}, ...] must cover the same slots")
    B, QL = tokens.shape
    T, H, R2 = B * QL, embed.shape[1], cos_table.shape[1]
    if seqs is not None:
        check_tensor(op, "seqs", seqs, 1, (torch.int64,), dev)
        if seqs.shape[0] != B:
            raise ValueError(f"{op}: seqs must be [{B}], got {tuple(seqs.shape)}")
    given = offsets if offsets is not None else positions
    if given is not None:
        check_tensor(op, "offsets" if offsets is not None else "positions", given, 2, (torch.int64,), dev)
        if tuple(given.shape) != (B, QL):
            raise ValueError(f"{op}: offsets / positions must be [{B}, {QL}], got {tuple(given.shape)}")
    if norm_w is not None:
        check_tensor(op, "norm_w", norm_w, 1, (torch.bfloat16,), dev, contiguous=True)
        if norm_w.shape[0] != H:
            raise ValueError(f"{op}: norm_w must be [{H}], got {tuple(norm_w.shape)}")
    if x_out is not None:
        if norm_w is None:
            raise ValueError(f"{op}: x_out= holds the normed rows: it needs norm_w")
        check_tensor(op, "x_out", x_out, 2, (torch.bfloat16,), dev, last_contiguous=True)
        if tuple(x_out.shape) != (T, H):
            raise ValueError(f"{op}: x_out must be [{T}, {H}], got {tuple(x_out.shape)}")
    mode = POS_ROWS if given is None else (POS_OFFSETS if offsets is not None else POS_GIVEN)
    out = {"positions": torch.empty(T, dtype=torch.int64, device=dev),
           "slots": torch.empty(T, dtype=torch.int64, device=dev),
           "seq_lens": torch.empty(B, dtype=torch.int32, device=dev),
           "cos": torch.empty(T, R2, dtype=torch.float32, device=dev),
           "sin": torch.empty(T, R2, dtype=torch.float32, device=dev),
           "h": torch.empty(T, H, dtype=torch.bfloat16, device=dev)}
    # operands the static flags leave unread get a stand-in of the right shape and type
    x = out["h"] if norm_w is None else x_out if x_out is not None else torch.empty(T, H, dtype=torch.bfloat16,
                                                                                 device=dev)
    if T:
        one = torch.zeros(1, dtype=torch.int64, device=dev)
        cfg = invariant_config(step_prologue, {"H": H, "R2": R2}, T, config)   # its row sum follows num_warps
        step_prologue(tokens.reshape(-1).contiguous(), lens, bt,
                      seqs.contiguous() if seqs is not None else out["positions"][:B],
                      given.reshape(-1).contiguous() if given is not None else one, embed, cos_table, sin_table,
                      norm_w if norm_w is not None else embed[0], out["positions"], out["slots"], out["seq_lens"],
                      out["cos"], out["sin"], out["h"], x, QL, page_size, int(seqs is not None), mode,
                      int(norm_w is not None), float(eps), config=cfg)
    if norm_w is not None:
        out["x"] = x
    return out
