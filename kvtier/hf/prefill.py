"""Chunked prefill into a `TieredCache` through plain `model(...)` calls.

`model.generate` runs the whole prompt as one forward unless its `prefill_chunk_size` option is
set; a forward of a 128K prompt materializes activations of 128K tokens at every layer (the MLP's
[T, intermediate] alone is GBs), which the planner's budget does not allow for. This helper
feeds the prompt in chunks of the plan's size; `generate` then runs only the last prompt token.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.hf.cache import TieredCache


def cache_keyword(model: Any) -> str:
    """The name `model.forward` takes its cache by: `cache` from transformers 5.2x on (the old
    `past_key_values` is deprecated there), `past_key_values` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.inference_mode()
def prefill_in_chunks(
    model: Any, cache: TieredCache, input_ids: torch.Tensor, chunk_size: int | None = None
) -> int:
    """Run all prompt tokens but the last, input_ids [1, N], into `cache`, `chunk_size` tokens
    per forward (default: the cache's planned chunk). Returns how many tokens it ran (N - 1 minus
    those already cached).

    Then `model.generate(input_ids, past_key_values=cache, ...)` (the same, full input_ids) runs
    the last token and decodes. Tokens already in the cache (a previous turn) are skipped.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ConfigError(f"input_ids must be [1, N] (one sequence), got shape {list(input_ids.shape)}")
    chunk = chunk_size if chunk_size is not None else cache.plan.chunk_size
    if chunk < 1:
        raise ConfigError(f"chunk_size must be at least 1, got {chunk}")
    start, end = cache.get_seq_length(), input_ids.shape[1] - 1
    key = cache_keyword(model)
    for s in range(start, end, chunk):
        part = input_ids[:, s : min(s + chunk, end)]
        model(input_ids=part, use_cache=True, logits_to_keep=1, **{key: cache})
    return max(0, end - start)
