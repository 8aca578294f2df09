"""Static cost model: a predicted run time from the AOT report and the target's data sheet.

Simple on purpose, every term visible in `predict(...)["terms"]`:

* programs  P = product of the specialization's grid at the problem dims (M included).
* per-wave cycles: main-loop matrix instructions x loop trips x cycles per matrix instruction,
  plus the matrix instructions outside the loop once (wgmma fence/commit/wait count 0 cycles); likewise VALU x `valu_cycles`. With two or
  more waves resident per SIMD, MFMA and VALU of different waves overlap (max); with one they add.
* compute time: the CU's SIMDs share the work of ceil(P / CUs) programs, but a round of resident
  programs cannot finish faster than one wave's latency; rounds (wave quantization) =
  ceil(P / (CUs x resident programs per CU)), resident = occupancy x SIMDs / warps per program.
* memory time: the kernel's UNIQUE bytes (problem model) over HBM bandwidth, derated when too few
  waves are in flight to saturate it (assumption: one wave per SIMD over the chip saturates HBM).
  Programs that differ only in their M tile re-read the same weights (L2 hits), so for the
  weight share of the bytes they count as one stream; only the M-dependent share (activations,
  outputs) gains parallelism from splitting M.
* LDS time: the main loop's LDS traffic per wave and iteration (from the ISA: bytes per lane, a
  sub-dword access counted as a whole 4-byte bank slot) x wave size, over the CU's LDS bandwidth
  (`LDS_BYTES_PER_CLK`), summed over every wave the CU runs: the LDS is shared by the CU's SIMDs,
  so a tile that every wave re-reads (warps stacked along a 16-row M) pays for each copy.
* MFMA and VALU of different waves overlap only when two or more waves actually share a SIMD:
  min(occupancy, waves the CU is given per SIMD); one program of 4 warps on a 4-SIMD CU adds them.
* extra bytes (problem model: e.g. MLA split partials) add to the memory time, not to the floor.
  Extra bytes a launch WRITES, each program its own part (`extra_written`: the split partials), are
  not re-reads of shared bytes: they stream at the saturation of every program in flight, not only
  of the programs that read distinct bulk bytes (the two shares' times add).
* tail (a "last program finishes" launch, kd.atomic_ticket): work ONE program does after the grid,
  serially: its bytes at the bandwidth one program draws (the memory term's saturation rule at one
  program: warps / (CUs x SIMDs) of HBM) plus one ticket round trip (`TICKET_US`) per ticket drawn
  in sequence; added to the grid's time. The launch it saves is the step's (one gap fewer).
* predicted = max(compute, LDS, memory) + tail. Launch gaps are per launch and belong to a sequence of
  launches (a step), not to one kernel: `launch_gap_us(target, mode)`. Spilling configs are charged 2x and ranked after all clean
  ones; configs that failed (compile error, LDS overflow) rank last with an infinite time.
* roofline floor = max(bytes / bandwidth, flops / peak[operand type]); the fraction recorded is
  floor / predicted (1.0 = at the roofline).

Matrix instruction cycles are DERIVED, not tabulated by hand: MACs per wave of the instruction
(from its MxNxK shape; wgmma's MACs split over the 4 warps of a warpgroup) divided by the per-SIMD
MAC rate implied by the data-sheet peak for its operand type:
    macs_per_cycle_per_simd = peak_tflops[type] * 1e12 / 2 / (CUs * SIMDs * clock).
On gfx942 this gives v_mfma_f32_32x32x8_bf16 = 32 cycles, v_mfma_f32_16x16x16_bf16 = 16,
v_mfma_i32_32x32x16_i8 = 32, v_mfma_i32_16x16x32_i8 = 16 (i.e. 8 / 4 passes of 4 cycles as listed in
the AMD CDNA3 ISA guide's MFMA table), so the model's peak equals the data-sheet peak by construction.
"""
from __future__ import annotations

import math
import re
from typing import Any

_AMD_MM = re.compile(r"^v_(?:s)?mfma(?:_scale)?_(\w+?)_(\d+)x(\d+)x(\d+)(\w*)$")
_WGMMA = re.compile(r"m(\d+)n(\d+)k(\d+)")
_MMA = re.compile(r"m(\d+)n(\d+)k(\d+)")

# recorded in every statically tuned file; `autotune check` flags files ranked by another version
VERSION = "autotune.costmodel v3"

SPILL_FACTOR = 2.0

# LDS bandwidth per CU (SM), bytes per clock. gfx942 (CDNA3): 128 B/clk (32 banks x 4 B, AMD CDNA3
# ISA guide); gfx950 (CDNA4): 256 B/clk for reads (the CDNA4 white paper doubles LDS read bandwidth
# with the 160 KB LDS; writes are charged at the same rate here, a lower bound); sm90: 128 B/clk
# (32 banks x 4 B per SM). Model data, not tuning values.
LDS_BYTES_PER_CLK = {"gfx942": 128.0, "gfx950": 256.0, "sm90": 128.0}
# Gap between consecutive kernels of a step, microseconds: graph replay (hipGraph / CUDA graph) and
# eager launch from Python (PyTorch dispatch + runtime launch, host bound). Stated assumptions, not
# measurements on this machine: AMD graph replay ~2 us per kernel node, CUDA graphs ~1 us; eager ~8 us.
LAUNCH_GAP_US = {"graph": {"gfx942": 2.0, "gfx950": 2.0, "sm90": 1.0}, "eager": {"gfx942": 8.0, "gfx950": 8.0, "sm90": 6.0}}


