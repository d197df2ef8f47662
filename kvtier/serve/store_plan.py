"""How a request served over a store of its own is placed: `plan_store` plans it like `kvtier
generate` plans a prompt (`kvtier.methods.plan_for`), within the server's GPU budget minus the
page pool and what other requests' stores hold (`OffloadHost.offload_gpu_budget`), plus the pool
pages it may borrow now (`OffloadHost.lendable_pages`), whose run its buffers are carved from.
`kvtier.serve.tiered` runs what it plans: streamed from the host tier beside the batch, or, when
nothing streams, as a store of its own in the batch's forward (`kvtier.serve.engine`).

Each placement is logged (`kvtier serve` prints it); a HiP request that only fits with a
stopgap block cache is a warning that names `--offload-reserve`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch

from kvtier.engine.batch.sequence import Sequence
from kvtier.engine.llm import LLM
from kvtier.errors import CapacityError
from kvtier.kv.device_memory import CachingMemory, RegionMemory, fitting, region_buffers
from kvtier.kv.hooks import packing_codec
from kvtier.kv.layout import KVLayout
from kvtier.kv.paged import PagedKVStore
from kvtier.kv.store import TieredKVStore
from kvtier.methods import MethodChoice, plan_for
from kvtier.methods.registry import Placement
from kvtier.model.llama import CausalLM
from kvtier.planner.memory import GPU_RESERVE_BYTES, activation_bytes, weight_bytes
from kvtier.planner.placement import KVPlan
from kvtier.sparse import SMALL_CACHE_TOKEN_STEPS


class OffloadHost(Protocol):
    """What a tiered run needs of the serving engine (`OffloadEngine`, so `ServeEngine`, is one)."""

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
        store, parts = llm.make_store(
            placement.plan, context, placement.cache_tokens, method, memory=memory,
            hip_prune_bytes=placement.prune_bytes, graphs=False,
        )  # fmt: skip
        return store, parts.describe

    return placement.plan, make, first
