"""Where HiP's KV goes on one GPU budget: the store plan and the block cache per offloaded slice.

HiP selects one set of chunks per store slice and needs each streamed slice whole. Whole-layer
slices are the published head reduction (`HIP_HEAD_REDUCE=1`: every head of a layer keeps the
same chunks) and the fewest slice steps a token (32 for llama-3-8b, against 256 head-wise). So
`plan_hip` tries layers first, with the block cache of a whole refresh interval and then smaller
ones (`CACHE_TOKEN_STEPS`), until a layer's two staging buffers fit; only then finer slices.

    512K, llama-3-8b, 24 GB:  whole-interval caches (5.5 GB) + layer staging (4.3 GB): no
                              10,240-token caches (1.8 GB) + layer staging: fits, 11x lossless

The prefill chunk comes first, though (`hip_chunk_size`). Over offload every chunk streams the
whole KV, as dense does, but HiP's work per query does not grow with the context, so dense's
roofline chunk (4K at 512K, where dense attention is the bound) leaves HiP waiting on PCIe:
3.3K tok/s at 512K with 4K chunks against 12.6K with 16K chunks (H200, 24 GB;
`bench/results/hip_prefill_512k_tuned.json`). A 16K chunk's activations push 512K from layer
slices to 4-head ones; only when no slicing fits with HiP's chunk does the store planner pick.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvtier.config import ModelConfig
from kvtier.errors import CapacityError, HostCapacityError
from kvtier.planner.hardware import DEFAULT_HARDWARE, Hardware
from kvtier.planner.memory import activation_bytes, round_up
from kvtier.planner.placement import KVPlan
from kvtier.planner.roofline import (
    CHUNK_MULTIPLE,
    MAX_CHUNK,
    MIN_CHUNK,
    linear_flops_per_token,
    min_host_hidden_chunk,
)
from kvtier.sparse import (
    CACHE_TOKEN_STEPS,
    SMALL_CACHE_TOKEN_STEPS,
    hip_config,
    hip_gpu_bytes,
    hip_phase_bytes,
)
from kvtier.sparse.config import HipConfig
from kvtier.sparse.prune_memory import PRUNE_BATCH_BYTES, whole_chunk_prune_bytes

# (group_size, gpu_budget, chunk_size) -> the store plan; None = the store planner's own choice.
PlanWith = Callable[[int | None, int | None, int | None], KVPlan]


def hip_prefill_flops_per_token(cfg: ModelConfig, context: int, hip: HipConfig) -> float:
    """FLOPs of one prefill query at `context` under HiP: the linear layers, attention over at most
    `attended_tokens` keys, and the pruning stages' probe products (2 probes per bisection level
    per chunk, against the stage's pooled queries)."""
    per_head = cfg.num_heads * cfg.num_layers * 2 * cfg.head_dim  # one q.k product, every head
    attention = 2 * hip.attended_tokens * per_head
    prune, n = 0.0, max(0, context - hip.sink - hip.window)
    for c, keep, stride in zip(hip.chunk_sizes, hip.budgets, hip.query_strides, strict=True):
        levels = max(1, math.ceil(math.log2(c)))
        prune += 2 * levels * -(-n // c) * per_head / stride
        n = min(n, keep)
    return linear_flops_per_token(cfg) + attention + prune


# HiP's prefill kernels gather keys by index and rotate them: they run at about a third of the
# peak FLOP/s the roofline assumes (H200, 512K, 16K chunks: 0.42 s of peak FLOPs in a 1.30 s chunk
# that PCIe bounds at 1.25 s; bench/results/hip_prefill_512k_tuned.json).
HIP_FLOP_EFFICIENCY = 1 / 3


def hip_chunk_size(cfg: ModelConfig, context: int, hw: Hardware, hip: HipConfig, dtype_bytes: int) -> int:
    """Roofline prefill chunk under HiP: the smallest whose work (at `HIP_FLOP_EFFICIENCY` of peak)
    takes as long as streaming the whole KV of `context` tokens over PCIe and hides the host's
    launches, rounded up to 1024, in [2048, 16384], at most `context`. llama-3-8b on an H200:
    5K at 128K, 16K from 512K up."""
    per_token_s = hip_prefill_flops_per_token(cfg, context, hip) / (hw.flops * HIP_FLOP_EFFICIENCY)
    pcie_s = context * cfg.kv_bytes_per_token(dtype_bytes) / hw.pcie_bw
    t = max(math.ceil(pcie_s / per_token_s), min_host_hidden_chunk(cfg, hw))
    return min(max(round_up(t, CHUNK_MULTIPLE), MIN_CHUNK), MAX_CHUNK, context)


def store_budget(
    cfg: ModelConfig,
    context: int,
    gpu_budget: int,
    preset: str | HipConfig,
    dtype_bytes: int,
    cache_tokens: int | None,
    chunk: int | None,
    idle_in_decode: int = 0,
) -> int:
    """The store planner's GPU budget under HiP: `gpu_budget` less HiP's bytes
    (`hip_phase_bytes`), by phase when the prefill `chunk` is known. The store planner takes the
    chunk's activations off itself; decode frees them, and prefill frees the decode caches
    (`HipKernel.begin_prefill`), so only the larger phase counts. With chunk None (the store
    planner picks it) both phases are taken off. `idle_in_decode`: bytes of the plan that decode
    gives back too (the staging buffers, with host keys)."""
    decode, always = hip_phase_bytes(cfg, preset, dtype_bytes, context, cache_tokens)
    if chunk is None:
        return gpu_budget - always - max(0, decode - idle_in_decode)
    freed = activation_bytes(cfg, min(chunk, context), dtype_bytes, group_size=1)
    freed -= activation_bytes(cfg, 1, dtype_bytes, group_size=1)  # a decode step's own
    return gpu_budget - always - max(0, decode - freed - idle_in_decode)


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
    preset: str | HipConfig,
    dtype_bytes: int,
    layers_first: bool,
    chunk_size: int | None = None,
    hardware: Hardware | None = None,
    staging_idle_in_decode: bool = False,
) -> HipPlacement:
    """Plan `context` tokens under HiP: `plan_with(group, budget, chunk)` is the store planner
    with HiP's GPU bytes taken off `gpu_budget` (None = unlimited). The prefill chunk is
    `chunk_size` when given, else `hip_chunk_size` on `hardware` (default: the RTX 4090 preset)
    and, if nothing fits with it, the store planner's own. With `layers_first` (the `auto`
    policy and no group given) slices are as wide as possible: whole layers first, then halves
    and so on, each with the largest block cache that lets two staging buffers hold a whole
    slice. Otherwise the caller's group, with the largest such cache.

    With `staging_idle_in_decode` (host keys: decode never streams, and the store gives its
    staging buffers back while it decodes) the block caches may also take the bytes of two
    staging buffers of whole slices of the group tried: a plan that has less staging than that
    (slices resident, or finer) is planned again without them.

    Raises CapacityError, before anything is allocated, when no plan holds whole slices."""

    def reserve(cache_tokens: int | None) -> int:
        return hip_gpu_bytes(cfg, preset, dtype_bytes, context, cache_tokens)

    def staging(group: int) -> int:  # two staging buffers of whole slices of `group` KV heads
        return 2 * context * group * 2 * cfg.head_dim * dtype_bytes

    def budget(cache_tokens: int | None, chunk: int | None, idle: int = 0) -> int | None:
        if gpu_budget is None:
            return None
        return store_budget(cfg, context, gpu_budget, preset, dtype_bytes, cache_tokens, chunk, idle)

    def plan_of(group: int | None, cache_tokens: int | None, chunk: int | None) -> KVPlan:
        if staging_idle_in_decode and group is not None and gpu_budget is not None:
            plan = plan_with(group, budget(cache_tokens, chunk, staging(group)), chunk)
            held = plan.staging_buffers * min(plan.staging_tokens, context) * 2 * cfg.head_dim * dtype_bytes
            if plan.streamed_slices and held * plan.group_size >= staging(group):
                return plan
        return plan_with(group, budget(cache_tokens, chunk), chunk)

    groups: list[int | None] = [None]
    if layers_first:
        groups = [g for g in range(cfg.num_kv_heads, 0, -1) if cfg.num_kv_heads % g == 0]
    chunks: list[int | None] = [chunk_size]
    if chunk_size is None:
        hw = hardware or DEFAULT_HARDWARE
        chunks = [hip_chunk_size(cfg, context, hw, hip_config(preset), dtype_bytes), None]
    error: CapacityError | None = None
    planned: KVPlan | None = None  # the last plan that fitted, only not with whole slices
    # NOTE: caches below the steps miss part of each step's final selection (fetched from the
    # host); they are tried only once no slicing fits with the steps, so no plan that fitted
    # before changes.
    for caches in ((None, *CACHE_TOKEN_STEPS), SMALL_CACHE_TOKEN_STEPS):
        for chunk in chunks:
            for group in groups:
                for cache_tokens in caches:
                    try:
                        plan = plan_of(group, cache_tokens, chunk)
                    except CapacityError as e:
                        error = e  # the last: the largest budget tried
                        continue
                    planned = plan
                    if plan.streamed_slices == 0:
                        return HipPlacement(plan, None, reserve(None))  # nothing offloaded: no block cache
                    if plan.staging_tokens >= plan.capacity_tokens:
                        return HipPlacement(plan, cache_tokens, reserve(cache_tokens))
    if isinstance(error, HostCapacityError):
        raise error  # HiP's GPU bytes are not what is short
    least = reserve(SMALL_CACHE_TOKEN_STEPS[-1]) / 1e9
    if error is not None and (not layers_first or not planned):
        raise CapacityError(
            f"{error}; --attention hip first takes {least:.2f} GB or more of --gpu-memory for its "
            "block caches, decode buffers and RoPE table"
        ) from None
    assert gpu_budget is not None  # without a GPU budget every plan holds whole slices
    finest = 2 * context * 2 * cfg.head_dim * dtype_bytes  # two staging buffers of one KV head
    if not layers_first and planned is not None and planned.group_size > 1:  # the caller's slicing
        g = planned.group_size
        raise CapacityError(
            f"--attention hip needs every offloaded slice whole in a staging buffer: at {context} "
            f"tokens two buffers of a slice of {g} KV heads take {g * finest / 1e9:.2f} GB, which "
            f"with HiP's block caches (at least {least:.2f} GB) does not fit --gpu-memory "
            f"{gpu_budget / 1e9:.2f} GB; use a smaller --head-group, or leave it out (the "
            "planner then takes the widest slices that fit)"
        )
    raise CapacityError(
        f"--attention hip needs every offloaded slice whole in a staging buffer: at {context} tokens "
        f"two buffers of one KV head take {finest / 1e9:.2f} GB, and with HiP's block caches "
        f"(at least {least:.2f} GB) no slicing fits --gpu-memory {gpu_budget / 1e9:.2f} GB; use a "
        "larger --gpu-memory, a shorter context, or --attention dense"
    )


