"""Where the KV cache lives: the engine's placement plan, derived from the memory budget.

The KV cache is cut into slices, one per (layer, group of `group_size` KV heads):

    layer 0: [g0][g1]...[g(G-1)]    G = num_kv_heads / group_size groups per layer
    layer 1: [g0][g1]...            num_slices = num_layers x G
    ...
    `resident_slices` of them stay on the GPU for good (which ones is the store's choice:
    `kvtier.kv.layout.spread` interleaves them with streamed ones); every other slice lives in
    pinned host memory and is copied through `staging_buffers` ping-pong GPU buffers of
    `staging_tokens` tokens each, in sequence blocks when staging_tokens is smaller than the
    context (partial attentions merged by log-sum-exp).

Layers whose sliding window binds at the context (`ModelConfig.windowed_layers`) are not
placed: their `window_slices` always stay on the GPU, holding `window_tokens` tokens each (the
window plus one prefill chunk), and count as fixed GPU bytes next to the weights. `num_slices`
and everything placed are the other layers' slices.

`plan_kv` is the one source of truth: the KV store configures itself from its result (a
`KVPlan`, `kvtier.planner.kv_plan`, re-exported here), and `kvtier plan` prints the same numbers.
This file holds `plan_kv`'s checks and policy decisions; the bytes each candidate takes are
`kvtier.planner.placement_sizes`, and the choices made by simulated decode step (CPU split,
a finer slicing, a third staging buffer, a second unpack scratch) `kvtier.planner.decode_choice`.
"""

from __future__ import annotations

from dataclasses import replace

from kvtier.attention.row_formats import native_row_format
from kvtier.config import ModelConfig
from kvtier.errors import CapacityError, ConfigError
from kvtier.planner.compact import CompactSlices
from kvtier.planner.decode_choice import faster_scratches, fastest_split, with_cpu_split
from kvtier.planner.hardware import DEFAULT_HARDWARE, Hardware
from kvtier.planner.kv_plan import POLICIES, KVPlan
from kvtier.planner.memory import ACTIVATIONS, GPU_RESERVE_BYTES, kv_token_bytes, weight_bytes
from kvtier.planner.packed import PackedFormat
from kvtier.planner.placement_sizes import MIN_REDUCED_CHUNK, PlacementSizes, buffer_tokens, gb
from kvtier.planner.roofline import MIN_CHUNK

__all__ = ["MIN_REDUCED_CHUNK", "POLICIES", "KVPlan", "plan_kv"]


