"""Shape-aware tuning: M buckets, tuned-config JSON per (kernel, arch, problem), search and the
static cost model. Ops call `lookup_config` at run time."""
from .store import lookup_config  # noqa: F401
