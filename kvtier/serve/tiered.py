"""A request served over its own tiered store, alongside the batch, on a CUDA stream of its own.

Two kinds of request run this way: one whose prompt + max_tokens needs more pages than the
whole page pool (its KV is planned like `kvtier generate` plans it: head/layer slices streamed
from the host tier, within the server's GPU budget minus the pool), and one that names a
method (`"method": "quest,kv_budget=1k"` in the body: any registered method, over the same
store `kvtier generate` uses). `kvtier.serve.store_plan` plans both; this module runs them.

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

The launcher can be paced (`PacedAttention`, `BatchConfig.tiered_lookahead_layers` > 0): it then
queues a layer only once the device has reached the layer a few before it. On the H200 that made
the short streams and the long run both slower (bench/results/serve_gpu_24gib_b7512d8.json, 4 layers,
beside serve_gpu_24gib_unpaced.json), so it is off by default.

A decode token's write-backs to the host tier are queued at the start of the run's next token
(`kvtier.kv.write_back`), not behind each layer: device-to-host copies run in the
order queued, across streams, so a write-back waiting for its layer held the batch's token
read-back up to 108 ms on the H200 (bench/results/serve_gpu_24gib_trace_b.json).

The launcher also builds the run's store and frees it: a 256K-token request pins ~34 GB of host
memory (14.1 s on the H200, `bench/results/serve_gpu_24gib_c8b4a00.json`), and freeing it had held the
loop 5.9 s at the run's end (`serve_gpu_24gib_716554e.json`); the server's runs now leave that
memory in PyTorch's pinned cache for the next one (`TieredKVStore.close(release_host=False)`).

On the CPU (no streams) a step runs when it is launched, in the engine's thread, so `ready` is
True at once (`BatchConfig.tiered_thread=True` runs it on the launcher thread there too).

    engine loop:  [batch step] [run A: collect, launch] [batch step] [run A: not ready] ...
    launcher A:                 [queue A's step ......]
"""

from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtier.engine.batch.sequence import Sequence
from kvtier.engine.runner import prefill_spans
from kvtier.errors import raised_at
from kvtier.kv.store import TieredKVStore
from kvtier.kv.tiers import TierAccount
from kvtier.planner.placement import KVPlan
from kvtier.serve.store_plan import OffloadHost, StoreMaker


def detached(error: BaseException) -> BaseException:
    """`error` without its traceback, whose frames hold the failed step's tensors (a partly built
    store, a layer's activations) and, through the run in them, the error itself: a cycle only
    the garbage collector frees, while the next request's plan needs that GPU memory free now.
    An out-of-memory error keeps kvtier's line that asked for the memory in its message (once:
    one raised again, from a frame of its own, is detached again)."""
    named = getattr(error, "_kvtier_site_named", False)
    site = raised_at(error) if isinstance(error, torch.OutOfMemoryError) and not named else ""
    if site and error.args and isinstance(error.args[0], str):
        error._kvtier_site_named = True  # type: ignore[attr-defined]
        first, _, rest = error.args[0].partition("\n")
        error.args = (f"{first} (at {site})" + (f"\n{rest}" if rest else ""), *error.args[1:])
    error.__context__ = error.__cause__ = None
    return error.with_traceback(None)


class PacedAttention:
    """A run's store as the model's attention (`kvtier.attention.Attention`), keeping the
    launcher thread at most `ahead` layers ahead of the device: before queuing layer l it waits
    (on the host, the launcher's thread only) until the device has reached layer l - ahead.

    Queued all at once, a 256K-token request's decode token is ~1,000 kernels and ~500 slice
    loads, ~0.8 s of device work; on the H200 the batch beside it lost ~0.47 s once per such
    token (`bench/results/serve_gpu_24gib_b7512d8.json`). Whatever makes a batch step wait for the work
    queued before it (an implicit device synchronization, a full launch queue), the wait is
    then at most `ahead` layers of the run, not a whole token. The launcher's host work per
    layer is far below the device's at such lengths, so the device never waits for it.
    """

    def __init__(self, store: TieredKVStore, stream: torch.cuda.Stream | None, ahead: int) -> None:
        self.store, self.stream, self.ahead = store, stream, ahead
        self._marks: deque[torch.cuda.Event] = deque()  # each queued layer's start, on `stream`

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.stream is not None and self.ahead > 0:
            mark = torch.cuda.Event()
            mark.record(self.stream)
            self._marks.append(mark)
            while len(self._marks) > self.ahead:
                self._marks.popleft().synchronize()  # NOTE: releases the GIL while it waits
        return self.store(layer, q, k, v)


