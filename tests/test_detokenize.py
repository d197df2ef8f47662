"""IncrementalText gives, token by token, the text a full decode gives, decoding O(1) tokens a step."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.batch.detokenize import IncrementalText

MIXED = (
    "Plain ASCII, then accents: café, naïve, Zürich. CJK: 東京タワーは高い。 Emoji: 🚀🔥 "
    "and a family 👨‍👩‍👧. Greek αβγ, math ∑∫√, a euro €5. Done.\n\nNext paragraph:   spaces."
)


@pytest.fixture(scope="module")
def tokenizer(embedded_hf_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_hf_dir)


def assert_matches_full(tok: Any, ids: list[int]) -> None:
    inc = IncrementalText(tok)
    for i in range(1, len(ids) + 1):
        want = tok.decode(ids[:i], skip_special_tokens=True)
        assert inc.update(ids[:i]) == want, f"after {i} tokens"
    assert not inc.whole, "fell back to full decodes"


def test_text_with_multibyte_characters(tokenizer: Any) -> None:
    ids = tokenizer(MIXED)["input_ids"]
    # byte-level pieces split some characters over tokens: the test is only as good as that
    partial = [i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd")]
    assert partial, "no character of the sample text is split over tokens"
    assert_matches_full(tokenizer, ids)


def test_random_ids_with_special_tokens(tokenizer: Any) -> None:
    rng = random.Random(3)
    special = sorted(set(tokenizer.all_special_ids))
    for _ in range(3):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
        for j in rng.sample(range(300), 20):
            ids[j] = rng.choice(special)
        assert_matches_full(tokenizer, ids)


def test_list_cut_back_starts_over(tokenizer: Any) -> None:
    ids = tokenizer("one two three four five six")["input_ids"]
    inc = IncrementalText(tokenizer)
    for i in range(1, len(ids) + 1):
        inc.update(ids[:i])
    other = tokenizer("seven")["input_ids"]
    assert inc.update(ids[:2] + other) == tokenizer.decode(ids[:2] + other)


class CountingTokenizer:
    """Decodes token i as chr(65 + i % 26), counting the tokens it is asked to decode."""

    clean_up_tokenization_spaces = False

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return "".join(chr(65 + i % 26) for i in ids)


def test_each_step_decodes_a_few_tokens() -> None:
    tok = CountingTokenizer()
    inc = IncrementalText(tok)
    ids = list(range(2000))
    for i in range(1, len(ids) + 1):
        assert inc.update(ids[:i]) == tok.decode(ids[:i])
    n = len(ids)
    # the checks' own full decodes are n (n + 1) / 2 tokens; the rest is the class's: a few a step
    assert tok.decoded - n * (n + 1) // 2 <= 4 * n


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_whole() -> None:
    class CleaningUp(CountingTokenizer):
        clean_up_tokenization_spaces = True

    tok = CleaningUp()
    inc = IncrementalText(tok)
    assert inc.update([0, 1, 2]) == "ABC"
    assert tok.decoded == 3  # one full decode, no windows


def test_windows_stay_short_on_runs_without_text() -> None:
    class SkipsEvens(CountingTokenizer):
        """Even ids are special tokens (skipped), odd ones letters."""

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            self.decoded += len(ids)
            return "".join(chr(65 + i % 26) for i in ids if i % 2)

    tok = SkipsEvens()
    inc = IncrementalText(tok)
    ids = [0] * 500 + [1, 3] + [2] * 500 + [5]  # long runs of special tokens
    spans = []
    for i in range(1, len(ids) + 1):
        assert inc.update(ids[:i]) == tok.decode(ids[:i])
        spans.append(i - inc.start)
    assert max(spans) <= 17
