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
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

import torch

from kvtier.engine.batch.sequence import Sequence
from kvtier.engine.llm import LLM
from kvtier.engine.runner import prefill_spans
from kvtier.errors import CapacityError, raised_at
from kvtier.kv.device_memory import CachingMemory, RegionMemory, fitting, region_buffers
from kvtier.kv.hooks import packing_codec
from kvtier.kv.layout import KVLayout
from kvtier.kv.paged import PagedKVStore
from kvtier.kv.store import TieredKVStore
from kvtier.kv.tiers import TierAccount
from kvtier.methods import MethodChoice, plan_for
from kvtier.methods.registry import Placement
from kvtier.model.llama import CausalLM
from kvtier.planner.memory import GPU_RESERVE_BYTES, activation_bytes, weight_bytes
from kvtier.planner.placement import KVPlan
from kvtier.sparse import SMALL_CACHE_TOKEN_STEPS


class OffloadHost(Protocol):
    """What a tiered run needs of the serving engine (`ServeEngine` is one)."""

    llm: LLM
    model: CausalLM
    device: torch.device
    eos: frozenset[int]
    tokenizer_lock: threading.Lock
    pool_tokens: int
    paged: bool  # whether requests can run over the page pool at all (plain scores)
    store: PagedKVStore  # the page pool's tensors
    stream: torch.cuda.Stream | None  # the batch's stream (CUDA)

    @property
    def page_bytes(self) -> int:
        """Device bytes of one page (every layer)."""
        ...

    def offload_gpu_budget(self) -> int | None: ...

    def lendable_pages(self, keep_batch: bool = True) -> int:
        """Pages a tiered run may borrow now (0: none); `keep_batch` False: without the pages
        kept for the batch's future sequences (`ServeConfig.tiered_keep_tokens`)."""
        ...

    def lend(self, count: int) -> int | None:
        """Lend a run of `count` consecutive pages; its first id (None: no such run now)."""
        ...


def run_method(engine: OffloadHost, seq: Sequence) -> MethodChoice:
    """The method `seq` runs with: its own (`seq.method`) or the server's, placed by the planner
    ("head" on the CPU for a request too long for the pool, so its KV really streams there too;
    one that only needs a store the pool cannot be, such as a soft-capped model's, stays "auto")."""
    if seq.method is not None:
        return seq.method
    too_long = engine.paged and len(seq.prompt) + seq.params.max_tokens > engine.pool_tokens
    # NOTE: on the CPU "auto" would keep it resident
    return replace(engine.llm.method, kv="head" if too_long and engine.device.type != "cuda" else "auto")


StoreMaker = Callable[[], tuple[TieredKVStore, str]]
"""Builds a request's store (allocating its tiers) and returns it with its method's description."""

REPLANS = 8  # plans tried over lent pages (each well under a millisecond)
log = logging.getLogger("kvtier.serve")  # each placed request (`kvtier serve` prints it)


