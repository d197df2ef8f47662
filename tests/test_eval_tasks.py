"""kvtier.eval's task generators on the CPU: determinism, lengths, needle placement, the
haystack and prompt fitting.

Only tokenization here (the embedded SmolLM2's tokenizer); no model forward pass.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.eval.haystack import FILLER, Haystack, prose_text
from kvtier.eval.prompts import fit_size
from kvtier.eval.ruler import RULER_SUBTASKS
from kvtier.eval.tasks import PASSKEY_INTRO, PASSKEY_QUESTION, TaskSpec, generate_samples


@pytest.fixture(scope="module")
def tok(embedded_hf_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_hf_dir))


def _n(tok: Any, text: str) -> int:
    return len(tok(text, add_special_tokens=False, verbose=False)["input_ids"])


# -- generators ----------------------------------------------------------------------------------


def test_generators_are_deterministic_given_the_seed(tok: Any) -> None:
    spec = TaskSpec("ruler", (1024,), samples=2, seed=3)
    a, b = generate_samples(spec, tok), generate_samples(spec, tok)
    assert a == b
    other = generate_samples(TaskSpec("ruler", (1024,), samples=2, seed=4), tok)
    assert all(x.expected != y.expected for x, y in zip(a, other, strict=True))
    assert a[0].expected != a[1].expected  # samples differ from each other


def test_a_sample_does_not_change_when_the_grid_grows(tok: Any) -> None:
    small = generate_samples(TaskSpec("niah", (1024,), depths=(50.0,), seed=1), tok)
    big = generate_samples(TaskSpec("niah", (1024, 2048), depths=(0.0, 50.0), samples=3, seed=1), tok)
    assert small[0] in big


def test_a_later_sample_run_alone_is_the_grids(tok: Any) -> None:
    """--first-sample 1 --samples 2 makes samples 1-2 of a --samples 3 grid, the same prompts."""
    grid = generate_samples(TaskSpec("niah", (1024,), depths=(0.0, 50.0), samples=3, seed=2), tok)
    spec = TaskSpec("niah", (1024,), depths=(0.0, 50.0), samples=2, seed=2, first_sample=1)
    later = generate_samples(spec, tok)
    assert [s.index for s in later] == [1, 2, 1, 2]
    assert later == [s for s in grid if s.index > 0]


@pytest.mark.parametrize("task,haystack", [("passkey", "repeat"), ("passkey", "prose"), ("niah", "prose")])
def test_length_within_one_percent(tok: Any, task: str, haystack: str) -> None:
    spec = TaskSpec(task, (1024, 3000, 8192), depths=(0.0, 50.0, 100.0), haystack=haystack)
    for s in generate_samples(spec, tok):
        total = s.prompt_tokens + s.max_tokens
        assert 0.99 * s.length <= total <= s.length, (s.task, s.length, total)


def test_ruler_lengths_within_one_percent(tok: Any) -> None:
    samples = generate_samples(TaskSpec("ruler", (1024, 4096)), tok)
    assert [s.task for s in samples] == [t for t in RULER_SUBTASKS for _ in range(2)]
    for s in samples:
        assert 0.99 * s.length <= s.prompt_tokens + s.max_tokens <= s.length, (s.task, s.length)


@pytest.mark.parametrize("haystack", ["repeat", "prose"])
def test_passkey_needle_at_the_requested_depth(tok: Any, haystack: str) -> None:
    depths = (0.0, 10.0, 25.0, 50.0, 75.0, 90.0, 100.0)
    for s in generate_samples(TaskSpec("passkey", (2048,), depths=depths, haystack=haystack), tok):
        text = tok.decode(s.prompt_ids)
        key = s.expected[0]
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        assert text.count(needle) == 1
        # Locate it independently: filler tokens before the needle / all filler tokens.
        start = text.index(PASSKEY_INTRO) + len(PASSKEY_INTRO) + 1
        end = text.rindex(PASSKEY_QUESTION)
        at = text.index(needle)
        before = _n(tok, text[start:at])
        filler = _n(tok, text[start:end]) - _n(tok, needle)
        assert s.depth is not None
        assert abs(100 * before / filler - s.depth) <= 3.0, (haystack, s.depth, 100 * before / filler)
        assert abs(s.needle_depths[0] - s.depth) <= 3.0
        assert text.endswith("<|im_start|>assistant\nThe pass key is")


def test_niah_needle_sits_on_a_sentence_boundary(tok: Any) -> None:
    for s in generate_samples(TaskSpec("niah", (1024,), depths=(0.0, 30.0, 60.0, 100.0)), tok):
        text = tok.decode(s.prompt_ids)
        m = re.search(
            r"(.)(.)One of the special magic numbers for [a-z]+-[a-z]+ is: (\d{7})\.(\s)", text, re.S
        )
        assert m is not None and m.group(3) == s.expected[0]
        if s.depth == 0.0:
            assert m.group(2) == "\n"  # right after the task's intro line
        else:
            assert m.group(1) in '.!?"\n' and m.group(2) in " \n"


def test_passkey_random_depths_spread(tok: Any) -> None:
    samples = generate_samples(TaskSpec("passkey", (1024,), samples=8), tok)
    depths = [s.needle_depths[0] for s in samples]
    assert min(depths) < 30 and max(depths) > 70
    assert all(s.depth is None for s in samples)


def test_ruler_answers_are_in_the_prompt(tok: Any) -> None:
    for s in generate_samples(TaskSpec("ruler", (2048,)), tok):
        text = tok.decode(s.prompt_ids)
        assert all(e in text for e in s.expected), s.task
        if s.task == "niah_multikey":
            assert len(re.findall(r"special magic numbers for ", text)) == 4
            assert len(s.expected) == 1
        if s.task in ("niah_multivalue", "niah_multiquery"):
            assert len(s.expected) == 4
        if s.task == "vt":
            assert len(s.expected) == 5 and all(re.fullmatch(r"[A-Z]{5}", e) for e in s.expected)
        if s.task == "cwe":
            body = text.rsplit("\nQuestion: What are the 10", 1)[0].rsplit("\n", 1)[1]
            counts = {w: len(re.findall(rf"\d+\. {w}(?= |$)", body)) for w in s.expected}
            assert set(counts.values()) == {6}  # below 4K each common word appears 6 times


# -- haystack and fitting ------------------------------------------------------------------------


def test_haystack_insert_keeps_order_and_spans(tok: Any) -> None:
    hay = Haystack("repeat", tok, 200)
    assert hay.text.startswith(FILLER)
    piece = hay.slice(0, 60)
    text, spans = piece.insert([(100.0, "Z."), (0.0, "A."), (0.0, "B.")])
    assert text.startswith("A. B. The grass is green.")
    assert [text[a:b] for a, b in spans] == ["Z.", "A.", "B."]
    assert len(prose_text().split()) > 5000


def test_fit_size_finds_the_largest_fit() -> None:
    calls: list[int] = []

    def count(n: int) -> int:
        calls.append(n)
        return 10 + 3 * n

    assert fit_size(count, 100, 1000) == 30
    assert len(calls) <= 8
    assert fit_size(lambda n: 10 + n, 100, 50) == 50  # capped by hi
    with pytest.raises(ConfigError, match="fixed text"):
        fit_size(lambda n: 200 + n, 100, 50)


def test_too_short_length_is_a_config_error(tok: Any) -> None:
    with pytest.raises(ConfigError, match="too short"):
        generate_samples(TaskSpec("passkey", (40,)), tok)
