"""RULER-style tasks (Hsieh et al. 2024, NVIDIA/RULER `scripts/data/synthetic`), offline.

Subtasks, with RULER's templates and answer prefixes:

| subtask          | RULER name      | needles                          | answer              |
|------------------|-----------------|----------------------------------|---------------------|
| niah_single      | niah_single_1   | 1 key, 1 value                   | the value           |
| niah_multikey    | niah_multikey_1 | 4 keys (3 distractors), 1 value  | the queried value   |
| niah_multivalue  | niah_multivalue | 1 key, 4 values                  | all 4 values        |
| niah_multiquery  | niah_multiquery | 4 keys, 1 value each, 4 queried  | all 4 values        |
| vt               | vt              | a chain VAR A = 12345, VAR B =   | the 5 variable      |
|                  |                 | VAR A, ... (4 hops)              | names               |
| cwe              | cwe             | numbered word list (no haystack) | the 10 common words |

Keys are "adjective-noun" words, values 7-digit numbers. Needles go at depths drawn from RULER's
40 evenly spaced depths; the vt chain at sorted random depths. vt and cwe start with one worked
example, as RULER's do. Scored with `recall` (RULER's `string_match_all`).
"""

from __future__ import annotations

import random

from kvtier.eval.haystack import Haystack
from kvtier.eval.prompts import Built, Draft, haystack_build
from kvtier.eval.words import distinct_keys, number_value, sample_words, variable_names

RULER_SUBTASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")

NIAH_SHAPES = {  # subtask -> (keys, values per key, keys queried)
    "niah_single": (1, 1, 1),
    "niah_multikey": (4, 1, 1),
    "niah_multivalue": (1, 4, 1),
    "niah_multiquery": (4, 1, 4),
}

RULER_DEPTHS = tuple(round(i * 100 / 39) for i in range(40))
"""RULER's needle depths: round(linspace(0, 100, 40))."""

NEEDLE = "One of the special magic numbers for {key} is: {value}."
_NIAH_ONE = (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards.",
    "What is the special magic number for {query} mentioned in the provided text?",
    "The special magic number for {query} mentioned in the provided text is",
)
_NIAH_MANY = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.",
    "What are all the special magic numbers for {query} mentioned in the provided text?",
    "The special magic numbers for {query} mentioned in the provided text are",
)

VT_HOPS = 4
_VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text."
_VT_QUESTION = "Question: Find all variables that are assigned the value {query} in the text above."
_VT_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, "
    "{n} variables are assigned the value {query}, they are:"
)

CWE_COMMON = 10
_CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
_CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
_CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"


def join_keys(keys: list[str]) -> str:
    """RULER's query list: `a`, `a, and b`, `a, b, and c`."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def niah_draft(
    hay: Haystack, rng: random.Random, shape: tuple[int, int, int], depths: list[float] | None = None
) -> Draft:
    """A needle-in-a-haystack sample; `depths` (one per needle) default to RULER's random ones."""
    n_keys, n_values, n_queries = shape
    keys = distinct_keys(rng, n_keys)
    values = [[number_value(rng) for _ in range(n_values)] for _ in keys]
    needles = [NEEDLE.format(key=k, value=v) for k, vs in zip(keys, values, strict=True) for v in vs]
    rng.shuffle(needles)
    if depths is None:
        depths = [float(d) for d in rng.sample(RULER_DEPTHS, len(needles))]
    queried = rng.sample(range(n_keys), n_queries)
    query = join_keys([keys[i] for i in queried])
    intro, question, prefix = _NIAH_ONE if n_queries * n_values == 1 else _NIAH_MANY
    start = hay.random_start(rng)
    build = haystack_build(
        hay, start, list(zip(depths, needles, strict=True)), intro + "\n", "\n" + question.format(query=query)
    )
    expected = tuple(v for i in queried for v in values[i])
    single = len(expected) == 1
    return Draft(
        build=build,
        answer_prefix=prefix.format(query=query),
        expected=expected,
        scorer="recall",
        max_tokens=32 if single else 64,
        max_size=hay.max_tokens(start),
        stop=("\n",) if single else (),
    )


def _chain(rng: random.Random) -> tuple[list[str], int, list[tuple[float, str]]]:
    names = variable_names(rng, VT_HOPS + 1)
    value = rng.randint(10000, 99999)
    lines = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(VT_HOPS)]
    depths = sorted(rng.uniform(0, 100) for _ in lines)
    return names, value, list(zip(depths, lines, strict=True))


def vt_draft(hay: Haystack, rng: random.Random, length: int) -> Draft:
    """Variable tracking: follow a chain of 4 assignments back to a value."""
    names, value, chain = _chain(rng)
    ex_names, ex_value, ex_chain = _chain(rng)
    ex_text, _ = hay.slice(hay.random_start(rng), min(300, length // 8)).insert(ex_chain)
    example = (
        f"{_VT_INTRO}\n\n{ex_text}\n{_VT_QUESTION.format(query=ex_value)}\n"
        f"{_VT_PREFIX.format(n=len(ex_names), query=ex_value)} {' '.join(ex_names)}\n\n"
    )
    start = hay.random_start(rng)
    build = haystack_build(
        hay, start, chain, f"{example}{_VT_INTRO}\n\n", "\n" + _VT_QUESTION.format(query=value)
    )
    prefix = _VT_PREFIX.format(n=len(names), query=value)
    return Draft(build, prefix, tuple(names), "recall", 30, hay.max_tokens(start))


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def cwe_draft(pool: list[str], rng: random.Random, length: int) -> Draft:
    """Common words extraction: the 10 words repeated most often in a long numbered list.

    RULER's counts: at 4K and longer each common word appears 30 times and every other word
    3 times (example: 40 words, 10 and 3 times); below 4K, 6 and 1 (example: 20 words, 3 and 1).
    """
    big = length >= 4096
    cw, ucw = (30, 3) if big else (6, 1)
    ex_size, ex_cw, ex_ucw = (40, 10, 3) if big else (20, 3, 1)
    max_n = max(length // (2 * ucw), 1)  # a list entry "12. word" takes at least 2 tokens
    words = sample_words(pool, rng, CWE_COMMON + max_n)
    ex_words = rng.sample(pool, ex_size)
    shuffle_seed = rng.getrandbits(32)
    ex_list = ex_words[:CWE_COMMON] * ex_cw + ex_words[CWE_COMMON:] * ex_ucw
    random.Random(shuffle_seed).shuffle(ex_list)
    example = (
        f"{_CWE_INTRO}\n{_numbered(ex_list)}\n{_CWE_QUESTION}\n"
        f"{_CWE_PREFIX} {_numbered(ex_words[:CWE_COMMON])}\n\n{_CWE_INTRO}\n"
    )

    def build(n: int) -> Built:
        items = words[:CWE_COMMON] * cw + words[CWE_COMMON : CWE_COMMON + n] * ucw
        random.Random(shuffle_seed).shuffle(items)
        body = _numbered(items)
        return Built(f"{example}{body}\n{_CWE_QUESTION}", (len(example), len(example) + len(body)))

    return Draft(build, _CWE_PREFIX, tuple(words[:CWE_COMMON]), "recall", 120, max_n)