# One gpu-scope acq_rel atomic (a ticket) as seen by the program that draws it, microseconds: on AMD
# the L2 write-back (buffer_wbl2) and wait before it, the atomic at the memory side, the invalidate
# after it; on NVIDIA an L2 atomic round trip. Stated assumptions (a few HBM latencies), not
# measurements on this machine.
TICKET_US = {"gfx942": 1.0, "gfx950": 1.0, "sm90": 0.5}


def tail_us(target: Any, num_warps: int, nbytes: float, tickets: int) -> float:
    """The serial tail's time (see the module doc): tickets in sequence plus one program's bytes."""
    if not nbytes and not tickets:
        return 0.0
    name = getattr(target, "name", target)
    share = min(1.0, max(1, num_warps) / (target.cu_count * target.simd_per_cu))
    return tickets * TICKET_US.get(name, max(TICKET_US.values())) + nbytes / (target.hbm_gbps * 1e3 * share)


def launch_gap_us(target: Any, mode: str = "graph") -> float:
    """The stated per-launch gap (see LAUNCH_GAP_US) for `mode` "graph" or "eager"."""
    name = getattr(target, "name", target)
    table = LAUNCH_GAP_US[mode]
    return table.get(name, max(table.values()))


def lds_bytes_per_clk(target: Any) -> float:
    return LDS_BYTES_PER_CLK.get(getattr(target, "name", target), 128.0)


def _operand_type(mnemonic: str) -> str:
    s = mnemonic.lower()
    if re.search(r"(?:^|_|\.)(?:i8|s8|u8)(?:$|_|\.)|_i8$|xi8", s) or s.startswith("v_mfma_i32"):
        return "i8"
    if "fp8" in s or "bf8" in s or "e4m3" in s or "e5m2" in s or "f8f6f4" in s:
        return "fp8"
    if "bf16" in s:
        return "bf16"
    if "f16" in s:
        return "f16"
    return "f32"


def matrix_cycles(mnemonic: str, target: Any) -> float:
    """Cycles one wave's matrix instruction occupies its SIMD's matrix unit (see module doc)."""
    dt = _operand_type(mnemonic)
    peak = target.peak_tflops.get(dt, target.peak_tflops.get("bf16"))
    rate = peak * 1e12 / 2.0 / (target.cu_count * target.simd_per_cu * target.clock_ghz * 1e9)
    m = _AMD_MM.match(mnemonic)
    if m:
        return int(m.group(2)) * int(m.group(3)) * int(m.group(4)) / rate
    if mnemonic.startswith("wgmma"):
        m = _WGMMA.search(mnemonic)
        if not m:
            return 0.0  # wgmma.fence / commit_group / wait_group: synchronization, no math
        return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) / 4 / rate
    m = _MMA.search(mnemonic)
    if m:
        return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) / rate
    return 16.0  # unknown shape: a 16-cycle guess


def cycle_table(target: Any, mnemonics: list[str]) -> dict[str, float]:
    return {mn: round(matrix_cycles(mn, target), 2) for mn in mnemonics}


def roofline_floor_s(target: Any, nbytes: float, flops: float, peak_dtype: str) -> tuple[float, str]:
    mem = nbytes / (target.hbm_gbps * 1e9)
    peak = target.peak_tflops.get(peak_dtype, target.peak_tflops["bf16"])
    comp = flops / (peak * 1e12)
    return (mem, "memory") if mem >= comp else (comp, "compute")


