"""`ServeEngine`: the continuous-batching step loop over one model, in a background thread.

Callers (HTTP handlers, tests, the benchmark) talk to it through thread-safe methods only:
`submit` a tokenized request with a `sink` that receives `Delta`s, `abort` it, `reset_prefix_cache`.
Everything else (scheduler, pages, model) is touched by the engine thread alone, or, without a
thread, by whoever calls `step()` / `run_until_idle()`.

A request whose prompt + max_tokens needs more pages than the whole pool holds, or that names a
method of its own, is not refused: it is served over a tiered store of its own
(`kvtier.serve.tiered`), planned within the server's GPU budget minus the pool, exactly like
`kvtier generate` plans it. The engine thread advances each such run by one prefill chunk or
decode token between two batch steps, so the batch keeps going and its tokens stream.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.engine.llm import LLM
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.errors import CapacityError, ConfigError, KvtierError, PromptError
from kvtier.methods import MethodChoice
from kvtier.planner.hardware import host_memory_available
from kvtier.serve.graphs import DecodeRunner
from kvtier.serve.kv_manager import KVCacheManager
from kvtier.serve.paged_store import PagedKVStore, SeqStep
from kvtier.serve.prefix_cache import root_hash
from kvtier.serve.scheduler import Scheduler, SchedulerConfig
from kvtier.serve.sequence import Delta, Sequence, Sink, Status
from kvtier.serve.sizing import CPU_DEFAULT_PAGES, PoolBudget, measure_pool_budget, offload_gpu_budget
from kvtier.serve.stopping import check_stop
from kvtier.serve.tiered import TieredRun

MAX_TIERED_RUNS = 4  # tiered runs advanced together; more wait for one to finish
SHUTTING_DOWN = "the server is shutting down; send the request again once it is back (or to another server)"


class EngineClosed(KvtierError):
    """The engine is shutting down and takes no new requests."""


@dataclass(frozen=True)
class ServeConfig:
    """Pool and batch sizes of the server. None = chosen from the device at start."""

    page_size: int = 16
    num_pages: int | None = None  # device pages (default: what the memory budget leaves; see sizing.py)
    num_host_pages: int | None = None  # host-tier pages for evicted prefixes (default: num_pages, capped)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefix_caching: bool = True
    threads: int | None = None  # torch CPU threads of the engine thread (None: torch's default)
    # Decode-only steps from static buffers (`kvtier.serve.graphs`), replayed as CUDA graphs
    # (None: on CUDA; on the CPU they run eagerly, for tests).
    static_decode: bool | None = None
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ConfigError(f"--page-size must be at least 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ConfigError(f"--num-pages must be at least 1, got {self.num_pages}")
        if self.num_host_pages is not None and self.num_host_pages < 0:
            raise ConfigError(f"--num-host-pages must not be negative, got {self.num_host_pages}")
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens)  # validates
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {self.threads}")


class ServeEngine:
    """A loaded `LLM` served with paged KV, prefix caching and continuous batching."""

    def __init__(self, llm: LLM, config: ServeConfig | None = None) -> None:
        self.llm = llm
        self.config = cfg = config or ServeConfig()
        if llm.method.kv not in ("auto", "gpu"):
            raise ConfigError(
                f"kvtier serve keeps the running sequences' KV on the device; --kv {llm.method.kv} "
                "(offload of the active context) is for `kvtier generate`. Use --kv gpu or auto"
            )
        self.model = llm.loaded.model
        self.device = llm.device
        num_pages, host = self._pool_sizes()
        self.store = PagedKVStore(
            llm.model_config,
            num_pages=num_pages,
            page_size=cfg.page_size,
            device=llm.device,
            dtype=llm.dtype,
            max_batch=cfg.max_num_seqs,
            max_blocks=-(-llm.max_model_len // cfg.page_size),
        )
        static = self.device.type == "cuda" if cfg.static_decode is None else cfg.static_decode
        graphs = cfg.cuda_graphs and self.device.type == "cuda"
        self.decoder = DecodeRunner(self.model, self.store, graphs=graphs) if static else None
        self.kv = KVCacheManager(self.store, host, cfg.prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens), self.kv)
        self.salt = f"{llm.loaded.name}|{llm.dtype}|kv={llm.method.kv}|paged{cfg.page_size}"
        self.eos = frozenset(llm.loaded.eos_token_ids)
        self.max_model_len = llm.max_model_len
        self.pool_tokens = num_pages * cfg.page_size  # longer requests are served with offload
        self._tiered_wait: deque[Sequence] = deque()  # requests for tiered runs, not started yet
        self._tiered: dict[Sequence, TieredRun] = {}  # the running ones
        self.offloaded = 0  # tiered runs finished
        self.tiered_h2d_bytes = self.tiered_d2h_bytes = 0  # PCIe bytes of finished tiered runs
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._by_id: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closing = threading.Event()  # set by begin_shutdown: no new requests
        # NOTE: HF fast tokenizers are not safe to share between threads ("Already borrowed");
        # the HTTP thread encodes and the engine thread decodes, so both take this lock.
        self.tokenizer_lock = threading.Lock()
        self.prompt_tokens = self.generation_tokens = self.finished = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated) per step

    def _pool_sizes(self) -> tuple[int, int]:
        """(device pages, host-tier pages): as given, checked against the memory budget, or sized
        from it (`kvtier.serve.sizing`). Raises CapacityError before anything is allocated."""
        cfg, llm = self.config, self.llm
        itemsize = torch.empty((), dtype=llm.dtype).element_size()
        per_page = cfg.page_size * llm.model_config.kv_bytes_per_token(itemsize)
        budget = measure_pool_budget(
            llm.model_config,
            self.device,
            llm.dtype,
            llm.gpu_budget(),
            llm.config.gpu_memory is not None,
            cfg.max_num_batched_tokens,
            cfg.max_num_seqs,
        )
        cpu = self.device.type != "cuda"
        if cfg.num_pages is not None:
            num_pages = cfg.num_pages
            if budget is not None:
                budget.check(num_pages, per_page)
        elif budget is None:
            num_pages = CPU_DEFAULT_PAGES
        else:
            num_pages = budget.default_pages(per_page, cap=CPU_DEFAULT_PAGES if cpu else None)
        available = host_memory_available()
        if available is None:  # unknown (not Linux): as given, else as many as device pages
            return num_pages, num_pages if cfg.num_host_pages is None else cfg.num_host_pages
        # Host pages live in host memory (pinned on CUDA); on the CPU the pool is there too.
        host = PoolBudget(
            "host",
            "host memory available",
            available,
            num_pages * per_page if cpu else 0,
            budget.activation if cpu and budget is not None else 0,
            0,
            cfg.max_num_batched_tokens,
            used_by="the device page pool",
        )
        if cfg.num_host_pages is not None:
            host.check(cfg.num_host_pages, per_page, "--num-host-pages")
            return num_pages, cfg.num_host_pages
        # As many host pages as device pages, but at most a quarter of the host memory left.
        return num_pages, min(num_pages, host.fitting(per_page) // 4)

    def offload_gpu_budget(self) -> int | None:
        """The GPU budget an offloaded request is planned within: the server's budget minus the
        page pool (None on the CPU: unlimited)."""
        budget = self.llm.gpu_budget()
        if self.device.type != "cuda" or budget is None:
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        allocated = int(torch.cuda.memory_allocated(self.device))
        return offload_gpu_budget(budget, allocated, free, self.store.bytes_per_page * self.store.num_pages)

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

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise `PromptError` if a request can never run here (too long for the model).

        A request too long for the page pool is fine: it is served with offload (see the module)."""
        total = len(prompt) + params.max_tokens
        if not prompt:
            raise PromptError("the prompt is empty")
        if total > self.max_model_len:
            raise PromptError(
                f"the prompt has {len(prompt)} tokens; with max_tokens={params.max_tokens} that is "
                f"{total}, past this server's limit of {self.max_model_len} tokens. Shorten the prompt "
                "or lower max_tokens"
            )

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
        served over a tiered store (`kvtier.serve.tiered`). Raises EngineClosed once
        `begin_shutdown` was called."""
        if self._closing.is_set():
            raise EngineClosed(SHUTTING_DOWN)
        self.check(prompt, params)
        rid = f"req-{next(self._ids)}"
        seq = Sequence(
            request_id=rid,
            prompt=list(prompt),
            params=params,
            root=root_hash(self.salt + "|" + (cache_salt or "")),
            sink=sink,
            sampler=Sampler(params, self.device),
            method=method,
        )
        tiered = method is not None or self.needs_offload(prompt, params)
        self._inbox.put(("tiered" if tiered else "add", seq))
        return rid

    def needs_offload(self, prompt: list[int], params: SamplingParams) -> bool:
        """Whether the request needs more pages than the whole pool has (then it runs tiered)."""
        return len(prompt) + params.max_tokens > self.pool_tokens

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
            self._drain(block=False)

    def step_tiered(self) -> None:
        """Start waiting tiered runs while there is room, then advance each running one by one
        prefill chunk or decode token (a failing run fails its own request only)."""
        while self._tiered_wait and len(self._tiered) < MAX_TIERED_RUNS:
            seq = self._tiered_wait[0]
            if seq.status is Status.FINISHED:  # aborted while it waited
                self._tiered_wait.popleft()
                continue
            try:
                run = TieredRun(self, seq)
            except CapacityError as e:
                if self._tiered:  # others hold the memory: wait for one of them to finish
                    break
                self._tiered_wait.popleft()
                self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
                continue
            except Exception as e:
                self._tiered_wait.popleft()
                self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
                continue
            self._tiered_wait.popleft()
            self._tiered[seq] = run
        for seq, run in list(self._tiered.items()):
            try:
                token = run.step()
            except Exception as e:  # fail this request, keep serving
                self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
                continue
            if token is None:
                continue
            now = time.perf_counter()
            if seq.first_token_at is None:
                seq.first_token_at = now
                self.prompt_tokens += len(seq.prompt)
            seq.tokens.append(token)
            self.generation_tokens += 1
            self._recent.append((now, 1))
            self._after_token(seq)

    def step(self) -> int:
        """One batch step: schedule, one forward over all new tokens, sample, emit. Returns tokens run."""
        batch = self.scheduler.schedule()
        if not batch:
            return 0
        ids: list[int] = []
        steps, sample_at, samplers = [], [], []
        for seq, n in batch:
            ids.extend(seq.tokens[seq.num_computed : seq.num_computed + n])
            steps.append(SeqStep(tuple(seq.block_table), seq.num_computed, n))
            if seq.num_computed + n == len(seq.tokens):
                sample_at.append(len(ids) - 1)
                samplers.append(seq)
        if self.decoder is not None and len(ids) == len(batch) == len(samplers):
            logits = self.decoder.run(ids, steps)  # a decode-only step: static buffers / graph
        else:
            self.store.begin_step(steps)
            logits = self.model(
                torch.tensor(ids, dtype=torch.long, device=self.device),
                self.store,
                logits_at=torch.tensor(sample_at, dtype=torch.long, device=self.device),
            )  # [N, vocab]
            self.store.end_step()
        for seq, n in batch:
            self.kv.commit(seq, n)
        tokens = sample_all(samplers, logits)
        now = time.perf_counter()
        for seq, tok in zip(samplers, tokens, strict=True):
            if seq.first_token_at is None:
                seq.first_token_at = now
                self.prompt_tokens += len(seq.prompt)
            seq.tokens.append(tok)
            self._after_token(seq)
        self.generation_tokens += len(tokens)
        self._recent.append((now, len(tokens)))
        while now - self._recent[0][0] > 60.0:
            self._recent.popleft()
        return len(ids)

    def _after_token(self, seq: Sequence) -> None:
        text = ""
        if self.llm.tokenizer is not None:
            with self.tokenizer_lock:
                text = self.llm.tokenizer.decode(seq.output, skip_special_tokens=True)
        at_limit = len(seq.tokens) >= self.max_model_len
        visible, reason = check_stop(seq.output, text, seq.params, self.eos, at_limit)
        if visible is None:
            return
        self._emit(seq, visible, reason)
        if reason is not None:
            self._finish(seq, reason, emitted=True)

    def _emit(self, seq: Sequence, text: str, reason: str | None, error: str | None = None) -> None:
        new_tokens = tuple(seq.output[seq.emitted_tokens :])
        delta = Delta(
            token_ids=new_tokens,
            text=text[seq.emitted_text :],  # empty when held-back text shrank the visible part
            finish_reason=reason,
            prompt_tokens=len(seq.prompt),
            completion_tokens=len(seq.output),
            cached_tokens=seq.cached_tokens,
            error=error,
        )
        seq.emitted_tokens += len(new_tokens)
        seq.emitted_text = max(seq.emitted_text, len(text))
        try:
            seq.sink(delta)
        except Exception:  # a broken listener loses its own request, never the batch
            if seq.status is not Status.FINISHED:
                self._inbox.put(("abort", seq.request_id))

    def _finish(self, seq: Sequence, reason: str, emitted: bool = False, error: str | None = None) -> None:
        if seq.status is Status.FINISHED:
            return
        run = self._tiered.pop(seq, None)
        if run is not None:  # NOTE: a tiered sequence is in no scheduler queue and holds no pages
            run.close()
            self.offloaded += 1
            self.tiered_h2d_bytes += run.h2d_bytes
            self.tiered_d2h_bytes += run.d2h_bytes
        self.scheduler.finish(seq, reason)
        self._by_id.pop(seq.request_id, None)
        self.finished += 1
        if not emitted:
            self._emit(seq, "", reason, error)

    # -- numbers for /metrics --------------------------------------------------------------------

    @property
    def num_tiered(self) -> tuple[int, int]:
        """(running, waiting) tiered runs."""
        return len(self._tiered), len(self._tiered_wait)

    def transfer_bytes(self) -> dict[tuple[str, str], int]:
        """PCIe bytes so far by (direction, source): the prefix cache's host tier, and the
        tiered runs (finished ones, plus what running ones have moved)."""
        page = self.store.bytes_per_page
        running = [r.store.account for r in self._tiered.values() if r.store is not None]
        return {
            ("d2h", "prefix_cache"): self.kv.host.saved * page,
            ("h2d", "prefix_cache"): self.kv.host.loaded * page,
            ("h2d", "tiered"): self.tiered_h2d_bytes + sum(a.h2d_bytes for a in running),
            ("d2h", "tiered"): self.tiered_d2h_bytes + sum(a.d2h_bytes for a in running),
        }

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds."""
        now = time.perf_counter()
        return sum(n for t, n in list(self._recent) if now - t <= window) / window


def sample_all(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """Next token of each sequence from logits [N, vocab]: the greedy ones in one argmax, then
    one host sync for all."""
    greedy = [i for i, s in enumerate(seqs) if s.params.temperature == 0]
    picked = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        picked[rows] = logits[rows].argmax(-1)
    for i, s in enumerate(seqs):
        if s.params.temperature != 0:
            picked[i] = s.sampler(logits[i])
    return [int(t) for t in picked.tolist()]
