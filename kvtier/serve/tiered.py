"""A request served over its own tiered store, alongside the batch, on a CUDA stream of its own.

Two kinds of request run this way: one whose prompt + max_tokens needs more pages than the
whole page pool (its KV is planned like `kvtier generate` plans it: head/layer slices streamed
from the host tier, within the server's GPU budget minus the pool), and one that names a
method (`"method": "quest,kv_budget=1k"` in the body: any registered method, over the same
store `kvtier generate` uses).

On CUDA a run's steps (one prefill chunk, or one decode token) are queued on a stream of their
own, at a lower priority than the batch's, and the engine loop never waits for them: it queues
a step (`launch`), goes on with batch steps, and collects the sampled token once the step's
event has completed (`ready`, `collect`). The run's PCIe streaming and compute thus overlap the
batch's steps, and the GPU gives the batch's kernels precedence:

    batch stream (high priority):  [step][step][step][step][step][step][step] ...
    run stream (low priority):       [  chunk / token of the long request  ]  [  next  ] ...
    h2d copy stream:                 [ slice loads, ordered by events only ]

On the CPU (no streams) a step runs when it is launched, so `ready` is True at once.

    engine loop:  [batch step] [run A: collect, launch] [batch step] [run A: not ready] ...
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import replace
from typing import Protocol

import torch

from kvtier.engine.batch.sequence import Sequence
from kvtier.engine.llm import LLM
from kvtier.engine.runner import prefill_spans
from kvtier.kv.store import TieredKVStore
from kvtier.methods import MethodChoice, plan_for
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import KVPlan


class OffloadHost(Protocol):
    """What a tiered run needs of the serving engine (`ServeEngine` is one)."""

    llm: LLM
    model: CausalLM
    device: torch.device
    eos: frozenset[int]
    tokenizer_lock: threading.Lock
    pool_tokens: int
    paged: bool  # whether requests can run over the page pool at all (plain scores)

    def offload_gpu_budget(self) -> int | None: ...


def run_method(engine: OffloadHost, seq: Sequence) -> MethodChoice:
    """The method `seq` runs with: its own (`seq.method`) or the server's, placed by the planner
    ("head" on the CPU for a request too long for the pool, so its KV really streams there too;
    one that only needs a store the pool cannot be, such as a soft-capped model's, stays "auto")."""
    if seq.method is not None:
        return seq.method
    too_long = engine.paged and len(seq.prompt) + seq.params.max_tokens > engine.pool_tokens
    # NOTE: on the CPU "auto" would keep it resident
    return replace(engine.llm.method, kv="head" if too_long and engine.device.type != "cuda" else "auto")


def plan_store(engine: OffloadHost, seq: Sequence) -> tuple[KVPlan, TieredKVStore, str]:
    """`seq`'s placement under its method (`run_method`), planned within what the server's GPU
    budget leaves now, a fresh store for it, and the method's description. Raises
    `CapacityError` when it fits nowhere."""
    llm = engine.llm
    method = run_method(engine, seq)
    context = len(seq.prompt) + seq.params.max_tokens
    inputs = replace(llm.plan_inputs(context, method), gpu_budget=engine.offload_gpu_budget())
    placement = plan_for(inputs, method)
    store, parts = llm.make_store(placement.plan, context, placement.cache_tokens, method)
    return placement.plan, store, parts.describe


class TieredRun:
    """`seq` over its own `TieredKVStore` (from `plan_store`): `launch` queues one prefill chunk
    or decode token, `ready` says whether it has finished on the device, `collect` returns what
    it sampled."""

    def __init__(self, engine: OffloadHost, seq: Sequence, plan: KVPlan, store: TieredKVStore) -> None:
        self.seq, self.model, self.device = seq, engine.model, engine.device
        self.plan = plan
        self.store: TieredKVStore | None = store
        self.ids = torch.tensor(seq.prompt, dtype=torch.long, device=engine.device)  # [N]
        self.spans = prefill_spans(len(seq.prompt), self.plan.chunk_size, store)
        self.done_spans = 0
        self.token: torch.Tensor | None = None  # the last sampled token (0-d, on the device)
        self.h2d_bytes = self.d2h_bytes = 0  # what its store moved over PCIe (set by `close`)
        # The run's own stream (default priority, below the batch's), ordered after the store's
        # allocation and the prompt's copy on the engine's current stream.
        self.stream: torch.cuda.Stream | None = None
        if engine.device.type == "cuda":
            self.stream = torch.cuda.Stream(engine.device)
            self.stream.wait_stream(torch.cuda.current_stream(engine.device))
        self._done: torch.cuda.Event | None = None  # the launched step's end, on `stream`
        self._in_flight = False
        self._samples = False  # whether the launched step samples a token

    @property
    def prefilling(self) -> bool:
        return self.done_spans < len(self.spans)

    @property
    def in_flight(self) -> bool:
        """Whether a step was launched and not collected yet."""
        return self._in_flight

    def ready(self) -> bool:
        """Whether the launched step has finished on the device (no host blocking)."""
        return self._done is None or self._done.query()

    def launch(self) -> None:
        """Queue the next step (a prefill chunk, or the decode token after the last sampled one)
        on the run's stream; returns without waiting for the device."""
        store = self.store
        assert store is not None, "the run was closed"
        assert not self._in_flight, "collect the launched step first"
        on = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with on:
            if self.prefilling:
                s, e = self.spans[self.done_spans]
                last = e == len(self.seq.prompt)
                none = torch.empty(0, dtype=torch.long, device=self.device)
                store.begin_step(e - s)
                logits = self.model(self.ids[s:e], store, logits_at=None if last else none, mlp_chunk=e - s)
                store.end_step()
                self.done_spans += 1
                self._samples = last
            else:
                assert self.token is not None
                store.begin_step(1)
                logits = self.model(self.token.view(1), store)
                store.end_step()
                self._samples = True
            if self._samples:
                self.token = self.seq.sampler(logits[-1])
            if self.stream is not None:
                self._done = torch.cuda.Event()
                self._done.record(self.stream)
        self._in_flight = True

    def collect(self) -> int | None:
        """The token the launched step sampled (None after a prefill chunk that samples none).
        Call once `ready()`; it then never waits."""
        assert self._in_flight, "nothing was launched"
        self._in_flight = False
        self._done = None
        if not self._samples:
            return None
        assert self.token is not None
        return int(self.token)

    def close(self) -> None:
        """Free the store (its GPU buffers and pinned host memory) once its queued work is done;
        keep its PCIe byte counts."""
        if self.store is not None:
            if self.stream is not None:
                self.stream.synchronize()  # NOTE: a launched step may still read the store
            self.h2d_bytes, self.d2h_bytes = self.store.account.h2d_bytes, self.store.account.d2h_bytes
            self.store.close()
            self.store = None
