"""`ServeEngine`: `kvtier serve`'s engine, the continuous-batching `BatchEngine` in a background
thread, plus tiered runs and shutdown.

Callers (HTTP handlers, tests, the benchmark) talk to it through thread-safe methods only:
`submit` a tokenized request with a `sink` that receives `Delta`s, `abort` it, `reset_prefix_cache`.
Everything else (scheduler, pages, model) is touched by the engine thread alone, or, without a
thread, by whoever calls `step()` / `run_until_idle()`.

A request that names a method of its own is planned for (`kvtier.serve.store_plan.plan_store`)
within the server's GPU budget minus the pool, exactly like `kvtier generate` plans it. When its
store fits wholly in device memory it joins the batch: the batch's forward attends it next to
the pages (`kvtier.kv.batch_step.MixedStep`). When it streams from the host tier, as does a
request too long for the pool, it is a tiered run: the engine thread queues its steps (a
prefill chunk or a decode token) on a CUDA stream of the run's own, below the batch's priority,
and collects their tokens between batch steps once done, so the batch never waits for a run's
PCIe streaming. What such requests get of the engine (the GPU budget, lent pool pages and their
compaction) is its base, `kvtier.serve.offload_host.OffloadEngine`.
"""

from __future__ import annotations

import contextlib
import gc
import queue
import threading
import time
from collections import deque
from typing import Any

import torch

from kvtier.engine.batch.config import BatchConfig
from kvtier.engine.batch.sequence import OwnStore, Sequence, Sink, Status
from kvtier.engine.llm import LLM
from kvtier.engine.runner import prefill_spans
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.warmup import KernelWarmup
from kvtier.errors import CapacityError, KvtierError, PromptError
from kvtier.methods import MethodChoice
from kvtier.serve.offload_host import OffloadEngine
from kvtier.serve.store_plan import plan_store
from kvtier.serve.tiered import TieredRun

MAX_TIERED_RUNS = 4  # tiered runs advanced together; more wait for one to finish
IDLE_POLL_S = 0.0005  # sleep between polls of tiered runs' steps when the batch is idle
SHUTTING_DOWN = "the server is shutting down; send the request again once it is back (or to another server)"

ServeConfig = BatchConfig
"""The server's pool and batch sizes (`kvtier serve`'s --page-size, --num-pages, ... flags)."""


class EngineClosed(KvtierError):
    """The engine is shutting down and takes no new requests."""


