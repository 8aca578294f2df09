"""Problem models: what the tuner needs to know of an op beyond its kernel: which dims form the
problem key (and in what order), which dim is M, the bytes it must move and the flops it does
(for the roofline and the cost model's memory time), the operand type that sets its matrix peak,
and the trip count of its main loop.

The models themselves live next to the kernels: a kernel package ships a `problems` module that
calls `register(...)` (this repository: ops/problems.py). `model_for(kernel)` imports
`<package>.problems` of the kernel's package on first use, so autotune imports nothing of ops.
Models are matched by kernel-name pattern (fnmatch, first registered wins). A kernel without a
model gets a generic one: all non-M dims in signature order, bytes from its operand dtypes and
shapes, no flops.
"""
from __future__ import annotations

import fnmatch
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

Problem = dict[str, Any]

# Config keys that do not change a kernel's numerics (only where and how fast it runs). Everything
# else (tile sizes, K/KV step sizes, MFMA selection, reduction modes) can change the order of a
# float reduction, so a batch-invariant launch takes it from one reference config.
LAUNCH_ONLY_KEYS = frozenset({"num_warps", "num_stages", "waves_per_eu", "INT4_UNPACK"})


@dataclass(frozen=True)
class ProblemModel:
    pattern: str
    key_dims: tuple[str, ...] = ()  # problem key order; () = the kernel's dims in signature order
    m_dim: str = "M"
    m_block: str | None = "BLOCK_M"  # the tunable tiling M (capped at the bucket); None: none does
    peak_dtype: str = "bf16"  # which target.peak_tflops entry bounds its matrix work
    bytes_fn: Callable[[Problem, int], float] | None = None
    flops_fn: Callable[[Problem, int], float] | None = None
    loop_dim: str | None = "K"  # the dim its main loop walks
    loop_block: str | None = "BLOCK_K"  # the tunable that sets the loop step
    reference: Callable[..., Any] | None = None  # torch reference over the kernel's inputs (measured mode)
    # dims computed from the key dims, M and the config (e.g. G = K / 32; MoE block counts from M)
    derived: Callable[[Problem, int, dict[str, Any]], Problem] | None = None
    loops: int = 1  # main loops of that trip count (a two-pass kernel walks K twice)
    # a loop nested in the main one, (dim, block tunable): the report's main loop then runs loop trips
    # x these trips (mla_combine_uv: the splits in each DL tile). Where the compiler keeps the matrix
    # work in the outer loop, the report names that one and the model charges it at the inner trips
    # too: an upper bound, so that no tile hides the nested loop (one trip: exact)
    inner_loop: tuple[str, str] | None = None
    # dims the op's host code picks from the device as well (split-KV counts from the CU count):
    # (problem, m, config, target) -> dims; applied after `derived` when a target is known
    launch_dims: Callable[[Problem, int, dict[str, Any], Any], Problem] | None = None
    # the grid dim whose programs re-read the same bulk bytes (L2 hits, no extra HBM streams) and
    # those bytes at M=m: GEMM/MoE programs along M share the weights (the default: m_dim and the
    # bytes at M=0); attention programs along the query-row tile (and MLA's value-column split)
    # share the KV cache; a tuple names several such dims
    reuse_dim: str | tuple[str, ...] | None = None
    shared_bytes_fn: Callable[[Problem, int], float] | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # M of a recorded launch from its bound dims (default: the m_dim), e.g. batch x q_len for decode
    # attention, MO for MoE stage 2
    m_of: Callable[[Problem], int] | None = None
    # traffic beyond the floor that the implementation adds (problem, m, launch dims) -> bytes, e.g.
    # MLA split partials written by the split kernel: charged in the predicted time, not the floor
    extra_bytes_fn: Callable[[Problem, int, Problem], float] | None = None
    # those extra bytes are the launch's own writes, each program its own part (the split partials):
    # every program streams them, not only those that read distinct bulk bytes (costmodel.predict)
    extra_written: bool = False
    # work one program does serially AFTER the grid (a "last program finishes" tail, kd.atomic_ticket):
    # (problem, m, launch dims) -> (bytes that program moves, tickets it draws one after another)
    tail_fn: Callable[[Problem, int, Problem], tuple[float, int]] | None = None
    # the op's batch-invariant launches take every key but LAUNCH_ONLY_KEYS from the M=1 entry at any
    # M (ops._common.invariant_config): the tuner then picks those keys once, jointly over the buckets
    shared_numerics: bool = False
    # the problem whose M=1 entry sets this problem's numerics keys at run time (a q_len-4 verify
    # reduces like the q_len-1 decode: ops call invariant_config with it); the tuner then takes that
    # file's numerics as given and tunes only the launch keys
    numerics_ref: Callable[[Problem], Problem] | None = None
    # tunables of this kernel that change no bit either (LAUNCH_ONLY_KEYS are the common ones), e.g.
    # the chunk of a norm whose every program reduces the whole row
    launch_keys: tuple[str, ...] = ()
    # kernels whose programs this one runs with another epilogue (the same tunables and tiles): their
    # tuned files at this problem (their key dims of it), any arch, join the tuner's warm start
    tiles_from: tuple[str, ...] = ()
    # the kernel whose numerics this one's launches keep (the same grid and main loop plus a serial
    # tail after the grid, `tail_fn`): its files hold the base file's numerics tile at every bucket
    # with launch keys searched for this kernel (spills included in its figures), so its outputs
    # equal the base's bit for bit and an op can ask whether the tail pays; tune the base first,
    # `autotune check` compares the two
    configs_of: str | None = None


