"""A sequence's output text, decoded a few tokens at a time instead of in full at every step.

The engine needs the output text after every new token (stop strings, the text a stream sends),
and decoding the whole output each time costs O(length) per token: with SmolLM2's tokenizer
36 / 141 / 702 us a step at 128 / 512 / 2,048 output tokens on the development CPU, for every
sequence of every batch step, so O(length^2) per request (`bench/results/detokenize_cpu.json`).
`IncrementalText` keeps the text of the tokens up to a character boundary and decodes only the
tokens since:

    ids:   [ .......... done .......... | prefix | new ]
                                        ^ start  ^ read
    text = done's text + decode(prefix + new)[len(decode(prefix)):]

`prefix` (the tokens of the last completed piece) is decoded again beside `new` so that a
tokenizer whose decoding of a token depends on the one before (SentencePiece's leading space,
byte-level pieces of one character) sees the same neighbour it does in a full decode. The window
moves on only when its text does not end in U+FFFD (an incomplete UTF-8 character), so a
multi-byte character split over tokens is decoded whole. Tokens that decode to nothing (skipped
special tokens) join the window without moving it, and a window moves on whatever it ends with
once it spans `WINDOW` tokens, so a step's decode stays a few tokens long. `update` returns what a
full decode would; `tests/test_detokenize.py` checks that token by token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INCOMPLETE = "\ufffd"  # what a decode ends with while a UTF-8 character is split over tokens
WINDOW = 16  # tokens a window may span before it moves on whatever it ends with


class IncrementalText:
    """The decoded text of a growing token list (`update` takes the whole list each time).

    A tokenizer that cleans up spaces around punctuation after decoding
    (`clean_up_tokenization_spaces`) can give a window a text that a full decode does not; such
    a tokenizer, or a window whose text stops matching, is decoded in full from then on."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.whole = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.done = ""  # text of ids[:read], up to the last character boundary seen
        self.start = 0  # first token of the prefix window
        self.read = 0  # tokens whose text is in `done`

    def update(self, ids: Sequence[int]) -> str:
        """The text of `ids` (which extend the list of the last call), as
        `tokenizer.decode(ids, skip_special_tokens=...)` gives it."""
        if self.whole:
            return self._decode(ids)
        if len(ids) < self.read:  # NOTE: the list was cut back: start over
            self.done, self.start, self.read = "", 0, 0
        prefix = self._decode(ids[self.start : self.read])
        full = self._decode(ids[self.start :])
        if not full.startswith(prefix):  # the window decodes unlike the whole: decode in full
            self.whole = True
            return self._decode(ids)
        new = full[len(prefix) :]
        if (new and not new.endswith(INCOMPLETE)) or len(ids) - self.start > WINDOW:
            self.done += new  # NOTE: past WINDOW a U+FFFD is kept; a later mismatch decodes whole
            self.start, self.read = self.read, len(ids)
            return self.done
        if not new:  # tokens without text (skipped special tokens): read on, same prefix
            self.read = len(ids)
        return self.done + new

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=self.skip)) if ids else ""
