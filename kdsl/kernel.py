"""`@kernel`: a traced tile program, its specializations and its launcher.

A specialization is (config, target, static dims). Tracing runs the Python body once with concrete
tunable values, the passes run, the emitter writes a source file that is imported; launches
then bind tensors to dims, check shapes, dtypes and strides, and call the Triton function.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from . import record
from . import types as T
from .cache import write_and_import
from .emit import emit_module
from .errors import ConfigError, LaunchError
from .ir import GridEntry, OperandHandle, Param, TraceContext, TunableSpec, Value, tracing
from .options import backend_options, split_config
from .passes import clamped_dims, constant_indices, lane_sums, run_passes
from .targets import Target, current_target, get_target, resolve_dtype

REGISTRY: dict[str, "Kernel"] = {}

I32_SPAN = 2**31  # an operand whose element span reaches this needs 64-bit offsets
GRID_LIMITS = (2**31 - 1, 65535, 65535)  # programs per grid axis (CUDA and HIP launch limits)
_PROBLEM: list[dict[str, int]] = []


def wide_dims(shape: Iterable[int], strides: Iterable[int]) -> tuple[int, ...]:
    """The dims whose offset terms must be 64-bit: none while the largest reachable offset fits
    in i32 (< 2^31); else the dims with the largest reach, fewest first, until the other terms' sum fits
    (those stay 32-bit and are summed before the one widening add)."""
    rest = 0
    for n, s in zip(shape, strides):
        if n == 0:
            return ()
        rest += (n - 1) * (s if s >= 0 else -s)
    if rest < I32_SPAN:  # the common case, decided without building the list below
        return ()
    reach = [((n - 1) * abs(s), i) for i, (n, s) in enumerate(zip(shape, strides))]
    out = []
    for r, i in sorted(reach, reverse=True):
        if rest < I32_SPAN:  # the largest offset fits in i32
            break
        out.append(i)
        rest -= r
    return tuple(sorted(out))


@contextlib.contextmanager
def problem_dims(dims: dict[str, int]):
    """Inside the block, `specialize` without `dims` or `wide` sizes its operands from `dims` (for
    callers that pass only static dims, e.g. the AOT report of a given problem)."""
    _PROBLEM.append(dict(dims))
    try:
        yield
    finally:
        _PROBLEM.pop()


@dataclass
class Specialization:
    kernel: "Kernel"
    target: Target
    config: dict[str, Any]  # full: tunables + options, defaults filled
    tunables: dict[str, Any]
    options: dict[str, Any]
    static: dict[str, int]
    source: str
    path: str
    grid: list[GridEntry]
    params: list[Param]  # the generated function's parameters, in order
    stats: dict[str, int] = field(default_factory=dict)
    sources: dict[str, tuple[str, str, int]] = field(default_factory=dict)  # param -> (kind, source, dim): launch view
    wide: dict[str, tuple[int, ...]] = field(default_factory=dict)  # operand -> dims with 64-bit offset terms
    clamped: frozenset = frozenset()  # (operand, dim) read through a clamped gathered index
    constant: tuple = ()  # ((operand, dim), index): the largest constant index used along that dim
    lane_sums: bool = False  # float sums across a tile axis: num_warps sets their order (passes.lane_sums)
    _fn: Any = None

    @property
    def fn(self):
        """The launchable function: a JITFunction, or an interpreted one on the CPU."""
        if self._fn is None:
            mod, _ = write_and_import(self.kernel.name, self.source)
            jf = getattr(mod, self.kernel.name)
            if self.target.backend == "interpret":
                from triton.runtime.interpreter import InterpretedFunction

                # the emitter lowers tl.sum/max/min/sigmoid (JITFunctions) to interpretable forms
                self._fn = InterpretedFunction(jf.fn)
            else:
                self._fn = jf
        return self._fn

    def jit_function(self):
        mod, _ = write_and_import(self.kernel.name, self.source)
        return getattr(mod, self.kernel.name)

    def grid_size(self, dims: dict[str, int]) -> tuple[int, ...]:
        return tuple(e.count(dims) for e in self.grid)


class Kernel:
    """A tile program. Call it with tensors to launch; `specialize` to get its generated code."""

    def __init__(self, fn: Callable, name: str | None = None, static: Iterable[str] = (),
                 checks: Iterable[tuple[str, Callable[[dict[str, int]], bool], str]] = (),
                 example: dict[str, int] | None = None, doc: str | None = None,
                 contiguous: Iterable[str] | bool = ()) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.static = tuple(static)
        self.checks = list(checks)
        self.example = dict(example or {})
        self.doc = doc or (inspect.getdoc(fn) or "").split("\n")[0]
        self.signature = self._parse_signature(fn)
        self.contiguous = tuple(self.signature.operands if contiguous is True else contiguous or ())
        for d in self.static:
            if d not in self.signature.all_dims():
                raise ConfigError(self.name, d, f"static dim {d!r} is not a dim of any parameter")
        for n in self.contiguous:
            op = self.signature.operands.get(n)
            if op is None or isinstance(op.dtype, T.Int4) or T.is_fp4(op.dtype):
                raise ConfigError(self.name, n, "contiguous names operands of unpacked dtypes (the kernel takes "
                                  "their strides from their dims)")
        self._specs: dict[Any, Specialization] = {}
        self._launchers: dict[tuple, Callable[[tuple], Specialization]] = {}
        self._dispatch = _dispatch_fn(self)
        self._last: tuple[Any, Any] = (None, None)  # (key, launcher) of the last cached launch
        self._tunable_cache: dict[Any, dict[str, TunableSpec]] = {}
        if self.name in REGISTRY and REGISTRY[self.name].fn.__code__ is not fn.__code__:
            other = REGISTRY[self.name].fn.__code__
            raise ConfigError(self.name, None, f"a different kernel with this name is already registered "
                              f"({other.co_filename}:{other.co_firstlineno}); kernel names are global: rename "
                              f"this one with @kd.kernel(name=\"<module>_{self.name}\") or another unique name")
        REGISTRY[self.name] = self

    def __repr__(self) -> str:
        return f"<kdsl kernel {self.name}>"

    def _parse_signature(self, fn: Callable) -> T.Signature:
        ann = inspect.get_annotations(fn, eval_str=True)
        sig = T.Signature()
        for p in inspect.signature(fn).parameters.values():
            a = ann.get(p.name)
            if isinstance(a, T.Operand):
                sig.operands[p.name] = a
            elif isinstance(a, T.ScalarParam):
                sig.scalars[p.name] = a
            elif isinstance(a, T.DimParam):
                sig.dim_params.append(p.name)
            else:
                raise ConfigError(self.name, p.name, "every parameter needs an In/Out/InOut, Scalar or Dim annotation")
            sig.order.append(p.name)
        return sig

    # -- tracing ---------------------------------------------------------------------------------
    def _trace(self, target: Target, tun: dict[str, Any], static: dict[str, int],
               wide: dict[str, tuple[int, ...]] | None = None) -> TraceContext:
        wide = wide or {}
        c = TraceContext(self.name, target, tun, static)
        sig = self.signature
        args: list[Any] = []
        with tracing(c):
            for pname in sig.order:
                if pname in sig.operands:
                    op = sig.operands[pname]
                    dt = resolve_dtype(op.dtype, target)
                    c.params.append(Param(f"{pname}_ptr", f"*{dt.sig}", "ptr", pname))
                    strides: list[Any] = []
                    for i in range(len(op.dims)):
                        if pname in self.contiguous and all(d in static for d in op.dims[i + 1:]):
                            # a contiguous operand's stride from static dims: a constant, no argument
                            # (no scalar register live through the kernel)
                            strides.append(math.prod(static[d] for d in op.dims[i + 1:]))
                            continue
                        # strides stay i32 parameters (a stride past 2^31 is passed as i64 by the
                        # JIT); the 64-bit products of wide dims cast them in the generated code
                        sv = Value(T.i32, (), hint="s")
                        sv.name = f"{pname}_s{i}"
                        c.params.append(Param(sv.name, "i32", "stride", pname, i))
                        strides.append(sv)
                    h = OperandHandle(pname, op, dt, strides, self.name, wide=tuple(wide.get(pname, ())))
                    c.operands[pname] = h
                    args.append(h)
                elif pname in sig.scalars:
                    sv = Value(sig.scalars[pname].dtype, (), hint=pname)
                    sv.name = pname
                    c.params.append(Param(pname, sig.scalars[pname].dtype.sig, "scalar"))
                    args.append(sv)
                else:
                    args.append(None)  # Dim params resolved below
            for d in sig.all_dims():
                if d in static:
                    c.dims[d] = static[d]
                else:
                    dv = Value(T.i32, (), hint=d)
                    dv.name = d
                    c.dims[d] = dv
                    if d not in sig.dim_params:
                        pass
            for d in sig.dim_params:
                if d not in static:
                    c.params.append(Param(d, "i32", "dim"))
            for d in sig.all_dims():
                if d not in static and d not in sig.dim_params:
                    c.params.append(Param(d, "i32", "dim"))
            for i, pname in enumerate(sig.order):
                if pname in sig.dim_params:
                    args[i] = c.dims[pname]
            self.fn(*args)
        if not c.grid:
            from .ir import Loc

            code = self.fn.__code__
            raise c.error("the kernel never called kd.grid(...)",
                          loc=Loc(code.co_filename, code.co_firstlineno, f"def {code.co_name}(...)"))
        unknown = set(tun) - set(c.tunables)
        if unknown:
            raise ConfigError(self.name, sorted(unknown)[0], f"not a tunable of this kernel; tunables: {sorted(c.tunables)}")
        return c

    def tunables(self, target: str | Target = "interpret", static: dict[str, int] | None = None) -> dict[str, TunableSpec]:
        """The tunables the kernel declares (from a trace at its defaults)."""
        target = get_target(target)
        static = self._static_values(static)
        key = (target.name, tuple(sorted(static.items())))
        if key not in self._tunable_cache:
            c = self._trace(target, {}, static)
            self._tunable_cache[key] = c.tunables
        return self._tunable_cache[key]

    def _static_values(self, static: dict[str, int] | None) -> dict[str, int]:
        static = dict(static or {})
        for d in self.static:
            if d not in static:
                if d in self.example:
                    static[d] = self.example[d]
                else:
                    raise ConfigError(self.name, d, f"static dim {d!r} needs a value (no example value declared)")
        return {d: static[d] for d in self.static}

    def default_config(self, target: str | Target = "interpret", static: dict[str, int] | None = None) -> dict[str, Any]:
        target = get_target(target)
        cfg = {n: s.default for n, s in self.tunables(target, static).items()}
        cfg.update({o.name: o.default for o in target.options})
        return cfg

    def specialize(self, config: dict[str, Any] | None = None, target: str | Target = "interpret",
                   static: dict[str, int] | None = None, dims: dict[str, int] | None = None,
                   wide: dict[str, Iterable[int]] | Iterable[str] | None = None) -> Specialization:
        """The specialization for (config, target, static dims, 64-bit offsets). `wide` maps an
        operand to the dims whose offset terms need 64-bit arithmetic (a bare operand name: all
        its dims); by default they come from the contiguous shapes of `dims` (a whole problem;
        default: the dims of an enclosing `problem_dims`). A launch derives them from the real
        shapes and strides (`wide_dims`)."""
        target = get_target(target)
        if wide is None:
            dims = dims if dims is not None else (_PROBLEM[-1] if _PROBLEM else None)
            wide = self.wide_operands(dims) if dims else {}
        if wide:
            if not isinstance(wide, dict):
                wide = {n: range(len(self.signature.operands[n].dims)) if n in self.signature.operands else ()
                        for n in wide}
            for n in wide:
                if n not in self.signature.operands:
                    raise ConfigError(self.name, n, "wide (64-bit offset) names must be operands")
            wide = {n: tuple(sorted(set(v))) for n, v in wide.items() if v}
        else:
            wide = {}
        static = self._static_values(static)
        config = dict(config or {})
        tun_specs = self.tunables(target, static)
        tun, opts = split_config(self.name, target, config, tun_specs)
        full_tun = {n: tun.get(n, s.default) for n, s in tun_specs.items()}
        key = (target.name, tuple(sorted(full_tun.items())), tuple(sorted(opts.items())), tuple(sorted(static.items())),
               tuple(sorted(wide.items())))
        sp = self._specs.get(key)
        if sp is not None:
            return sp
        c = self._trace(target, full_tun, static, wide)
        opts = self._requested_options(target, opts, c.option_requests)
        stats = run_passes(c.root, target, c.dims, kernel=self.name)
        full_tun = {n: c.config.get(n, s.default) for n, s in c.tunables.items()}
        header = [f"kdsl kernel {self.name} for {target.name}",
                  f"source: {inspect.getsourcefile(self.fn)}:{inspect.getsourcelines(self.fn)[1]}",
                  f"tunables: {full_tun}", f"options: {opts}"]
        if static:
            header.append(f"static dims: {static}")
        if wide:
            named = [f"{n}[{', '.join(self.signature.operands[n].dims[i] for i in v)}]" for n, v in sorted(wide.items())]
            header.append(f"64-bit offsets: {', '.join(named)} (element span >= 2^31)")
        header.append(f"passes: {stats}")
        src = emit_module(c, target, self.name, header)
        sp = Specialization(self, target, {**full_tun, **opts}, full_tun, opts, static, src, "", list(c.grid),
                            list(c.params), stats, _param_sources(c.params), wide=wide,
                            clamped=frozenset(clamped_dims(c.root)),
                            constant=tuple(sorted(constant_indices(c.root).items())), lane_sums=lane_sums(c.root))
        self._specs[key] = sp
        return sp

    def _requested_options(self, target: Target, opts: dict[str, Any], requests: dict[str, Any]) -> dict[str, Any]:
        """The launch options with the kernel's `kd.compile_option` requests applied: each where the
        config left the option at the target's default (another explicit value is a ConfigError)."""
        opts = dict(opts)
        for name, value in requests.items():
            spec = target.option(name)
            if spec is None:
                continue  # the interpreter, or an option of another backend
            if opts[name] not in (spec.default, value):
                raise ConfigError(self.name, name, f"the kernel asks for {name}={value!r} (kd.compile_option) in "
                                  f"this specialization; the config sets {opts[name]!r}")
            opts[name] = value
        return opts

    def source(self, config: dict[str, Any] | None = None, target: str | Target = "interpret",
               static: dict[str, int] | None = None, dims: dict[str, int] | None = None) -> str:
        return self.specialize(config, target, static, dims).source

    def wide_operands(self, dims: dict[str, int]) -> dict[str, tuple[int, ...]]:
        """64-bit offset dims of each operand, contiguous with these dims (dims not given count as 1)."""
        out = {}
        for pname, op in self.signature.operands.items():
            shape = [int(dims.get(d, 1)) for d in op.dims]
            if shape and isinstance(op.dtype, T.Int4):
                shape[-1] = -(-shape[-1] // 8)
            strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
            w = wide_dims(shape, strides)
            if w:
                out[pname] = w
        return out

    # -- launching -------------------------------------------------------------------------------
    def bind(self, args: tuple, kwargs: dict, target: Target, check_device: bool = True
             ) -> tuple[dict[str, Any], dict[str, int]]:
        sig = self.signature
        names = sig.order
        if len(args) > len(names):
            raise LaunchError(self.name, None, f"takes {len(names)} arguments ({', '.join(names)}), got {len(args)}")
        bound = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names:
                raise LaunchError(self.name, k, f"unknown argument; parameters: {', '.join(names)}")
            if k in bound:
                raise LaunchError(self.name, k, "given twice")
            bound[k] = v
        missing = [n for n in names if n not in bound]
        if missing:
            raise LaunchError(self.name, missing[0], "missing argument")
        dims: dict[str, int] = {}
        src: dict[str, str] = {}
        device = None
        for pname, op in sig.operands.items():
            t = bound[pname]
            if not isinstance(t, torch.Tensor):
                raise LaunchError(self.name, pname, f"expected a torch.Tensor for {op!r}, got {type(t).__name__}")
            want = resolve_dtype(op.dtype, target)
            if t.dtype != want.torch:
                extra = ""
                if isinstance(op.dtype, T.Fp8):
                    extra = f" (the native fp8 of {target.name})"
                elif isinstance(op.dtype, T.Int4):
                    extra = " (packed int4: 8 values per int32 word)"
                elif T.is_fp4(op.dtype):
                    extra = " (packed fp4 e2m1: 2 values per byte)"
                raise LaunchError(self.name, pname, f"dtype must be {want.torch}{extra}, got {t.dtype}")
            if t.dim() != len(op.dims):
                raise LaunchError(self.name, pname, f"must have {len(op.dims)} dims {list(op.dims)}, got shape {tuple(t.shape)}")
            if device is None:
                device = t.device
            elif t.device != device:
                raise LaunchError(self.name, pname, f"is on {t.device}, other operands on {device}")
            for i, d in enumerate(op.dims):
                n = t.shape[i]
                how = f"{pname}.shape[{i}]"
                if isinstance(op.dtype, T.Int4) and i == len(op.dims) - 1:
                    n, how = n * 8, f"{pname}.shape[{i}]*8 (int4 words)"
                elif T.is_fp4(op.dtype) and i == len(op.dims) - 1:
                    n, how = n * T.FP4_PER_BYTE, f"{pname}.shape[{i}]*2 (packed fp4 bytes)"
                if d in dims and dims[d] != n:
                    raise LaunchError(self.name, pname, f"shape mismatch on dim {d}: {how} = {n} but {src[d]} = {dims[d]}")
                dims.setdefault(d, n)
                src.setdefault(d, how)
            if pname in self.contiguous and not t.is_contiguous():
                raise LaunchError(self.name, pname, f"must be contiguous (the kernel takes its strides from its "
                                                    f"dims), got strides {tuple(t.stride())}")
            if t.numel() and t.stride(-1) != 1 and isinstance(op.dtype, T.Int4):
                raise LaunchError(self.name, pname, "packed int4 words must be contiguous along the last dim")
            if t.numel() and t.stride(-1) != 1 and T.is_fp4(op.dtype):
                raise LaunchError(self.name, pname, "packed fp4 bytes must be contiguous along the last dim")
        for d in sig.dim_params:
            v = bound[d]
            if isinstance(v, bool) or not isinstance(v, int):
                raise LaunchError(self.name, d, f"Dim argument must be an int, got {v!r}")
            if d in dims and dims[d] != v:
                raise LaunchError(self.name, d, f"= {v} but {src[d]} = {dims[d]}")
            dims[d] = v
        for s in sig.scalars:
            if not isinstance(bound[s], (int, float)):
                raise LaunchError(self.name, s, f"scalar argument must be a number, got {bound[s]!r}")
        if device is not None and check_device:
            if target.backend == "interpret" and device.type != "cpu":
                raise LaunchError(self.name, None, f"the interpret target runs on CPU tensors, got {device}")
            if target.backend != "interpret" and device.type != "cuda":
                raise LaunchError(self.name, None, f"target {target.name} needs GPU tensors, got {device}")
        for d, v in dims.items():
            if not -I32_SPAN <= v < I32_SPAN:
                raise LaunchError(self.name, d, f"dim {d} = {v} overflows the 32-bit index arithmetic of this "
                                                f"kernel (dims must be below 2^31)")
        for param, pred, rule in self.checks:
            if not pred(dims):
                raise LaunchError(self.name, param, f"{rule} (dims: {dims})")
        return bound, dims

    def wide_from_tensors(self, bound: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """64-bit offset dims of each bound tensor operand (`wide_dims` of its shape and strides)."""
        out = {}
        for pname in self.signature.operands:
            t = bound[pname]
            if t.numel() < I32_SPAN and t.is_contiguous():  # the common case: the span is the numel
                continue
            w = wide_dims(t.shape, t.stride())
            if w:
                out[pname] = w
        return out

    def grid_for(self, sp: Specialization, dims: dict[str, int]) -> tuple[int, ...]:
        """Programs per grid axis; a grid the launch limits or 32-bit tile indices cannot hold is an
        error naming the dim."""
        grid = sp.grid_size(dims)
        if 0 not in grid:
            for op, d in sorted(sp.clamped):
                if dims[d] == 0:
                    raise LaunchError(self.name, op, f"dim {d} is 0, but the kernel reads {op} at positions taken "
                                                     "from loaded data")
            for (op, d), k in sp.constant:
                if not 0 <= k < dims[d]:
                    raise LaunchError(self.name, op, f"the kernel accesses {op} at the constant index {k} along {d}, "
                                                     f"but {d} = {dims[d]}")
        for ax, (e, g) in enumerate(zip(sp.grid, grid)):
            for p in e.leaves():
                if dims[p.dim] < 0:
                    raise LaunchError(self.name, p.dim, f"dim {p.dim} = {dims[p.dim]} is negative (grid axis {ax})")
                if p.kind == "tile" and p.count(dims) * p.block >= I32_SPAN:
                    raise LaunchError(self.name, p.dim, f"dim {p.dim} = {dims[p.dim]} in tiles of {p.block} overflows "
                                                        f"32-bit tile indices")
            if g > GRID_LIMITS[ax]:
                raise LaunchError(self.name, e.dim, f"grid axis {ax} over dim {e.dim} needs {g} programs, more than "
                                                    f"the launch limit {GRID_LIMITS[ax]}")
        return grid

    def __call__(self, *args: Any, config: dict[str, Any] | None = None, target: str | Target | None = None,
                 **kwargs: Any) -> Specialization:
        if record._ACTIVE:
            return self._record(record.active(), args, kwargs, config)
        if kwargs:
            try:
                args, kwargs = self._positional(args, kwargs), {}
            except TypeError:  # not what a launch takes: the full path says what is wrong
                return self._launch(args, kwargs, config, target, None)
        return self._dispatch(args, config, target)

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        """All arguments in parameter order (an exception, i.e. the full path, when names do not fit)."""
        rest = self.signature.order[len(args):]
        if len(rest) != len(kwargs):
            raise TypeError("argument count")
        return args + tuple(kwargs[n] for n in rest)

    def _launch(self, args: tuple, kwargs: dict, config: dict[str, Any] | None, target: str | Target | None,
                key: tuple | None) -> Specialization:
        """The full path: bind and check, specialize, launch; with a key, cache a bound launcher."""
        if target is None:  # CPU tensors run on the interpreter, GPU tensors on the current GPU
            on_cpu = any(isinstance(a, torch.Tensor) and a.device.type == "cpu"
                         for a in (*args, *kwargs.values()))
            tgt = get_target("interpret") if on_cpu else _current()
        else:
            tgt = get_target(target)
        bound, dims = self.bind(args, kwargs, tgt)
        static = {d: dims[d] for d in self.static}
        sp = self.specialize(config, tgt, static, wide=self.wide_from_tensors(bound))
        grid = self.grid_for(sp, dims)
        if key is not None:
            run = _bound_launcher(self, key, sp, grid, bound, dims, self.signature.order)
            if len(self._launchers) >= LAUNCH_CACHE["max_entries"]:
                self._launchers.clear()
            self._launchers[key] = run
            self._last = (key, run)
            return run(tuple(bound[n] for n in self.signature.order))
        if 0 in grid:
            return sp
        flat: list[Any] = []
        for p in sp.params:
            kind, ref, i = sp.sources[p.name]
            if kind == "ptr" or kind == "scalar":
                flat.append(bound[ref])
            elif kind == "stride":
                flat.append(bound[ref].stride(i))
            else:
                flat.append(dims[ref])
        sp.fn[grid](*flat, **backend_options(self.name, tgt, sp.options))
        return sp

    def _record(self, rec: "record.Recorder", args: tuple, kwargs: dict, config: dict[str, Any] | None) -> Specialization:
        """Record mode: bind and check as a launch would (any device), specialize, log, run nothing."""
        bound, dims = self.bind(args, kwargs, rec.target, check_device=False)
        sp = self.specialize(config, rec.target, {d: dims[d] for d in self.static}, wide=self.wide_from_tensors(bound))
        grid = self.grid_for(sp, dims)
        rec.launches.append(record.LaunchRecord(self, dict(sp.config), dict(dims), grid, rec.target.name))
        return sp


LAUNCH_CACHE: dict[str, Any] = {"enabled": True, "max_entries": 512}
"""Bound launchers per kernel, keyed by everything a launch checks (`_key_parts`): a repeated
launch with the same shapes, strides, dtypes, devices, dims and config skips binding, validation and
the specialization lookup. `enabled` False: every launch takes the full path (bench.launch compares)."""


def _key_parts(sig: T.Signature, names: list[str]) -> list[str]:
    """The launch key's terms, one expression each. A contiguous tensor's strides follow from its
    shape except along size-1 dims, whose stride never scales a valid index (the only index there is
    0), so `is_contiguous()` stands for them: cheaper than building the stride tuple."""
    parts = ["tuple(c.items()) if c else None", "t if t is None or t.__class__ is str else id(t)"]
    for n, pname in zip(names, sig.order):
        if pname in sig.operands:
            parts += [f"{n}.shape", f"None if {n}.is_contiguous() else {n}.stride()", f"{n}.dtype",
                      f"{n}.get_device()"]
        elif pname in sig.dim_params:
            parts += [f"{n}.__class__", n]
        else:
            parts.append(f"{n}.__class__")
    return parts


def _dispatch_fn(kernel: "Kernel") -> Callable[[tuple, Any, Any], Specialization]:
    """dispatch(args, config, target) for positional arguments: the launch key computed inline, the
    last launcher (a decode step launches each kernel with the same shapes every time) or a cached one
    called, anything else handed to the full path. Generated per kernel so that the common case is
    one function with no attribute lookups beyond the key's own."""
    names = [f"a{i}" for i in range(len(kernel.signature.order))]
    unpack = f"        {', '.join(names)}, = a\n" if names else "        if a:\n            raise TypeError\n"
    src = (
        "def dispatch(a, c, t):\n"
        "    if not CACHE['enabled']:\n"
        "        return K._launch(a, {}, c, t, None)\n"
        "    try:\n"
        f"{unpack}"
        f"        key = ({', '.join(_key_parts(kernel.signature, names))},)\n"
        "    except Exception:\n"
        "        return K._launch(a, {}, c, t, None)\n"
        "    last = K._last\n"
        "    if last[0] == key:\n"
        "        return last[1](a)\n"
        "    run = K._launchers.get(key)\n"
        "    if run is None:\n"
        "        return K._launch(a, {}, c, t, key)\n"
        "    K._last = (key, run)\n"
        "    return run(a)\n")
    ns: dict[str, Any] = {"K": kernel, "CACHE": LAUNCH_CACHE}
    exec(src, ns)
    return ns["dispatch"]


def _bound_launcher(kernel: "Kernel", key: tuple, sp: Specialization, grid: tuple[int, ...],
                    bound: dict[str, Any], dims: dict[str, int], order: list[str]) -> Callable[[tuple], Specialization]:
    """run(args) for one launch shape of a specialization: every stride and dim is a constant, so a
    launch only passes this call's tensors and scalars. The first version fills a template; a key
    launched again gets a generated function with the constants inlined (one call, no loop), built
    then so that shapes seen once do not pay for generating it."""
    if 0 in grid:
        return lambda a: sp
    pos = {n: i for i, n in enumerate(order)}
    tmpl: list[Any] = []
    fill: list[tuple[int, int]] = []
    for p in sp.params:
        kind, ref, i = sp.sources[p.name]
        if kind == "ptr" or kind == "scalar":
            fill.append((len(tmpl), pos[ref]))
            tmpl.append(None)
        else:
            tmpl.append(int(bound[ref].stride(i) if kind == "stride" else dims[ref]))
    fn = sp.fn[grid]
    opts = backend_options(sp.kernel.name, sp.target, sp.options)
    uses = [0]

    def run(a: tuple) -> Specialization:
        flat = tmpl.copy()
        for fi, ai in fill:
            flat[fi] = a[ai]
        fn(*flat, **opts)
        uses[0] += 1
        if uses[0] == 2 and kernel._launchers.get(key) is run:
            fast = _inlined(fn, opts, sp, tmpl, dict(fill))
            kernel._launchers[key] = fast
            if kernel._last[1] is run:
                kernel._last = (key, fast)
        return sp

    return run


def _inlined(fn: Any, opts: dict[str, Any], sp: Specialization, tmpl: list[Any], fill: dict[int, int]
             ) -> Callable[[tuple], Specialization]:
    """The launcher as one generated call: constants inlined, arguments picked by position."""
    exprs = [f"a[{fill[j]}]" if j in fill else repr(v) for j, v in enumerate(tmpl)]
    ns: dict[str, Any] = {"_fn": fn, "_opts": opts, "_sp": sp}
    exec(f"def run(a):\n    _fn({''.join(e + ', ' for e in exprs)}**_opts)\n    return _sp\n", ns)
    return ns["run"]


def _param_sources(params: list[Param]) -> dict[str, tuple[str, str, int]]:
    """Where each generated parameter's value comes from at launch, read off its record:
    (kind, operand / Scalar / dim name, dim index of a stride)."""
    return {p.name: (p.kind, p.source, p.dim or 0) for p in params}


_CURRENT: list[Target] = []


def _current() -> Target:
    if not _CURRENT:
        _CURRENT.append(current_target())
    return _CURRENT[0]


def kernel(fn: Callable | None = None, *, name: str | None = None, static: Iterable[str] = (),
           checks: Iterable[tuple[str, Callable[[dict[str, int]], bool], str]] = (),
           example: dict[str, int] | None = None, contiguous: Iterable[str] | bool = ()) -> Any:
    """Declare a tile program. `static` dims are specialized at trace time (head dims, group
    sizes); `checks` are launch-time rules over the bound dims; `example` is the problem that
    `show` and reports use when none is given (a Kimi-K2.5 shape for the ops here). `contiguous`
    operands (True: all) must be contiguous at launch: their strides along dims followed only by static dims
    are constants of the generated code, not arguments (fewer scalar registers held through the
    kernel)."""
    def wrap(f: Callable) -> Kernel:
        return Kernel(f, name=name, static=static, checks=checks, example=example, contiguous=contiguous)

    return wrap(fn) if fn is not None else wrap
