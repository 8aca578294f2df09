"""The search space: the kernel's tunables x the target's launch options (restricted to values
worth trying), pruned BEFORE any compile by tracing each candidate (kd.require rules raise
ConfigError/TraceError) and by a register estimate that rejects certain spills."""
from __future__ import annotations

import hashlib
import itertools
import json
import random
from dataclasses import dataclass
from typing import Any

from kdsl.errors import KdslError
from kdsl.targets import Target

from .buckets import ANY

# Launch-option values worth trying per backend (the full domains multiply the space ~10x for
# options that rarely matter). Options missing here keep their default.
OPTION_DOMAINS: dict[str, dict[str, tuple[Any, ...]]] = {
    "gfx942": {"num_warps": (4, 8, 16), "num_stages": (1, 2), "waves_per_eu": (0, 2), "kpack": (1, 2)},
    "gfx950": {"num_warps": (4, 8, 16), "num_stages": (1, 2), "waves_per_eu": (0, 2)},
    "sm90": {"num_warps": (4, 8), "num_stages": (2, 3, 4)},
    "interpret": {},
}
# Accumulator elements per lane above which a config spills for sure (AMD: 512 VGPR+AGPR per
# lane; NVIDIA: 255 registers), so it is not worth a compile.
ACC_PER_LANE_LIMIT = {"hip": 256, "cuda": 128, "interpret": 1 << 30}
# Multiply-adds per lane in one main-loop step above which the unrolled body takes minutes to
# compile and spills anyway (e.g. 256x256x256 tiles on 4 warps).
UNROLL_LIMIT = 16384
RULES_VERSION = 2


def option_domains(target: Target) -> dict[str, tuple[Any, ...]]:
    dom = OPTION_DOMAINS.get(target.name, {})
    out = {}
    for o in target.options:
        vals = tuple(v for v in dom.get(o.name, (o.default,)) if v in o.domain)
        out[o.name] = vals or (o.default,)
    return out


def tunable_domains(kernel: Any, target: Target, static: dict[str, int], m: int | None,
                    m_block: str | None = "BLOCK_M") -> dict[str, tuple[Any, ...]]:
    """Tunable domains; the M tile is capped at the bucket's M rounded up to a power of two (larger
    tiles only add masked rows), plus the smallest tile >= 16 (the matrix-instruction path) when
    the bucket is below 16. Tunables declared with `search=False` keep their default; with a tuple
    of values, only those are tried."""
    specs = kernel.tunables(target, static)
    out = {}
    for name, s in specs.items():
        dom = s.searched()
        if name == m_block and m is not None and all(isinstance(v, int) for v in dom):
            cap = 1 << max(0, (m - 1)).bit_length()
            mma = [v for v in dom if v >= 16]
            dom = tuple(v for v in dom if v <= cap or (mma and v == min(mma) and cap < 16)) or (min(dom),)
        out[name] = dom
    return out


def space_hash(tun: dict[str, tuple], opts: dict[str, tuple]) -> str:
    blob = json.dumps({"tunables": {k: list(v) for k, v in sorted(tun.items())},
                       "options": {k: list(v) for k, v in sorted(opts.items())}, "rules": RULES_VERSION},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Space:
    candidates: list[dict[str, Any]]  # valid configs, in seeded order, default first
    pruned: dict[str, int]  # reason -> count
    size: int  # full product size
    hash: str
    sampled: bool
    domains: dict[str, tuple[Any, ...]]

    def admits(self, cfg: dict[str, Any]) -> bool:
        """Whether `cfg` lies in this space's domains (a config compiled for another bucket)."""
        return all(k in self.domains and v in self.domains[k] for k, v in cfg.items())


def _acc_per_lane(sp: Any) -> float:
    tiles = [e.block for e in sp.grid if e.kind == "tile"]
    prod = 1
    for b in tiles:
        prod *= b
    return prod / (sp.options.get("num_warps", 4) * sp.target.warp_size)


def _macs_per_lane(sp: Any) -> float:
    """Multiply-adds per lane in one main-loop step (grid tiles x the K block), 0 without BLOCK_K."""
    bk = sp.config.get("BLOCK_K")
    if not isinstance(bk, int):
        return 0.0
    return _acc_per_lane(sp) * bk


def build(kernel: Any, target: Target, static: dict[str, int], m: int | str | None, seed: int,
          max_candidates: int | None = None, m_block: str | None = "BLOCK_M") -> Space:
    """Enumerate (or seeded-sample) the space for one bucket, pruning invalid configs by tracing."""
    mm = None if m is None or m == ANY else int(m)
    tun = tunable_domains(kernel, target, static, mm, m_block)
    opts = option_domains(target)
    names = list(tun) + list(opts)
    doms = [tun[n] for n in tun] + [opts[n] for n in opts]
    allc = [dict(zip(names, vals)) for vals in itertools.product(*doms)]
    rng = random.Random(seed)
    rng.shuffle(allc)
    default = kernel.default_config(target, static)
    default = {k: v for k, v in default.items() if k in names}
    if mm is not None and m_block in tun and default.get(m_block) not in tun[m_block]:
        default[m_block] = max(tun[m_block])
    allc = [default] + [c for c in allc if c != default]
    pruned: dict[str, int] = {}
    out: list[dict[str, Any]] = []
    limit = ACC_PER_LANE_LIMIT.get(target.backend, 1 << 30)
    sampled = False
    for c in allc:
        if max_candidates is not None and len(out) >= max_candidates:
            sampled = True
            break
        try:
            sp = kernel.specialize(c, target, static)
        except KdslError as e:
            key = f"rule: {e.rule}"[:120]
            pruned[key] = pruned.get(key, 0) + 1
            continue
        macs = _macs_per_lane(sp)
        if macs > UNROLL_LIMIT:
            key = f"main-loop body > {UNROLL_LIMIT} MACs per lane (huge unrolled body: slow compile, spills)"
            pruned[key] = pruned.get(key, 0) + 1
            continue
        if _acc_per_lane(sp) > limit:
            key = f"accumulator > {limit} registers per lane (certain spill)"
            pruned[key] = pruned.get(key, 0) + 1
            continue
        out.append(c)
    return Space(out, pruned, len(allc), space_hash(tun, opts), sampled, {**tun, **opts})
