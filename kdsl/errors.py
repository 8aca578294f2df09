"""Errors that name the kernel, the parameter and the rule that was broken."""
from __future__ import annotations


class KdslError(Exception):
    """Base error. `kernel`, `param` and `rule` say what broke, in that order."""

    def __init__(self, kernel: str | None, param: str | None, rule: str) -> None:
        self.kernel, self.param, self.rule = kernel, param, rule
        where = f"kernel {kernel!r}" if kernel else "kdsl"
        if param:
            where += f", parameter {param!r}"
        super().__init__(f"{where}: {rule}")


class ConfigError(KdslError):
    """A tile config or launch option that is invalid for this kernel or target."""


class LaunchError(KdslError):
    """Arguments that do not fit the kernel's declared operands."""


class TraceError(KdslError):
    """The tile program itself is malformed (shape, type or axis mismatch)."""


class CompileError(KdslError):
    """The backend compiler failed, or the result breaks a hard limit (LDS, spills in strict mode)."""


class UsageError(KdslError):
    """Bad command-line input: `param` is the flag (or its NAME=value part), `rule` what it must be."""

    def __init__(self, param: str, rule: str, kernel: str | None = None) -> None:
        self.kernel, self.param, self.rule = kernel, param, rule
        Exception.__init__(self, (f"kernel {kernel!r}: " if kernel else "") + (f"{param} {rule}" if param else rule))