# The context length sets the bytes and the split count of decode attention but is no part of the
# lookup key (a tuned tile has to serve every length). Tuning and `check` use this nominal length:
# the middle of the bench's 1k/8k/32k, long enough that the split count, not the length, sets the
# grid at small batch, and the context of the peer figures (REFERENCE section 7). A problem may carry
# `CTX` to model another length (the benches do); lookups drop it with the other non-key dims.
NOMINAL_CTX = 8192

_MODELS: list[ProblemModel] = []
_LOADED: set[str] = set()


def register(*models: ProblemModel) -> None:
    """Add problem models (a kernel package's `problems` module calls this at import)."""
    for pm in models:
        if all(pm.pattern != o.pattern for o in _MODELS):
            _MODELS.append(pm)


def _load_models(kernel: Any) -> None:
    """Import the `problems` module of the package that defines `kernel` (once per package)."""
    if isinstance(kernel, str):
        from kdsl.kernel import REGISTRY

        k = REGISTRY.get(kernel)
        if k is None:
            from kdsl.registry import discover

            k = discover().get(kernel)
        kernel = k
    fn = getattr(kernel, "fn", None)
    mod = getattr(fn, "__module__", None) or ""
    pkg = mod.rpartition(".")[0] or mod
    if not pkg or pkg in _LOADED:
        return
    _LOADED.add(pkg)
    try:
        importlib.import_module(pkg + ".problems")
    except ModuleNotFoundError as e:
        if e.name != pkg + ".problems":
            raise


def m_of(kernel: Any, dims: Problem) -> int:
    """M of a launch with these bound dims (what the op passes to its config lookup)."""
    pm = model_for(kernel)
    if pm.m_of is not None:
        return int(pm.m_of(dims))
    return int(dims.get(pm.m_dim, 1))


def extra_bytes(kernel: Any, problem: Problem, m: int, dims: Problem) -> float:
    """Bytes beyond the floor that one launch moves (see ProblemModel.extra_bytes_fn)."""
    pm = model_for(kernel)
    return float(pm.extra_bytes_fn(problem, m, dims)) if pm.extra_bytes_fn is not None else 0.0



def _generic_bytes(kernel: Any) -> Callable[[Problem, int], float]:
    def nbytes(p: Problem, m: int) -> float:
        from kdsl.targets import GFX942, resolve_dtype

        dims = {**p, "M": m}
        total = 0.0
        for op in kernel.signature.operands.values():
            n = 1
            for d in op.dims:
                n *= int(dims.get(d, 1))
            dt = op.dtype
            if hasattr(dt, "pack"):
                total += n * 0.5
            else:
                total += n * resolve_dtype(dt, GFX942).torch.itemsize
        return total

    return nbytes


_LANE_SUMS: dict[tuple, bool] = {}


def lane_sums(kernel: Any, config: dict[str, Any]) -> bool:
    """Whether `config` makes `kernel` add floats across a tile axis (kdsl.passes.lane_sums), traced
    once per (kernel, config) at the kernel's example dims; True when it cannot be traced (the safe
    answer: num_warps then counts as a numerics key)."""
    from kdsl.targets import get_target

    key = (kernel.name, tuple(sorted((k, v) for k, v in config.items() if k not in LAUNCH_ONLY_KEYS)))
    if key not in _LANE_SUMS:
        try:
            ex = dict(kernel.example or {})
            tgt = get_target("interpret")
            names = set(kernel.tunables(tgt, {d: ex[d] for d in kernel.static if d in ex}))
            sp = kernel.specialize({k: v for k, v in config.items() if k in names}, tgt,
                                   {d: ex[d] for d in kernel.static if d in ex})
            _LANE_SUMS[key] = bool(sp.lane_sums)
        except Exception:  # noqa: BLE001 - an untraceable config: assume the worst
            _LANE_SUMS[key] = True
    return _LANE_SUMS[key]


def launch_only_keys(kernel: Any, config: dict[str, Any]) -> frozenset[str]:
    """The keys of `config` that change no bit of `kernel`'s results: LAUNCH_ONLY_KEYS and the
    model's `launch_keys`, less num_warps where the config adds floats across lanes (a reduction's
    order follows the layout num_warps sets). A batch-invariant launch takes all others from its
    reference entry."""
    keys = LAUNCH_ONLY_KEYS | frozenset(model_for(kernel).launch_keys)
    if isinstance(kernel, str) or not lane_sums(kernel, config):
        return keys
    return keys - {"num_warps"}


