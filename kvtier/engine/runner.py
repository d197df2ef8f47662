"""The per-sequence loop: chunked prefill through the KV store, then decode."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from tqdm import tqdm

from kvtier.engine.layer_prefill import prefill_by_layer
from kvtier.engine.outputs import GenerationStats, step_summary
from kvtier.engine.step_probe import StepProbe
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


class StepClock:
    """Seconds of consecutive steps without a host sync between them: CUDA events recorded on
    the current stream (read once the work is done), or the wall clock off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[torch.cuda.Event | float] = []

    def mark(self) -> None:
        """The end of a step (the first mark: the start of the first)."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Each step's seconds (4 decimals). On CUDA, only once the marked work has finished."""
        out = []
        for a, b in itertools.pairwise(self._marks):
            if isinstance(a, torch.cuda.Event) and isinstance(b, torch.cuda.Event):
                out.append(round(a.elapsed_time(b) / 1e3, 4))
            elif isinstance(a, float) and isinstance(b, float):
                out.append(round(b - a, 4))
        return out


class Prefilled(NamedTuple):
    """What `prefill` returns: the last position's logits [vocab], and whether the chunks ran
    layer by layer."""

    logits: torch.Tensor
    by_layer: bool


def prefill(
    model: CausalLM,
    store: TieredKVStore,
    ids: torch.Tensor,
    chunk_size: int,
    progress: bool = False,
    clock: StepClock | None = None,
    by_layer: bool = False,
) -> Prefilled:
    """Run prompt ids [N] in `prefill_spans`. `clock`: marked before the first step and after
    each (no host sync). `by_layer`: the chunks run as one step taken layer by layer where the
    store can (`kvtier.engine.layer_prefill`; the clock then marks each layer), a last token
    alone (HiP's) as a step of its own after it."""
    n = ids.shape[0]
    spans = prefill_spans(n, chunk_size, store)
    # NOTE: a last token alone stays out of the pass: HiP makes a layer's decode caches at it,
    # which its plan counts in place of a chunk's activations, never beside them. Inside the
    # pass, layers 0..i's caches sat beside layer i + 1's 15K-token chunks and took Llama-3-8B
    # at 512K past 24 GiB (OOM at layer 6 on an H100); out of it, its slices load once more.
    passed = spans[:-1] if spans[-1][1] - spans[-1][0] == 1 else spans
    layered = by_layer and len(passed) > 1 and store.layer_pass_fits(passed[-1][1])
    rest = spans[len(passed) :] if layered else spans
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
    if clock is not None:
        clock.mark()

    def done() -> None:
        if clock is not None:
            clock.mark()
        if progress:
            _sync(ids.device)  # NOTE: only so the bar shows real progress

    with bar:
        if layered:
            m = passed[-1][1]
            logits = prefill_by_layer(
                model, store, ids[:m], passed, chunk_size, progress=bar.update, layer_done=done
            )
        for s, e in rest:
            part = ids[s:e]
            last = e == n
            store.begin_step(part.shape[0])
            logits = model(part, store, logits_at=None if last else none, mlp_chunk=chunk_size)
            store.end_step()
            done()
            bar.update(part.shape[0])
    return Prefilled(logits[-1], layered)


def generate_tokens(
    model: CausalLM,
    store: TieredKVStore,
    ids: torch.Tensor,
    sampler: Callable[[torch.Tensor], torch.Tensor],
    max_tokens: int,
    chunk_size: int,
    should_stop: Callable[[list[int]], bool],
    progress: bool = False,
    by_layer: bool = False,
) -> tuple[list[int], GenerationStats]:
    """Prefill `ids` then decode up to `max_tokens` tokens until `should_stop(tokens)`;
    `sampler` (a `Sampler`, or one whose token all tensor-parallel ranks share) picks each token
    from the logits [vocab]. `by_layer`: as `prefill`'s (`stats.prefill_order` says which ran)."""
    device = ids.device
    stats = GenerationStats(prompt_tokens=ids.shape[0])
    _sync(device)
    t0 = time.perf_counter()
    clock = StepClock(device)
    logits, layered = prefill(model, store, ids, chunk_size, progress, clock, by_layer)
    stats.prefill_order = "layer" if layered else "chunk"
    token = sampler(logits)
    out = [int(token)]  # host sync: ends the prefill timing honestly
    stats.prefill_s = time.perf_counter() - t0
    stats.prefill_step_s = clock.seconds()
    h2d_after_prefill = store.account.h2d_bytes
    probe = StepProbe(store.account, device)
    t1 = time.perf_counter()
    ends = [t1]
    try:
        while len(out) < max_tokens and not should_stop(out):
            store.begin_step(1)
            logits = model(token.view(1), store)[-1]
            store.end_step()
            token = sampler(logits)
            out.append(int(token))  # host sync: ends the step
            ends.append(time.perf_counter())
            probe.step()
        _sync(device)
    finally:
        probe.close()
    stats.decode_s = time.perf_counter() - t1 if len(out) > 1 else 0.0
    steps = [b - a for a, b in itertools.pairwise(ends)]
    stats.decode_step_s = step_summary(steps)
    stats.decode_step_times_s = [round(t, 4) for t in steps]
    stats.decode_step_h2d_bytes = probe.step_h2d_bytes
    stats.decode_gc = probe.gc_summary()
    stats.decode_allocator = probe.allocator
    stats.generated_tokens = len(out)
    stats.h2d_bytes = store.account.h2d_bytes
    stats.d2h_bytes = store.account.d2h_bytes
    stats.decode_h2d_bytes = store.account.h2d_bytes - h2d_after_prefill
    return out, stats