class ServeEngine(OffloadEngine):
    """A loaded `LLM` served with paged KV, prefix caching and continuous batching."""

    def __init__(self, llm: LLM, config: BatchConfig | None = None) -> None:
        super().__init__(llm, config)
        self._tiered_wait: deque[Sequence] = deque()  # requests for tiered runs, not started yet
        self.offloaded = 0  # tiered runs finished
        self.cache_releases = 0  # `_release_cached_blocks` calls
        self.own_store_requests = 0  # requests whose own store joined the batch's forward
        self.exact_lossless_requests = 0  # lossy requests that ran lossless (`submit`)
        self._count_lock = threading.Lock()  # counters `submit` updates from callers' threads
        self._compacted_for: Sequence | None = None  # the waiting request it last compacted for
        self.tiered_h2d_bytes = self.tiered_d2h_bytes = 0  # PCIe bytes of finished tiered runs
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._by_id: dict[str, Sequence] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closing = threading.Event()  # set by begin_shutdown: no new requests
        # The GPU libraries' first calls now, not in the first request's prefill: its {"seconds"},
        # {} where none ran (kvtier.engine.warmup: KVTIER_WARMUP off, off CUDA, done already).
        warm = KernelWarmup().start(llm.loaded.model, self.device, ranked=llm.parallel is not None)
        self.warmup = warm.join()
        # Every decode graph now, not at a request's first step of each batch size.
        self.graphs_at_start = 0
        if self.decoder is not None:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                self.graphs_at_start = self.decoder.capture_all()
        # What is allocated while no request holds a store (`held_by_stores`).
        cuda = self.device.type == "cuda"
        self._idle_allocated = int(torch.cuda.memory_allocated(self.device)) if cuda else 0

    # -- thread-safe API -----------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int] | None, messages: list[dict[str, str]] | None) -> list[int]:
        """Token ids of a completion prompt or of chat messages (with the model's chat template)."""
        tok = self.llm.tokenizer
        with self.tokenizer_lock:
            if messages is None:
                assert prompt is not None
                return self.llm.encode(prompt)
            if tok is None or not getattr(tok, "chat_template", None):
                raise PromptError(f"model {self.llm.loaded.name!r} has no chat template; use /v1/completions")
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.llm.encode(list(tok(text, add_special_tokens=False)["input_ids"]))

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        sink: Sink,
        cache_salt: str | None = None,
        method: MethodChoice | None = None,
    ) -> str:
        """Queue a request; `sink` gets its `Delta`s from the engine thread. Returns its id.

        `method`: a method of its own (any registered one, or a placement): the request is then
        served over a tiered store (`kvtier.serve.tiered`), unless the method drops nothing at
        the request's length (`LLM.exact_note`: HiP below its budgets), which then runs
        lossless, in the batch when it names no placement. Raises EngineClosed once
        `begin_shutdown` was called."""
        if self._closing.is_set():
            raise EngineClosed(SHUTTING_DOWN)
        if method is not None and self.llm.exact_note(method, len(prompt) + params.max_tokens) is not None:
            method = method.lossless_twin
            method = None if method == MethodChoice() else method
            with self._count_lock:
                self.exact_lossless_requests += 1
        seq = self.make_sequence(prompt, params, sink, cache_salt, method)
        tiered = method is not None or self.needs_offload(prompt, params)
        self._inbox.put(("tiered" if tiered else "add", seq))
        return seq.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request (e.g. its client went away) and free its pages. No-op if finished."""
        self._inbox.put(("abort", request_id))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (device and host) at the next step boundary."""
        self._inbox.put(("reset", None))

    @property
    def closing(self) -> bool:
        """Whether `begin_shutdown` was called (new requests are refused)."""
        return self._closing.is_set()

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort every queued and running one at the next step boundary
        (an offloaded one at its next token): each gets a last `Delta` with finish_reason
        "abort" and `error` = SHUTTING_DOWN, and its pages are freed. Thread-safe, idempotent."""
        self._closing.set()
        self._inbox.put(("abort_all", None))

    def start(self) -> None:
        """Run the step loop in a daemon thread (again accepting requests after a shutdown)."""
        self._stop.clear()
        self._closing.clear()
        self._thread = threading.Thread(target=self._loop, name="kvtier-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left (`begin_shutdown`) and stop the engine thread, waiting up to
        `timeout` seconds for it (it is a daemon thread: a stuck one does not keep the process)."""
        self.begin_shutdown()
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        if self.config.threads is not None:
            # NOTE: on a CPU shared with other work, 2+ OpenMP threads can make small GEMMs 10x
            # slower (threads wait for descheduled peers); 1 thread is then the fastest.
            torch.set_num_threads(self.config.threads)
        while not self._stop.is_set():
            self._drain(block=not self.has_work)
            if self.scheduler.has_work:
                try:
                    self.step()
                except Exception as e:  # fail the batch, keep serving
                    for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                        self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
            self.step_tiered()
            self._idle_wait()

    def _idle_wait(self) -> None:
        """With no batch work and every tiered run's step still on the device, sleep a little
        instead of spinning (a short sleep keeps aborts and shutdown prompt)."""
        if not self.scheduler.has_work and self._tiered and not any(r.ready() for r in self._tiered.values()):
            time.sleep(IDLE_POLL_S)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    @property
    def has_work(self) -> bool:
        return bool(self._tiered_wait or self._tiered) or self.scheduler.has_work

    def _handle(self, kind: str, arg: Any) -> None:
        if kind == "add":
            self._by_id[arg.request_id] = arg
            self.scheduler.add(arg)
        elif kind == "tiered":
            self._by_id[arg.request_id] = arg
            self._tiered_wait.append(arg)
        elif kind == "abort" and arg in self._by_id:
            self._finish(self._by_id[arg], "abort")
        elif kind == "abort_all":
            for seq in list(self._by_id.values()):
                self._finish(seq, "abort", error=SHUTTING_DOWN)
        elif kind == "reset":
            self.kv.reset_prefix_cache()

    def run_until_idle(self) -> None:
        """Step (in the calling thread) until every submitted request has finished."""
        self._drain(block=False)
        while self.has_work:
            if self.scheduler.has_work:
                self.step()
            self.step_tiered()
            self._idle_wait()
            self._drain(block=False)

    def step_tiered(self) -> None:
        """Start waiting tiered runs while there is room, then advance each running one by one
        prefill chunk or decode token (a failing run fails its own request only)."""
        while self._tiered_wait and len(self._tiered) < MAX_TIERED_RUNS:
            seq = self._tiered_wait[0]
            if seq.status is Status.FINISHED:  # aborted while it waited
                self._tiered_wait.popleft()
                continue
            if any(run.opening for run in self._tiered.values()):
                break  # NOTE: its store's memory is not in the budget yet: plan after it
            if self.paged and self.scheduler.running and seq is not self._compacted_for:
                # NOTE: once per waiting request (the scan is O(pool pages) on the host)
                self._compacted_for = seq
                self.compact()
            try:
                plan, make_store, first = plan_store(self, seq)
            except CapacityError as e:
                # others hold the memory (runs, stores of their own in the batch, or sequences
                # whose pages it could borrow): wait
                if self._tiered or self._closing_runs or self._batch_holds_memory():
                    break
                self._tiered_wait.popleft()
                self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
                continue
            except Exception as e:
                self._tiered_wait.popleft()
                self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
                continue
            self._tiered_wait.popleft()
            if first is not None:
                self._lent[seq] = first
            if plan.streamed_slices == 0:  # nothing streams: its store joins the batch's forward
                try:
                    store, describe = make_store()
                except Exception as e:
                    self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
                    continue
                chunk = min(plan.chunk_size, self.config.max_num_batched_tokens)
                seq.own = OwnStore(store, prefill_spans(len(seq.prompt), chunk, store), describe)
                self.own_store_requests += 1
                self.add(seq)
                continue
            self._tiered[seq] = TieredRun(
                self,
                seq,
                plan,
                make_store,
                threaded=self.config.tiered_thread,
                lookahead_layers=self.config.tiered_lookahead_layers,
            )
        self._take_back_runs()
        for seq, run in list(self._tiered.items()):
            try:
                self._advance(seq, run)
            except Exception as e:  # fail this request, keep serving
                self._finish(seq, "error", error=f"{type(e).__name__}: {e}")

    def _advance(self, seq: Sequence, run: TieredRun) -> None:
        """Collect a run's finished step and launch its next; never waits for the device (on
        the CPU a launched step is done at once, so it is collected in the same call)."""
        if run.in_flight:
            if not run.ready():
                return
            self._take_tiered_token(seq, run.collect())
            if seq.status is Status.FINISHED:
                return
        run.launch()
        if run.ready():
            self._take_tiered_token(seq, run.collect())

    def _take_tiered_token(self, seq: Sequence, token: int | None) -> None:
        if token is None:
            return
        first = seq.first_token_at is None  # its prefill has just ended
        now = time.perf_counter()
        self._count_token(seq, now)
        seq.tokens.append(token)
        self._recent.append((now, 1))
        if first and self.config.tiered_release_after_prefill:
            self._release_cached_blocks()
        self._after_token(seq)

    def _release_cached_blocks(self) -> None:
        """Return the caching allocator's unused blocks to the device (on CUDA): those a tiered
        run's prefill chunks left cached on its stream, which the batch's stream cannot reuse.
        A device-wide synchronization, made while the run's stream is idle, instead of the one
        an allocation at the budget's cap makes (a retry), which waits behind the run's queued
        decode work (`bench/results/serve_gpu_24gib_share0.json`)."""
        self.cache_releases += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _sink_failed(self, seq: Sequence) -> None:
        self._inbox.put(("abort", seq.request_id))  # at the next step boundary

    def _finish(self, seq: Sequence, reason: str, emitted: bool = False, error: str | None = None) -> None:
        if seq.status is Status.FINISHED:
            return
        run = self._tiered.pop(seq, None)
        first = self._lent.pop(seq, None)  # the run of pages its store's buffers live in
        if run is not None:  # NOTE: a tiered sequence is in no scheduler queue and holds no block table
            freed = run.close(wait=self._stop.is_set())  # NOTE: freeing pinned memory takes seconds
            if freed is not None:
                self._closing_runs.append((freed, first))
            elif first is not None:
                self.kv.pool.return_run(first)
            self.offloaded += 1
            self.tiered_h2d_bytes += run.h2d_bytes
            self.tiered_d2h_bytes += run.d2h_bytes
            first = None
        self._by_id.pop(seq.request_id, None)
        owned = seq.own is not None
        super()._finish(seq, reason, emitted, error)  # NOTE: closes a store of its own (own = None)
        if first is not None:
            self.kv.pool.return_run(first)
        if error is not None and (run is not None or owned):
            # NOTE: what the failed step allocated may still sit in reference cycles through
            # its error's frames (`tiered.detached` breaks the run's own; a library's may
            # remain), which only the collector frees: before the next request is planned
            gc.collect()

    # -- numbers for /metrics --------------------------------------------------------------------

    @property
    def num_tiered(self) -> tuple[int, int]:
        """(running, waiting) tiered runs."""
        return len(self._tiered), len(self._tiered_wait)

    def transfer_bytes(self) -> dict[tuple[str, str], int]:
        """PCIe bytes so far by (direction, source): the prefix cache's host tier, and the
        tiered runs (finished ones, plus what running ones have moved)."""
        page = self.store.bytes_per_page
        running = [r.account for r in self._tiered.values() if r.account is not None]
        return {
            ("d2h", "prefix_cache"): self.kv.host.saved * page,
            ("h2d", "prefix_cache"): self.kv.host.loaded * page,
            ("h2d", "tiered"): self.tiered_h2d_bytes + sum(a.h2d_bytes for a in running),
            ("d2h", "tiered"): self.tiered_d2h_bytes + sum(a.d2h_bytes for a in running),
        }
