"""The `kvtier eval` tasks and the generator that turns a `TaskSpec` into samples.

- `passkey` (Landmark Attention): a 5-digit key in filler; "What is the pass key?", asking for the
  number alone (`PASSKEY_QUESTION`).
- `niah` (Kamradt's needle in a haystack, with RULER's needle): one "special magic number" at
  each requested depth, for a length x depth heatmap.
- `ruler`: the RULER-style subtasks in `kvtier.eval.ruler`.

Every sample has its own `random.Random`, seeded by (seed, subtask, length, depth, index), so a
sample does not change when other lengths, depths or sample counts are added to a run.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError
from kvtier.eval.haystack import HAYSTACKS, Haystack, prose_text
from kvtier.eval.prompts import ChatFormat, Draft, Sample, finish, haystack_build
from kvtier.eval.ruler import NIAH_SHAPES, RULER_SUBTASKS, cwe_draft, niah_draft, vt_draft
from kvtier.eval.words import word_pool

TASKS: dict[str, tuple[str, ...]] = {"passkey": ("passkey",), "niah": ("niah",), "ruler": RULER_SUBTASKS}
"""Task name -> its subtasks."""

DEFAULT_HAYSTACK = {  # RULER: niah_single_1 and vt use the noise haystack, the others essays
    "passkey": "repeat",
    "niah": "prose",
    "niah_single": "repeat",
    "niah_multikey": "prose",
    "niah_multivalue": "prose",
    "niah_multiquery": "prose",
    "vt": "repeat",
    "cwe": "prose",  # (only its word pool)
}

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
# Landmark Attention asks "What is the pass key?" alone; the embedded SmolLM2 then defines a pass key
# ("The pass key is a special type of key ...") even at 1K (6/10, dense) and 4K (0/10). Asking for
# the number alone, it answered 10/10 and 9/10 (dense, CPU, 10 samples each): the test then
# measures retrieval, not the model's reading of the question.
PASSKEY_QUESTION = "\nWhat is the pass key? Answer with the 5-digit number only."


@dataclass(frozen=True)
class TaskSpec:
    """What to generate. `depths` None: random depths (passkey), 0:100:10 (niah)."""

    task: str
    lengths: tuple[int, ...]
    depths: tuple[float, ...] | None = None
    samples: int = 1
    seed: int = 0
    first_sample: int = 0  # index of the first sample of each cell (a run of a grid's later samples)
    haystack: str | None = None  # None: each subtask's default (DEFAULT_HAYSTACK)
    subtasks: tuple[str, ...] | None = None  # a subset of TASKS[task]; None: all

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        if not self.lengths or min(self.lengths) < 1:
            raise ConfigError("give at least one positive context length (--lengths 2k,4k)")
        if self.samples < 1:
            raise ConfigError(f"--samples must be at least 1, got {self.samples}")
        if self.first_sample < 0:
            raise ConfigError(f"--first-sample must be 0 or more, got {self.first_sample}")
        if self.haystack is not None and self.haystack not in HAYSTACKS:
            raise ConfigError(f"unknown --haystack {self.haystack!r}; choose one of {', '.join(HAYSTACKS)}")
        if self.depths is not None:
            if self.task == "ruler":
                raise ConfigError("ruler places its needles at random depths (as RULER does); drop --depths")
            bad = [d for d in self.depths if not 0 <= d <= 100]
            if bad or not self.depths:
                raise ConfigError(f"depths are percentages in 0..100; got {list(self.depths)}")
        unknown = sorted(set(self.subtasks or ()) - set(TASKS[self.task]))
        if unknown:
            raise ConfigError(
                f"unknown {self.task} subtask(s) {', '.join(unknown)}; "
                f"choose from {', '.join(TASKS[self.task])}"
            )

    @property
    def names(self) -> tuple[str, ...]:
        """The subtasks to run, in registry order."""
        return tuple(s for s in TASKS[self.task] if self.subtasks is None or s in self.subtasks)

    @property
    def grid_depths(self) -> tuple[float | None, ...]:
        """The depths each (subtask, length) is run at; None means drawn per sample."""
        if self.depths is not None:
            return self.depths
        return tuple(float(d) for d in range(0, 101, 10)) if self.task == "niah" else (None,)


@dataclass
class _Context:
    """Haystacks (built on first use) and the word pool, shared by a run's samples."""

    tokenizer: Any
    min_tokens: int
    haystacks: dict[str, Haystack] = field(default_factory=dict)

    def haystack(self, kind: str) -> Haystack:
        if kind not in self.haystacks:
            self.haystacks[kind] = Haystack(kind, self.tokenizer, self.min_tokens)
        return self.haystacks[kind]


def passkey_draft(hay: Haystack, rng: random.Random, depth: float | None) -> Draft:
    """The passkey test: a 5-digit key at `depth` percent (uniform at random when None)."""
    key = str(rng.randint(10000, 99999))
    where = rng.uniform(0, 100) if depth is None else depth
    start = hay.random_start(rng)
    needle = PASSKEY_NEEDLE.format(key=key)
    build = haystack_build(hay, start, [(where, needle)], PASSKEY_INTRO + "\n", PASSKEY_QUESTION)
    return Draft(build, "The pass key is", (key,), "first_int", 10, hay.max_tokens(start), ("\n",))


def _draft(
    name: str, ctx: _Context, kind: str, rng: random.Random, depth: float | None, length: int
) -> Draft:
    if name == "passkey":
        return passkey_draft(ctx.haystack(kind), rng, depth)
    if name == "niah":
        return niah_draft(ctx.haystack(kind), rng, (1, 1, 1), [depth if depth is not None else 50.0])
    if name in NIAH_SHAPES:
        return niah_draft(ctx.haystack(kind), rng, NIAH_SHAPES[name])
    if name == "vt":
        return vt_draft(ctx.haystack(kind), rng, length)
    if name == "cwe":
        return cwe_draft(word_pool(prose_text()), rng, length)
    raise ConfigError(f"no generator for subtask {name!r}")  # pragma: no cover - TASKS lists them


def generate_samples(
    spec: TaskSpec, tokenizer: Any, progress: Callable[[Sample], None] | None = None
) -> list[Sample]:
    """All samples of `spec`, ordered by subtask, length, depth and index (deterministic)."""
    ctx = _Context(tokenizer, max(spec.lengths))
    fmt = ChatFormat(tokenizer)
    out: list[Sample] = []
    for name in spec.names:
        kind = spec.haystack or DEFAULT_HAYSTACK[name]
        for length in spec.lengths:
            for depth in spec.grid_depths:
                for i in range(spec.first_sample, spec.first_sample + spec.samples):
                    rng = random.Random(f"{spec.seed}/{name}/{length}/{depth}/{i}")
                    draft = _draft(name, ctx, kind, rng, depth, length)
                    sample = finish(draft, fmt, tokenizer, task=name, length=length, depth=depth, index=i)
                    out.append(sample)
                    if progress is not None:
                        progress(sample)
    return out
