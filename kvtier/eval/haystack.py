"""Haystacks: filler text cut to a size in tokens, with needles put in at sentence boundaries.

Two kinds:

- `repeat`: the classic noise sentence of the passkey test (Landmark Attention) and RULER's
  `noise` haystack, repeated with spaces;
- `prose`: the plain essays that ship with kvtier in `kvtier/eval/data/*.txt`, written for the
  project (Kamradt's NIAH and RULER's `essay` haystack use Paul Graham's essays, which are
  copyrighted and cannot be bundled). It is repeated when a context needs more of it.

The filler is tokenized once with the model's tokenizer; a slice is `n` tokens of it starting
at a sentence. Needles go in at the sentence boundary nearest to `depth` percent of the slice's
tokens (Kamradt walks back to the previous '.'; nearest halves the error)::

    slice:   |The grass is green. The sky is blue. The sun is yel|     n tokens
    depth 40:                    ^ boundary nearest to token 0.4 n
    result:  |The grass is green. NEEDLE The sky is blue. The sun is yel|

The slice ends where its `n`-th token ends, usually inside a sentence, so the last boundary is
the start of that partial sentence: depth 100 puts the needle before it (a few tokens short of
the end), never glued to half a sentence.
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from kvtier.errors import ConfigError

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""The passkey test's filler (Landmark Attention), also RULER's `noise` haystack."""

HAYSTACKS = ("repeat", "prose")

_SENTENCE_GAP = re.compile(r"(?<=[.!?])[\"')\]]?\s+")
"""The whitespace after a sentence's end: the next sentence starts where a match ends."""


@lru_cache(maxsize=1)
def prose_text() -> str:
    """The bundled essays (`kvtier/eval/data/*.txt`, in name order), joined by blank lines."""
    folder = resources.files("kvtier.eval").joinpath("data")
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".txt"))
    if not names:
        raise ConfigError("kvtier/eval/data holds no .txt haystack files; reinstall kvtier")
    return "\n\n".join(folder.joinpath(n).read_text(encoding="utf-8").strip() for n in names)


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[int], list[int]]:
    """Token ids of `text` (no special tokens) and each token's start and end character."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    offsets = enc["offset_mapping"]
    return list(enc["input_ids"]), [int(a) for a, _ in offsets], [int(b) for _, b in offsets]


@dataclass(frozen=True)
class Piece:
    """A slice of a haystack: its text, sentence starts and token starts (both in characters)."""

    text: str
    boundaries: tuple[int, ...]  # sentence starts inside the text, with 0 first
    token_starts: tuple[int, ...]  # one per token of the slice

    def position(self, depth: float) -> int:
        """The boundary (a character index) nearest to `depth` percent of the tokens."""
        n = len(self.token_starts)
        k = round(depth / 100 * n)
        char = len(self.text) if k >= n else self.token_starts[k]
        if k >= n and self.text.rstrip().endswith((".", "!", "?")):
            return len(self.text)
        i = bisect.bisect_left(self.boundaries, char)
        near = self.boundaries[max(i - 1, 0) : i + 1]
        return min(near, key=lambda b: (abs(b - char), b))

    def insert(self, needles: Sequence[tuple[float, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The text with each `(depth, needle)` put in; returns it and each needle's span.

        Needles at the same boundary keep their given order. Spans are in the returned text and
        follow the order of `needles`.
        """
        placed = sorted(
            ((self.position(d), i, s) for i, (d, s) in enumerate(needles)), key=lambda t: (t[0], t[1])
        )
        out: list[str] = []
        spans: dict[int, tuple[int, int]] = {}
        size, cursor = 0, 0
        for pos, i, needle in placed:
            chunk = self.text[cursor:pos]
            out.append(chunk)
            size += len(chunk)
            cursor = pos
            lead = " " if pos == len(self.text) and pos > 0 else ""
            trail = "" if pos == len(self.text) else " "
            out.append(lead + needle + trail)
            spans[i] = (size + len(lead), size + len(lead) + len(needle))
            size += len(lead) + len(needle) + len(trail)
        out.append(self.text[cursor:])
        return "".join(out), [spans[i] for i in range(len(needles))]


class Haystack:
    """Filler text of one kind, tokenized once, long enough for `min_tokens` from any start."""

    def __init__(self, kind: str, tokenizer: Any, min_tokens: int) -> None:
        if kind not in HAYSTACKS:
            raise ConfigError(f"unknown haystack {kind!r}; choose one of {', '.join(HAYSTACKS)}")
        self.kind = kind
        unit, sep = (FILLER, " ") if kind == "repeat" else (prose_text(), "\n\n")
        unit_tokens = max(1, len(encode_with_offsets(tokenizer, unit)[0]))
        copies = -(-min_tokens // unit_tokens) + 2  # one spare copy for the random start
        self.text = sep.join([unit] * copies)
        _, self._tok_start, self._tok_end = encode_with_offsets(tokenizer, self.text)
        starts = [0] + [m.end() for m in _SENTENCE_GAP.finditer(self.text)]
        self._sentences = [s for s in starts if s < len(self.text)]
        self._first_copy = bisect.bisect_left(self._sentences, len(unit) + len(sep))

    def random_start(self, rng: random.Random) -> int:
        """A sentence index in the first copy, drawn from `rng` (where a slice begins)."""
        return rng.randrange(max(self._first_copy, 1))

    def max_tokens(self, start: int) -> int:
        """How many tokens a slice beginning at sentence `start` can have."""
        return len(self._tok_end) - self._token_at(self._sentences[start])

    def slice(self, start: int, n_tokens: int) -> Piece:
        """`n_tokens` tokens of filler beginning at sentence `start`."""
        cs = self._sentences[start]
        t0 = self._token_at(cs)
        t1 = t0 + n_tokens
        if t1 > len(self._tok_end):
            raise ConfigError(f"haystack too short: {n_tokens} tokens asked, {self.max_tokens(start)} left")
        ce = self._tok_end[t1 - 1] if n_tokens > 0 else cs
        text = self.text[cs:ce].rstrip()
        lo = bisect.bisect_right(self._sentences, cs)
        hi = bisect.bisect_left(self._sentences, cs + len(text))
        bounds = (0, *(s - cs for s in self._sentences[lo:hi]))
        tokens = tuple(max(0, s - cs) for s in self._tok_start[t0:t1])
        return Piece(text, bounds, tokens)

    def _token_at(self, char: int) -> int:
        """Index of the token that holds character `char` (its leading space may come before)."""
        return bisect.bisect_right(self._tok_end, char)
