"""From a task's draft to a finished sample: chat template, length fitting, needle depths.

A task draws everything random first and returns a `Draft` whose `build(n)` renders the user
message for a haystack of size `n` (tokens of filler, or words of a list). `finish` then finds
the largest `n` whose prompt fits, the RULER way: prompt tokens + `max_tokens` <= length, so a
sample at length 8K fits an 8K model with room for its answer. The prompt is the model's chat
template around the user message, followed by the task's answer prefix (the start of the
assistant's reply, as RULER appends `answer_prefix` and the passkey test ends with "The pass key
is"); a tokenizer without a chat template gets the bare text.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.eval.haystack import Haystack, encode_with_offsets

Span = tuple[int, int]


@dataclass(frozen=True)
class Built:
    """A rendered user message and where its filler and needles sit (character spans)."""

    user: str
    filler: Span = (0, 0)
    needles: tuple[Span, ...] = ()


@dataclass(frozen=True)
class Draft:
    """A sample whose random choices are made, waiting for its haystack size."""

    build: Callable[[int], Built]
    answer_prefix: str
    expected: tuple[str, ...]
    scorer: str  # a name in kvtier.eval.scoring.SCORERS
    max_tokens: int
    max_size: int  # largest n that build() accepts
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sample:
    """One prompt, ready to run, with what a correct answer contains."""

    task: str  # "passkey", "niah" or a RULER subtask such as "niah_multikey"
    length: int  # requested context: prompt tokens + max_tokens <= length
    depth: float | None  # requested needle depth in percent; None = drawn at random
    index: int
    prompt_ids: tuple[int, ...]
    expected: tuple[str, ...]
    scorer: str
    max_tokens: int
    needle_depths: tuple[float, ...]  # measured: % of the filler's tokens before each needle
    stop: tuple[str, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


class ChatFormat:
    """The model's chat template split around the user message (or nothing without one)."""

    def __init__(self, tokenizer: Any) -> None:
        self.head, self.tail = "", "\n"
        if getattr(tokenizer, "chat_template", None):
            mark = "\x00USER\x00"
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": mark}], add_generation_prompt=True, tokenize=False
            )
            self.head, _, self.tail = str(text).partition(mark)

    def render(self, user: str, answer_prefix: str) -> str:
        """Full prompt text: template head, the user message, template tail, answer prefix."""
        return self.head + user + self.tail + answer_prefix


def fit_size(count: Callable[[int], int], target: int, hi: int) -> int:
    """Largest `n` in [0, hi] with `count(n) <= target`, for a nondecreasing `count`.

    Secant steps (a haystack adds about one token per unit, a word list a few) land within a
    token or two in 2-3 tries; bisection takes over if they stall. Raises `ConfigError` when
    even `n = 0` does not fit.
    """
    lo, lo_c = 0, count(0)
    if lo_c > target:
        raise ConfigError(f"the task's fixed text alone takes {lo_c} tokens, more than {target}")
    up = hi + 1  # count(up) is taken to be > target
    slope = 1.0
    for step in range(64):
        if up - lo <= 1:
            break
        guess = lo + int((target - lo_c) / slope) if step < 6 else (lo + up) // 2
        guess = min(max(guess, lo + 1), up - 1)
        c = count(guess)
        slope = max((c - lo_c) / (guess - lo), 1e-3)
        if c <= target:
            lo, lo_c = guess, c
            if c == target:
                break
        else:
            up = guess
    return lo


def finish(
    draft: Draft, fmt: ChatFormat, tokenizer: Any, *, task: str, length: int, depth: float | None, index: int
) -> Sample:
    """Fit `draft` to `length` and tokenize it into a `Sample`."""
    target = length - draft.max_tokens

    def count(n: int) -> int:
        text = fmt.render(draft.build(n).user, draft.answer_prefix)
        return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    try:
        n = fit_size(count, target, draft.max_size)
    except ConfigError as e:
        raise ConfigError(f"length {length} is too short for {task}: {e}; ask for a longer one") from None
    built = draft.build(n)
    ids, starts, _ = encode_with_offsets(tokenizer, fmt.render(built.user, draft.answer_prefix))
    return Sample(
        task=task,
        length=length,
        depth=depth,
        index=index,
        prompt_ids=tuple(ids),
        expected=draft.expected,
        scorer=draft.scorer,
        max_tokens=draft.max_tokens,
        needle_depths=needle_depths(starts, built, len(fmt.head)),
        stop=draft.stop,
    )


def haystack_build(
    haystack: Haystack, start: int, needles: Sequence[tuple[float, str]], head: str, tail: str
) -> Callable[[int], Built]:
    """`build(n)`: `head`, then `n` filler tokens from sentence `start` with `needles`, then `tail`."""

    def build(n: int) -> Built:
        text, spans = haystack.slice(start, n).insert(needles)
        a = len(head)
        return Built(head + text + tail, (a, a + len(text)), tuple((a + s, a + e) for s, e in spans))

    return build


def needle_depths(token_starts: list[int], built: Built, shift: int = 0) -> tuple[float, ...]:
    """Percent of the filler's own tokens (needles not counted) before each needle."""

    def tok(char: int) -> int:  # index of the token holding `char`
        return max(bisect.bisect_right(token_starts, char + shift) - 1, 0)

    a, b = built.filler
    sizes = [tok(e) - tok(s) for s, e in built.needles]
    filler = max(tok(b) - tok(a) - sum(sizes), 1)
    out = []
    for s, _ in built.needles:
        before = tok(s) - tok(a) - sum(sz for (s2, _), sz in zip(built.needles, sizes, strict=True) if s2 < s)
        out.append(round(100 * before / filler, 2))
    return tuple(out)
