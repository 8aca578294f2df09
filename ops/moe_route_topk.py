"""noaux_tc MoE routing written with `kd.topk`: the same contract as `ops.moe.moe_route` (same
operands, static dims and launch arguments, identical expert ids), one sorting network instead of
TOPK rounds of max-and-mask. `ops.moe.route` can launch this kernel in place of `moe_route`."""
from __future__ import annotations

import kdsl as kd

from ops.moe import split_sum

NEG_INF = float("-inf")


def _p2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@kd.kernel(static=("E", "TOPK", "NG", "TOPKG", "NORM", "SPLIT"),
           example={"M": 1, "E": 384, "TOPK": 8, "NG": 1, "TOPKG": 1, "NORM": 1, "SPLIT": 14})
def moe_route_topk(logits: kd.In["SPLIT", "M", "E", kd.f32], bias: kd.In["E", kd.f32],
                   ids: kd.Out["M", "TOPK", kd.i32], wts: kd.Out["M", "TOPK", kd.f32],
                   NG: kd.Dim, TOPKG: kd.Dim, NORM: kd.Dim, scale: kd.Scalar[kd.f32]):
    """noaux_tc routing for one token per program: sigmoid scores, biased group-limited top-k by kd.topk."""
    (m,) = kd.grid(kd.each("M"))
    E, K, ng, tkg = kd.static("E"), kd.static("TOPK"), kd.static("NG"), kd.static("TOPKG")
    kd.require(E % ng == 0, "E must be a multiple of n_group", "NG")
    eg = E // ng
    kk = kd.full_range("TOPK")
    if ng == 1:
        e = kd.full_range("E")
        scores = kd.sigmoid(split_sum(logits, m, e))  # fixed order: deterministic
        _, top = kd.topk(scores + bias[e], K, axis=e, into=kk)  # masked lanes rank last
    else:  # group score = sum of the top-2 biased scores of the group; keep topk_group groups
        g = kd.span(0, _p2(ng), ng if _p2(ng) != ng else None, "g")
        j = kd.span(0, _p2(eg), eg if _p2(eg) != eg else None, "j")
        e = g * eg + j  # expert id over (g, j)
        scores = kd.sigmoid(split_sum(logits, m, e))
        sel = scores + bias[e]
        top2, _ = kd.topk(sel, 2, axis=j)
        gs = kd.sum(top2, axis=top2.axes[-1])
        _, kept = kd.topk(gs, tkg, axis=g)
        keep = kd.max(kd.where(g == kept, 1, 0), axis=kept.axes[-1])
        sel = kd.where(keep > 0, sel, NEG_INF)
        _, top = kd.topk(sel, K, axis=(g, j), index=e, into=kk)
    # the unbiased score of each chosen expert (one nonzero term per sum: exact)
    w = kd.sum(kd.where(e == top, scores, 0.0), axis=e) if ng == 1 else \
        kd.sum(kd.sum(kd.where(e == top, scores, 0.0), axis=j), axis=g)
    mult = scale / (kd.sum(w, axis=kk) + 1e-20) if kd.static("NORM") else scale
    ids[m, kk] = top
    wts[m, kk] = w * mult