def predict(report: dict[str, Any], target: Any, programs: int, iters: int, nbytes: float, flops: float,
            peak_dtype: str, m_tiles: int = 1, m_bytes_fraction: float = 1.0, extra_bytes: float = 0.0,
            tail_bytes: float = 0.0, tail_tickets: int = 0, extra_written: bool = False) -> dict[str, Any]:
    """Predicted time (µs) of one launch, the roofline floor and the terms behind them.
    `m_tiles`: programs along M; `m_bytes_fraction`: the share of bytes that grows with M (rows of
    activations and outputs); the rest (weights) is re-read by every M tile. `extra_bytes`: traffic
    the implementation adds beyond the floor's bytes (split partials). `tail_bytes`, `tail_tickets`:
    the serial tail one program runs after the grid; `extra_written`: the extra bytes are the
    programs' own writes (module doc)."""
    floor_s, bound = roofline_floor_s(target, nbytes, flops, peak_dtype)
    out: dict[str, Any] = {"programs": programs, "loop_iters": iters, "floor_us": floor_s * 1e6, "bound": bound}
    if not report.get("ok", False):
        out.update(predicted_us=math.inf, roofline_fraction=0.0, penalty="failed: " + "; ".join(report.get("errors", []))[:200])
        return out
    hist = report.get("matrix_instructions", {}) or {}
    n_mm = sum(hist.values())
    hist_cyc = sum(matrix_cycles(k, target) * v for k, v in hist.items())
    n_math = sum(v for k, v in hist.items() if matrix_cycles(k, target) > 0)
    avg = hist_cyc / n_math if n_math else 0.0
    mm_loop = report.get("matrix_in_main_loop", 0)
    valu_loop = report.get("valu_in_main_loop", 0)
    loop_share = min(1.0, mm_loop / n_mm) if n_mm else 0.0  # of the kernel's matrix work, in the main loop
    mm_cyc = (loop_share * iters + (1.0 - loop_share)) * hist_cyc
    valu_cyc = (valu_loop * iters + max(0, report.get("valu_instructions", 0) - valu_loop)) * target.valu_cycles
    nw = max(1, int(report.get("num_warps", 4)))
    occ = max(1, int(report.get("occupancy", 1)))
    resident = max(1, (occ * target.simd_per_cu) // nw)
    per_cu = math.ceil(programs / target.cu_count)
    # waves that really share a SIMD: what the occupancy allows and what the grid gives a CU
    sharing = min(occ, math.ceil(min(per_cu, resident) * nw / target.simd_per_cu))
    wave_cyc = max(mm_cyc, valu_cyc) if sharing >= 2 else mm_cyc + valu_cyc
    rounds = math.ceil(programs / (target.cu_count * resident))
    simd_share = per_cu * nw * wave_cyc / target.simd_per_cu
    lds_lane = float(report.get("lds_slot_bytes_in_main_loop", 0) or 0)
    lds_wave_cyc = lds_lane * iters * getattr(target, "warp_size", 64) / lds_bytes_per_clk(target)
    lds_cyc = per_cu * nw * lds_wave_cyc  # the CU's LDS serves every wave of every program it runs
    compute_cyc = max(simd_share, rounds * wave_cyc, lds_cyc)
    compute_s = compute_cyc / (target.clock_ghz * 1e9)
    # programs that differ only along M stream the same weights: towards HBM they add parallelism
    # only for the M-dependent share of the bytes
    streams = programs * m_bytes_fraction + (programs / max(1, m_tiles)) * (1.0 - m_bytes_fraction)

    def saturation_of(n: float) -> float:  # share of HBM bandwidth that n programs' waves draw
        return min(1.0, min(n, target.cu_count * resident) * nw / (target.cu_count * target.simd_per_cu))

    saturation = saturation_of(streams)
    bw = target.hbm_gbps * 1e9
    if extra_written:
        memory_s = nbytes / (bw * saturation) + extra_bytes / (bw * saturation_of(programs))
    else:
        memory_s = (nbytes + extra_bytes) / (bw * saturation)
    tail_s = tail_us(target, nw, tail_bytes, tail_tickets) * 1e-6
    t = max(compute_s, memory_s) + tail_s
    spills = int(report.get("spills", 0) or 0) + (1 if report.get("scratch_bytes", 0) else 0)
    penalty = ""
    if spills:
        t *= SPILL_FACTOR
        penalty = f"spills ({report.get('spills', 0)} registers): x{SPILL_FACTOR}"
    out.update(predicted_us=t * 1e6, roofline_fraction=min(1.0, floor_s / t) if t > 0 else 0.0, penalty=penalty,
               terms={"matrix_cycles_per_wave": round(mm_cyc, 1), "valu_cycles_per_wave": round(valu_cyc, 1),
                      "cycles_per_mfma": round(avg, 2), "resident_programs_per_cu": resident, "rounds": rounds,
                      "waves_sharing_simd": sharing, "lds_cycles_per_cu": round(lds_cyc, 1),
                      "lds_us": round(lds_cyc / (target.clock_ghz * 1e9) * 1e6, 4), "extra_bytes": extra_bytes,
                      "compute_us": round(compute_s * 1e6, 4), "memory_us": round(memory_s * 1e6, 4),
                      **({"tail_us": round(tail_s * 1e6, 4)} if tail_s else {}),
                      "hbm_saturation": round(saturation, 3), "m_tiles": m_tiles,
                      "m_bytes_fraction": round(m_bytes_fraction, 3)})
    return out


def rank_key(fig: dict[str, Any]) -> tuple[int, float, float]:
    """Sort key: clean configs by time, then spilling ones, then failed ones. Ties (typically many
    memory-bound configs all at the HBM time) go to the least compute time: the most slack for
    the latencies the model does not see."""
    t = fig.get("predicted_us", math.inf)
    cls = 2 if not math.isfinite(t) else (1 if fig.get("penalty") else 0)
    return (cls, t, fig.get("terms", {}).get("compute_us", math.inf))