def plan_kv(
    cfg: ModelConfig,
    context: int,
    *,
    policy: str = "auto",
    gpu_budget: int | None,
    dtype_bytes: int = 2,
    host_budget: int | None = None,
    chunk_size: int | None = None,
    group_size: int | None = None,
    hardware: Hardware | None = None,
    block_size: int = 256,
    reserve_bytes: int = GPU_RESERVE_BYTES,
    mlp_chunk: int | None = None,
    codec: PackedFormat | None = None,
    cpu_attention: str | int = "off",
    activations: str = "runner",
    compact: CompactSlices | None = None,
    unpack_scratches: int | None = None,
) -> KVPlan:
    """Plan KV placement for one sequence of `context` tokens.

    `gpu_budget` is the whole device memory the process may use (None = unlimited); weights,
    activations of one prefill chunk and `reserve_bytes` come off it first. Policies: "gpu" keeps
    everything resident; "layer" streams whole layers, "head" streams `group_size` (default 1)
    KV heads at a time; "auto" keeps everything resident if it fits, else picks the group size
    and resident-slice count with the least streamed bytes / PCIe bandwidth + streamed pieces x
    per-slice overhead. With a packing `codec` (quantized KV) every slice is sized packed, and
    resident slices need two staging buffers to unpack into. `cpu_attention` ("off", "auto" or a
    number of slices) gives some streamed slices to the CPU at decode (`kvtier.planner.cpu_split`;
    with a codec only a number: the CPU then reads the packed rows). `activations` says whose forward
    runs the chunks: "runner" (kvtier's, `activation_bytes`) or "hf" (transformers' model over a
    `kvtier.hf.TieredCache`, `hf_activation_bytes`). `compact`: slices an evictor keeps small on
    the GPU (head-wise sparsity), counted beside the weights and not placed. `unpack_scratches`:
    `KVPlan.unpack_scratches`; None: with a codec, two where the link model (`decode_step_s`,
    with the hardware's unpack rate, each plan with its CPU split) says unpacking off the link's
    stream beats what the second scratch costs (a resident slice, say), else one. Raises ConfigError on bad
    arguments and CapacityError with the numbers when the GPU or host budget is too small.
    """
    hw = hardware or DEFAULT_HARDWARE
    if unpack_scratches is None and (codec is None or hw.unpack_bw <= 0):
        unpack_scratches = 1  # nothing to weigh: one scratch
    if unpack_scratches is None:
        given = dict(locals())  # NOTE: first: a comprehension's locals() would be its own
        for name in ("cfg", "context", "unpack_scratches", "hw"):
            del given[name]
        one = plan_kv(cfg, context, **given, unpack_scratches=1)
        if not one.num_slices:
            return one
        try:
            two = plan_kv(cfg, context, **given, unpack_scratches=2)
        except CapacityError:
            return one
        return faster_scratches(cfg, one, two, hw, codec, dtype_bytes)
    _validate(cfg, context, policy, dtype_bytes, chunk_size, group_size, block_size)
    if activations not in ACTIVATIONS:
        raise ConfigError(f"unknown activation model {activations!r}; use one of {', '.join(ACTIVATIONS)}")
    scratches = unpack_scratches if codec is not None else 1
    # the link as the CPU split sees it: with two scratches packed loads unpack off its stream
    link_hw = hw if scratches == 1 else replace(hw, unpack_bw=0.0)
    sizes = PlacementSizes(
        cfg=cfg,
        context=context,
        policy=policy,
        gpu_budget=gpu_budget,
        host_budget=host_budget,
        dtype_bytes=dtype_bytes,
        chunk_size=chunk_size,
        hw=hw,
        block_size=block_size,
        reserve_bytes=reserve_bytes,
        mlp_chunk=mlp_chunk,
        codec=codec,
        activations=activations,
        compact=compact,
        scratches=scratches,
    )
    capacity = sizes.capacity

    def on_cpu(plan: KVPlan) -> KVPlan:
        """The plan with its CPU-attended slices chosen (`decode_choice.with_cpu_split`)."""
        return with_cpu_split(
            plan,
            cfg,
            hw=hw,
            link_hw=link_hw,
            dtype_bytes=dtype_bytes,
            cpu_attention=cpu_attention,
            codec=codec,
            windowed=sizes.windowed,
            compact=compact,
        )

    if policy == "gpu":
        min_g = group_size or cfg.num_kv_heads
        chunk = sizes.pick_chunk(min_g, lambda c: sizes.all_resident_kv(min_g, c))
        min_kv = sizes.all_resident_kv(min_g, chunk)
    else:
        min_g = cfg.num_kv_heads if policy == "layer" else (group_size or 1)
        # nothing to stream: no staging
        min_kv = sizes.staging_kv(min_g, block_size) if sizes.placed_layers else 0
        chunk = sizes.pick_chunk(min_g, lambda c: min_kv)
    if gpu_budget is not None and sizes.fixed(chunk, min_g) + min_kv > gpu_budget:
        w = weight_bytes(cfg, dtype_bytes)
        act = sizes.fixed(chunk, min_g) - w - reserve_bytes
        if policy == "gpu":
            advice = "a shorter context, the 'auto' policy or a larger --gpu-memory"
        elif chunk_size is not None and w + reserve_bytes + min_kv < gpu_budget:
            advice = "a smaller --chunk-size or a larger --gpu-memory"
        else:
            advice = "a larger --gpu-memory"
        raise CapacityError(
            f"{context} tokens need {gb(w + act + reserve_bytes + min_kv)} of GPU memory "
            f"(weights {gb(w)}, activations of a {chunk}-token chunk {gb(act)}, "
            f"reserve {gb(reserve_bytes)}, KV {gb(min_kv)}), --gpu-memory is {gb(gpu_budget)}; "
            f"use {advice}"
        )

    if policy == "gpu":
        return on_cpu(sizes.make(min_g, sizes.placed(min_g), 0, chunk))
    if policy == "auto":
        g = group_size or cfg.num_kv_heads
        # NOTE: everything stays resident if it does with a chunk of at least MIN_CHUNK tokens;
        # a smaller chunk would trade PCIe time for host-bound prefill.
        c = sizes.pick_chunk(g, lambda c: sizes.all_resident_kv(g, c), floor=min(MIN_CHUNK, chunk))
        if gpu_budget is None or sizes.fixed(c, g) + sizes.all_resident_kv(g, c) <= gpu_budget:
            return on_cpu(sizes.make(g, sizes.placed(g), 0, c))
    if policy in ("layer", "head"):
        g = min_g
        avail = None if gpu_budget is None else gpu_budget - sizes.fixed(chunk, g)
        tok = kv_token_bytes(cfg, g, dtype_bytes)
        return on_cpu(sizes.make(g, 0, buffer_tokens(avail, capacity, tok, block_size), chunk))
    assert gpu_budget is not None
    candidates = [group_size] if group_size else _divisors(cfg.num_kv_heads)
    best: tuple[float, int, KVPlan] | None = None
    feasible: list[KVPlan] = []
    host_error: CapacityError | None = None
    scratch_need = 0  # with a codec: GPU bytes the smallest slicing needed and did not have
    for g in candidates:
        tok = kv_token_bytes(cfg, g, dtype_bytes)

        def stream_kv(_c: int, g: int = g) -> int:  # the least a streaming plan needs
            return sizes.staging_kv(g, block_size)

        c = sizes.pick_chunk(g, stream_kv)
        pk = sizes.sizing(g)
        scratch = 0 if pk is None else scratches * pk.scratch_bytes(capacity)
        avail = gpu_budget - sizes.fixed(c, g) - scratch
        n = sizes.placed(g)
        staging = buffer_tokens(avail, capacity, tok, block_size)
        if staging == 0:
            need = sizes.fixed(c, g) + scratch + 2 * block_size * tok
            scratch_need = need if not scratch_need else min(scratch_need, need)
            continue
        resident = (
            max(0, min((avail - 2 * capacity * tok) // sizes.slice_kv(g, c), n - 1))
            if staging == capacity
            else 0
        )
        try:
            plan = sizes.make(g, resident, staging, c)
        except CapacityError as e:
            host_error = host_error or e
            continue
        cost = (
            plan.host_kv_bytes / hw.pcie_bw
            + plan.streamed_slices * plan.blocks_per_slice * hw.slice_overhead_s
        )
        feasible.append(plan)
        if best is None or (cost, n) < best[:2]:
            best = (cost, n, plan)
    if best is None and host_error is None:
        # NOTE: the budget check above counts a packed slice's unpack scratch for one block; a
        # load unpacks the whole slice's rows, so a long packed context can still not fit.
        raise CapacityError(
            f"{context} tokens of packed KV need {gb(scratch_need)} of GPU memory to stream a slice "
            f"(its packed rows unpack through a scratch of the whole slice), --gpu-memory is "
            f"{gb(gpu_budget)}; use a shorter context or a larger --gpu-memory"
        )
    if best is None:  # the budget check guarantees room for group_size 1, so the host is too small
        assert host_error is not None
        raise host_error
    chosen = on_cpu(best[2])
    # NOTE: over a quantized cache the least-streaming slicing may give the CPU nothing where a
    # finer one splits well (its slices are a layer's smaller share), so finer ones are tried
    # either way; the CPU then attends at its packed rate.
    if group_size is None and cpu_attention == "auto" and (chosen.cpu_slices or codec is not None):
        split_hw = hw if codec is None else link_hw.over_packed(native_row_format(codec))
        finer = [on_cpu(p) for p in feasible if p.group_size < chosen.group_size]  # NOTE: ~20 ms each
        chosen = fastest_split(cfg, chosen, finer, split_hw, dtype_bytes)
    return chosen


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _validate(
    cfg: ModelConfig,
    context: int,
    policy: str,
    dtype_bytes: int,
    chunk_size: int | None,
    group_size: int | None,
    block_size: int,
) -> None:
    if policy not in POLICIES:
        raise ConfigError(f"unknown KV policy {policy!r}; use one of {', '.join(POLICIES)}")
    if context < 1:
        raise ConfigError(f"context must be at least 1 token, got {context}")
    if dtype_bytes < 1 or block_size < 1:
        raise ConfigError(f"dtype_bytes and block_size must be positive, got {dtype_bytes}, {block_size}")
    if chunk_size is not None and chunk_size < 1:
        raise ConfigError(f"--chunk-size must be positive, got {chunk_size}")
    if group_size is not None:
        if group_size < 1 or cfg.num_kv_heads % group_size:
            raise ConfigError(
                f"--head-group {group_size} must divide the model's {cfg.num_kv_heads} KV heads; "
                f"use one of {', '.join(map(str, _divisors(cfg.num_kv_heads)))}"
            )
        if policy in ("gpu", "layer") and group_size != cfg.num_kv_heads:
            raise ConfigError(f"--head-group applies to the 'head' and 'auto' policies, not {policy!r}")
