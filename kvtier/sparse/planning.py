"""Where HiP's KV goes on one GPU budget: the store plan and the block cache per offloaded slice.

HiP selects one set of chunks per store slice and needs each streamed slice whole. Whole-layer
slices are the published head reduction (`HIP_HEAD_REDUCE=1`: every head of a layer keeps the
same chunks) and the fewest slice steps a token (32 for llama-3-8b, against 256 head-wise). So
`plan_hip` tries layers first, with the block cache of a whole refresh interval and then smaller
ones (`CACHE_TOKEN_STEPS`), until a layer's two staging buffers fit; only then finer slices.

    512K, llama-3-8b, 24 GB:  whole-interval caches (5.5 GB) + layer staging (4.3 GB): no
                              10,240-token caches (1.8 GB) + layer staging: fits, 11x lossless
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.config import ModelConfig
from kvtier.errors import CapacityError, HostCapacityError
from kvtier.planner.placement import KVPlan
from kvtier.sparse import CACHE_TOKEN_STEPS, hip_gpu_bytes

# (group_size, gpu_budget) -> the store plan; group None = the caller's own choice.
PlanWith = Callable[[int | None, int | None], KVPlan]


@dataclass(frozen=True)
class HipPlacement:
    """The store plan under HiP, its block cache per offloaded slice and HiP's GPU bytes."""

    plan: KVPlan
    cache_tokens: int | None  # block cache per offloaded slice; None = a whole refresh interval
    reserve_bytes: int  # block caches, decode buffers and RoPE table, off the plan's budget


def plan_hip(
    cfg: ModelConfig,
    context: int,
    plan_with: PlanWith,
    *,
    gpu_budget: int | None,
    preset: str,
    dtype_bytes: int,
    layers_first: bool,
) -> HipPlacement:
    """Plan `context` tokens under HiP: `plan_with(group, budget)` is the store planner with
    HiP's GPU bytes taken off `gpu_budget` (None = unlimited). With `layers_first` (the `auto`
    policy and no group given) slices are as wide as possible: whole layers first, then halves
    and so on, each with the largest block cache that lets two staging buffers hold a whole
    slice. Otherwise the caller's group, with the largest such cache.

    Raises CapacityError, before anything is allocated, when no plan holds whole slices."""

    def reserve(cache_tokens: int | None) -> int:
        return hip_gpu_bytes(cfg, preset, dtype_bytes, context, cache_tokens)

    def budget(cache_tokens: int | None) -> int | None:
        return None if gpu_budget is None else gpu_budget - reserve(cache_tokens)

    groups: list[int | None] = [None]
    if layers_first:
        groups = [g for g in range(cfg.num_kv_heads, 0, -1) if cfg.num_kv_heads % g == 0]
    error: CapacityError | None = None
    planned = False  # some plan fitted, only not with whole slices
    for group in groups:
        for cache_tokens in (None, *CACHE_TOKEN_STEPS):
            try:
                plan = plan_with(group, budget(cache_tokens))
            except CapacityError as e:
                error = e  # the last: the largest budget tried
                continue
            planned = True
            if plan.streamed_slices == 0:
                return HipPlacement(plan, None, reserve(None))  # nothing offloaded: no block cache
            if plan.staging_tokens >= plan.capacity_tokens:
                return HipPlacement(plan, cache_tokens, reserve(cache_tokens))
    if isinstance(error, HostCapacityError):
        raise error  # HiP's GPU bytes are not what is short
    least = reserve(CACHE_TOKEN_STEPS[-1]) / 1e9
    if error is not None and (not layers_first or not planned):
        raise CapacityError(
            f"{error}; --attention hip first takes {least:.2f} GB or more of --gpu-memory for its "
            "block caches, decode buffers and RoPE table"
        ) from None
    assert gpu_budget is not None  # without a GPU budget every plan holds whole slices
    finest = 2 * context * 2 * cfg.head_dim * dtype_bytes  # two staging buffers of one KV head
    raise CapacityError(
        f"--attention hip needs every offloaded slice whole in a staging buffer: at {context} tokens "
        f"two buffers of one KV head take {finest / 1e9:.2f} GB, and with HiP's block caches "
        f"(at least {least:.2f} GB) no slicing fits --gpu-memory {gpu_budget / 1e9:.2f} GB; use a "
        "larger --gpu-memory, a shorter context, or --attention dense"
    )
