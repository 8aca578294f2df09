"""Problem models of the kernels in ops/ (the contract is `autotune.problems.ProblemModel`): per
kernel family the dims of the tuned-config key, which dim is M (and how to read M off a recorded
launch), the bytes that must move (the roofline floor) and any extra traffic the implementation
adds (MLA split partials), the flops, the operand type that sets the matrix peak, the main loop's
trip count, and the dims a launch derives from M, the config and the device (MoE aligned blocks,
MLA split counts) exactly as the ops compute them.

They live next to the kernels so the tuner imports nothing of ops: `autotune.problems` imports
`<package>.problems` of a kernel's package the first time it needs a model of that kernel.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from autotune.problems import NOMINAL_CTX, Problem, ProblemModel, register
from ops.mla import DEFAULT_MAX_SPLITS, MAX_Q_LEN, launch_split_count, max_splits_for
from ops.moe import aligned_blocks, route_split
from ops.norm import WHOLE_ROW

def _gemm(wb: float, ab: float, peak: str, group: int = 0) -> tuple[Callable, Callable]:
    def nbytes(p: Problem, m: int) -> float:
        n, k = p["N"], p["K"]
        b = n * k * wb + m * k * ab + m * n * 2 + 4 * n + 4 * m  # weights, acts, bf16 out, scales
        if group:
            b += n * (k // group) * 2  # group scales (bf16)
        return b

    def flops(p: Problem, m: int) -> float:
        return 2.0 * m * p["N"] * p["K"]

    return nbytes, flops


def _quant_bytes(p: Problem, m: int) -> float:
    k = p.get("K", p.get("N", 0))
    return m * k * (2 + 1) + 4 * m  # bf16 in, 8-bit out, one f32 scale per row


def _quant_flops(p: Problem, m: int) -> float:
    k = p.get("K", p.get("N", 0))
    return 4.0 * m * k


# ---- fused MoE: keyed on the expert shapes; M only sets how many experts and blocks are touched

def routed_share(p: Problem) -> float:
    """The expected share of a token's TOPK experts that this launch's E experts hold: E / EALL,
    where the model-only dim EALL (bench.step sets it for an expert-parallel rank: every rank's
    experts together) is absent otherwise (share 1). Assumes uniform routing and costs the mean
    rank: a token's experts land on the ranks in proportion to the experts they hold."""
    return p["E"] / p["EALL"] if "EALL" in p and "E" in p else 1.0


def routed_rows(p: Problem, m: int) -> float:
    """Expected (token, k) rows of m tokens whose expert this launch holds: m x TOPK x share."""
    return m * p["TOPK"] * routed_share(p)


def experts_touched(p: Problem, m: int) -> float:
    """Expected distinct experts (of this launch's E) hit by m tokens routing to TOPK distinct
    experts each out of EALL (default E), uniformly (exact at m=1 without EP: TOPK); only their
    weights are read."""
    e = p["E"]
    return e * (1.0 - (1.0 - p["TOPK"] / p.get("EALL", e)) ** m)


