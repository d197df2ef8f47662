"""bench/hip_decode_fidelity.py's texts and scores (its model runs are the bench's own)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.hip_decode_fidelity import score, texts


class CountingTokenizer:
    """Token i is the i-th character's code: enough to check how texts are cut."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, Any]:
        return {"input_ids": [ord(c) for c in text[:200]]}


def test_copy_text_continues_the_first_copy() -> None:
    prompt, cont = texts(CountingTokenizer(), "copy", context=50, tokens=10, copy_span=40)
    assert len(prompt) == 50 and len(cont) == 10
    assert prompt[40:] == prompt[:10]  # the second copy starts over
    assert cont == prompt[10:20]  # and goes on as the first did


def test_copy_of_entries_is_as_long_as_asked() -> None:
    prompt, cont = texts(CountingTokenizer(), "copy-entries", context=150, tokens=10, copy_span=100)
    assert prompt[100:] == prompt[:50] and cont == prompt[50:60]


def test_copy_text_rejects_a_context_outside_the_second_copy() -> None:
    with pytest.raises(SystemExit, match="--context must lie in"):
        texts(CountingTokenizer(), "copy", context=75, tokens=10, copy_span=40)
    with pytest.raises(SystemExit, match="--context must lie in"):
        texts(CountingTokenizer(), "copy", context=40, tokens=10, copy_span=40)


def test_scores_against_truth_and_reference_by_bucket() -> None:
    cont = [1, 2, 3, 4]
    ref = {"argmax": [1, 2, 3, 4], "logprob": [0.0] * 4}
    row = {"argmax": [1, 9, 3, 9], "logprob": [math.log(0.5)] * 2 + [math.log(0.25)] * 2}
    got = score(row, ref, cont, bucket=2)
    assert got["accuracy"] == got["agreement"] == 0.5
    assert got["nll"] == pytest.approx(-(2 * math.log(0.5) + 2 * math.log(0.25)) / 4, abs=1e-4)
    assert got["perplexity"] == pytest.approx(math.exp(got["nll"]), rel=1e-3)
    assert [b["steps"] for b in got["by_bucket"]] == [[0, 2], [2, 4]]
    assert [b["agreement"] for b in got["by_bucket"]] == [0.5, 0.5]
    assert score(ref, ref, cont, bucket=4)["agreement"] == 1.0