def model_for(kernel: Any) -> ProblemModel:
    """The problem model of a kdsl kernel (or kernel name)."""
    name = kernel if isinstance(kernel, str) else kernel.name
    _load_models(kernel)
    for pm in _MODELS:
        if fnmatch.fnmatchcase(name, pm.pattern):
            if pm.bytes_fn is None and not isinstance(kernel, str):
                import dataclasses

                return dataclasses.replace(pm, bytes_fn=_generic_bytes(kernel))
            return pm
    bytes_fn = None if isinstance(kernel, str) else _generic_bytes(kernel)
    return ProblemModel("*", (), bytes_fn=bytes_fn, flops_fn=lambda p, m: 0.0, peak_dtype="bf16")


def key_dims(kernel: Any, problem: Problem) -> list[str]:
    """The problem dims of the key, in canonical order (M excluded). A model that names its key
    dims keys on those alone (the others are derived or irrelevant)."""
    pm = model_for(kernel)
    order = list(pm.key_dims)
    if order:
        return [d for d in order if d in problem]
    if not isinstance(kernel, str):
        order += [d for d in kernel.signature.all_dims() if d not in order]
    rest = sorted(d for d in problem if d not in order)
    return [d for d in order + rest if d in problem and d != pm.m_dim]


def problem_key(kernel: Any, problem: Problem) -> str:
    """e.g. N2048_K7168: the file-name key of a problem (M is the bucket, not part of it)."""
    dims = key_dims(kernel, problem)
    if not dims:
        return "default"
    return "_".join(f"{d}{problem[d]}" for d in dims)


# dims a problem may carry that are neither a kernel's dims nor part of its lookup key, read only by
# the problem models: CTX, the attention context length (see NOMINAL_CTX); EALL, the routed experts of
# all ranks when the launch is one expert-parallel rank's E of them (ops.problems.routed_share)
MODEL_DIMS = ("CTX", "EALL")


def strip_m(kernel: Any, problem: Problem) -> Problem:
    """The problem as keyed: M dropped; for a model with key dims, only those."""
    pm = model_for(kernel)
    if pm.key_dims:
        return {k: problem[k] for k in pm.key_dims if k in problem}
    return {k: v for k, v in problem.items() if k != pm.m_dim}


def required_dims(kernel: Any) -> list[str]:
    """Dims a problem must give for `kernel` (M and derived dims excluded)."""
    pm = model_for(kernel)
    if pm.key_dims:
        return list(pm.key_dims)
    return [d for d in kernel.signature.all_dims() if d != pm.m_dim]


def full_dims(kernel: Any, problem: Problem, m: int, config: dict[str, Any] | None = None,
              target: Any = None) -> Problem:
    """All dims of a launch of `config` at M=m: the problem, its derived dims and M (and, given
    the target, the dims the op chooses from the device, e.g. its split count)."""
    pm = model_for(kernel)
    out = dict(problem)
    if pm.derived:
        out.update(pm.derived(problem, m, config or {}))
    if pm.launch_dims and target is not None:
        out.update(pm.launch_dims(out, m, config or {}, target))
    out[pm.m_dim] = m
    return out


def shared_bytes(kernel: Any, problem: Problem, m: int) -> float:
    """Bytes that the programs along the model's reuse dim all read (see ProblemModel)."""
    pm = model_for(kernel)
    if pm.shared_bytes_fn is not None:
        return pm.shared_bytes_fn(problem, m)
    return pm.bytes_fn(problem, 0) if pm.bytes_fn else 0.0


def loop_iters(kernel: Any, problem: Problem, config: dict[str, Any]) -> int:
    """Trip count of the main loop for `config` (1 when the model names no loop); with an
    `inner_loop`, the nested loop's trips over all outer trips."""
    pm = model_for(kernel)
    n = 1
    if pm.loop_dim and pm.loop_block and pm.loop_dim in problem and pm.loop_block in config:
        n = max(1, math.ceil(problem[pm.loop_dim] / config[pm.loop_block])) * pm.loops
    if pm.inner_loop:
        d, b = pm.inner_loop
        if d in problem and b in config:
            n *= max(1, math.ceil(problem[d] / config[b]))
    return n


def parse_problem(text: str) -> Problem:
    """`N=2048,K=7168` -> {"N": 2048, "K": 7168} (values that are not ints stay strings)."""
    out: Problem = {}
    for part in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in part:
            raise ValueError(f"problem item {part!r} is not NAME=VALUE")
        k, v = part.split("=", 1)
        k, v = k.strip(), v.strip()
        try:
            out[k] = int(v)
        except ValueError:
            out[k] = v
    return out
