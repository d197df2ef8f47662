"""When a sequence stops, and how much of its text may be sent yet."""

from __future__ import annotations

from collections.abc import Set

from kvtier.engine.sampling import SamplingParams


def check_stop(
    output: list[int], text: str, params: SamplingParams, eos: Set[int], at_length_limit: bool
) -> tuple[str | None, str | None]:
    """(text that may be sent now or None to wait, finish reason or None) after a new token.

    `text` is the decoded output so far. A stop string cuts the text before it (and is never
    sent: while running, the tail that could begin a stop string is held back). A text ending
    in an incomplete UTF-8 character waits for the next token.
    """
    reason = None
    if not params.ignore_eos and output[-1] in eos:
        reason = "stop"
    for s in params.stop:
        if s in text:
            return text[: text.index(s)], "stop"
    if reason is None and (len(output) >= params.max_tokens or at_length_limit):
        reason = "length"
    if reason is not None:
        return text, reason
    if text.endswith("\ufffd"):
        return None, None
    if params.stop:
        return text[: len(text) - max(map(len, params.stop)) + 1], None
    return text, None
