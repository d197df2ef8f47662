"""The per-sequence loop: chunked prefill through the KV store, then decode."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from kvtier.engine.outputs import GenerationStats, step_summary
from kvtier.kv.store import TieredKVStore
from kvtier.model.llama import CausalLM


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_spans(n: int, chunk_size: int, store: TieredKVStore) -> list[tuple[int, int]]:
    """The prefill steps of `n` prompt tokens: [start, end) chunks of at most `chunk_size`.

    A store kernel with `last_query_alone` (HiP) gets the last token as a step of its own, so its
    selection is made for that query alone (the first answer token comes from its logits).
    """
    # NOTE: a capability flag of the kernel; dense kernels lack it, and splitting would only
    # change their rounding.
    alone = n > 1 and bool(getattr(store.kernel, "last_query_alone", False))
    body = n - 1 if alone else n
    spans = [(s, min(s + chunk_size, body)) for s in range(0, body, chunk_size)]
    return [*spans, (body, n)] if alone else spans


def prefill(
    model: CausalLM,
    store: TieredKVStore,
    ids: torch.Tensor,
    chunk_size: int,
    progress: bool = False,
) -> torch.Tensor:
    """Run prompt ids [N] in `prefill_spans`; returns the last position's logits [vocab]."""
    n = ids.shape[0]
    spans = prefill_spans(n, chunk_size, store)
    none = torch.empty(0, dtype=torch.long, device=ids.device)
    bar = tqdm(
        total=n,
        unit="tok",
        unit_scale=True,
        desc="prefill",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    logits = torch.empty(0)
    with bar:
        for s, e in spans:
            part = ids[s:e]
            last = e == n
            store.begin_step(part.shape[0])
            logits = model(part, store, logits_at=None if last else none, mlp_chunk=chunk_size)
            store.end_step()
            if progress:
                _sync(ids.device)  # NOTE: only so the bar shows real progress
            bar.update(part.shape[0])
    return logits[-1]


def generate_tokens(
    model: CausalLM,
    store: TieredKVStore,
    ids: torch.Tensor,
    sampler: Callable[[torch.Tensor], torch.Tensor],
    max_tokens: int,
    chunk_size: int,
    should_stop: Callable[[list[int]], bool],
    progress: bool = False,
) -> tuple[list[int], GenerationStats]:
    """Prefill `ids` then decode up to `max_tokens` tokens until `should_stop(tokens)`;
    `sampler` (a `Sampler`, or one whose token all tensor-parallel ranks share) picks each token
    from the logits [vocab]."""
    device = ids.device
    stats = GenerationStats(prompt_tokens=ids.shape[0])
    _sync(device)
    t0 = time.perf_counter()
    logits = prefill(model, store, ids, chunk_size, progress)
    token = sampler(logits)
    out = [int(token)]  # host sync: ends the prefill timing honestly
    stats.prefill_s = time.perf_counter() - t0
    h2d_after_prefill = store.account.h2d_bytes
    t1 = time.perf_counter()
    ends = [t1]
    while len(out) < max_tokens and not should_stop(out):
        store.begin_step(1)
        logits = model(token.view(1), store)[-1]
        store.end_step()
        token = sampler(logits)
        out.append(int(token))  # host sync: ends the step
        ends.append(time.perf_counter())
    _sync(device)
    stats.decode_s = time.perf_counter() - t1 if len(out) > 1 else 0.0
    stats.decode_step_s = step_summary([b - a for a, b in itertools.pairwise(ends)])
    stats.generated_tokens = len(out)
    stats.h2d_bytes = store.account.h2d_bytes
    stats.d2h_bytes = store.account.d2h_bytes
    stats.decode_h2d_bytes = store.account.h2d_bytes - h2d_after_prefill
    return out, stats
