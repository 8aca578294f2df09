"""Causal variable-length FMHA prefill (MLA prefill over decompressed K/V, or plain MHA/GQA), in kdsl.

Layout: packed tokens of B sequences, cu_seqlens [B+1] int32 (sequence b is rows
cu[b]..cu[b+1]); q [T, H, DA+DB], k [T, KVH, DA+DB], v [T, KVH, DV], out [T, H, DV] bf16.
For MLA the qk head dim 192 is not a power of two, so it is handled as two dots, DA=128 (nope)
and DB=64 (rope); DB=0 gives a single dot. fp32 softmax and accumulation; the bf16 output is
rounded to nearest even, or toward zero when the config sets RTZ=1 (to match engines that
truncate).
"""
from __future__ import annotations

from typing import Any

import torch

import kdsl as kd
from ops._common import check_backend, check_tensor, config_for, validating
from ops.mla import LOG2E, NEG_BIG, normalized

_EX = {"T": 4096, "H": 64, "KVH": 64, "DQK": 192, "DA": 128, "DB": 64, "DV": 128, "B1": 2, "B": 1, "MAXLEN": 4096}
_CHECKS = [
    ("q", lambda d: d["DQK"] == d["DA"] + d["DB"], "qk head dim must equal DA + DB"),
    ("q", lambda d: d["H"] % d["KVH"] == 0, "q heads must be a multiple of kv heads"),
    ("cu_seqlens", lambda d: d["B1"] == d["B"] + 1, "cu_seqlens must have B + 1 entries"),
]


@kd.kernel(static=("DA", "DB", "DV"), example=_EX, checks=_CHECKS)
def fmha_prefill(q: kd.In["T", "H", "DQK", kd.bf16], k: kd.In["T", "KVH", "DQK", kd.bf16],
                 v: kd.In["T", "KVH", "DV", kd.bf16], cu_seqlens: kd.In["B1", kd.i32],
                 out: kd.Out["T", "H", "DV", kd.bf16], sm_scale: kd.Scalar[kd.f32],
                 B: kd.Dim, MAXLEN: kd.Dim, DA: kd.Dim, DB: kd.Dim):
    """Causal varlen flash attention: one program per (sequence, head, BLOCK_M query rows)."""
    b, h, i = kd.grid(kd.each("B"), kd.each("H"), kd.tile("MAXLEN", "BLOCK_M", domain=(16, 32, 64, 128), default=64))
    # default 64x16: 0 spills on gfx942/gfx950 (64x32 spills 1/3 VGPRs; 32x64 spills 64)
    BN = kd.tunable("BLOCK_N", (16, 32, 64, 128), 16, "keys per inner step")
    rtz = kd.tunable("RTZ", (0, 1), 0, "1: round the bf16 output toward zero instead of to nearest even")
    s0 = cu_seqlens[b]
    n = cu_seqlens[b + 1] - s0
    first = kd.min(i, axis=i)
    kd.exit_if(first >= n)
    kvh = h // (kd.dim("H") // kd.dim("KVH"))
    DAs = kd.static("DA")
    da = kd.full_range("DA")
    dv = kd.full_range("DV")
    rows = i < n
    qa = q.load(s0 + i, h, da, mask=rows)
    qb = None
    if kd.static("DB"):
        db = kd.full_range("DB")
        qb = q.load(s0 + i, h, db + DAs, mask=rows)
    stop = kd.minimum(n, kd.max(i, axis=i) + 1)
    qk_scale = sm_scale * LOG2E

    def step(j, m_i, l_i, acc):
        s = kd.dot(qa, k[s0 + j, kvh, da])
        if qb is not None:
            s = s + kd.dot(qb, k[s0 + j, kvh, db + DAs])
        s = kd.where((j <= i) & (j < stop), s * qk_scale, float("-inf"))
        m_new = kd.maximum(m_i, kd.max(s, axis=j))
        alpha = kd.exp2(m_i - m_new)
        p = kd.exp2(s - m_new)
        l_new = l_i * alpha + kd.sum(p, axis=j)
        return m_new, l_new, acc * alpha + kd.dot(p.to(kd.bf16), v[s0 + j, kvh, dv])

    m_i, l_i, acc = kd.fold(kd.tiles(start=0, stop=stop, block=BN, label="N"),
                            (kd.full((i,), NEG_BIG, kd.f32), kd.zeros((i,), kd.f32), kd.zeros((i, dv), kd.f32)), step)
    o = normalized(acc, l_i)
    o = o.to(kd.bf16, rounding="rtz") if rtz else o.to(kd.bf16)
    out.store(s0 + i, h, dv, value=o, mask=rows)


# ---------------------------------------------------------------------------------------------

