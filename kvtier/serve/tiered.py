"""A request served over its own tiered store, alongside the batch, on a CUDA stream of its own.

Two kinds of request run this way: one whose prompt + max_tokens needs more pages than the
whole page pool (its KV is planned like `kvtier generate` plans it: head/layer slices streamed
from the host tier, within the server's GPU budget minus the pool), and one that names a
method (`"method": "quest,kv_budget=1k"` in the body: any registered method, over the same
store `kvtier generate` uses).

On CUDA a run's steps (one prefill chunk, or one decode token) are queued on a stream of their
own, at a lower priority than the batch's, and the engine loop never waits for them: it hands
a step to the run's launcher thread (`launch`), goes on with batch steps, and collects the
sampled token once the launcher is done and the step's event has completed (`ready`,
`collect`). The run's PCIe streaming and compute thus overlap the batch's steps, and the GPU
gives the batch's kernels precedence:

    batch stream (high priority):  [step][step][step][step][step][step][step] ...
    run stream (low priority):       [  chunk / token of the long request  ]  [  next  ] ...
    h2d copy stream:                 [ slice loads, ordered by events only ]

The launcher thread is there because queuing a step can itself block: on the H200 the call
that queued a 256K-token request's decode token held the engine loop up to 4.7 s, and 32 short
streams beside it ran 9x slower. The likely cause: such a token queues ~500 slice loads and
~1,000 kernels, more than CUDA's launch queues hold, so the host waits inside a launch until
the device drains them. The thread blocks instead of the loop; torch and Triton release the
GIL while they wait.

On the CPU (no streams) a step runs when it is launched, in the engine's thread, so `ready` is
True at once (`BatchConfig.tiered_thread=True` runs it on the launcher thread there too).

    engine loop:  [batch step] [run A: collect, launch] [batch step] [run A: not ready] ...
    launcher A:                 [queue A's step ......]
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
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
    it sampled. `threaded` (default: on CUDA): queue the steps from a launcher thread."""

    def __init__(
        self,
        engine: OffloadHost,
        seq: Sequence,
        plan: KVPlan,
        store: TieredKVStore,
        threaded: bool | None = None,
    ) -> None:
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
        threaded = engine.device.type == "cuda" if threaded is None else threaded
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="kvtier-tiered") if threaded else None
        self._queued: Future[None] | None = None  # the launcher's current step

    @property
    def prefilling(self) -> bool:
        return self.done_spans < len(self.spans)

    @property
    def in_flight(self) -> bool:
        """Whether a step was launched and not collected yet."""
        return self._in_flight

    def ready(self) -> bool:
        """Whether the launched step has been queued and has finished on the device (no host
        blocking)."""
        if self._queued is not None and not self._queued.done():
            return False
        return self._done is None or self._done.query()

    def launch(self) -> None:
        """Queue the next step (a prefill chunk, or the decode token after the last sampled one)
        on the run's stream; returns without waiting for the device (with a launcher thread,
        without waiting for the queuing either)."""
        assert self.store is not None, "the run was closed"
        assert not self._in_flight, "collect the launched step first"
        self._in_flight = True
        if self._launcher is not None:
            self._queued = self._launcher.submit(self._queue_step)
        else:
            self._queue_step()

    def _queue_step(self) -> None:
        store = self.store
        assert store is not None
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
                done = torch.cuda.Event()
                done.record(self.stream)
                self._done = done

    def collect(self) -> int | None:
        """The token the launched step sampled (None after a prefill chunk that samples none).
        Call once `ready()`; it then never waits. Raises what queuing the step raised."""
        assert self._in_flight, "nothing was launched"
        self._in_flight = False
        queued, self._queued = self._queued, None
        self._done = None
        if queued is not None:
            queued.result()
        if not self._samples:
            return None
        assert self.token is not None
        return int(self.token)

    def close(self) -> None:
        """Free the store (its GPU buffers and pinned host memory) once its queued work is done;
        keep its PCIe byte counts."""
        if self._launcher is not None:
            self._launcher.shutdown(wait=True)  # NOTE: a step being queued still uses the store
            self._launcher = None
        if self.store is not None:
            if self.stream is not None:
                self.stream.synchronize()  # NOTE: a launched step may still read the store
            self.h2d_bytes, self.d2h_bytes = self.store.account.h2d_bytes, self.store.account.d2h_bytes
            self.store.close()
            self.store = None
