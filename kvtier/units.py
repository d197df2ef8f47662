"""Parsing of human-written sizes ("24GiB", "24 GB", "24g"), token counts ("128K", "1M"),
bounded integers, finite floats and seeds. Every parser raises ConfigError naming the option."""

from __future__ import annotations

import math
import re

from kvtier.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_COUNT_UNITS = {"": 1, "k": 1024, "m": 1024**2}

SEED_LIMIT = 2**64
"""--seed is 0 <= seed < 2**64 (torch.Generator.manual_seed overflows past it; it also takes
negative seeds down to -2**63, which SamplingParams accepts for the server)."""

COUNT_LIMIT = 2**31
"""Counts (pages, sequences, threads, bytes of a request) stay below this: a larger one is a typo,
and would make an allocator fail deep inside instead of here."""


def parse_size(text: str | int | float, what: str = "size") -> int:
    """Bytes from "24GiB", "24 GB" (1e9), "24g" (GiB) or a plain number of bytes.

    Raises ConfigError naming `what` when the text is not a size.
    """
    if isinstance(text, (int, float)):
        if not math.isfinite(text) or text < 0:
            raise ConfigError(f"{what} must be a finite size of at least 0 bytes, got {text}")
        return int(text)
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    value = float(m.group(1)) * _SIZE_UNITS[unit] if m is not None and unit in _SIZE_UNITS else None
    if value is None or not math.isfinite(value):
        raise ConfigError(f"{what}: cannot read {text!r} as a size; write e.g. '24GiB', '24 GB' or '24g'")
    return int(value)


def parse_count(text: str | int, what: str = "count") -> int:
    """Token counts: "1M" = 1,048,576, "128K" = 131,072, "3000" = 3000 (K and M are binary)."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(text)
        unit = m.group(2).lower() if m else None
        number = float(m.group(1)) * _COUNT_UNITS[unit] if m is not None and unit in _COUNT_UNITS else None
        if number is None or not math.isfinite(number):
            raise ConfigError(f"{what}: cannot read {text!r} as a token count; write e.g. 4096, 128K or 1M")
        value = int(number)
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    return value


def parse_int(text: str | int, what: str, lo: int | None = None, hi: int | None = None) -> int:
    """An integer within [lo, hi] (either bound may be None). "8", "+8" and "1_000" are read."""
    if isinstance(text, bool):
        raise ConfigError(f"{what} must be an integer, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        try:
            value = int(text.strip())
        except ValueError:
            raise ConfigError(f"{what}: cannot read {text!r} as an integer") from None
    below, above = lo is not None and value < lo, hi is not None and value > hi
    if below or above:
        if lo is not None and hi is not None and hi != COUNT_LIMIT - 1:
            rule = f"in {lo}..{hi}"
        else:  # NOTE: COUNT_LIMIT is a cap against typos, named only when it is what was hit
            rule = f"at least {lo}" if below else f"at most {hi}"
        raise ConfigError(f"{what} must be {rule}, got {value}")
    return value


def parse_seed(text: str | int, what: str = "--seed") -> int:
    """A random seed: an integer with 0 <= seed < 2**64 (SEED_LIMIT)."""
    return parse_int(text, what, 0, SEED_LIMIT - 1)


def parse_finite_float(
    text: str | float,
    what: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """A finite float within the interval from `lo` to `hi` (open at an end where `*_open`).

    "nan", "inf" and numbers too large for a float ("1e999") are refused with a ConfigError.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise ConfigError(f"{what}: cannot read {text!r} as a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number, got {text!r}")
    below = lo is not None and (value <= lo if lo_open else value < lo)
    above = hi is not None and (value >= hi if hi_open else value > hi)
    if below or above:
        raise ConfigError(f"{what} must be {_float_range(lo, hi, lo_open, hi_open)}, got {value:g}")
    return value


def _float_range(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    assert hi is not None
    return f"{'<' if hi_open else '<='} {hi:g}"


def format_bytes(n: float) -> str:
    """'1.50 GiB' style, for messages and tables."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
