"""`BatchEngine`: continuous batching of many sequences over one model's paged KV.

One step schedules the running and waiting sequences (`Scheduler`: decodes first, prefill
chunks in the token budget left, preemption by recompute), runs ONE forward over their new
tokens as a flat stream (`kvtier.kv.paged.PagedKVStore` is its attention), samples and emits
`Delta`s to each sequence's sink. A sequence with a store of its own (`Sequence.own`: a
method of its own, KV in device memory) is attended in the same forward (`MixedStep`).
Decode-only steps of paged sequences run from static buffers, replayed as CUDA graphs on the
GPU (`DecodeRunner`). `LLM.generate` with a list of prompts and `kvtier serve`
(which adds a thread, tiered runs and shutdown) both drive this class.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import replace

import torch

from kvtier.attention.interface import Attention
from kvtier.engine.batch.config import BatchConfig, ModelHost
from kvtier.engine.batch.detokenize import IncrementalText
from kvtier.engine.batch.graphs import DecodeRunner
from kvtier.engine.batch.kv_manager import KVCacheManager
from kvtier.engine.batch.latency import RequestLatency
from kvtier.engine.batch.sample import sample_all, sample_on_device
from kvtier.engine.batch.scheduler import Scheduler, SchedulerConfig
from kvtier.engine.batch.sequence import Delta, Sequence, Sink, Status
from kvtier.engine.batch.sizing import CPU_DEFAULT_PAGES, PoolBudget, measure_pool_budget
from kvtier.engine.batch.stopping import check_stop
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.errors import ConfigError, PromptError
from kvtier.kv.batch_step import MixedStep
from kvtier.kv.paged import PagedKVStore, SeqStep
from kvtier.kv.prefix_cache import root_hash
from kvtier.methods import MethodChoice
from kvtier.planner.hardware import host_memory_available

BATCH_STREAM_PRIORITY = -1  # CUDA stream priority of batch steps (lower = higher; default 0)


class BatchEngine:
    """A loaded model with paged KV, prefix caching and continuous batching; single-threaded:
    `add` sequences, then `step()` (or `run_until_idle()`)."""

    def __init__(self, host: ModelHost, config: BatchConfig | None = None) -> None:
        self.host = host
        self.config = cfg = config or BatchConfig()
        if getattr(host, "parallel", None) is not None:
            raise ConfigError(
                "batched requests (kvtier serve, LLM.generate over paged KV) do not run over several "
                "ranks yet; use one process, or `kvtier generate --tensor-parallel N` for one prompt"
            )
        if host.method.kv not in ("auto", "gpu"):
            raise ConfigError(
                f"batched requests keep their KV on the device; --kv {host.method.kv} "
                "(offload of the active context) is for one request at a time. Use --kv gpu or auto"
            )
        # NOTE: the paged kernels compute plain scores only; a model with logit soft-capping
        # (Gemma-2) or latent attention (DeepSeek-V2) batches every request over a store of its
        # own (`needs_offload`), attended in the same forward, and keeps a token pool.
        self.paged = host.model_config.plain_scores
        if not self.paged:
            self.config = cfg = replace(cfg, num_pages=1, num_host_pages=0, prefix_caching=False)
        self.model = host.model
        self.device = host.device
        num_pages, host_pages = self._pool_sizes()
        self.store = PagedKVStore(
            host.model_config,
            num_pages=num_pages,
            page_size=cfg.page_size,
            device=host.device,
            dtype=host.dtype,
            max_batch=cfg.max_num_seqs,
            max_blocks=-(-host.max_model_len // cfg.page_size),
            prefill_cudnn=cfg.prefill_cudnn,
        )
        static = self.device.type == "cuda" if cfg.static_decode is None else cfg.static_decode
        graphs = cfg.cuda_graphs and self.device.type == "cuda"
        self.decoder = DecodeRunner(self.model, self.store, graphs=graphs) if static else None
        # NOTE: batch steps run on a stream of their own at high priority, so that work queued
        # on other streams (a tiered run's long prefill chunk or streamed decode, see
        # kvtier.serve.tiered) yields the GPU to them; ordered after the pool's allocation.
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device, priority=BATCH_STREAM_PRIORITY)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.kv = KVCacheManager(self.store, host_pages, cfg.prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens), self.kv)
        self.salt = f"{host.name}|{host.dtype}|kv={host.method.kv}|paged{cfg.page_size}"
        self.eos = host.eos_token_ids
        self.max_model_len = host.max_model_len
        self.pool_tokens = num_pages * cfg.page_size
        self._ids = itertools.count()
        # NOTE: HF fast tokenizers are not safe to share between threads ("Already borrowed");
        # a server's HTTP thread encodes while its engine thread decodes, so both take this lock.
        self.tokenizer_lock = threading.Lock()
        self.prompt_tokens = self.generation_tokens = self.finished = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated) per step
        self.latency = RequestLatency()
        self.ahead_steps = 0  # decode-only steps that queued more than one forward (`decode_steps`)

    def _pool_sizes(self) -> tuple[int, int]:
        """(device pages, host-tier pages): as given, checked against the memory budget, or sized
        from it (`kvtier.engine.batch.sizing`). Raises CapacityError before anything is allocated."""
        cfg, host_ = self.config, self.host
        itemsize = host_.dtype.itemsize
        per_page = cfg.page_size * host_.model_config.kv_bytes_per_token(itemsize)
        budget = measure_pool_budget(
            host_.model_config,
            self.device,
            host_.dtype,
            host_.gpu_budget(),
            host_.budget_given,
            cfg.max_num_batched_tokens,
            cfg.max_num_seqs,
            cfg.offload_reserve or 0,
        )
        cpu = self.device.type != "cuda"
        sized = cfg.offload_reserve is None and cfg.num_pages is None
        if budget is not None and budget.where == "GPU" and sized:
            budget = budget.with_default_offload()
        self.pool_budget = budget
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

    def make_sequence(
        self,
        prompt: list[int],
        params: SamplingParams,
        sink: Sink,
        cache_salt: str | None = None,
        method: MethodChoice | None = None,
    ) -> Sequence:
        """A new request's `Sequence` (not scheduled yet), checked (`check`)."""
        self.check(prompt, params)
        return Sequence(
            request_id=f"req-{next(self._ids)}",
            prompt=list(prompt),
            params=params,
            root=root_hash(self.salt + "|" + (cache_salt or "")),
            sink=sink,
            sampler=Sampler(params, self.device),
            method=method,
        )

    def add(self, seq: Sequence) -> None:
        """Schedule `seq` in the batch (it must fit the pool: `needs_offload` is False, or have a
        store of its own, made on the current stream: the batch's stream is ordered after it)."""
        if seq.own is not None and self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.scheduler.add(seq)

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise `PromptError` if a request can never run here (too long for the model).

        A request too long for the page pool is fine for the server (it runs over a tiered store);
        `needs_offload` tells."""
        total = len(prompt) + params.max_tokens
        if not prompt:
            raise PromptError("the prompt is empty")
        if total > self.max_model_len:
            raise PromptError(
                f"the prompt has {len(prompt)} tokens; with max_tokens={params.max_tokens} that is "
                f"{total}, past this server's limit of {self.max_model_len} tokens. Shorten the prompt "
                "or lower max_tokens"
            )

    def needs_offload(self, prompt: list[int], params: SamplingParams) -> bool:
        """Whether the request cannot run over the page pool: it needs more pages than the whole
        pool has, is longer than the model's sliding window (which the paged kernels do not
        mask), or the model's scores are not plain (`paged` is False). It then gets a store of
        its own: in the batch's forward when it fits the device, else as a tiered run."""
        total = len(prompt) + params.max_tokens
        windowed = bool(self.host.model_config.windowed_layers(total))
        return not self.paged or total > self.pool_tokens or windowed

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def run_until_idle(self) -> None:
        """Step until every added sequence has finished."""
        while self.has_work:
            self.step()

    def step(self) -> int:
        """One batch step: schedule, one forward over all new tokens, sample, emit. Returns tokens
        run. On CUDA the step's work is queued on the engine's high-priority stream."""
        if self.stream is None:
            return self._step()
        with torch.cuda.stream(self.stream):
            return self._step()

    def _step(self) -> int:
        batch = self.scheduler.schedule()
        self.kv.host.flush()  # NOTE: the pages scheduling evicted, copied before the forward reuses them
        if not batch:
            return 0
        # Paged sequences first, then those with stores of their own (`kvtier.kv.batch_step`).
        batch = [b for b in batch if b[0].own is None] + [b for b in batch if b[0].own is not None]
        ids: list[int] = []
        steps, own, sample_at, samplers = [], [], [], []
        for seq, n in batch:
            ids.extend(seq.tokens[seq.num_computed : seq.num_computed + n])
            if seq.own is None:
                steps.append(SeqStep(tuple(seq.block_table), seq.num_computed, n))
            else:
                own.append((n, seq.own.store))
            if seq.num_computed + n == len(seq.tokens):
                sample_at.append(len(ids) - 1)
                samplers.append(seq)
        if self.decoder is not None and not own and len(ids) == len(batch) == len(samplers):
            rounds = self._decode_rounds(samplers)
            if rounds > 1:
                return self._decode_ahead(samplers, ids, rounds)
            logits = self.decoder.run(ids, steps)  # a decode-only step: static buffers / graph
        else:
            attention: Attention = self.store
            if own:
                attention = MixedStep(self.store, len(ids) - sum(n for n, _ in own), own)
                for n, store in own:
                    store.begin_step(n)
            if steps:
                self.store.begin_step(steps)
            # NOTE: non-blocking copies of host lists (pageable: staged at once, no wait for the
            # device); a tensor made on the device from host values would wait for the stream
            logits = self.model(
                torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True),
                attention,
                logits_at=torch.tensor(sample_at, dtype=torch.long).to(self.device, non_blocking=True),
            )  # [N, vocab]
            if steps:
                self.store.end_step()
            for _, store in own:
                store.end_step()
        for seq, n in batch:
            self.kv.commit(seq, n)
        tokens = sample_all(samplers, logits)
        now = time.perf_counter()
        for seq, tok in zip(samplers, tokens, strict=True):
            self._count_token(seq, now)
            seq.tokens.append(tok)
            self._after_token(seq)
        self._made(now, len(tokens))
        return len(ids)

    def _decode_rounds(self, seqs: list[Sequence]) -> int:
        """How many decode tokens this decode-only step computes (`BatchConfig.decode_steps`):
        1 unless every sequence can take that many more tokens, pages for them are free without
        a preemption, and no request waits to join the next step."""
        k = self.config.decode_steps
        if k == 1 or self.scheduler.waiting:
            return 1
        left = [min(s.params.max_tokens - len(s.output), self.max_model_len - len(s.tokens)) for s in seqs]
        if min(left) < k:
            return 1
        if not all(self.kv.allocate(s, s.num_computed + k) for s in seqs):
            return 1  # NOTE: the pages some got stay theirs, for their next steps
        self.kv.host.flush()  # NOTE: cached pages those allocations evicted, copied out before reuse
        return k

    def _decode_ahead(self, seqs: list[Sequence], ids: list[int], rounds: int) -> int:
        """`rounds` decode forwards of `seqs` queued back to back, each on the tokens the one
        before sampled on the device, then one read-back; tokens a sequence samples after it
        stopped are dropped. Each sequence's tokens are those of single steps (tests)."""
        assert self.decoder is not None
        self.ahead_steps += 1
        picked: list[torch.Tensor] = []
        for r in range(rounds):
            steps = [SeqStep(tuple(s.block_table), s.num_computed + r, 1) for s in seqs]
            logits = self.decoder.run(picked[-1] if picked else ids, steps)
            picked.append(sample_on_device(seqs, logits))  # NOTE: before the next run reuses logits
        tokens = torch.stack(picked).tolist()  # [rounds, n]: one host sync
        now = time.perf_counter()
        made = 0
        for row in tokens:
            for seq, tok in zip(seqs, row, strict=True):
                if seq.status is Status.FINISHED:
                    continue
                self.kv.commit(seq, 1)
                self._count_token(seq, now)
                seq.tokens.append(int(tok))
                made += 1
                self._after_token(seq)
        self._made(now, made)
        return made

    def _made(self, now: float, tokens: int) -> None:
        """Count `tokens` generated at `now` for `tokens_per_second` (the last minute is kept)."""
        self._recent.append((now, tokens))
        while now - self._recent[0][0] > 60.0:
            self._recent.popleft()

    def _count_token(self, seq: Sequence, now: float) -> None:
        """Count one new token of `seq` at `now`: its time to first token or since its last."""
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.prompt_tokens += len(seq.prompt)
            self.latency.ttft.observe(now - seq.arrival)
        elif seq.last_token_at is not None:
            self.latency.tpot.observe(now - seq.last_token_at)
        seq.last_token_at = now
        self.generation_tokens += 1

    def _after_token(self, seq: Sequence) -> None:
        output = seq.output  # NOTE: a copy of the list: taken once a token
        text = ""
        if self.host.tokenizer is not None:
            if seq.text is None:
                seq.text = IncrementalText(self.host.tokenizer)
            with self.tokenizer_lock:
                text = seq.text.update(output)
        at_limit = len(seq.tokens) >= self.max_model_len
        visible, reason = check_stop(output, text, seq.params, self.eos, at_limit)
        if visible is None:
            return
        self._emit(seq, visible, reason)
        if reason is not None:
            self._finish(seq, reason, emitted=True)

    def _emit(self, seq: Sequence, text: str, reason: str | None, error: str | None = None) -> None:
        new_tokens = tuple(seq.tokens[len(seq.prompt) + seq.emitted_tokens :])
        delta = Delta(
            token_ids=new_tokens,
            text=text[seq.emitted_text :],  # empty when held-back text shrank the visible part
            finish_reason=reason,
            prompt_tokens=len(seq.prompt),
            completion_tokens=len(seq.tokens) - len(seq.prompt),
            cached_tokens=seq.cached_tokens,
            error=error,
        )
        seq.emitted_tokens += len(new_tokens)
        seq.emitted_text = max(seq.emitted_text, len(text))
        try:
            seq.sink(delta)
        except Exception:  # a broken listener loses its own request, never the batch
            if seq.status is not Status.FINISHED:
                self._sink_failed(seq)

    def _sink_failed(self, seq: Sequence) -> None:
        """A sink raised: the request is dropped (a server defers this to its next step)."""
        self._finish(seq, "abort", emitted=True)

    def _finish(self, seq: Sequence, reason: str, emitted: bool = False, error: str | None = None) -> None:
        if seq.status is Status.FINISHED:
            return
        self.scheduler.finish(seq, reason)
        if seq.own is not None:
            seq.own.store.close()  # NOTE: synchronizes: queued steps may still read its buffers
            seq.own = None
        self.finished += 1
        if seq.first_token_at is not None:
            self.latency.e2e.observe(time.perf_counter() - seq.arrival)
        if not emitted:
            self._emit(seq, "", reason, error)

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds."""
        now = time.perf_counter()
        return sum(n for t, n in list(self._recent) if now - t <= window) / window