def _moe_blocks(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    """The aligned-block dims `fused_experts` launches with: worst-case block count
    ops.moe.aligned_blocks (unused blocks exit at once), S = NB * BLOCK_M rows; under expert
    parallelism (EALL) NB is the expected count of blocks that hold rows."""
    bm = int(c.get("BLOCK_M", 16))
    t = m * p["TOPK"]
    nb = aligned_blocks(t, p["E"], bm)
    out = {"T": t, "NB": nb, "S": nb * bm}
    if "EALL" in p:  # an expert-parallel rank: the programs are the blocks its expected rows fill (the
        # other blocks exit at once); without EP the worst case is charged, as launched
        out["NB"] = min(nb, max(1, math.ceil(experts_touched(p, m) + routed_rows(p, m) / bm)))
    return out


def _moe_stage1_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    return {**_moe_blocks(p, m, c), "N2": 2 * p["I"], "KG": p["K"] // 32}


def _moe_stage2_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    d = _moe_blocks(p, m, c)
    return {**d, "MO": m, "P": d["T"], "IG": p["I"] // 32}


def _moe_stage2_m(d: Problem) -> int:
    """Tokens of a stage-2 launch: MO (the atomic output's rows), or with REDUCE="partial" (MO = 0)
    the partial rows P over TOPK."""
    mo = int(d.get("MO", 0))
    return mo if mo > 0 else int(d.get("P", 0)) // max(1, int(d.get("TOPK", 1)))


def _moe_stage1q_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    """moe_stage1_w4a8_q: the stage-1 dims and NT = I / BLOCK_N scale groups per row."""
    return {**_moe_stage1_derived(p, m, c), "NT": p["I"] // int(c.get("BLOCK_N", 64))}


def _moe_stage2gq_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    """moe_stage2_w4a8_gq: the stage-2 dims and NT = I / BLOCK_K (its K tile is the scale group)."""
    return {**_moe_stage2_derived(p, m, c), "NT": p["I"] // int(c.get("BLOCK_K", 64))}


def _moe_q(stage: int) -> tuple[Callable, Callable]:
    """(bytes, flops) of the W4A8 stages with the int8 intermediate of stage2_quant 'stage1': the
    [T, I] int8 rows plus one f32 scale per 64 columns replace the bf16 intermediate."""
    nbytes0, flops = _moe(stage, 0.5, 1, False)

    def nbytes(p: Problem, m: int) -> float:
        t = routed_rows(p, m)
        inter = t * p["I"] * (1 + 4 / 64)
        if stage == 1:
            return nbytes0(p, m) - t * p["I"] * 2 + inter
        return nbytes0(p, m) - t * p["I"] * 1 - 4 * t + inter

    return nbytes, flops


AMAX_COLS = 64  # nominal stage-1 BLOCK_N of the tile maxima (stage 2's config does not hold it)


def _amax_tiles(p: Problem, block_n: int | None = None) -> int:
    """NT of stage2_quant 'amax': stage-1 column tiles per row, cdiv(I, BLOCK_N)."""
    return int(p["NT"]) if block_n is None and "NT" in p else -(-p["I"] // (block_n or AMAX_COLS))


def _moe_stage1a_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    """moe_stage1_w4a8_amax: the stage-1 dims and NT = cdiv(I, BLOCK_N) tile maxima per row."""
    return {**_moe_stage1_derived(p, m, c), "NT": _amax_tiles(p, int(c.get("BLOCK_N", 64)))}


def _moe_stage2a_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    """moe_stage2_w4a8_aq: the stage-2 dims and NT, the stage-1 tile maxima per row."""
    return {**_moe_stage2_derived(p, m, c), "NT": _amax_tiles(p)}


def _moe_amax(stage: int) -> tuple[Callable, Callable]:
    """(bytes, flops) of the W4A8 stages of stage2_quant 'amax': the bf16 intermediate, plus NT f32
    tile maxima per routed row (stage 1 writes them; stage 2 reads them instead of one scale)."""
    nbytes0, flops = _moe(stage, 0.5, 1 if stage == 1 else 2, False)

    def nbytes(p: Problem, m: int) -> float:
        t = routed_rows(p, m)
        return nbytes0(p, m) + 4 * t * (_amax_tiles(p) - (0 if stage == 1 else 1))

    return nbytes, flops


def _moe(stage: int, wbytes: float, abytes: float, group_scales: bool) -> tuple[Callable, Callable]:
    """(bytes, flops) of one MoE stage: touched experts' weights and scales, activations in, the
    bf16 intermediate (stage 1) or the f32 [M, H] output (stage 2); rows and flops are the routed
    rows this launch's experts get (`routed_rows`: all of them without expert parallelism)."""
    def dims(p: Problem) -> tuple[int, int]:
        return (2 * p["I"], p["K"]) if stage == 1 else (p["H"], p["I"])

    def nbytes(p: Problem, m: int) -> float:
        n, k = dims(p)
        t = routed_rows(p, m)
        scales = n * (k // 32) * 2 if group_scales else n * 4
        w = experts_touched(p, m) * (n * k * wbytes + scales)
        if stage == 1:
            return w + m * k * abytes + 4 * m + t * p["I"] * 2
        return w + t * k * abytes + 4 * t + 4 * t + m * n * 4  # + per-row scales, routing weights

    def flops(p: Problem, m: int) -> float:
        n, k = dims(p)
        return 2.0 * routed_rows(p, m) * n * k

    return nbytes, flops


def _moe_gate_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    split = route_split(p["H"])
    return {"SPLIT": split, "HS": -(-p["H"] // split)}  # HS: hidden elements per split (its loop)


def _silu_gemm_bytes(p: Problem, m: int) -> float:
    """gate|up weights [N2, K] bf16, x [M, K] bf16 in, the bf16 [M, N2/2] product out."""
    return p["N2"] * p["K"] * 2 + m * p["K"] * 2 + m * (p["N2"] // 2) * 2


def _splitk_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    """gemm_bf16_splitk's partial count S (= SPLIT_K, the op allocates [SPLIT_K, M, N]) and KS, the
    K elements of one split (a BLOCK_K multiple): ops.gemm.splitk_bounds."""
    from ops.gemm import SPLIT_K_DEFAULT

    s, bk = int(c.get("SPLIT_K", SPLIT_K_DEFAULT)), int(c.get("BLOCK_K", 64))
    return {"S": s, "KS": -(-(-(-p["K"] // s)) // bk) * bk}


def _splitk_norm_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    """ops.splitk_norm's launch dims: the split of gemm_bf16_splitk and the ticket counters it uses."""
    from ops.splitk_norm import counters_needed

    return {**_splitk_derived(p, m, c), "C": counters_needed(max(1, m), p["D"], c),
            "BM": int(c.get("BLOCK_M", 16)), "BN": int(c.get("BLOCK_N", 64))}


def _splitk_norm_tail(p: Problem, m: int, d: Problem, qb: int) -> tuple[float, int]:
    """The serial work after the grid (bytes one program moves, tickets drawn in sequence): the last
    column tile's fix-up (S f32 partial tiles + residual in, res_out out) and then the last M tile's
    row-wide norm (res_out rows + norm weight in, out (+ q, scale) out), one ticket before each."""
    rows = min(max(1, m), d["BM"])
    fixup = rows * d["BN"] * (4 * d["S"] + 2 + 2)
    norm = rows * p["D"] * (2 + 2 + qb) + p["D"] * 2 + 4 * rows * qb
    return float(fixup + norm), 2


def _route_tail_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    """The route tail's launch dims: moe_route_align's, its slots named SL (S is the split count in),
    AL = NB + SL (the block map and slots in one operand)."""
    d = _route_align_derived(p, m, c)
    return {"MB": d["MB"], "NB": d["NB"], "SL": d["S"], "AL": d["NB"] + d["S"]}


def _route_tail_work(p: Problem, m: int, d: Problem) -> tuple[float, int]:
    """The route tail one program runs after the grid (ops.gemm_addnorm._route_tail): moe_route_align's
    bytes (the SPLIT router partials of the M tokens and the bias in; ids, weights, block map and
    sorted slots out) after one ticket. Kimi's routing (384 experts, top 8, blocks of 16) where the
    problem does not say."""
    q = {**p, **d}
    e, k, bm = q.get("E", 384), q.get("TOPK", 8), q.get("BM", 16)
    nb = q.get("NB", aligned_blocks(m * k, q.get("EA", e), bm))
    return float(q.get("SPLIT", q.get("P", 1)) * m * e * 4 + e * 4 + m * k * 8 + nb * (1 + bm) * 4), 1


def _rmsnorm_split(p: Problem, c: dict[str, Any]) -> Problem:
    """gemm_bf16_rmsnorm's output partial count P (= SPLIT_K) and KS, the K elements of one split."""
    d = _splitk_derived(p, 0, {"SPLIT_K": 1, **c})
    return {"P": d["S"], "KS": d["KS"]}


# how int4 weights are unpacked changes no bit (the values are exact: the W4A8 expert stages and
# int4 GEMMs are integer dots, the dense W4A16 GEMM scales exact values), so each M bucket's best
# tile also tries every lowering (autotune.search.tune)
INT4_LOWERING = ("INT4_UNPACK",)

MODELS: list[ProblemModel] = [
    ProblemModel("gemm_bf16_silu_mul", ("N2", "K"), peak_dtype="bf16", bytes_fn=_silu_gemm_bytes,
                 flops_fn=lambda p, m: 2.0 * m * p["N2"] * p["K"], derived=lambda p, m, c: {"I": p["N2"] // 2},
                 shared_numerics=True),
    # the q_b GEMM with the q_a RMSNorm in its prologue: the gemm bytes plus the norm weight; the
    # prologue's second read of each program's rows hits L2 (no extra HBM stream). Its rows come as
    # split-K partials [S, M, K] f32 (S of the recorded launch; 1 when tuned): their traffic is
    # charged to gemm_bf16_splitk, which writes them. It writes its own output as P = SPLIT_K f32
    # partials over K ranges of KS (the ranges of gemm_bf16_splitk), written and read back once
    ProblemModel("gemm_bf16_rmsnorm", ("N", "K"), peak_dtype="bf16",
                 bytes_fn=lambda p, m: _gemm(2, 2, "bf16")[0](p, m) + 2 * p["K"],
                 flops_fn=lambda p, m: _gemm(2, 2, "bf16")[1](p, m) + 4.0 * m * p["K"], shared_numerics=True,
                 derived=lambda p, m, c: {"S": p.get("S", 1), **_rmsnorm_split(p, c)}, loop_dim="KS",
                 extra_bytes_fn=lambda p, m, d: 2.0 * m * p["N"] * (4 * d["P"] - 2),
                 # a row sits at its own place (row mod 16) of one aligned 16-row dot at any BLOCK_M;
                 # ROW_SQUARES, the numerics key, admits the BLOCK_M values of its mode. A column is its
                 # own column of that dot at any BLOCK_N: the 16-row dot compiles to one matrix
                 # instruction at every BLOCK_N of the domain (16x16 MFMA on gfx942 / gfx950, m16n8k16
                 # on sm90: tests/test_gemm_rmsnorm.py), so an output's K order is the BLOCK_K loop's
                 launch_keys=("BLOCK_M", "BLOCK_N")),
    # gemm_bf16_rmsnorm over r = bf16(x + res) with r stored (ops.gemm_addnorm: a layer's first GEMM at
    # world size > 1): the GEMM bytes, the norm weight, the residual read and r written (2 + 2 bytes a
    # row element; the prologue's re-reads of both rows hit L2); its own split-K partials as above
    # (gemm_bf16_addnorm_y: the normed rows y written too, 2 more bytes a row element; _yq: and their
    # int8 codes, 1 more, plus a scale per row). BLOCK_M and BLOCK_N are launch-only as in
    # gemm_bf16_rmsnorm (the same main loop, ops.gemm.output_split_gemm; the first column tile's
    # stores are the same values at any width); the route forms search their own (configs_of)
    *(ProblemModel(name, ("N", "K"), peak_dtype="bf16",
                   bytes_fn=lambda p, m, ob=ob: _gemm(2, 2, "bf16")[0](p, m) + 2 * p["K"] + ob * m * p["K"],
                   flops_fn=lambda p, m: _gemm(2, 2, "bf16")[1](p, m) + 5.0 * m * p["K"], shared_numerics=True,
                   derived=lambda p, m, c: _rmsnorm_split(p, c), loop_dim="KS",
                   extra_bytes_fn=lambda p, m, d: 2.0 * m * p["N"] * (4 * d["P"] - 2),
                   launch_keys=("BLOCK_M", "BLOCK_N"), tiles_from=("gemm_bf16_rmsnorm", "gemm_bf16_addnorm"))
      for name, ob in (("gemm_bf16_addnorm", 4), ("gemm_bf16_addnorm_y", 6), ("gemm_bf16_addnorm_yq", 7))),
    # the same at world size 1 over o_proj's S split-K f32 partials (their traffic charged to
    # gemm_bf16_splitk, which writes them, as for gemm_bf16_rmsnorm); S is part of the key: every
    # program's prologue re-reads all S partials of its rows (at S=4 twice the time of S=1 on gfx942)
    *(ProblemModel(name, ("N", "K", "S"), peak_dtype="bf16",
                   bytes_fn=lambda p, m, ob=ob: _gemm(2, 2, "bf16")[0](p, m) + 2 * p["K"] + ob * m * p["K"],
                   flops_fn=lambda p, m: _gemm(2, 2, "bf16")[1](p, m) + 5.0 * m * p["K"], shared_numerics=True,
                   derived=lambda p, m, c: _rmsnorm_split(p, c), loop_dim="KS",
                   extra_bytes_fn=lambda p, m, d: 2.0 * m * p["N"] * (4 * d["P"] - 2),
                   launch_keys=("BLOCK_M", "BLOCK_N"), tiles_from=("gemm_bf16_addnorm_y", "gemm_bf16_addnorm_yq"))
      for name, ob in (("gemm_bf16_addnorm_splitk_y", 6), ("gemm_bf16_addnorm_splitk_yq", 7))),
    # split-K: the floor of the plain GEMM; the f32 partials [S, M, N] written and read back once by
    # the consumers are the split's extra traffic; S = SPLIT_K more programs, each looping over KS
    ProblemModel("gemm_bf16_splitk", ("N", "K"), peak_dtype="bf16", bytes_fn=_gemm(2, 2, "bf16")[0],
                 flops_fn=_gemm(2, 2, "bf16")[1], derived=_splitk_derived, loop_dim="KS",
                 extra_bytes_fn=lambda p, m, d: 2.0 * d["S"] * m * p["N"] * 4, shared_numerics=True),
    # the MLP down GEMM over split-K gate|up partials [S, M, 2I]: a gemm_bf16 over the bf16 SwiGLU
    # rows; the partials' traffic is charged to gemm_bf16_splitk, which writes them. S is static
    # (the split sum unrolls, so the ISA and the tuner see every split's adds) and part of the key
    ProblemModel("gemm_bf16_swiglu", ("N", "I", "S"), peak_dtype="bf16", loop_dim="I",
                 bytes_fn=lambda p, m: p["N"] * p["I"] * 2 + m * p["I"] * 2 + m * p["N"] * 2,
                 flops_fn=lambda p, m: 2.0 * m * p["N"] * p["I"], derived=lambda p, m, c: {"N2": 2 * p["I"]},
                 # a row sits at its own place (row mod 16) of one aligned 16-row dot at any BLOCK_M; a
                 # program's N_TILES dots are each a BLOCK_N dot of the same A tile
                 shared_numerics=True, launch_keys=("BLOCK_M", "N_TILES")),
    # gemm_bf16_swiglu with the MoE layer's end in its epilogue: its weights and SwiGLU rows, no bf16
    # shared output, the routed rows (f32) and ids in; then ops.moe.moe_combine_add's residual read and
    # written (bf16) and the residual as f32 rows out (8 bytes a column), or (a rank's end at world
    # size > 1) moe_combine_rank's bf16 rows out (2). Same tiles (and numerics keys) as gemm_bf16_swiglu
    *(ProblemModel(name, ("N", "I", "S", "TOPK"), peak_dtype="bf16", loop_dim="I",
                   bytes_fn=lambda p, m, ob=ob: (p["N"] * p["I"] * 2 + m * p["I"] * 2 + routed_rows(p, m) * p["N"] * 4
                                                 + m * (p["N"] * ob + p["TOPK"] * 4)),
                   flops_fn=lambda p, m, adds=adds: 2.0 * m * p["N"] * p["I"] + (p["TOPK"] + adds) * m * p["N"],
                   derived=lambda p, m, c: {"N2": 2 * p["I"], **_topk_derived(p, m, c)},
                   shared_numerics=True, launch_keys=("BLOCK_M", "N_TILES"), tiles_from=("gemm_bf16_swiglu",))
      for name, ob, adds in (("gemm_bf16_swiglu_combine", 8, 2.0), ("gemm_bf16_swiglu_rank", 2, 1.0))),
    # gemm_bf16_splitk with the residual-add norm tail of rmsnorm_add(_quant)_splitk in its last
    # programs (ops.splitk_norm): the GEMM's bytes plus residual, norm weight, res_out (+ q, scale);
    # the partials written and read back once and res_out read back by the row tail are extra; the
    # tail's serial work after the grid is `tail_fn`
    *(ProblemModel(name, ("D", "K"), peak_dtype="bf16", loop_dim="KS", shared_numerics=True,
                   bytes_fn=lambda p, m, qb=qb: (p["D"] * p["K"] * 2 + m * p["K"] * 2 + p["D"] * 2
                                                 + m * p["D"] * (2 + 2 + 2 + qb) + (4 * m if qb else 0)),
                   flops_fn=lambda p, m: 2.0 * m * p["D"] * p["K"] + (8.0 + 4) * m * p["D"],
                   derived=_splitk_norm_derived,
                   extra_bytes_fn=lambda p, m, d: 2.0 * d["S"] * m * p["D"] * 4 + m * p["D"] * 2,
                   tail_fn=lambda p, m, d, qb=qb: _splitk_norm_tail(p, m, d, qb))
      for name, qb in (("gemm_bf16_splitk_norm", 0), ("gemm_bf16_splitk_norm_quant", 1))),
    ProblemModel("gemm_bf16*", ("N", "K"), peak_dtype="bf16", bytes_fn=_gemm(2, 2, "bf16")[0],
                 flops_fn=_gemm(2, 2, "bf16")[1], shared_numerics=True),
    ProblemModel("gemm_fp8*", ("N", "K"), peak_dtype="fp8", bytes_fn=_gemm(1, 1, "fp8")[0],
                 flops_fn=_gemm(1, 1, "fp8")[1]),
    ProblemModel("gemm_w8a8*", ("N", "K"), peak_dtype="i8", bytes_fn=_gemm(1, 1, "i8")[0],
                 flops_fn=_gemm(1, 1, "i8")[1]),
    ProblemModel("gemm_w4a8*", ("N", "K"), peak_dtype="i8", bytes_fn=_gemm(0.5, 1, "i8")[0],
                 flops_fn=_gemm(0.5, 1, "i8")[1], launch_keys=INT4_LOWERING),
    ProblemModel("gemm_w4a16*", ("N", "K"), peak_dtype="bf16", bytes_fn=_gemm(0.5, 2, "bf16", 32)[0],
                 flops_fn=_gemm(0.5, 2, "bf16", 32)[1], derived=lambda p, m, c: {"G": p["K"] // 32},
                 launch_keys=INT4_LOWERING),
    ProblemModel("moe_stage1_w4a8", ("E", "K", "I", "TOPK"), peak_dtype="i8", bytes_fn=_moe(1, 0.5, 1, False)[0],
                 flops_fn=_moe(1, 0.5, 1, False)[1], derived=_moe_stage1_derived,
                 launch_keys=INT4_LOWERING),
    ProblemModel("moe_stage1_w4a8_q", ("E", "K", "I", "TOPK"), peak_dtype="i8", bytes_fn=_moe_q(1)[0],
                 flops_fn=_moe_q(1)[1], derived=_moe_stage1q_derived, launch_keys=INT4_LOWERING),
    ProblemModel("moe_stage2_w4a8_gq", ("E", "H", "I", "TOPK"), peak_dtype="i8", bytes_fn=_moe_q(2)[0],
                 flops_fn=_moe_q(2)[1], derived=_moe_stage2gq_derived, m_of=_moe_stage2_m, loop_dim="I",
                 launch_keys=INT4_LOWERING),
    ProblemModel("moe_stage1_w4a8_amax", ("E", "K", "I", "TOPK"), peak_dtype="i8", bytes_fn=_moe_amax(1)[0],
                 flops_fn=_moe_amax(1)[1], derived=_moe_stage1a_derived,
                 launch_keys=INT4_LOWERING),
    ProblemModel("moe_stage2_w4a8_aq", ("E", "H", "I", "TOPK"), peak_dtype="i8", bytes_fn=_moe_amax(2)[0],
                 flops_fn=_moe_amax(2)[1], derived=_moe_stage2a_derived, m_of=_moe_stage2_m, loop_dim="I",
                 launch_keys=INT4_LOWERING),
    ProblemModel("moe_stage1_w4a16", ("E", "K", "I", "TOPK"), peak_dtype="bf16", bytes_fn=_moe(1, 0.5, 2, True)[0],
                 flops_fn=_moe(1, 0.5, 2, True)[1], derived=_moe_stage1_derived, shared_numerics=True),
    ProblemModel("moe_stage1_bf16", ("E", "K", "I", "TOPK"), peak_dtype="bf16", bytes_fn=_moe(1, 2, 2, False)[0],
                 flops_fn=_moe(1, 2, 2, False)[1], derived=_moe_stage1_derived, shared_numerics=True),
    ProblemModel("moe_stage2_w4a8_pq", ("E", "H", "I", "TOPK"), peak_dtype="i8", bytes_fn=_moe(2, 0.5, 1, False)[0],
                 flops_fn=_moe(2, 0.5, 1, False)[1], derived=_moe_stage2_derived, m_of=_moe_stage2_m, loop_dim="I",
                 launch_keys=INT4_LOWERING),
    ProblemModel("moe_stage2_w4a8", ("E", "H", "I", "TOPK"), peak_dtype="i8", bytes_fn=_moe(2, 0.5, 2, False)[0],
                 flops_fn=_moe(2, 0.5, 2, False)[1], derived=_moe_stage2_derived, m_of=_moe_stage2_m, loop_dim="I", loops=2,
                 launch_keys=INT4_LOWERING),
    ProblemModel("moe_stage2_w4a16", ("E", "H", "I", "TOPK"), peak_dtype="bf16", bytes_fn=_moe(2, 0.5, 2, True)[0],
                 flops_fn=_moe(2, 0.5, 2, True)[1], derived=_moe_stage2_derived, m_of=_moe_stage2_m, loop_dim="I",
                 shared_numerics=True),
    ProblemModel("moe_stage2_bf16", ("E", "H", "I", "TOPK"), peak_dtype="bf16", bytes_fn=_moe(2, 2, 2, False)[0],
                 flops_fn=_moe(2, 2, 2, False)[1], derived=_moe_stage2_derived, m_of=_moe_stage2_m, loop_dim="I",
                 shared_numerics=True),
    ProblemModel("moe_gate_gemm", ("E", "H"), peak_dtype="bf16", derived=_moe_gate_derived,
                 bytes_fn=lambda p, m: (p["E"] * p["H"] + m * p["H"]) * 2 + _moe_gate_derived(p, m, {})["SPLIT"] * m * p["E"] * 4,
                 flops_fn=lambda p, m: 2.0 * m * p["E"] * p["H"], loop_dim="HS", loop_block="BLOCK_H",
                 shared_numerics=True),
    # two passes over the row: absmax, then quantize
    ProblemModel("quant_per_token*", ("K",), peak_dtype="f32", bytes_fn=_quant_bytes, flops_fn=_quant_flops,
                 loops=2),
]

# the gate|up + router forms that have a route-tail variant, and the route's key dims (moe_route_align's)
_ROUTE_BASES = ("gemm_bf16_addnorm_y", "gemm_bf16_addnorm_yq", "gemm_bf16_addnorm_splitk_y",
                "gemm_bf16_addnorm_splitk_yq")
_ROUTE_KEY = ("E", "TOPK", "NG", "EA", "BM")
MODELS[:0] = [  # ahead of the gemm_bf16* wildcard
    # the _y / _yq forms whose last program routes the tokens (ops.gemm_addnorm._route_tail): the base
    # kernel's grid and main loop with the base file's numerics tile and launch keys of their own
    # (configs_of), plus the route's serial tail; keyed by the base's dims and moe_route_align's
    *(dataclasses.replace(base, pattern=base.pattern + "_route", key_dims=base.key_dims + _ROUTE_KEY,
                          derived=lambda p, m, c, d=base.derived: {**d(p, m, c), **_route_tail_derived(p, m, c)},
                          shared_numerics=False, tiles_from=(), configs_of=base.pattern, tail_fn=_route_tail_work)
      for base in MODELS if base.pattern in _ROUTE_BASES),
]


# ---- attention decode over a paged KV cache: keyed on the head shapes and q_len; M = batch x q_len


def _ctx(p: Problem) -> int:
    return int(p.get("CTX", NOMINAL_CTX))


def _batch(p: Problem, m: int) -> int:
    """Sequences in a launch of M = batch x q_len rows."""
    return max(1, math.ceil(m / p["QL"]))


def _mla_kv_bytes(p: Problem, m: int) -> float:
    """The latent cache read once: every cached token's DL + DR bf16 values, per sequence."""
    return _batch(p, m) * _ctx(p) * (p["DL"] + p["DR"]) * 2 if m else 0.0


def _mla_bytes(p: Problem, m: int) -> float:
    """KV read + q read + bf16 output + block table. The split partials (f32, S per row, written
    here and read back by the combine) are the split's own overhead, not part of the floor."""
    b = _batch(p, m) if m else 0
    rows = b * p["QL"] * p["H"]
    return _mla_kv_bytes(p, m) + rows * (p["DL"] + p["DR"]) * 2 + rows * p["DL"] * 2 + b * math.ceil(_ctx(p) / p["PS"]) * 4


def _mla_flops(p: Problem, m: int) -> float:
    """QK^T over DL + DR and PV over DL for every (row, head, cached token)."""
    return 2.0 * _batch(p, m) * p["QL"] * p["H"] * _ctx(p) * (2 * p["DL"] + p["DR"])


def _paged_dims(p: Problem, m: int) -> Problem:
    """Batch, block-table width and page pool of a paged decode launch: the step's table capacity."""
    b = _batch(p, m)
    mp = _table_capacity(p) // p["PS"]
    return {"B": b, "MP": mp, "NP": b * mp}


def _mla_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    return {**_paged_dims(p, m), "QH": p["QL"] * p["H"], "DQ": p["DL"] + p["DR"]}


def _split_chunk(ctx: int, s: int, bn: int, split_tokens: int = 0, max_splits: int = DEFAULT_MAX_SPLITS) -> int:
    """Tokens one split walks (ops.mla.split_range): batch-invariant (SPLIT_TOKENS > 0) chunks of
    SPLIT_TOKENS, or of the context over `max_splits` rounded up to BLOCK_N when that is longer;
    with SPLIT_TOKENS 0 the length cut into S chunks rounded up to BLOCK_N."""
    if split_tokens:
        return max(split_tokens, math.ceil(math.ceil((ctx + MAX_Q_LEN - 1) / max_splits) / bn) * bn)
    return math.ceil(math.ceil(ctx / s) / bn) * bn


def _step_tokens(p: Problem) -> int:
    """Tokens a sequence holds when the split kernel runs: the context and the step's QL new
    tokens (appended first). A bench passes that as CTX (bench.step: ctx + q_len); the tuner's
    nominal step is NOMINAL_CTX of context plus its QL new tokens."""
    return int(p["CTX"]) if "CTX" in p else NOMINAL_CTX + int(p.get("QL", 1))


def _table_capacity(p: Problem) -> int:
    """Tokens the step's block table holds (the capacity `ops.mla.mla_decode` plans its splits
    for): the sequence's tokens rounded up to whole pages."""
    return -(-_step_tokens(p) // p["PS"]) * p["PS"]


def _mla_launch(d: Problem, m: int, c: dict[str, Any], target: Any) -> Problem:
    """The split count `ops.mla.mla_decode` launches with (same call), and the tokens per split.
    The op counts the table's capacity, and a step's table holds the context and the q_len new
    tokens in pages of PS (bench.step's: 8192 + 1 -> 129 pages -> 8256 tokens -> 33 splits of 256,
    as `_combine_uv_launch` counts); scoring at the context alone (32 splits) tunes for a grid the
    step does not launch."""
    bm, bn = int(c.get("BLOCK_M", 16)), int(c.get("BLOCK_N", 32))
    st = int(c.get("SPLIT_TOKENS", 256))
    ms = max_splits_for(d["H"])
    cap = _table_capacity(d)
    s = launch_split_count(cap, d["B"], d["QL"] * d["H"], bm, bn, st, target.cu_count, ms)
    # ops.mla.split_range: fixed chunks from the first new row's context (the tokens less QL - 1),
    # or (SPLIT_TOKENS 0) the sequence's tokens cut into S
    n = _step_tokens(d)
    return {"S": s, "CHUNK": _split_chunk(n - d["QL"] + 1 if st else n, s, bn, st, ms)}


def _decode_ref(p: Problem) -> Problem:
    """Decode attention's numerics come from the q_len-1 problem (ops.mla.mla_decode and
    ops.mha.paged_mha_decode: invariant_config with QL 1), so a verify row reduces like decode."""
    return {**p, "QL": 1}


def _split_partials(p: Problem, m: int, d: Problem) -> float:
    """f32 partial outputs + log-sum-exp of every split, written by the split kernel (the combine
    reads them back: its own bytes)."""
    rows = _batch(p, m) * p["QL"] * p["H"]
    return rows * int(d.get("S", 1)) * (p["DL"] + 1) * 4.0


def _combine_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    return {"B": _batch(p, m), "QH": p["QL"] * p["H"]}


def _combine_launch(mha: bool) -> Callable[..., Problem]:
    """The split count of the split kernel a combine follows, unless the problem names one: the
    batch-invariant plan of `ops.mla.mla_decode` (`mha`: `ops.mha.paged_mha_decode`, its MHA
    shape: as many KV heads as query heads) over the step's table (`_table_capacity` in pages of
    _SPLIT_PS) with the SPLIT_TOKENS of that arch's tuned split kernel (`_split_tokens`), as
    `_combine_uv_launch` counts: S is static and sets the merge loop's trips."""
    def launch(d: Problem, m: int, c: dict[str, Any], target: Any) -> Problem:
        if "S" in d:
            return {}
        cap = _table_capacity({**d, "PS": _SPLIT_PS})
        st = _split_tokens(target, d["H"], d["DL"], mha)
        ms = DEFAULT_MAX_SPLITS if mha else max_splits_for(d["H"])
        return {"S": launch_split_count(cap, d["B"], d["QL"] * d["H"], 16, 32, st, target.cu_count, ms)}
    return launch


def _batch_rows(d: Problem) -> int:
    return int(d.get("B", 1)) * int(d.get("QL", 1))


def _mha_kv_bytes(p: Problem, m: int) -> float:
    """K and V read once: KVH heads x D bf16 values each, per cached token and sequence."""
    return _batch(p, m) * _ctx(p) * p["KVH"] * p["D"] * 2 * 2 if m else 0.0


def _mha_bytes(p: Problem, m: int) -> float:
    b = _batch(p, m) if m else 0
    rows = b * p["QL"] * p["HQ"]
    return _mha_kv_bytes(p, m) + rows * p["D"] * 2 * 2 + b * math.ceil(_ctx(p) / p["PS"]) * 4


def _mha_flops(p: Problem, m: int) -> float:
    return 2.0 * _batch(p, m) * p["QL"] * p["HQ"] * _ctx(p) * 2 * p["D"]


def _mha_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    return {**_paged_dims(p, m), "QG": p["QL"] * (p["HQ"] // p["KVH"])}


def _mha_launch(d: Problem, m: int, c: dict[str, Any], target: Any) -> Problem:
    """The split count `ops.mha.paged_mha_decode` launches with (the same call: per sequence
    KVH x BLOCK_M-padded rows of its GQA group, over the table's capacity as `_mla_launch`)."""
    bm, bn = int(c.get("BLOCK_M", 16)), int(c.get("BLOCK_N", 32))
    st = int(c.get("SPLIT_TOKENS", 256))
    rows = d["KVH"] * math.ceil(d["QG"] / bm) * bm
    s = launch_split_count(_table_capacity(d), d["B"], rows, bm, bn, st, target.cu_count)
    n = _step_tokens(d)
    return {"S": s, "BS": d["B"] * s, "CHUNK": _split_chunk(n - d["QL"] + 1 if st else n, s, bn, st)}


MODELS += [
    ProblemModel("mla_decode_split*", ("QL", "H", "DL", "DR", "PS"), peak_dtype="bf16", bytes_fn=_mla_bytes,
                 flops_fn=_mla_flops, derived=_mla_derived, launch_dims=_mla_launch, loop_dim="CHUNK",
                 loop_block="BLOCK_N", reuse_dim=("QH", "DL"), shared_bytes_fn=_mla_kv_bytes, m_block=None,
                 extra_bytes_fn=_split_partials, extra_written=True, m_of=_batch_rows, shared_numerics=True,
                 numerics_ref=_decode_ref,
                 launch_keys=("DL_SPLIT",)),
    ProblemModel("mha_decode", ("QL", "HQ", "KVH", "D", "PS"), peak_dtype="bf16", bytes_fn=_mha_bytes,
                 flops_fn=_mha_flops, derived=_mha_derived, launch_dims=_mha_launch, loop_dim="CHUNK",
                 loop_block="BLOCK_N", reuse_dim="QG", shared_bytes_fn=_mha_kv_bytes, m_block=None,
                 m_of=_batch_rows, shared_numerics=True, numerics_ref=_decode_ref),
]




# ---- small kernels of the decode step: the op's lookup key, M, and the bytes they move

def _align_nb(p: Problem, t: int) -> int:
    """Aligned blocks of T = t rows (ops.moe.moe_align): ops.moe.aligned_blocks."""
    return aligned_blocks(t, p["E"], p["BM"])


def _ea(p: Problem) -> Problem:
    """The align's view of a route_align problem: E = the experts aligned (EA)."""
    return {"E": p["EA"], "BM": p["BM"]}


def _route_align_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    """ops.moe.route_align's launch dims: the token tile MB = p2(M), the aligned blocks of T = M x TOPK."""
    nb = _align_nb(_ea(p), m * p["TOPK"])
    return {"MB": 1 << max(0, (m - 1).bit_length()), "NB": nb, "S": nb * p["BM"]}


def _topk_derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    """Partial rows P = M x TOPK; E (the id bound) and SH (shared expert added) are compile-time
    values of the kernel but no part of its cost or key: Kimi's 384 experts and a shared expert."""
    return {"P": m * p["TOPK"], "E": p.get("E", 384), "SH": p.get("SH", 1)}

def _rows(k: str, per_row: Callable[[Problem], float], fixed: Callable[[Problem], float] = lambda p: 0.0
          ) -> Callable[[Problem, int], float]:
    def nbytes(p: Problem, m: int) -> float:
        return m * per_row(p) + fixed(p)
    return nbytes


def _combine_bytes(out_bytes: int) -> Callable[[Problem, int], float]:
    def nbytes(p: Problem, m: int) -> float:  # the output: the floor of a combine is its write
        return _batch(p, m) * p["QL"] * p["H"] * p["DL"] * out_bytes
    return nbytes


def _combine_extra(p: Problem, m: int, d: Problem) -> float:
    s = int(d.get("S", p.get("S", 1)))
    return _batch(p, m) * p["QL"] * p["H"] * s * (p["DL"] + 1) * 4.0


# The RMSNorm kernels split a row's outputs over CH = cdiv(D, BLOCK_D) programs that each read the
# whole row for its statistics. Programs are dealt round-robin over the L2 partitions (the 8 XCDs of
# gfx942 / gfx950), so up to 8 of them miss L2 on the same row: those re-reads count as traffic,
# charged at HBM bandwidth (an upper bound: the Infinity Cache serves most of them).
NORM_L2_PARTITIONS = 8


def _norm_chunks(p: Problem, m: int, c: dict[str, Any]) -> Problem:
    return {"CH": -(-p["D"] // c.get("BLOCK_D", WHOLE_ROW))}


def _norm_rereads(row_bytes: Callable[[Problem], float]) -> Callable[[Problem, int, Problem], float]:
    def extra(p: Problem, m: int, d: Problem) -> float:
        return m * (min(int(d.get("CH", 1)), NORM_L2_PARTITIONS) - 1) * row_bytes(p)
    return extra


MODELS += [
    ProblemModel("rmsnorm", ("D",), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=_rows("D", lambda p: p["D"] * 4, lambda p: p["D"] * 2),
                 flops_fn=lambda p, m: 4.0 * m * p["D"], derived=_norm_chunks,
                 extra_bytes_fn=_norm_rereads(lambda p: p["D"] * 2),
                 shared_numerics=True, launch_keys=("BLOCK_D",)),
    ProblemModel("rmsnorm_add", ("D",), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=_rows("D", lambda p: p["D"] * 8, lambda p: p["D"] * 2),
                 flops_fn=lambda p, m: 5.0 * m * p["D"], derived=_norm_chunks,
                 extra_bytes_fn=_norm_rereads(lambda p: p["D"] * 4),
                 shared_numerics=True, launch_keys=("BLOCK_D",)),
    # a step's bookkeeping (ops.step_prologue), per new row: the embedding row read, h and x written,
    # the cos/sin rows read and written, a few indices; the norm weight once
    ProblemModel("step_prologue", ("H", "R2"), m_dim="T", m_block=None, peak_dtype="f32", loop_dim=None,
                 loop_block=None, bytes_fn=_rows("H", lambda p: p["H"] * 6 + p["R2"] * 16 + 40, lambda p: p["H"] * 2),
                 flops_fn=lambda p, m: 4.0 * m * p["H"], shared_numerics=True),
    ProblemModel("silu_mul", ("I",), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=_rows("I", lambda p: p["I"] * 6), flops_fn=lambda p, m: 6.0 * m * p["I"]),
    ProblemModel("rope_*", ("H", "R"), m_dim="T", m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 derived=lambda p, m, c: {"R2": p["R"] // 2},
                 bytes_fn=_rows("R", lambda p: p["H"] * p["R"] * 4 + p["R"] * 4),
                 flops_fn=lambda p, m: 3.0 * m * p["H"] * p["R"]),
    ProblemModel("moe_route", ("E", "TOPK"), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=_rows("E", lambda p: p.get("SPLIT", 1) * p["E"] * 4 + p["TOPK"] * 8, lambda p: p["E"] * 4),
                 flops_fn=lambda p, m: 4.0 * m * p["E"]),
    ProblemModel("moe_route_local", ("E", "TOPK"), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=_rows("E", lambda p: p.get("SPLIT", 1) * p["E"] * 4 + p["TOPK"] * 8, lambda p: p["E"] * 4),
                 flops_fn=lambda p, m: 4.0 * m * p["E"]),
    # route + align in one program: the SPLIT partial logits of M tokens, ids, weights, block map and
    # sorted slots (EA: the experts aligned, E or an expert-parallel rank's share; MB: the token tile)
    *(ProblemModel(name, ("E", "TOPK", "NG", "EA", "BM"), m_block=None, peak_dtype="f32", loop_dim=None,
                   loop_block=None, flops_fn=lambda p, m: 4.0 * m * p["E"] + 2.0 * m * p["TOPK"] * p["EA"],
                   bytes_fn=lambda p, m: (m * (p.get("SPLIT", 1) * p["E"] * 4 + p["TOPK"] * 8) + p["E"] * 4
                                          + _align_nb(_ea(p), m * p["TOPK"]) * (1 + p["BM"]) * 4),
                   derived=_route_align_derived)
      for name in ("moe_route_align", "moe_route_align_local")),
    ProblemModel("moe_align_blocks", ("E", "BM"), m_dim="T", m_block=None, peak_dtype="f32", loop_dim=None,
                 loop_block=None, bytes_fn=lambda p, m: m * 4 + p["E"] * 4 + _align_nb(p, m) * (1 + p["BM"]) * 4,
                 flops_fn=lambda p, m: 0.0,
                 derived=lambda p, m, c: {"NB": _align_nb(p, m), "S": _align_nb(p, m) * p["BM"]}),
    ProblemModel("moe_align_one", ("E", "BM"), m_dim="T", m_block=None, peak_dtype="f32", loop_dim=None,
                 loop_block=None, bytes_fn=lambda p, m: m * 4 + _align_nb(p, m) * (1 + p["BM"]) * 4,
                 flops_fn=lambda p, m: 0.0,
                 derived=lambda p, m, c: {"NB": _align_nb(p, m), "S": _align_nb(p, m) * p["BM"]}),
    ProblemModel("moe_align_scatter", ("E",), m_dim="T", m_block=None, peak_dtype="f32", loop_dim=None,
                 loop_block=None, bytes_fn=lambda p, m: m * 8 + p["E"] * 4, flops_fn=lambda p, m: 0.0),
    # KV appends: each new token's row read and written once (the cache size is not traffic: the key
    # leaves the page count out, a nominal pool of 4096 pages of 64 fills the compile-only dims)
    ProblemModel("mla_cache_append", ("DQ",), m_dim="NT", m_block=None, peak_dtype="f32", loop_dim=None,
                 loop_block=None, bytes_fn=lambda p, m: m * (p["DQ"] * 2 * 2 + 8), flops_fn=lambda p, m: 0.0,
                 derived=lambda p, m, c: {"NP": 4096, "PS": 64}),
    ProblemModel("mha_cache_append", ("KVH", "D"), m_dim="NT", m_block=None, peak_dtype="f32", loop_dim=None,
                 loop_block=None, bytes_fn=lambda p, m: m * (p["KVH"] * p["D"] * 2 * 2 * 2 + 8),
                 flops_fn=lambda p, m: 0.0, derived=lambda p, m, c: {"NP": 4096, "PS": 64}),
    ProblemModel("moe_sum_ids", ("H", "TOPK"), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=_rows("H", lambda p: p["H"] * 4 * (p["TOPK"] + 1) + p["TOPK"] * 4),
                 flops_fn=lambda p, m: m * p["H"] * p["TOPK"], derived=_topk_derived),
    # top-k partial rows (f32) + shared (bf16) + residual read and written + normed row out, per token
    ProblemModel("moe_combine_norm", ("D", "TOPK"), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=_rows("D", lambda p: p["D"] * (4 * p["TOPK"] + 2 + 4 + 2) + p["TOPK"] * 4,
                                lambda p: p["D"] * 2),
                 flops_fn=lambda p, m: (p["TOPK"] + 6.0) * m * p["D"], derived=_topk_derived, shared_numerics=True),
    # a rank's share before the all-reduce: top-k partial rows (f32) + shared (bf16) in, bf16 row out
    ProblemModel("moe_combine_rank", ("D", "TOPK"), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=lambda p, m: routed_rows(p, m) * p["D"] * 4 + m * (p["D"] * 4 + p["TOPK"] * 4),
                 flops_fn=lambda p, m: (p["TOPK"] + 1.0) * m * p["D"], derived=_topk_derived),
    ProblemModel("rmsnorm_add_quant", ("D",), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=_rows("D", lambda p: p["D"] * (2 + 4 + 2 + 1) + 4, lambda p: p["D"] * 2),
                 flops_fn=lambda p, m: 9.0 * m * p["D"], derived=_norm_chunks,
                 extra_bytes_fn=_norm_rereads(lambda p: p["D"] * 4),
                 shared_numerics=True, launch_keys=("BLOCK_D",)),
    # the residual-add norms over the layer output's split-K partials [S, M, D] f32 (o_proj at world
    # size 1): the bytes of the bf16-input kernels (the partials' one read is charged to
    # gemm_bf16_splitk, which writes them), the chunks' re-reads of the whole row at S x f32 + bf16
    ProblemModel("rmsnorm_add_splitk", ("D", "S"), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=_rows("D", lambda p: p["D"] * 8, lambda p: p["D"] * 2),
                 flops_fn=lambda p, m: (4.0 + p["S"]) * m * p["D"], derived=_norm_chunks,
                 extra_bytes_fn=_norm_rereads(lambda p: p["D"] * (4 * p["S"] + 2)),
                 shared_numerics=True, launch_keys=("BLOCK_D",)),
    ProblemModel("rmsnorm_add_quant_splitk", ("D", "S"), m_block=None, peak_dtype="f32", loop_dim=None,
                 loop_block=None, bytes_fn=_rows("D", lambda p: p["D"] * (2 + 4 + 2 + 1) + 4, lambda p: p["D"] * 2),
                 flops_fn=lambda p, m: (8.0 + p["S"]) * m * p["D"], derived=_norm_chunks,
                 extra_bytes_fn=_norm_rereads(lambda p: p["D"] * (4 * p["S"] + 2)),
                 shared_numerics=True, launch_keys=("BLOCK_D",)),
    # combine_norm without the norm: top-k partial rows (f32) + shared (bf16) + residual read and
    # written (bf16) + the residual as f32 rows out (read by the next q_a|kv_a GEMM's prologue)
    ProblemModel("moe_combine_add", ("D", "TOPK"), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=lambda p, m: routed_rows(p, m) * p["D"] * 4 + m * (p["D"] * 10 + p["TOPK"] * 4),
                 flops_fn=lambda p, m: (p["TOPK"] + 2.0) * m * p["D"], derived=_topk_derived),
    ProblemModel("moe_sum", ("H", "TOPK"), m_block=None, peak_dtype="f32", loop_dim=None, loop_block=None,
                 bytes_fn=_rows("H", lambda p: p["H"] * 4 * (p["TOPK"] + 1)), flops_fn=lambda p, m: m * p["H"] * p["TOPK"]),
    ProblemModel("mla_decode_combine", ("QL", "H", "DL"), m_block=None, peak_dtype="f32", loop_dim=None,
                 loop_block=None, bytes_fn=_combine_bytes(2), extra_bytes_fn=_combine_extra, m_of=_batch_rows,
                 derived=_combine_derived, launch_dims=_combine_launch(False)),
    ProblemModel("mla_decode_combine_f32", ("QL", "H", "DL"), m_block=None, peak_dtype="f32", loop_dim=None,
                 loop_block=None, bytes_fn=_combine_bytes(4), extra_bytes_fn=_combine_extra, m_of=_batch_rows,
                 derived=_combine_derived, launch_dims=_combine_launch(False)),
    ProblemModel("mha_decode_combine*", ("QL", "H", "DL"), m_block=None, peak_dtype="f32", loop_dim=None,
                 loop_block=None, bytes_fn=_combine_bytes(2), extra_bytes_fn=_combine_extra, m_of=_batch_rows,
                 derived=_combine_derived, launch_dims=_combine_launch(True)),
]

register(*MODELS)

from ops import problems_mxfp4  # noqa: E402,F401  (registers the MXFP4 kernels' models)


# ---- the fused MLA steps (ops.mla_fused): prep (norms, k rope, cache append), q absorb (W_UK), and the
# split combine with W_UV


def _prep_derived(q: bool) -> Callable[[Problem, int, dict[str, Any]], Problem]:
    def derived(p: Problem, m: int, c: dict[str, Any]) -> Problem:
        dq = p["DL"] + 2 * p["R2"]
        return {"NQ": (p["QR"] if q else 0) + dq, "DQ": dq, "NP": 4096, "PS": 64}
    return derived


def _prep_bytes(q: bool) -> Callable[[Problem, int], float]:
    """The GEMM output row read once, q_c and the cache row written, slot and cos/sin read, the
    norm weights (the page pool is not traffic: a nominal 4096 pages of 64 fill the compile dims)."""
    def nbytes(p: Problem, m: int) -> float:
        qr = p["QR"] if q else 0
        dq = p["DL"] + 2 * p["R2"]
        return m * ((qr + dq) * 2 + qr * 2 + dq * 2 + 8 + 2 * p["R2"] * 4) + (qr + p["DL"]) * 2
    return nbytes


def _absorb_bytes(p: Problem, m: int) -> float:
    """W_UK once, q rows in, absorbed rows out, cos/sin."""
    dqk, dq = p["NOPE"] + 2 * p["R2"], p["DL"] + 2 * p["R2"]
    return p["H"] * p["NOPE"] * p["DL"] * 2 + m * (p["H"] * (dqk + dq) * 2 + 2 * p["R2"] * 4)


# The split kernel's rope dim and page size are no part of the combine's key: Kimi's (and the
# bench's) 64 and 64 name the split problem whose tuned tile sets the combine's split count.
_SPLIT_DR, _SPLIT_PS = 64, 64


def _split_tokens(target: Any, heads: int, latent: int, mha: bool = False) -> int:
    """SPLIT_TOKENS of the split kernel a batch-invariant mla_decode (`mha`: paged_mha_decode, KV
    heads = query heads) runs before the combine: the M=1 entry of its tuned q_len-1 file on this
    arch (invariant_config with QL 1), else the kernel's default."""
    import warnings

    from autotune import lookup_config

    if mha:
        from ops.mha import mha_decode as kern
        prob = {"QL": 1, "HQ": heads, "KVH": heads, "D": latent, "PS": _SPLIT_PS}
        static = {"QL": 1, "D": latent}
    else:
        from ops.mla import mla_decode_split as kern
        prob = {"QL": 1, "H": heads, "DL": latent, "DR": _SPLIT_DR, "PS": _SPLIT_PS}
        static = {"QL": 1, "DL": latent, "DR": _SPLIT_DR}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = lookup_config(kern, target.name, prob, 1)
    return int(cfg.get("SPLIT_TOKENS", kern.tunables(static=static)["SPLIT_TOKENS"].default))


def _combine_uv_launch(d: Problem, m: int, c: dict[str, Any], target: Any) -> Problem:
    """The split count S of the MLA split kernel it follows, unless the recorded launch bound one.
    The tuner assumes what mla_decode launches at the problem's context (NOMINAL_CTX 8192 unless
    CTX is given): a batch-invariant plan over a table that holds the context and the new token,
    in pages of 64 (bench.step's table: 8193 tokens -> 129 pages -> 8256), with the SPLIT_TOKENS of
    the arch's tuned split kernel, capped at max_splits_for(H): gfx942 H=8: 128 -> 65 splits (the
    65th covers the new token), gfx950 H=8 or 16: 64 -> 128 (the cap), H=64: 256 -> 33 (the cap is 64).
    S is a compile-time dim and sets the split loop's trips, so scoring at another S (the old fixed
    256: 32 at H=8) tunes BLOCK_S for a loop the step does not run."""
    if "S" in d:
        return {}
    cap = _table_capacity({**d, "PS": _SPLIT_PS})
    st = _split_tokens(target, d["H"], d["DL"])
    return {"S": launch_split_count(cap, m, d["H"], 16, 32, st, target.cu_count, max_splits_for(d["H"]))}


MLA_FUSED_MODELS = [
    ProblemModel("mla_prep_qkv", ("QR", "DL", "R2"), m_dim="T", m_block=None, peak_dtype="f32", loop_dim=None,
                 loop_block=None, bytes_fn=_prep_bytes(True), derived=_prep_derived(True),
                 flops_fn=lambda p, m: m * (4.0 * (p["QR"] + p["DL"]) + 6.0 * p["R2"])),
    ProblemModel("mla_prep_kv", ("DL", "R2"), m_dim="T", m_block=None, peak_dtype="f32", loop_dim=None,
                 loop_block=None, bytes_fn=_prep_bytes(False), derived=_prep_derived(False),
                 flops_fn=lambda p, m: m * (4.0 * p["DL"] + 6.0 * p["R2"])),
    ProblemModel("mla_q_absorb", ("H", "NOPE", "DL", "R2"), m_dim="T", m_block="BLOCK_T", peak_dtype="bf16",
                 loop_dim="NOPE", loop_block="BLOCK_K", bytes_fn=_absorb_bytes,
                 flops_fn=lambda p, m: 2.0 * m * p["H"] * p["NOPE"] * p["DL"],
                 derived=lambda p, m, c: {"DQK": p["NOPE"] + 2 * p["R2"], "DQ": p["DL"] + 2 * p["R2"]}),
    # q absorb + the cache append of mla_prep_qkv's kv part (one program per row writes it)
    ProblemModel("mla_q_absorb_kv", ("H", "NOPE", "DL", "R2"), m_dim="T", m_block="BLOCK_T", peak_dtype="bf16",
                 loop_dim="NOPE", loop_block="BLOCK_K",
                 bytes_fn=lambda p, m: _absorb_bytes(p, m) + _prep_bytes(False)(p, m),
                 flops_fn=lambda p, m: 2.0 * m * p["H"] * p["NOPE"] * p["DL"] + m * (4.0 * p["DL"] + 6.0 * p["R2"]),
                 derived=lambda p, m, c: {"DQK": p["NOPE"] + 2 * p["R2"], "DQ": p["DL"] + 2 * p["R2"],
                                          "NK": p["DL"] + 2 * p["R2"], "NP": 4096, "PS": 64, "S": p.get("S", 1),
                                          "P": p.get("P", 1)},
                 # a row sits at its own place (row mod 16) of one aligned 16-row dot at any BLOCK_T; a
                 # column sums over NOPE in BLOCK_K steps at any BLOCK_C
                 shared_numerics=True, launch_keys=("BLOCK_T", "BLOCK_C")),
    # floor: W_UV once and the bf16 output; the f32 split partials it reads are the split's overhead
    ProblemModel("mla_combine_uv", ("H", "DL", "V"), m_dim="BQ", m_block="BLOCK_M", peak_dtype="bf16",
                 loop_dim="DL", loop_block="BLOCK_C", inner_loop=("S", "BLOCK_S"), launch_dims=_combine_uv_launch,
                 bytes_fn=lambda p, m: p["H"] * p["DL"] * p["V"] * 2 + m * p["H"] * p["V"] * 2,
                 flops_fn=lambda p, m: 2.0 * m * p["H"] * p["DL"] * p["V"],
                 extra_bytes_fn=lambda p, m, d: m * p["H"] * int(d.get("S", p.get("S", 1))) * (p["DL"] + 1) * 4.0,
                 shared_numerics=True),  # combine_uv: invariant_config, the M=1 entry's tiles at any M
]
register(*MLA_FUSED_MODELS)
