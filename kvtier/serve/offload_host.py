"""`OffloadEngine`: the batch engine's side of requests served over stores of their own (the
`OffloadHost` that `kvtier.serve.store_plan.plan_store` plans within): the GPU budget such a
request is planned within, what other requests' stores hold of it, the page pool's runs of
pages it may borrow (the compaction that makes them longer, and taking them back once a run's
store is freed), and the GPU memory and tiered stores' bytes /metrics reports.
`kvtier.serve.engine.ServeEngine` builds on it with the engine thread and the tiered runs
themselves.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future

import torch

from kvtier.engine.batch.config import BatchConfig
from kvtier.engine.batch.core import BatchEngine
from kvtier.engine.batch.sequence import Sequence
from kvtier.engine.batch.sizing import offload_gpu_budget, outside_allocator_bytes
from kvtier.engine.llm import LLM
from kvtier.serve.tiered import TieredRun


class OffloadEngine(BatchEngine):
    """A `BatchEngine` that lends GPU memory and pool pages to requests over stores of their own
    (an `OffloadHost`)."""

    _idle_allocated: int  # what is allocated while no request holds a store (set by the subclass)

    def __init__(self, llm: LLM, config: BatchConfig | None = None) -> None:
        super().__init__(llm, config)
        self.llm = llm
        self._tiered: dict[Sequence, TieredRun] = {}  # the running tiered runs
        self._lent: dict[Sequence, int] = {}  # requests holding a run of pages -> its first id
        # Finished runs whose stores are being freed, with the first page of the run each had
        # borrowed (given back once freed).
        self._closing_runs: list[tuple[Future[None], int | None]] = []
        self.pages_compacted = 0  # pages moved to make a run longer (`compact`)

    def offload_gpu_budget(self) -> int | None:
        """The GPU budget an offloaded request is planned within: the server's budget minus the
        page pool, what a batch step allocates beside it and the CUDA context (None on the CPU:
        unlimited)."""
        budget = self.llm.gpu_budget()
        if self.device.type != "cuda" or budget is None:
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        allocated = int(torch.cuda.memory_allocated(self.device))
        pool = self.store.bytes_per_page * self.store.num_pages
        sized = self.pool_budget
        # NOTE: the context is not the planner's to give either (see sizing.py).
        batch = 0 if sized is None else sized.activation + int(pool * sized.gather) + sized.context
        return offload_gpu_budget(budget, allocated, free, pool, batch, self.held_by_stores(allocated))

    def held_by_stores(self, allocated: int) -> int:
        """GPU bytes that requests' stores hold outside the pool now (tiered runs, running or
        being freed, and stores of their own in the batch): what is allocated beyond the last
        time none held any (`allocated` then; weights, pool, graphs and the like). Requests
        planned without them ran out of memory (a Quest one planned while a finished HiP run's
        store was being freed: `bench/results/serve_methods_fit_24gib_1647454.json`)."""
        if not (self._tiered or self._closing_runs or self._own_store_in_batch()):
            self._idle_allocated = allocated
            return 0
        return max(0, allocated - self._idle_allocated)

    @property
    def page_bytes(self) -> int:
        return self.store.bytes_per_page

    def lendable_pages(self, keep_batch: bool = True) -> int:
        """Pages a tiered run may borrow now: at most `tiered_share` of the pool for all runs
        together, in one stretch of unreferenced ids, leaving the running sequences the pages
        they need to reach their full length and, with `keep_batch`, the batch `max_num_seqs` x
        `tiered_keep_tokens` tokens of pages (`plan_store` asks without it for a request that
        fits nowhere else)."""
        return min(self._lendable_in_all(keep_batch), self.kv.pool.largest_run())

    def _lendable_in_all(self, keep_batch: bool = True) -> int:
        """`lendable_pages` were the pool's unreferenced ids one stretch."""
        pool, cfg = self.kv.pool, self.config
        cap = int(cfg.tiered_share * pool.num_pages) - pool.num_lent
        p = cfg.page_size
        keep = -(-cfg.max_num_seqs * cfg.tiered_keep_tokens // p) if keep_batch else 0
        headroom = sum(
            max(0, -(-(len(s.prompt) + s.params.max_tokens) // p) - len(s.block_table))
            for s in self.scheduler.running
        )
        return max(0, min(cap, pool.num_free - headroom - keep))

    def compact(self) -> int:
        """Move running sequences' pages down to free ids (engine thread, between batch steps)
        when that makes the stretch a run may borrow longer (`PagePool.compaction`): the pages'
        tensors are copied on the batch's stream, after its queued work and the host tier's
        pending saves, and the block tables rewritten. Returns the pages moved."""
        pool = self.kv.pool
        moves = pool.compaction(self._lendable_in_all())
        if not moves:
            return 0
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            self.kv.host.flush()  # NOTE: saves read pages by id; none of these, but keep the order
            self.store.move_pages(moves)
        moved = dict(moves)
        for src, dst in moves:
            pool.move(src, dst)
        for seq in self.scheduler.running:
            if any(p in moved for p in seq.block_table):
                seq.block_table = [moved.get(p, p) for p in seq.block_table]
        self.pages_compacted += len(moves)
        return len(moves)

    def lend(self, count: int) -> int | None:
        """Lend `count` consecutive pages (engine thread): evicted cached pages among them are
        saved to the host tier first, on the batch's stream, which the run's stream then waits
        for (`TieredRun`)."""
        first = self.kv.pool.take_run(count)
        if first is not None:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                self.kv.host.flush()  # NOTE: before the run's store writes the pages
        return first

    def _take_back_runs(self) -> None:
        """Return to the pool the pages of every run whose store has been freed."""
        still = []
        for freed, first in self._closing_runs:
            if not freed.done():
                still.append((freed, first))
            elif first is not None:
                self.kv.pool.return_run(first)
        self._closing_runs = still

    def _batch_holds_memory(self) -> bool:
        """Whether the batch's sequences hold memory a waiting tiered request could get once
        they finish: pool pages, or a store of their own."""
        busy = self.scheduler.has_work and self.kv.pool.num_used > 0
        return busy or self._own_store_in_batch()

    def _own_store_in_batch(self) -> bool:
        """Whether a running or waiting sequence of the batch has a store of its own."""
        return any(s.own is not None for q in (self.scheduler.running, self.scheduler.waiting) for s in q)

    def gpu_memory(self) -> dict[str, int]:
        """This process's GPU memory now, by kind, for /metrics: the allocator's allocated and
        reserved bytes and their peaks, what it holds outside the allocator (the CUDA context;
        `kvtier.engine.batch.sizing.outside_allocator_bytes`) and the budget. Empty on the CPU."""
        if self.device.type != "cuda":
            return {}
        free, total = torch.cuda.mem_get_info(self.device)
        return {
            "allocated": int(torch.cuda.memory_allocated(self.device)),
            "reserved": int(torch.cuda.memory_reserved(self.device)),
            "peak_allocated": int(torch.cuda.max_memory_allocated(self.device)),
            "peak_reserved": int(torch.cuda.max_memory_reserved(self.device)),
            "outside_allocator": outside_allocator_bytes(self.device, free, total),
            "budget": self.llm.gpu_budget() or total,
        }

    def tiered_bytes(self) -> dict[str, int]:
        """KV bytes allocated now by the running tiered runs' stores, per tier (gpu, host)."""
        out = {"gpu": 0, "host": 0}
        for run in self._tiered.values():
            if run.store is not None:
                for tier, n in run.store.account.allocated.items():
                    out[tier] += n
        return out
