"""`LLM.generate` one prompt at a time: each over a tiered KV store of its own, planned for it
alone (offloaded KV, a prompt the batch engine cannot take, several ranks), through the chunked
prefill / decode loop (`runner`), with its plan, peaks and allocator counts in its stats."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, Protocol

import torch

from kvtier.attention.interface import CountingKernel
from kvtier.engine.config import EngineConfig
from kvtier.engine.outputs import RequestOutput, allocator_counts
from kvtier.engine.progress import PinBar
from kvtier.engine.prompts import Prompt, stopper
from kvtier.engine.runner import generate_tokens
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.engine.warmup import KernelWarmup
from kvtier.errors import CapacityError, raised_at
from kvtier.kv.store import TieredKVStore
from kvtier.kv.tiers import reporting_pins
from kvtier.loading import LoadedModel
from kvtier.methods import MethodChoice, Placement
from kvtier.parallel.group import RankGroup
from kvtier.planner.placement import KVPlan
from kvtier.policies import PolicyParts


class StoreHost(Protocol):
    """What a request over a tiered store of its own needs of a loaded model, alone or in a
    batch (`kvtier.engine.llm.LLM` is one): its store, and the output text of its tokens."""

    def make_store(
        self,
        plan: KVPlan,
        context: int,
        hip_cache_tokens: int | None = None,
        method: MethodChoice | None = None,
        *,
        hip_prune_bytes: int | None = None,
    ) -> tuple[TieredKVStore, PolicyParts]: ...

    def text_and_reason(self, tokens: list[int], params: SamplingParams) -> tuple[str, str]: ...


class TieredHost(StoreHost, Protocol):
    """What one prompt run alone needs of a loaded model: its plan, its ranks, the model."""

    device: torch.device
    loaded: LoadedModel
    tokenizer: Any
    parallel: RankGroup | None
    config: EngineConfig
    pipeline: bool  # ranks are pipeline stages (else tensor-parallel shards)
    collectives_started: bool  # set here once the model runs: an error may then strand a rank

    def placement(self, context: int, method: MethodChoice, new_tokens: int | None = None) -> Placement: ...


def generate_tiered(
    llm: TieredHost,
    prompt: Prompt,
    ids: list[int],
    params: SamplingParams,
    progress: bool,
    method: MethodChoice,
) -> RequestOutput:
    """Generate for one prompt (`ids`, its tokens) under `method` over a store planned for it
    alone (`plan_and_store`), closed when it ends; CapacityError, naming the plan, when it runs
    out of device memory."""
    context = len(ids) + params.max_tokens
    allocator: dict[str, int] = {}
    if llm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(llm.device)
        allocator = allocator_counts(llm.device)
    t0 = time.perf_counter()
    # NOTE: beside the setup, whose pinning leaves the GPU idle
    warmup = KernelWarmup().start(llm.loaded.model, llm.device, ranked=llm.parallel is not None)
    pins = PinBar(progress)
    try:
        with reporting_pins(pins):
            plan, store, parts = plan_and_store(llm, context, method, params.max_tokens)
    finally:
        pins.close()
        warmed = warmup.join()
    setup_s = time.perf_counter() - t0
    sampler: Callable[[torch.Tensor], torch.Tensor] = Sampler(params, llm.device)
    if llm.parallel is not None:  # the last stage's logits are the model's
        sampler = llm.parallel.synced(sampler, src=llm.parallel.size - 1 if llm.pipeline else 0)
    llm.collectives_started = True  # from here on an error may leave other ranks in a collective
    try:
        tokens, stats = generate_tokens(
            llm.loaded.model,
            store,
            torch.tensor(ids, dtype=torch.long, device=llm.device),
            sampler,
            params.max_tokens,
            plan.chunk_size,
            stopper(params, llm.loaded.eos_token_ids, llm.tokenizer),
            progress=progress and len(ids) > plan.chunk_size,
            by_layer=llm.config.prefill_order == "layer" and llm.parallel is None,
        )
        stats.setup_s = setup_s
        stats.warmup = warmed
        stats.peak_bytes = {"gpu_kv": store.account.peak["gpu"], "host_kv": store.account.peak["host"]}
        if isinstance(store.kernel, CountingKernel):
            stats.kernel = store.kernel.counters()
        if llm.device.type == "cuda":
            stats.peak_bytes["gpu_total"] = int(torch.cuda.max_memory_allocated(llm.device))
            after = allocator_counts(llm.device)
            stats.gpu_allocator = {k: after[k] - allocator[k] for k in after}
            stats.gpu_allocator["reserved_peak"] = int(torch.cuda.max_memory_reserved(llm.device))
    except torch.OutOfMemoryError as e:
        site = raised_at(e)
        raise CapacityError(
            f"out of memory during generation ({str(e).splitlines()[0][:160]}"
            f"{', at ' + site if site else ''}); the plan was "
            f"kv={plan.policy}, group={plan.group_size}, resident slices={plan.resident_slices}, "
            f"chunk={plan.chunk_size}. All KV memory was freed. Pass a smaller --gpu-memory (the "
            "planner then leaves more headroom), a smaller --chunk-size, or --kv head"
        ) from None
    finally:
        store.close()
    stats.plan = {**asdict(plan), "method": parts.describe}
    if llm.parallel is not None:
        # NOTE: the plan, peaks and PCIe bytes are this rank's; every rank has the same plan.
        stats.plan["pipeline_parallel" if llm.pipeline else "tensor_parallel"] = llm.parallel.size
    text, reason = llm.text_and_reason(tokens, params)
    return RequestOutput(prompt if isinstance(prompt, str) else None, ids, text, tokens, reason, stats)


def plan_and_store(
    llm: TieredHost, context: int, method: MethodChoice, new_tokens: int
) -> tuple[KVPlan, TieredKVStore, PolicyParts]:
    """One request's plan and store. Over several ranks every rank plans its own part, and
    they agree: a plan or store that fails on one rank (pipeline stages differ) fails on all,
    before any collective, and all run the smallest rank's prefill chunk."""
    if llm.parallel is None:
        placement = llm.placement(context, method, new_tokens)
        store, parts = llm.make_store(
            placement.plan, context, placement.cache_tokens, method, hip_prune_bytes=placement.prune_bytes
        )
        return placement.plan, store, parts
    with llm.parallel.agree("planning the request"):
        placement = llm.placement(context, method, new_tokens)
    # NOTE: a stage sends its chunk's hidden states to the next: the spans must be the same.
    chunk = min(llm.parallel.all_gather_object(placement.plan.chunk_size))
    plan = replace(placement.plan, chunk_size=chunk)
    with llm.parallel.agree("allocating the KV store"):
        store, parts = llm.make_store(
            plan, context, placement.cache_tokens, method, hip_prune_bytes=placement.prune_bytes
        )
    return plan, store, parts