class TieredRun:
    """`seq` over its own `TieredKVStore` (built by `plan_store`'s maker): `launch` queues one
    prefill chunk or decode token, `ready` says whether it has finished on the device,
    `collect` returns what it sampled, `close` frees the store. `threaded` (default: on CUDA):
    build the store, queue the steps and free the store on a launcher thread, in that order."""

    def __init__(
        self,
        engine: OffloadHost,
        seq: Sequence,
        plan: KVPlan,
        make_store: StoreMaker,
        threaded: bool | None = None,
        lookahead_layers: int = 0,
    ) -> None:
        self.seq, self.model, self.device = seq, engine.model, engine.device
        self.plan = plan
        self.store: TieredKVStore | None = None  # set by `_open` (on the launcher thread)
        self.account: TierAccount | None = None  # the store's byte counts, kept after `close`
        self.ids = torch.tensor(seq.prompt, dtype=torch.long, device=engine.device)  # [N]
        self.spans: list[tuple[int, int]] = []  # the prefill steps, once the store is built
        self.done_spans = 0
        self.token: torch.Tensor | None = None  # the last sampled token (0-d, on the device)
        # The run's own stream (default priority, below the batch's), ordered after the prompt's
        # copy on the engine's current stream (and, in `_open`, after the store's allocation).
        self.stream: torch.cuda.Stream | None = None
        if engine.device.type == "cuda":
            self.stream = torch.cuda.Stream(engine.device)
            self.stream.wait_stream(torch.cuda.current_stream(engine.device))
            if engine.stream is not None:  # NOTE: lent pages: after the batch's last use of them
                self.stream.wait_stream(engine.stream)
        self._done: torch.cuda.Event | None = None  # the launched step's end, on `stream`
        self._in_flight = False
        self._samples = False  # whether the launched step samples a token
        self._open_error: BaseException | None = None  # what building the store raised
        self._closed = False
        threaded = engine.device.type == "cuda" if threaded is None else threaded
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="kvtier-tiered") if threaded else None
        # NOTE: paced only on the launcher: its waits must never be the engine loop's
        self._ahead = lookahead_layers if threaded else 0
        self._attention: PacedAttention | None = None
        self._opening: Future[None] | None = None  # the store being built
        self._queued: Future[None] | None = None  # the launcher's current step
        if self._launcher is not None:
            self._opening = self._launcher.submit(self._open, make_store)
        else:
            self._open(make_store)

    def _open(self, make_store: StoreMaker) -> None:
        try:
            store, _ = make_store()
        except BaseException as e:  # NOTE: raised again by the first step's `collect`
            self._open_error = detached(e)
            return
        if self.stream is not None:  # NOTE: the store's buffers were allocated on this thread's stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.spans = prefill_spans(len(self.seq.prompt), self.plan.chunk_size, store)
        # NOTE: a step is launched only once the last one has finished on the device, so its
        # deferred write-backs queue no copy that waits: none holds up the batch's read-backs
        store.writes.defer = True
        self.account = store.account
        self._attention = PacedAttention(store, self.stream, self._ahead)
        self.store = store

    @property
    def opening(self) -> bool:
        """Whether its store is still being built (it then holds memory the budget does not
        show yet, so the engine starts no other run meanwhile)."""
        return self._opening is not None and not self._opening.done()

    @property
    def in_flight(self) -> bool:
        """Whether a step was launched and not collected yet."""
        return self._in_flight

    @property
    def h2d_bytes(self) -> int:
        """Bytes its store copied host-to-device so far."""
        return self.account.h2d_bytes if self.account is not None else 0

    @property
    def d2h_bytes(self) -> int:
        return self.account.d2h_bytes if self.account is not None else 0

    def ready(self) -> bool:
        """Whether the launched step has been queued and has finished on the device (no host
        blocking)."""
        if self._queued is not None and not self._queued.done():
            return False
        return self._done is None or self._done.query()

    def launch(self) -> None:
        """Queue the next step (a prefill chunk, or the decode token after the last sampled one)
        on the run's stream; returns without waiting for the device (with a launcher thread,
        without waiting for the store to be built or the step queued either)."""
        assert not self._closed, "the run was closed"
        assert not self._in_flight, "collect the launched step first"
        self._in_flight = True
        if self._launcher is not None:
            self._queued = self._launcher.submit(self._queue_step)
        else:
            self._queue_step()

    def _queue_step(self) -> None:
        error, self._open_error = self._open_error, None
        if error is not None:
            try:
                raise error
            finally:
                error = None  # NOTE: the traceback's frames must not hold what they raise
        store, attention = self.store, self._attention
        assert store is not None and attention is not None
        on = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with on:
            if self.done_spans < len(self.spans):
                s, e = self.spans[self.done_spans]
                last = e == len(self.seq.prompt)
                none = torch.empty(0, dtype=torch.long, device=self.device)
                store.begin_step(e - s)
                at = None if last else none
                logits = self.model(self.ids[s:e], attention, logits_at=at, mlp_chunk=e - s)
                store.end_step()
                self.done_spans += 1
                self._samples = last
            else:
                assert self.token is not None
                store.begin_step(1)
                logits = self.model(self.token.view(1), attention)
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
        Call once `ready()`; it then never waits. Raises what building the store or queuing
        the step raised."""
        assert self._in_flight, "nothing was launched"
        self._in_flight = False
        queued, self._queued = self._queued, None
        self._done = None
        error = None if queued is None else queued.exception()
        queued = None
        if error is not None:
            try:
                raise detached(error)
            finally:
                error = None  # NOTE: no frame of this traceback holds the exception
        if not self._samples:
            return None
        assert self.token is not None
        return int(self.token)

    def close(self, wait: bool = True) -> Future[None] | None:
        """Free the store (its GPU buffers and pinned host memory) once its queued work is done;
        `account` keeps its PCIe byte counts. With a launcher thread and `wait=False` the
        launcher frees it (after any step it is queuing) and the returned future completes
        then; the GPU memory stays allocated until it does."""
        if self._closed:
            return None
        self._closed = True
        self._queued = None  # NOTE: a failed step's future holds its error, whose frames hold this run
        launcher, self._launcher = self._launcher, None
        if launcher is None:
            self._free()
            return None
        freed = launcher.submit(self._free)
        launcher.shutdown(wait=wait)
        return None if wait else freed

    def _free(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            if self.stream is not None:
                self.stream.synchronize()  # NOTE: a launched step may still read the store
            store.close(release_host=False)  # NOTE: the next long request reuses its pinned memory
