"""The one M ladder: 1, 2, 4, ..., 8192, then "any". A tuned config is chosen for the smallest
bucket that holds M, so M=1 (decode) and M=4 (EAGLE-3 verify) can get different configs."""
from __future__ import annotations

LADDER: tuple[int, ...] = tuple(1 << i for i in range(14))  # 1 .. 8192
ANY = "any"
BUCKETS: tuple[int | str, ...] = LADDER + (ANY,)
# The M a tuner uses for the "any" bucket: a large prefill-like batch.
ANY_M = 8192


def bucket_for(m: int) -> int | str:
    """The smallest ladder bucket >= m, or "any" past the ladder."""
    if isinstance(m, bool) or not isinstance(m, int):
        raise TypeError(f"M must be an int, got {m!r}")
    if m < 1:
        raise ValueError(f"M must be >= 1, got {m}")
    for b in LADDER:
        if b >= m:
            return b
    return ANY


def parse_bucket(b: object) -> int | str:
    """A bucket as stored in JSON (int or "any"); ValueError when it is not on the ladder."""
    if b == ANY:
        return ANY
    if isinstance(b, int) and not isinstance(b, bool) and b in LADDER:
        return b
    raise ValueError(f"bucket {b!r} is not on the ladder {list(LADDER)} + ['any']")


def bucket_m(b: int | str) -> int:
    """The M a tuner measures/predicts a bucket at (its upper edge; ANY_M for "any")."""
    return ANY_M if b == ANY else int(b)


def bucket_order(b: int | str) -> int:
    return 1 << 30 if b == ANY else int(b)