# The most `whole_chunk_pruning` reserves: past it a batch's kernels run long enough that the
# launches one more batch costs are noise (SmolLM2's 16K chunk under `lean` takes 1.5 GB; Llama-3's
# 16K chunk at 64K would take ~17 GB, 256 blocks of 8 heads x 256 rows x 8K chunks of maxima).
WHOLE_CHUNK_PRUNE_MAX = 2 << 30


def whole_chunk_pruning(
    cfg: ModelConfig,
    context: int,
    placed: HipPlacement,
    hip: HipConfig,
    dtype_bytes: int,
    plan_again: Callable[[HipConfig], HipPlacement],
) -> tuple[HipPlacement, HipConfig]:
    """`placed` planned again with `hip.prune_bytes` raised so that each prefill chunk's query
    blocks are pruned in one batch a stage (`whole_chunk_prune_bytes` of a slice of the plan's
    group, at most `WHOLE_CHUNK_PRUNE_MAX`), where the plan keeps every slice on the GPU and the
    new one does too with the same slicing: the larger reservation then fits the budget.
    `plan_again(config)` plans with `config` and the same chunk. Otherwise `placed` and `hip` as
    they were."""
    plan = placed.plan
    if plan.streamed_slices:
        return placed, hip
    group = plan.group_size
    heads = group * (cfg.num_heads // cfg.num_kv_heads)
    chunk = min(plan.chunk_size, context)
    budgets = (*hip.budgets[:-1], max(hip.budgets[-1], hip.wide_budget if hip.wide_layers else 0))
    need = whole_chunk_prune_bytes(
        context, -(-chunk // hip.block_q), hip.block_q, heads, group, cfg.head_dim, dtype_bytes,
        chunk_sizes=hip.chunk_sizes, budgets=budgets, strides=hip.query_strides, head_score=hip.head_score,
    )  # fmt: skip
    need = min(need, WHOLE_CHUNK_PRUNE_MAX)
    if need <= (PRUNE_BATCH_BYTES if hip.prune_bytes is None else hip.prune_bytes):
        return placed, hip
    roomier = replace(hip, prune_bytes=need)
    try:
        again = plan_again(roomier)
    except CapacityError:
        return placed, hip
    if (
        again.plan.streamed_slices
        or again.plan.group_size != group
        or again.plan.chunk_size != plan.chunk_size
    ):
        return placed, hip
    return again, roomier
