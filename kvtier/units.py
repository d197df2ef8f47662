"""Parsing of human-written sizes ("24GiB", "24 GB", "24g") and token counts ("128K", "1M")."""

from __future__ import annotations

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


def parse_size(text: str | int | float, what: str = "size") -> int:
    """Bytes from "24GiB", "24 GB" (1e9), "24g" (GiB) or a plain number of bytes.

    Raises ConfigError naming `what` when the text is not a size.
    """
    if isinstance(text, (int, float)):
        if text < 0:
            raise ConfigError(f"{what} must not be negative, got {text}")
        return int(text)
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"{what}: cannot read {text!r} as a size; write e.g. '24GiB', '24 GB' or '24g'")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_count(text: str | int, what: str = "count") -> int:
    """Token counts: "1M" = 1,048,576, "128K" = 131,072, "3000" = 3000 (K and M are binary)."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(text)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _COUNT_UNITS:
            raise ConfigError(f"{what}: cannot read {text!r} as a token count; write e.g. 4096, 128K or 1M")
        value = int(float(m.group(1)) * _COUNT_UNITS[unit])
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """'1.50 GiB' style, for messages and tables."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
