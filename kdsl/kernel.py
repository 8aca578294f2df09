"""`@kernel`: a traced tile program, its specializations and its launcher.

A specialization is (config, target, static dims). Tracing runs the Python body once with concrete
tunable values, the passes run, the emitter writes a source file that is imported; launches
then bind tensors to dims, check shapes, dtypes and strides, and call the Triton function.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from . import record
from . import types as T
from .cache import write_and_import
from .emit import emit_module
from .errors import ConfigError, LaunchError
from .ir import GridEntry, OperandHandle, TraceContext, TunableSpec, Value, tracing
from .options import backend_options, split_config
from .passes import run_passes
from .targets import Target, current_target, get_target, resolve_dtype

REGISTRY: dict[str, "Kernel"] = {}


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
    params: list[tuple[str, Any]]  # (name, sig type string)
    stats: dict[str, int] = field(default_factory=dict)
    sources: dict[str, tuple[str, str, int]] = field(default_factory=dict)  # param -> (kind, name, dim index)
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
        g = []
        for e in self.grid:
            n = dims[e.dim]
            g.append(-(-n // e.block) if e.kind == "tile" else n)
        return tuple(g)


class Kernel:
    """A tile program. Call it with tensors to launch; `specialize` to get its generated code."""

    def __init__(self, fn: Callable, name: str | None = None, static: Iterable[str] = (),
                 checks: Iterable[tuple[str, Callable[[dict[str, int]], bool], str]] = (),
                 example: dict[str, int] | None = None, doc: str | None = None) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.static = tuple(static)
        self.checks = list(checks)
        self.example = dict(example or {})
        self.doc = doc or (inspect.getdoc(fn) or "").split("\n")[0]
        self.signature = self._parse_signature(fn)
        for d in self.static:
            if d not in self.signature.all_dims():
                raise ConfigError(self.name, d, f"static dim {d!r} is not a dim of any parameter")
        self._specs: dict[Any, Specialization] = {}
        self._tunable_cache: dict[Any, dict[str, TunableSpec]] = {}
        if self.name in REGISTRY and REGISTRY[self.name].fn.__code__ is not fn.__code__:
            raise ConfigError(self.name, None, "a different kernel with this name is already registered")
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
    def _trace(self, target: Target, tun: dict[str, Any], static: dict[str, int]) -> TraceContext:
        c = TraceContext(self.name, target, tun, static)
        sig = self.signature
        args: list[Any] = []
        with tracing(c):
            for pname in sig.order:
                if pname in sig.operands:
                    op = sig.operands[pname]
                    dt = resolve_dtype(op.dtype, target)
                    c.params.append((f"{pname}_ptr", f"*{dt.sig}"))
                    strides = []
                    for i in range(len(op.dims)):
                        sv = Value(T.i32, (), hint="s")
                        sv.name = f"{pname}_s{i}"
                        c.params.append((sv.name, "i32"))
                        strides.append(sv)
                    h = OperandHandle(pname, op, dt, strides, self.name)
                    c.operands[pname] = h
                    args.append(h)
                elif pname in sig.scalars:
                    sv = Value(sig.scalars[pname].dtype, (), hint=pname)
                    sv.name = pname
                    c.params.append((pname, sig.scalars[pname].dtype.sig))
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
                    c.params.append((d, "i32"))
            for d in sig.all_dims():
                if d not in static and d not in sig.dim_params:
                    c.params.append((d, "i32"))
            for i, pname in enumerate(sig.order):
                if pname in sig.dim_params:
                    args[i] = c.dims[pname]
            self.fn(*args)
        if not c.grid:
            raise c.error("the kernel never called kd.grid(...)")
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
                   static: dict[str, int] | None = None) -> Specialization:
        target = get_target(target)
        static = self._static_values(static)
        config = dict(config or {})
        tun_specs = self.tunables(target, static)
        tun, opts = split_config(self.name, target, config, tun_specs)
        full_tun = {n: tun.get(n, s.default) for n, s in tun_specs.items()}
        key = (target.name, tuple(sorted(full_tun.items())), tuple(sorted(opts.items())), tuple(sorted(static.items())))
        sp = self._specs.get(key)
        if sp is not None:
            return sp
        c = self._trace(target, full_tun, static)
        stats = run_passes(c.root, target, c.dims)
        full_tun = {n: c.config.get(n, s.default) for n, s in c.tunables.items()}
        header = [f"kdsl kernel {self.name} for {target.name}",
                  f"source: {inspect.getsourcefile(self.fn)}:{inspect.getsourcelines(self.fn)[1]}",
                  f"tunables: {full_tun}", f"options: {opts}"]
        if static:
            header.append(f"static dims: {static}")
        header.append(f"passes: {stats}")
        src = emit_module(c, target, self.name, header)
        sp = Specialization(self, target, {**full_tun, **opts}, full_tun, opts, static, src, "", list(c.grid),
                            list(c.params), stats, _param_sources(self.signature, c.params))
        self._specs[key] = sp
        return sp

    def source(self, config: dict[str, Any] | None = None, target: str | Target = "interpret",
               static: dict[str, int] | None = None) -> str:
        return self.specialize(config, target, static).source

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
                if d in dims and dims[d] != n:
                    raise LaunchError(self.name, pname, f"shape mismatch on dim {d}: {how} = {n} but {src[d]} = {dims[d]}")
                dims.setdefault(d, n)
                src.setdefault(d, how)
            if t.numel() and t.stride(-1) != 1 and isinstance(op.dtype, T.Int4):
                raise LaunchError(self.name, pname, "packed int4 words must be contiguous along the last dim")
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
        for param, pred, rule in self.checks:
            if not pred(dims):
                raise LaunchError(self.name, param, f"{rule} (dims: {dims})")
        return bound, dims

    def __call__(self, *args: Any, config: dict[str, Any] | None = None, target: str | Target | None = None,
                 **kwargs: Any) -> Specialization:
        rec = record.active()
        if rec is not None:
            return self._record(rec, args, kwargs, config)
        if target is None:  # CPU tensors run on the interpreter, GPU tensors on the current GPU
            on_cpu = any(isinstance(a, torch.Tensor) and a.device.type == "cpu"
                         for a in (*args, *kwargs.values()))
            target = get_target("interpret") if on_cpu else _current()
        else:
            target = get_target(target)
        bound, dims = self.bind(args, kwargs, target)
        static = {d: dims[d] for d in self.static}
        sp = self.specialize(config, target, static)
        grid = sp.grid_size(dims)
        if 0 in grid:
            return sp
        flat: list[Any] = []
        for pname, _ in sp.params:
            kind, ref, i = sp.sources[pname]
            if kind == "ptr":
                flat.append(bound[ref])
            elif kind == "stride":
                flat.append(bound[ref].stride(i))
            elif kind == "scalar":
                flat.append(bound[ref])
            else:
                flat.append(dims[ref])
        opts = backend_options(self.name, target, sp.options)
        sp.fn[grid](*flat, **opts)
        return sp

    def _record(self, rec: "record.Recorder", args: tuple, kwargs: dict, config: dict[str, Any] | None) -> Specialization:
        """Record mode: bind and check as a launch would (any device), specialize, log, run nothing."""
        bound, dims = self.bind(args, kwargs, rec.target, check_device=False)
        sp = self.specialize(config, rec.target, {d: dims[d] for d in self.static})
        rec.launches.append(record.LaunchRecord(self, dict(sp.config), dict(dims), sp.grid_size(dims), rec.target.name))
        return sp


def _param_sources(sig: T.Signature, params: list[tuple[str, Any]]) -> dict[str, tuple[str, str, int]]:
    """Where each generated parameter's value comes from at launch."""
    out: dict[str, tuple[str, str, int]] = {}
    for name, _ in params:
        for op, spec in sig.operands.items():
            if name == f"{op}_ptr":
                out[name] = ("ptr", op, 0)
            for i in range(len(spec.dims)):
                if name == f"{op}_s{i}":
                    out[name] = ("stride", op, i)
        if name not in out:
            out[name] = ("scalar", name, 0) if name in sig.scalars else ("dim", name, 0)
    return out


_CURRENT: list[Target] = []


def _current() -> Target:
    if not _CURRENT:
        _CURRENT.append(current_target())
    return _CURRENT[0]


def kernel(fn: Callable | None = None, *, name: str | None = None, static: Iterable[str] = (),
           checks: Iterable[tuple[str, Callable[[dict[str, int]], bool], str]] = (),
           example: dict[str, int] | None = None) -> Any:
    """Declare a tile program. `static` dims are specialized at trace time (head dims, group
    sizes); `checks` are launch-time rules over the bound dims; `example` is the problem that
    `show` and reports use when none is given (a Kimi-K2.5 shape for the ops here)."""
    def wrap(f: Callable) -> Kernel:
        return Kernel(f, name=name, static=static, checks=checks, example=example)

    return wrap(fn) if fn is not None else wrap
