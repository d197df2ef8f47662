"""A request's text side: a call's prompts as a list, prompts to token ids (with the chat
template), the length check, when generation stops, and the output text with its finish reason.
Pure functions of the tokenizer and the model's EOS ids; `LLM` and the batch engine call them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError, PromptError

Prompt = str | list[int]


def encode_prompt(
    prompt: Prompt, tokenizer: Any, model_name: str, vocab: int, chat: bool = False
) -> list[int]:
    """Token ids of `prompt`: text through `tokenizer` (with its chat template when `chat`), a
    list of ids as it is. PromptError for an empty prompt, ids outside [0, vocab), or text for a
    model without a tokenizer."""
    if isinstance(prompt, list):
        ids = [int(t) for t in prompt]
    else:
        if tokenizer is None:
            raise PromptError(f"model {model_name!r} has no tokenizer (random-weight preset); pass token ids")
        if not prompt.strip():
            raise PromptError("the prompt is empty; give some text (--prompt or --prompt-file)")
        if chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            ids = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        else:
            ids = list(tokenizer(prompt, verbose=False)["input_ids"])
    if not ids:
        raise PromptError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab:
        raise PromptError(f"token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
    return ids


def prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    """A call's prompts as a list: one prompt (text, or a list of token ids) alone, a list of
    prompts as it is. PromptError when there are none."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if isinstance(prompts, list) and prompts:
        return list(prompts)  # type: ignore[arg-type]
    raise PromptError("no prompts given")


def check_length(n_prompt: int, params: SamplingParams, limit: int) -> None:
    """PromptError when `n_prompt` tokens plus `params.max_tokens` exceed `limit`."""
    total = n_prompt + params.max_tokens
    if total > limit:
        raise PromptError(
            f"the prompt has {n_prompt} tokens; with max_tokens={params.max_tokens} that is {total}, "
            f"past this model's limit of {limit} tokens. Shorten the prompt, or pass "
            "--max-model-len (max_model_len=) to run past the trained context (quality may drop)"
        )


def stopper(params: SamplingParams, eos_ids: Iterable[int], tokenizer: Any) -> Callable[[list[int]], bool]:
    """Whether generation stops after `tokens`: an EOS id (unless `ignore_eos`) or a stop string
    in the decoded text."""
    eos = set() if params.ignore_eos else set(eos_ids)

    def should_stop(tokens: list[int]) -> bool:
        if tokens[-1] in eos:
            return True
        if params.stop and tokenizer is not None:
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            return any(s in text for s in params.stop)
        return False

    return should_stop


def text_and_reason(
    tokens: list[int], params: SamplingParams, eos_ids: Iterable[int], tokenizer: Any
) -> tuple[str, str]:
    """The output text of `tokens` (cut at a stop string) and why generation ended."""
    eos = set() if params.ignore_eos else set(eos_ids)
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else ""
    for s in params.stop:
        if s in text:
            return text[: text.index(s)], "stop"
    if tokens and tokens[-1] in eos:
        return text, "stop"
    if len(tokens) >= params.max_tokens:
        return text, "length"
    raise ConfigError("generation ended without a reason")  # pragma: no cover - invariant


def tokenize(
    prompts: list[Prompt], encode: Callable[[Prompt], list[int]]
) -> tuple[list[list[int]], list[float]]:
    """Each prompt's token ids by `encode`, and the seconds each took (`stats.tokenize_s`)."""
    encoded, seconds = [], []
    for p in prompts:
        t0 = time.perf_counter()
        encoded.append(encode(p))
        seconds.append(time.perf_counter() - t0)
    return encoded, seconds
