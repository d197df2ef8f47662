"""Scoring as the published tasks define it; every score is in [0, 1].

- `first_int` (passkey, Landmark Attention): the first integer in the answer equals the key.
- `recall` (NIAH and RULER's `string_match_all`): the fraction of expected strings found, case
  insensitive, anywhere in the answer. RULER first replaces control characters with newlines and
  strips the answer; neither changes a substring match, so the answer is used as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from kvtier.errors import ConfigError

_INT = re.compile(r"\d+")


def first_int(answer: str, expected: Sequence[str]) -> float:
    """1.0 when the first run of digits in `answer` is the integer `expected[0]`, else 0.0."""
    m = _INT.search(answer)
    return float(m is not None and int(m.group()) == int(expected[0]))


def recall(answer: str, expected: Sequence[str]) -> float:
    """Fraction of `expected` that occur in `answer` as case-insensitive substrings."""
    if not expected:
        raise ConfigError("recall needs at least one expected string")
    low = answer.lower()
    return sum(e.lower() in low for e in expected) / len(expected)


SCORERS: dict[str, Callable[[str, Sequence[str]], float]] = {"first_int": first_int, "recall": recall}


def score(scorer: str, answer: str, expected: Sequence[str]) -> float:
    """Score `answer` with the scorer named `scorer`."""
    if scorer not in SCORERS:
        raise ConfigError(f"unknown scorer {scorer!r}; known: {', '.join(SCORERS)}")
    return SCORERS[scorer](answer, expected)
