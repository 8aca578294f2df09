"""Ahead-of-time compile for any target from this machine, and the resource report.

The report is read from the ISA the backend produced: register counts, spills, scratch, LDS
against the arch limit, occupancy, the matrix instructions (histogram and count in the main
loop), VALU and memory instruction counts. A compiler `error:`, LDS over the limit, or (strict)
any spill makes `ok` false.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import CompileError
from .kernel import Kernel, Specialization
from .options import backend_options
from .targets import Target, get_target

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # keep 3.9's default, silence its notice


@dataclass
class Report:
    kernel: str
    arch: str
    config: dict[str, Any]
    problem: dict[str, int]
    vgpr: int = 0
    agpr: int = 0
    sgpr: int = 0
    spills: int = 0
    scratch_bytes: int = 0
    lds_bytes: int = 0
    lds_limit: int = 0
    occupancy: int = 0  # resident waves per SIMD (AMD) / warps per scheduler (NVIDIA)
    occupancy_limiter: str = ""
    num_warps: int = 4
    matrix_instructions: dict[str, int] = field(default_factory=dict)
    matrix_in_main_loop: int = 0
    valu_instructions: int = 0
    valu_in_main_loop: int = 0
    memory_instructions: int = 0
    memory_in_main_loop: int = 0
    lds_instructions_in_main_loop: int = 0
    # per lane, per wave, per main-loop iteration: bytes the LDS instructions read / write, and the
    # bytes the LDS must serve counting a sub-dword access as a whole 4-byte bank slot (what sets
    # its cycles: narrow ds_write_b8 cost as much LDS time as ds_write_b32)
    lds_read_bytes_in_main_loop: int = 0
    lds_write_bytes_in_main_loop: int = 0
    lds_slot_bytes_in_main_loop: int = 0
    main_loop_depth: int = 0  # nesting depth of the loop taken as the main loop (0: none found)
    instructions: int = 0
    ok: bool = True
    errors: list[str] = field(default_factory=list)
    compile_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        mm = ", ".join(f"{k}×{v}" for k, v in sorted(self.matrix_instructions.items())) or "none"
        lines = [
            f"kernel {self.kernel} on {self.arch}  ok={self.ok}",
            f"  config     {self.config}",
            f"  problem    {self.problem}",
            f"  registers  vgpr={self.vgpr} agpr={self.agpr} sgpr={self.sgpr} spills={self.spills} scratch={self.scratch_bytes} B",
            f"  LDS        {self.lds_bytes} / {self.lds_limit} B",
            f"  occupancy  {self.occupancy} waves/SIMD (limited by {self.occupancy_limiter}), {self.num_warps} warps/program",
            f"  matrix     {mm}; in main loop: {self.matrix_in_main_loop}",
            f"  VALU       {self.valu_instructions} (main loop {self.valu_in_main_loop})",
            f"  memory     {self.memory_instructions} (main loop {self.memory_in_main_loop}, LDS ops {self.lds_instructions_in_main_loop})",
            f"  LDS bytes  per lane per main-loop iteration: read {self.lds_read_bytes_in_main_loop}, "
            f"write {self.lds_write_bytes_in_main_loop} (bank slots {self.lds_slot_bytes_in_main_loop}); "
            f"main loop depth {self.main_loop_depth}",
        ]
        lines += [f"  ERROR      {e}" for e in self.errors]
        return "\n".join(lines)


@contextlib.contextmanager
def _capture_stderr():
    """Capture what the native compiler prints on fd 2 (LLVM errors do not go through Python)."""
    buf = tempfile.TemporaryFile(mode="w+b")
    saved = os.dup(2)
    os.dup2(buf.fileno(), 2)
    out: list[str] = []
    try:
        yield out
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        buf.seek(0)
        out.append(buf.read().decode(errors="replace"))
        buf.close()


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return list(reversed(strides))


def signature_for(sp: Specialization, problem: dict[str, int]) -> tuple[dict, dict, dict]:
    """Signature, constexprs and attributes that mirror what a JIT launch on contiguous tensors
    of `problem`'s shape would specialize: ints equal to 1 become constants, multiples of 16 and
    pointers get divisibility hints, AMD pointers get the range hint that enables buffer loads."""
    k = sp.kernel
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    attrs: dict[tuple, list] = {}
    amd = sp.target.backend == "hip"
    shapes = {}
    for pname, op in k.signature.operands.items():
        shp = [problem.get(d, 16) for d in op.dims]
        if shp and hasattr(op.dtype, "pack"):
            shp[-1] = max(1, shp[-1] // 8)
        shapes[pname] = _contiguous_strides(shp)
    for idx, p in enumerate(sp.params):
        pname, ty = p.name, p.sig
        val = None
        if p.kind == "ptr":
            sig[pname] = ty
            attrs[(idx,)] = [["tt.divisibility", 16]] + ([["tt.pointer_range", 32]] if amd else [])
            continue
        if p.kind == "stride":
            val = shapes[p.operand][p.dim]
        elif pname in problem:
            val = problem[pname]
        if ty == "i32" and val == 1:
            sig[pname] = "constexpr"
            consts[pname] = 1
            continue
        sig[pname] = ty
        if ty == "i32" and val is not None and val % 16 == 0:
            attrs[(idx,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def compile_spec(sp: Specialization, problem: dict[str, int] | None = None):
    """Compile a specialization for its (GPU) target; returns the Triton compiled kernel."""
    import triton
    from triton.compiler import ASTSource

    problem = dict(problem or {})
    sig, consts, attrs = signature_for(sp, problem)
    src = ASTSource(sp.jit_function(), sig, consts, attrs)
    opts = backend_options(sp.kernel.name, sp.target, sp.options)
    return triton.compile(src, target=sp.target.gpu_target(), options=opts)


_HDR = {
    "vgpr": r"\.vgpr_count:\s+(\d+)", "agpr": r"\.agpr_count:\s+(\d+)", "sgpr": r"\.sgpr_count:\s+(\d+)",
    "vspill": r"\.vgpr_spill_count:\s+(\d+)", "sspill": r"\.sgpr_spill_count:\s+(\d+)",
    "scratch": r"\.private_segment_fixed_size:\s+(\d+)", "occ": r"; Occupancy:\s+(\d+)",
}
_AMD_MEM = re.compile(r"^(global_|buffer_|flat_|scratch_|ds_|s_load|s_buffer_load)")
_AMD_LDS = re.compile(r"^ds_")


def _blocks(asm: str, label_re: str) -> list[tuple[str, str, list[str]]]:
    """Split assembly into (label, label comments, instruction mnemonics). The comments are the
    label line's and those of the comment-only lines right after it: LLVM prints the loop note
    (`=>This Inner Loop Header: Depth=1`, `in Loop: Header=...`) on the label line only when the
    block has no IR name; otherwise the name comes first (`; %.lr.ph`) and the note on the next line."""
    out: list[tuple[str, str, list[str]]] = [("entry", "", [])]
    for line in asm.split("\n"):
        m = re.match(label_re, line)
        if m:
            out.append((m.group(1), line, []))
            continue
        s = line.strip()
        if s.startswith((";", "//")) and not out[-1][2] and out[-1][0] != "entry":
            lab, com, ins = out[-1]
            out[-1] = (lab, com + " " + s, ins)
            continue
        if not s or s.startswith((";", "//", ".", "@")) and not s.startswith("@%"):
            if not s.startswith("@"):
                continue
        tok = s.split()[0] if s else ""
        if tok.startswith("@"):  # PTX predicate
            tok = s.split()[1] if len(s.split()) > 1 else ""
        if tok and not tok.endswith(":") and not tok.startswith((".", ";", "//", "{", "}")):
            out[-1][2].append(tok.rstrip(";"))
    return out


def _loops(blocks) -> dict[str, tuple[int, list[str]]]:
    """Innermost loop of every block (by LLVM's loop comments): header key -> (depth, instructions)."""
    loops: dict[str, tuple[int, list[str]]] = {}
    for label, comment, ins in blocks:
        m = re.search(r"Loop Header: Depth=(\d+)", comment)
        h = re.search(r"in Loop: Header=(\S+) Depth=(\d+)", comment) or re.search(r"in Loop: Header=(\S+)", comment)
        if m:
            key, depth = label.lstrip(".$L_").replace("_", ""), int(m.group(1))
        elif h:
            key = h.group(1).lstrip(".$L_").replace("_", "")
            depth = int(h.group(2)) if h.lastindex and h.lastindex >= 2 else 1
        else:
            continue
        d0, acc = loops.get(key, (depth, []))
        loops[key] = (max(d0, depth), acc + list(ins))
    return loops


def _main_loop(blocks, is_matrix) -> list[str]:
    """Instructions of the loop holding the most matrix instructions (then the deepest, then the
    longest): the K loop of a GEMM, also when it sits inside a persistent tile loop."""
    return _main_loop_depth(blocks, is_matrix)[1]


def _main_loop_depth(blocks, is_matrix) -> tuple[int, list[str]]:
    loops = _loops(blocks)
    if not loops:
        return 0, []
    return max(loops.values(), key=lambda d: (sum(1 for i in d[1] if is_matrix(i)), d[0], len(d[1])))


_DS_WIDTH = re.compile(r"^ds_(read|write|load|store)(2st64|2)?_(?:addtid_)?([biu])(\d+)")


def lds_bytes_per_lane(mnemonic: str) -> tuple[str, int, int]:
    """(direction, bytes per lane, bank-slot bytes per lane) of an AMD LDS instruction; ("", 0, 0)
    for other instructions. ds_read2_b64 moves 2 x 8 B; a sub-dword access occupies a 4-byte slot."""
    if mnemonic.startswith("ds_bpermute") or mnemonic.startswith("ds_permute") or mnemonic.startswith("ds_swizzle"):
        return "read", 4, 4
    m = _DS_WIDTH.match(mnemonic)
    if not m:
        if mnemonic.startswith("ds_"):
            return ("read" if "read" in mnemonic or "load" in mnemonic else "write"), 4, 4
        return "", 0, 0
    d = "read" if m.group(1) in ("read", "load") else "write"
    n = 2 if m.group(2) else 1
    b = max(1, int(m.group(4)) // 8)
    return d, n * b, n * max(b, 4)


def _amd_report(r: Report, asm: str, target: Target) -> None:
    def g(key: str) -> int:
        m = re.search(_HDR[key], asm)
        return int(m.group(1)) if m else 0

    r.vgpr, r.agpr, r.sgpr = g("vgpr"), g("agpr"), g("sgpr")
    r.spills = g("vspill") + g("sspill")
    r.scratch_bytes = g("scratch")
    blocks = _blocks(asm, r"^(\.LBB\S+?):")
    is_mm = lambda i: i.startswith(target.matrix_prefix)  # noqa: E731
    allins = [i for _, _, ins in blocks for i in ins]
    r.instructions = len(allins)
    r.matrix_instructions = dict(Counter(i for i in allins if is_mm(i)))
    r.valu_instructions = sum(1 for i in allins if i.startswith("v_") and not is_mm(i))
    r.memory_instructions = sum(1 for i in allins if _AMD_MEM.match(i))
    r.main_loop_depth, loop = _main_loop_depth(blocks, is_mm)
    r.matrix_in_main_loop = sum(1 for i in loop if is_mm(i))
    r.valu_in_main_loop = sum(1 for i in loop if i.startswith("v_") and not is_mm(i))
    r.memory_in_main_loop = sum(1 for i in loop if _AMD_MEM.match(i))
    r.lds_instructions_in_main_loop = sum(1 for i in loop if _AMD_LDS.match(i))
    for i in loop:
        d, nb, slot = lds_bytes_per_lane(i)
        if d == "read":
            r.lds_read_bytes_in_main_loop += nb
        elif d == "write":
            r.lds_write_bytes_in_main_loop += nb
        r.lds_slot_bytes_in_main_loop += slot
    # occupancy: registers (VGPR + AGPR share 512 per lane), LDS per CU, 8 waves per SIMD
    regs = -(-(r.vgpr + r.agpr) // 8) * 8
    by_regs = min(target.max_waves_per_simd, target.vgprs_per_simd_lane // max(regs, 8))
    waves_per_wg_per_simd = max(1, r.num_warps // target.simd_per_cu)
    if r.lds_bytes:
        alloc = -(-r.lds_bytes // target.lds_granule) * target.lds_granule
        wg_per_cu = target.lds_bytes // alloc
        by_lds = (wg_per_cu * r.num_warps) // target.simd_per_cu
    else:
        by_lds = target.max_waves_per_simd
    r.occupancy = max(0, min(by_regs, by_lds, target.max_waves_per_simd))
    r.occupancy_limiter = "registers" if by_regs <= by_lds and by_regs < target.max_waves_per_simd else (
        "LDS" if by_lds < target.max_waves_per_simd else "wave slots")
    del waves_per_wg_per_simd


def _ptxas_usage(ptx: str, target: Target) -> tuple[int, int, str]:
    """Registers and spill bytes from ptxas -v (the driver reports them only after a launch)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(int(target.arch)).path
    except Exception:
        ptxas = shutil.which("ptxas")
    if not ptxas:
        return 0, 0, ""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        arch = f"sm_{target.arch}a" if target.arch == 90 else f"sm_{target.arch}"
        res = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", p, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True)
    out = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.findall(r"(\d+) bytes spill (?:stores|loads)", out)
    return (int(regs.group(1)) if regs else 0), sum(int(s) for s in spill), out


def _cuda_report(r: Report, ptx: str, target: Target) -> None:
    regs, spill_bytes, _ = _ptxas_usage(ptx, target)
    r.vgpr, r.spills = regs, spill_bytes // 4
    blocks = _blocks(ptx, r"^(\$L__\S+?):")
    is_mm = lambda i: i.startswith(target.matrix_prefix)  # noqa: E731
    allins = [i for _, _, ins in blocks for i in ins]
    r.instructions = len(allins)
    r.matrix_instructions = dict(Counter(i for i in allins if is_mm(i)))
    mem = lambda i: i.startswith(("ld.", "st.", "cp.async", "atom.", "red.", "ldmatrix", "stmatrix"))  # noqa: E731
    r.memory_instructions = sum(1 for i in allins if mem(i))
    r.valu_instructions = sum(1 for i in allins if not mem(i) and not is_mm(i) and not i.startswith(("bra", "bar", "@")))
    r.main_loop_depth, loop = _main_loop_depth(blocks, is_mm)
    r.matrix_in_main_loop = sum(1 for i in loop if is_mm(i))
    r.memory_in_main_loop = sum(1 for i in loop if mem(i))
    r.valu_in_main_loop = sum(1 for i in loop if not mem(i) and not is_mm(i))
    r.lds_instructions_in_main_loop = sum(1 for i in loop if i.startswith(("ld.shared", "st.shared", "ldmatrix")))
    for i in loop:  # bytes per thread: vector width x element bits (ldmatrix .x4: 16 B per thread)
        if i.startswith(("ld.shared", "st.shared", "ldmatrix")):
            v = re.search(r"\.v(\d)", i)
            e = re.search(r"\.[bfsu](\d+)", i)
            nb = 16 if i.startswith("ldmatrix") else (int(v.group(1)) if v else 1) * max(1, int(e.group(1)) // 8 if e else 4)
            if i.startswith("st."):
                r.lds_write_bytes_in_main_loop += nb
            else:
                r.lds_read_bytes_in_main_loop += nb
            r.lds_slot_bytes_in_main_loop += max(nb, 4)
    warps_by_regs = 65536 // max(1, (-(-max(regs, 1) * 32 // 256) * 256)) if regs else 64
    by_lds = (target.lds_bytes // r.lds_bytes) * r.num_warps if r.lds_bytes else 64
    per_sm = min(64, warps_by_regs - warps_by_regs % r.num_warps, by_lds)
    r.occupancy = per_sm // target.simd_per_cu
    r.occupancy_limiter = "registers" if warps_by_regs <= by_lds else "shared memory"


def report(kernel: Kernel, arch: str | Target, config: dict[str, Any] | None = None,
           problem: dict[str, int] | None = None, strict: bool = False) -> Report:
    """Compile `kernel` for `arch` and read its resources from the ISA. Never raises for a failed
    compile: the report says `ok: false` with the errors (use `check` to raise)."""
    import time

    target = get_target(arch)
    problem = {**kernel.example, **(problem or {})}
    static = {d: problem[d] for d in kernel.static if d in problem}
    sp = kernel.specialize(config, target, static)
    r = Report(kernel.name, target.name, sp.config, problem, lds_limit=target.lds_bytes,
               num_warps=sp.options.get("num_warps", 4))
    t0 = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with _capture_stderr() as err:
                ck = compile_spec(sp, problem)
        except Exception as e:  # compiler failure: report it, do not crash the caller
            r.ok = False
            r.errors.append(f"compile failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}")
            r.compile_s = time.time() - t0
            return r
    r.compile_s = time.time() - t0
    text = err[0] if err else ""
    for line in text.splitlines():
        if "error:" in line:
            r.ok = False
            r.errors.append(line.strip())
    r.lds_bytes = int(ck.metadata.shared)
    if target.backend == "hip":
        _amd_report(r, ck.asm["amdgcn"], target)
    else:
        _cuda_report(r, ck.asm["ptx"], target)
    if r.lds_bytes > target.lds_bytes:
        r.ok = False
        r.errors.append(f"LDS {r.lds_bytes} B is over the {target.name} limit of {target.lds_bytes} B")
    if strict and (r.spills or r.scratch_bytes):
        r.ok = False
        r.errors.append(f"{r.spills} spilled registers, {r.scratch_bytes} B scratch (strict mode)")
    return r


def asm(kernel: Kernel, arch: str | Target, config: dict[str, Any] | None = None,
        problem: dict[str, int] | None = None, stage: str | None = None) -> str:
    target = get_target(arch)
    problem = {**kernel.example, **(problem or {})}
    static = {d: problem[d] for d in kernel.static if d in problem}
    sp = kernel.specialize(config, target, static)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = compile_spec(sp, problem)
    stage = stage or ("amdgcn" if target.backend == "hip" else "ptx")
    if stage not in ck.asm:
        raise CompileError(kernel.name, None, f"no stage {stage!r}; stages: {', '.join(ck.asm)}")
    a = ck.asm[stage]
    return a if isinstance(a, str) else a.decode(errors="replace")


def check(kernel: Kernel, arch: str | Target, config: dict[str, Any] | None = None,
          problem: dict[str, int] | None = None, strict: bool = True) -> Report:
    """Like `report`, but a failed compile, LDS overflow or (strict) spill raises CompileError."""
    r = report(kernel, arch, config, problem, strict=strict)
    if not r.ok:
        raise CompileError(kernel.name, None, f"{r.arch}: " + "; ".join(r.errors))
    return r
