"""`--evict window|streaming|h2o|snapkv --kv-budget N`: token eviction (`kvtier.policies.evict`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

from kvtier.errors import CapacityError
from kvtier.methods.registry import BuildContext, MethodEntry, Placement, PlanWith, register, within_budget
from kvtier.planner.inputs import PlanInputs
from kvtier.planner.memory import round_up
from kvtier.planner.placement import KVPlan
from kvtier.planner.roofline import MAX_CHUNK
from kvtier.policies import PolicyParts
from kvtier.policies.evict import H2OEvictor, SnapKVEvictor, WindowEvictor
from kvtier.policies.scoring import CacheRopeKernel, ScoringKernel

STREAMING_SINKS = 4  # StreamingLLM's attention sinks


def plan_kept(
    inputs: PlanInputs, options: Mapping[str, Any], plan_with: PlanWith, decode_appends: bool = False
) -> Placement:
    """An evictor keeps at most `--kv-budget` tokens of every slice plus one step's new ones, on
    the GPU (`TieredKVStore` holds evictable slices resident and compacts them each step), so it
    is planned as a resident cache of that many tokens a slice (`KVPlan.compact_tokens`: the
    store allocates each slice once at that size), not of the context: nothing streams and no
    host tier is needed. `decode_appends`: it evicts in prefill only (SnapKV), so a slice also
    keeps every decoded token (`PlanInputs.new_tokens`; unknown: the context).
    The prefill chunk is the lossless plan's where that plans (the kept tokens depend on the
    chunking), else the resident plan's own."""
    chunk = inputs.chunk_size
    if chunk is None:
        try:
            chunk = plan_with(None, inputs.gpu_budget, None).chunk_size
        except CapacityError:
            chunk = None  # e.g. the host cannot hold the whole context: nothing of it goes there
    budget = int(options["kv_budget"])
    decoded = 0
    if decode_appends:
        decoded = inputs.context if inputs.new_tokens is None else inputs.new_tokens

    def resident(chunk_tokens: int, chunk: int | None) -> KVPlan:
        tokens = min(inputs.context, round_up(budget + chunk_tokens + decoded, inputs.block_size))
        plan = replace(inputs, context=tokens, kv="gpu", chunk_size=chunk).plan()
        return replace(plan, compact_tokens=tokens)

    if chunk is None:  # the resident plan's own chunk, found with room for the largest
        chunk = resident(MAX_CHUNK, None).chunk_size
    return Placement(resident(chunk, chunk))


def evictor_entry(
    name: str,
    help: str,
    parts: Callable[[BuildContext, int], PolicyParts],
    decode_appends: bool = False,
) -> MethodEntry:
    """The registry entry of an evictor: `parts(ctx, budget)` builds it for one request;
    `decode_appends`: it never evicts in decode (`plan_kept`)."""

    def build(ctx: BuildContext) -> PolicyParts:
        budget = int(ctx.options["kv_budget"])
        built = parts(ctx, budget)
        return PolicyParts(
            kernel=built.kernel,
            rotate_keys=built.rotate_keys,
            codec=built.codec,
            evictor=built.evictor,
            describe=f"evict {name} budget {budget}",
        )

    return MethodEntry(
        name,
        "evict",
        help,
        build,
        takes=("kv_budget",),
        requires=("kv_budget",),
        examples={"kv_budget": "1k"},
        plan=partial(plan_kept, decode_appends=decode_appends),
        borrows_pages=True,  # its slices, allocated once at what they keep (`region_buffers`)
        exact_at=within_budget,  # evicts nothing up to its budget (its store would refuse that)
    )


def _scored(scorer: H2OEvictor | SnapKVEvictor) -> PolicyParts:
    return PolicyParts(kernel=ScoringKernel(scorer), evictor=scorer)


STREAMING = register(
    evictor_entry(
        WindowEvictor.STREAMING,
        "StreamingLLM: 4 attention sinks + the most recent tokens (RoPE at cache positions)",
        lambda ctx, b: PolicyParts(
            kernel=CacheRopeKernel(ctx.cfg, ctx.device),
            rotate_keys=False,
            evictor=WindowEvictor(b, sinks=STREAMING_SINKS),
        ),
    ),
)
H2O = register(
    evictor_entry(
        H2OEvictor.name,
        "H2O: heavy hitters by accumulated attention + recent",
        lambda _, b: _scored(H2OEvictor(b)),
    )
)
SNAPKV = register(
    evictor_entry(
        SnapKVEvictor.name,
        "SnapKV: prompt-window votes + recent",
        lambda _, b: _scored(SnapKVEvictor(b)),
        decode_appends=True,  # "Decode steps append without eviction" (SnapKVEvictor)
    )
)
WINDOW = register(
    evictor_entry(
        WindowEvictor.WINDOW,
        "sliding window: the last N tokens",
        lambda _, b: PolicyParts(evictor=WindowEvictor(b)),
    )
)
