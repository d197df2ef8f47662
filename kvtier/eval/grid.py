"""Parsing `--lengths` ("2k,4k,8k") and `--depths` ("0:100:10" or "0,25,50")."""

from __future__ import annotations

from kvtier.errors import ConfigError
from kvtier.units import parse_count


def parse_lengths(text: str) -> tuple[int, ...]:
    """Comma-separated token counts ("1k" = 1024), sorted, without repeats."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise ConfigError(f"--lengths {text!r}: write comma-separated token counts, e.g. 2k,4k,8k")
    return tuple(sorted({parse_count(t, "--lengths") for t in items}))


def parse_depths(text: str) -> tuple[float, ...]:
    """ "start:stop:step" (stop included) or a comma list, in percent within 0..100."""
    try:
        if ":" in text:
            parts = [float(p) for p in text.split(":")]
            if len(parts) != 3:
                raise ValueError
            start, stop, step = parts
            if step <= 0 or stop < start:
                raise ConfigError(f"--depths {text!r}: need start <= stop and a positive step")
            count = int((stop - start) / step + 1e-9) + 1
            values = [round(start + i * step, 6) for i in range(count)]
        else:
            values = [float(p) for p in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"--depths {text!r}: write start:stop:step (e.g. 0:100:10) or a list (0,50,100)"
        ) from None
    bad = [v for v in values if not 0 <= v <= 100]
    if bad:
        raise ConfigError(f"--depths {text!r}: depths are percentages within 0..100, got {bad[0]:g}")
    return tuple(sorted(set(values)))