def fmha_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, sm_scale: float,
             max_seqlen: int | None = None) -> torch.Tensor:
    """float64 causal varlen attention (GQA by repeating kv heads); rows past `max_seqlen` of a
    sequence are 0, as in the kernel."""
    T, H, _ = q.shape
    G = H // k.shape[1]
    out = torch.zeros(T, H, v.shape[-1], dtype=torch.float64)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        a, e = cu[b], cu[b + 1]
        if e == a:
            continue
        qq = q[a:e].double()
        kk = k[a:e].double().repeat_interleave(G, 1)
        vv = v[a:e].double().repeat_interleave(G, 1)
        s = torch.einsum("ihd,jhd->hij", qq, kk) * sm_scale
        n = e - a
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out[a:e] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vv)
        if max_seqlen is not None:
            out[a + max_seqlen:e] = 0
    return out


def fmha_prefill_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        sm_scale: float, rope_dim: int | None = None, max_seqlen: int | None = None,
                        rtz: bool = False, backend: str = "triton", config: dict[str, Any] | None = None,
                        validate: bool | None = None) -> torch.Tensor:
    """Causal prefill over packed sequences -> out [T, H, DV] bf16.

    `rope_dim` is the second part of the qk head dim (64 for MLA's 128+64; None: 0 when the head
    dim is a power of two, else 64, which needs a head dim above 64); it must lie in [0, head dim).
    `max_seqlen` (a host int) sizes the grid: None computes it from cu_seqlens (a device read);
    a value above T is clamped to T; rows of a sequence longer than it are returned as 0 (never
    uninitialised: the output starts zeroed when the caller's value is used unchecked).
    `rtz` selects round-toward-zero for the bf16 output unless `config` sets RTZ itself.
    `validate=True` checks cu_seqlens (rising from 0 to T) and max_seqlen against it (device reads)."""
    op = "fmha_prefill"
    check_backend(op, backend)
    check_tensor(op, "q", q, 3, (torch.bfloat16,), last_contiguous=True)
    dev = q.device
    check_tensor(op, "k", k, 3, (torch.bfloat16,), dev, last_contiguous=True)
    check_tensor(op, "v", v, 3, (torch.bfloat16,), dev, last_contiguous=True)
    check_tensor(op, "cu_seqlens", cu_seqlens, 1, (torch.int32, torch.int64), dev)
    T, H, DQK = q.shape
    if k.shape[0] != T or v.shape[0] != T or k.shape[2] != DQK or v.shape[1] != k.shape[1]:
        raise ValueError(f"fmha_prefill: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if H < 1 or k.shape[1] < 1 or DQK < 1 or v.shape[2] < 1:
        raise ValueError(f"fmha_prefill: heads and head dims must be positive, got q {tuple(q.shape)}, v {tuple(v.shape)}")
    if H % k.shape[1]:
        raise ValueError(f"fmha_prefill: q heads {H} must be a multiple of kv heads {k.shape[1]}")
    if cu_seqlens.numel() < 1:
        raise ValueError("fmha_prefill: cu_seqlens must have B + 1 >= 1 entries")
    if rope_dim is None:
        rope_dim = 0 if DQK & (DQK - 1) == 0 else 64
        if rope_dim >= DQK:
            raise ValueError(f"fmha_prefill: head dim {DQK} is not a power of two and not above the default "
                             f"rope_dim 64: pass rope_dim explicitly")
    if not isinstance(rope_dim, int) or not 0 <= rope_dim < DQK:
        raise ValueError(f"fmha_prefill: rope_dim must be an int in [0, head dim {DQK}), got {rope_dim!r}")
    if max_seqlen is not None and (not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 0):
        raise ValueError(f"fmha_prefill: max_seqlen must be a non-negative int, got {max_seqlen!r}")
    B = cu_seqlens.numel() - 1
    if validating(validate) or max_seqlen is None:  # device reads
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"fmha_prefill: cu_seqlens must rise from 0 to T={T}, got {cu}")
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        if max_seqlen is not None and max_seqlen < longest:
            raise ValueError(f"fmha_prefill: max_seqlen={max_seqlen} is below the longest sequence ({longest})")
        if max_seqlen is None:
            max_seqlen = longest
    if backend == "torch":
        return fmha_ref(q, k, v, cu_seqlens, sm_scale, max_seqlen).to(torch.bfloat16)
    DA = DQK - rope_dim
    maxlen = min(int(max_seqlen), T)
    problem = {"T": T, "H": H, "KVH": k.shape[1], "DQK": DQK, "DA": DA, "DB": rope_dim, "DV": v.shape[-1],
               "B1": B + 1, "B": B, "MAXLEN": maxlen}
    cfg = dict(config_for(fmha_prefill, problem, T, config))
    cfg.setdefault("RTZ", int(rtz))
    out = torch.zeros(T, H, v.shape[-1], dtype=torch.bfloat16, device=q.device)
    if B and maxlen:
        cu32 = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
        fmha_prefill(q, k, v, cu32, out, float(sm_scale), B, maxlen, DA, rope_dim, config=cfg)
    return out