def plan_store(engine: OffloadHost, seq: Sequence) -> tuple[KVPlan, StoreMaker, int | None]:
    """`seq`'s placement under its method (`run_method`), planned within what the server's GPU
    budget leaves now, a function that builds its store (slow for a long request's pinned host
    memory, so a `TieredRun` calls it on its launcher thread), and the first page of the run of
    pool pages its buffers live in (None: it has none).

    A lossless request, or one whose method `borrows_pages` (every registered one does), over a model
    the pool serves borrows pages (`OffloadHost.lendable_pages`):
    it is planned with their bytes added to its budget, and its whole-capacity resident slices
    and staging buffers are carved from one run of them (`kvtier.kv.device_memory`; those that
    do not fit spill to the caching allocator), and after them its method's decode caches
    (`Placement.method_buffers`: HiP's block caches, Quest's page bounds), taken here, on the
    engine's thread; the engine takes the run back once the store is freed. Raises
    `CapacityError` when it fits nowhere."""
    llm = engine.llm
    method = run_method(engine, seq)
    context = len(seq.prompt) + seq.params.max_tokens
    base = llm.plan_inputs(context, method, seq.params.max_tokens)
    cfg = llm.model_config
    borrows = all(e.borrows_pages for e in method.selected())  # lossless: none selected
    lends = engine.paged and borrows  # NOTE: a windowed layer's slices stay with the allocator
    if lends:  # staging carved from lent pages stays put in decode: no bytes to plan on
        base = replace(base, staging_freed_in_decode=False)
    packing = packing_codec(method.codec()) is not None  # its resident slices stay packed
    page_bytes = engine.page_bytes

    budget = engine.offload_gpu_budget()  # None: unlimited (the CPU)

    def planned(extra: int, chunk: int | None) -> Placement:
        lent_budget = None if budget is None else budget + extra
        return plan_for(replace(base, gpu_budget=lent_budget, chunk_size=chunk), method)

    def estimate(placed: Placement) -> int:  # GPU bytes besides the weights, as the planner counts them
        plan = placed.plan
        act = activation_bytes(
            cfg, plan.chunk_size, base.dtype_bytes, group_size=plan.group_size, context=context
        )
        return act + plan.gpu_kv_bytes + placed.reserve_bytes  # HiP's caches, Quest's page bounds

    # What the reserve can hold beside the weights (the planner's own terms; None: unlimited).
    # A plan over lent pages may put there no more than that: its activations and the buffers
    # that do not fit the lent run (they spill to the caching allocator, `RegionMemory`). The
    # planner spends all the bytes it is given (more resident slices), and buffers fill the
    # run only in whole buffers, so the bytes added to its budget (`extra`) shrink by what a
    # trial puts over the reserve until one fits, while the run offered stays the same. It keeps
    # the chunk the reserve alone gives it, when the request fits the reserve alone at all;
    # lent pages may also be what makes it fit.
    room = None if budget is None else budget - weight_bytes(cfg, base.dtype_bytes) - GPU_RESERVE_BYTES

    alone: Placement | None = None  # over the reserve alone
    short: CapacityError | None = None  # what the planner said of the reserve alone
    try:
        alone = planned(0, base.chunk_size)
    except CapacityError as e:
        short = e
    chunk = base.chunk_size if alone is None else alone.plan.chunk_size

    def over_pages(offer: int) -> tuple[Placement, int] | None:
        """The placement over the reserve and up to `offer` lent pages, with the pages its
        buffers take (None: no such plan keeps the rest within the reserve). Lends nothing."""
        extra, shrink, last = offer * page_bytes, 0, None
        for _ in range(REPLANS if offer else 0):
            try:
                trial = planned(extra, chunk)
            except CapacityError:
                return None
            layout = KVLayout.of(cfg, trial.plan.group_size, llm.config.block_size, llm.dtype)
            buffers = region_buffers(layout, trial.plan, context, trial.plan.window_slices, packing=packing)
            buffers += list(trial.method_buffers)
            used = fitting(buffers, offer * page_bytes)
            over = 0 if room is None else estimate(trial) - used - room
            if used and over <= 0:
                return trial, -(-used // page_bytes)
            # NOTE: plans are discrete: taking `over` off `extra` can leave the same plan (the
            # planner had that much slack), and the same `over`, trial after trial. Then the
            # step doubles.
            same = (trial.plan, trial.reserve_bytes) == last
            shrink = 2 * shrink if same else max(over, page_bytes)
            extra -= shrink
            last = (trial.plan, trial.reserve_bytes)
            if extra <= 0:
                return None
        return None

    def stopgap(p: Placement | None) -> bool:  # a block cache below the steps: misses each step
        return p is not None and p.cache_tokens in SMALL_CACHE_TOKEN_STEPS

    # NOTE: first within what the batch keeps for its future sequences. A request that fits
    # nowhere then, or only with a stopgap (HiP's decode memory beside an 8B model's pool under
    # 24 GiB, which keeps it all), may borrow the pages free now that the keep withheld, up to
    # the share.
    offer = engine.lendable_pages() if lends else 0
    paged = over_pages(offer)
    if (paged is None or stopgap(paged[0])) and (alone is None or stopgap(alone)) and lends:
        wider = engine.lendable_pages(keep_batch=False)
        if wider > offer:
            offer, more = wider, over_pages(wider)
            if more is not None and (paged is None or not stopgap(more[0])):
                paged = more
    placement, first, lent = alone, None, 0
    # pages when they fit, unless they only give a stopgap where the reserve alone does not
    if paged is not None and (alone is None or stopgap(paged[0]) <= stopgap(alone)):
        first = engine.lend(paged[1])
        if first is not None:
            placement, lent = paged
    if placement is None:
        if not offer:
            raise CapacityError(
                f"a {context:,}-token request does not fit the GPU memory left for requests over "
                "stores of their own (raise --offload-reserve or --gpu-memory) and the pool has no "
                f"pages to lend it now: {short}"
            )
        said = "" if short is None else f" (the reserve alone: {short})"
        raise CapacityError(
            f"a {context:,}-token request fits neither the GPU memory left for requests over "
            f"stores of their own nor that and the {offer:,} pool pages it may borrow now "
            f"({offer * page_bytes / 1e9:.2f} GB){said}; raise --offload-reserve (by default a "
            "quarter of the pool's room, at most 4 GiB) or --tiered-share, or run it alone with "
            "`kvtier generate`"
        )

    plan = placement.plan
    named = ", ".join(e.name for e in method.selected()) or "lossless"
    note = (
        f"a {context:,}-token request, {named}: kv={plan.policy}, "
        f"{plan.group_size} KV head{'s' * (plan.group_size > 1)} a slice, {plan.resident_slices} of "
        f"{plan.num_slices} slices "
        f"resident, chunk {plan.chunk_size}" + (f", {lent} pool pages borrowed" if lent else "")
    )
    if stopgap(placement):
        log.warning(
            f"{note}; its HiP block cache is a {placement.cache_tokens}-token stopgap: a decode "
            "step that reruns a stage looks its blocks up and fetches what it misses from the "
            "host, a sync a slice, so decode is bound by host work (it may be slower than "
            "lossless); a larger --offload-reserve gives it a whole cache and wider slices"
        )
    else:
        log.info(note)

    def make() -> tuple[TieredKVStore, str]:
        region = None if first is None else engine.store.page_run(first, lent)
        memory = None if region is None else RegionMemory(region, spill=CachingMemory(engine.device))
        store, parts = llm.make_store(placement.plan, context, placement.cache_tokens, method, memory=memory)
        return store, parts.describe

    return placement.plan, make, first


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
