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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kvtier.attention.row_formats import native_row_format
from kvtier.config import ModelConfig
from kvtier.errors import CapacityError, ConfigError, HostCapacityError
from kvtier.planner.compact import CompactSlices
from kvtier.planner.cpu_split import choose_cpu_slices, decode_step_s
from kvtier.planner.hardware import DEFAULT_HARDWARE, Hardware
from kvtier.planner.kv_plan import POLICIES, KVPlan

__all__ = ["MIN_REDUCED_CHUNK", "POLICIES", "KVPlan", "plan_kv"]
from kvtier.planner.memory import (
    ACTIVATIONS,
    GPU_RESERVE_BYTES,
    activation_bytes,
    hf_activation_bytes,
    kv_token_bytes,
    round_up,
    weight_bytes,
    window_kv_bytes,
    window_tokens,
)
from kvtier.planner.packed import PackedFormat, PackedSizing
from kvtier.planner.roofline import MIN_CHUNK, default_chunk_size

MIN_REDUCED_CHUNK = 256  # the planner halves the roofline chunk no further than this


def _one_more_buffer(plan: KVPlan) -> KVPlan | None:
    """`plan` with three staging buffers instead of two, the third paid for with resident
    slices (GPU KV bytes do not grow); None where it has no resident slice to give."""
    if plan.staging_buffers != 2 or plan.packed is not None:
        return None
    buffer = plan.staging_tokens * plan.slice_token_bytes
    drop = -(-buffer // plan.slice_store_bytes)
    if plan.resident_slices < drop:
        return None
    return replace(plan, staging_buffers=3, resident_slices=plan.resident_slices - drop)


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
        # NOTE: each with its own CPU split, which the CPU attends at its packed rate
        split_hw = hw.over_packed(native_row_format(codec)) if codec is not None else hw
        if (one.cpu_slices or two.cpu_slices) and split_hw.cpu_attention_bw <= 0:
            return one  # a split forced by count at an unknown CPU rate: nothing to simulate
        t_one = decode_step_s(cfg, one.slice_shape(cfg), split_hw, dtype_bytes, one.cpu_slices)
        t_two = decode_step_s(
            cfg, two.slice_shape(cfg), replace(split_hw, unpack_bw=0.0), dtype_bytes, two.cpu_slices
        )
        return two if t_two < t_one else one
    _validate(cfg, context, policy, dtype_bytes, chunk_size, group_size, block_size)
    if activations not in ACTIVATIONS:
        raise ConfigError(f"unknown activation model {activations!r}; use one of {', '.join(ACTIVATIONS)}")
    capacity = round_up(context, block_size)
    scratches = unpack_scratches if codec is not None else 1
    # the link as the CPU split sees it: with two scratches packed loads unpack off its stream
    link_hw = hw if scratches == 1 else replace(hw, unpack_bw=0.0)

    def on_cpu(plan: KVPlan) -> KVPlan:
        """The plan with its CPU-attended slices chosen (none where the CPU kernel's plain
        attention is not the model's, soft-capped or latent scores, and none next to windowed
        layers, which the CPU split does not model yet). A quantized cache splits at the CPU's
        measured rate over its packed rows (`Hardware.cpu_packed_bw`); without one, "auto"
        gives it none."""
        if plan.streamed_slices == 0 or not cfg.plain_scores or windowed or compact is not None:
            return plan  # NOTE: the store attends no evictor's slices on the CPU
        if codec is not None:
            packed_hw = link_hw.over_packed(native_row_format(codec))
            if packed_hw.cpu_attention_bw <= 0 and not isinstance(cpu_attention, int):
                return plan
            k = choose_cpu_slices(cfg, plan.slice_shape(cfg), packed_hw, dtype_bytes, cpu_attention)
            return replace(plan, cpu_slices=k)
        k = choose_cpu_slices(cfg, plan.slice_shape(cfg), hw, dtype_bytes, cpu_attention)
        best = replace(plan, cpu_slices=k)
        wider = _one_more_buffer(plan) if k else None
        if wider is not None:
            # NOTE: while the host waits for a layer's CPU results only `staging_buffers - 1`
            # loads are queued; one more buffer (paid for with a resident slice) keeps the link
            # busy through the wait, where the simulation says that pays.
            shape = wider.slice_shape(cfg)
            kw = choose_cpu_slices(cfg, shape, hw, dtype_bytes, cpu_attention)
            step_s = decode_step_s(cfg, best.slice_shape(cfg), hw, dtype_bytes, k)
            if kw and decode_step_s(cfg, shape, hw, dtype_bytes, kw) < step_s:
                best = replace(wider, cpu_slices=kw)
        return best

    placed_layers = cfg.full_layers(context)  # windowed layers are resident, outside the placement
    windowed = cfg.num_layers - placed_layers

    def n_compact(g: int) -> int:
        return 0 if compact is None else compact.count(cfg.num_layers * (cfg.num_kv_heads // g))

    def placed(g: int) -> int:
        """Placed slices of `g` KV heads: the full layers' less the compact ones among them (at
        least those the windowed layers cannot hold: the evictor picks by score, not layer)."""
        groups = cfg.num_kv_heads // g
        return placed_layers * groups - max(0, n_compact(g) - windowed * groups)

    def compact_tokens(c: int) -> int:
        return 0 if compact is None else min(compact.tokens(c, block_size), capacity)

    def fixed(c: int, g: int) -> int:  # GPU bytes that are not placed KV
        if activations == "hf":
            act = hf_activation_bytes(cfg, c, dtype_bytes, group_size=g, context=context)
        else:
            act = activation_bytes(cfg, c, dtype_bytes, mlp_chunk, group_size=g, context=context)
        return (
            weight_bytes(cfg, dtype_bytes)
            + act
            + reserve_bytes
            + window_kv_bytes(cfg, c, context, dtype_bytes, block_size)
            + (
                0
                if compact is None
                else compact.gpu_bytes(n_compact(g), compact_tokens(c), kv_token_bytes(cfg, g, dtype_bytes))
            )
        )

    def sizing(g: int) -> PackedSizing | None:
        return None if codec is None else PackedSizing.of(codec, g, cfg.head_dim)

    def slice_kv(g: int, c: int) -> int:
        """Bytes one slice of `g` KV heads stores at capacity (packed: rows and tail)."""
        tok, pk = kv_token_bytes(cfg, g, dtype_bytes), sizing(g)
        return capacity * tok if pk is None else pk.rows_bytes(capacity) + pk.tail_tokens(c, block_size) * tok

    def staging_kv(g: int, tokens: int) -> int:
        """Two staging buffers of `tokens` tokens (packed: and the rows a load unpacks from)."""
        pk = sizing(g)
        scratch = 0 if pk is None else scratches * pk.scratch_bytes(tokens)
        return 2 * tokens * kv_token_bytes(cfg, g, dtype_bytes) + scratch

    def all_resident_kv(g: int, c: int) -> int:
        n = placed(g)
        return n * slice_kv(g, c) + (0 if codec is None else staging_kv(g, capacity))

    def pick_chunk(g: int, kv: Callable[[int], int], floor: int = MIN_REDUCED_CHUNK) -> int:
        """The roofline chunk for slices of `g` KV heads (finer slices need longer chunks to hide
        the host's per-slice work), halved down to `floor` until it fits next to kv(chunk) bytes."""
        if chunk_size is not None:
            return min(chunk_size, context)
        pieces = placed(g) + windowed
        c = min(default_chunk_size(cfg, context, hw, dtype_bytes, pieces=pieces), context)
        while gpu_budget is not None and c > floor and fixed(c, g) + kv(c) > gpu_budget:
            c = max(c // 2, floor)
        return c

    if policy == "gpu":
        min_g = group_size or cfg.num_kv_heads
        chunk = pick_chunk(min_g, lambda c: all_resident_kv(min_g, c))
        min_kv = all_resident_kv(min_g, chunk)
    else:
        min_g = cfg.num_kv_heads if policy == "layer" else (group_size or 1)
        min_kv = staging_kv(min_g, block_size) if placed_layers else 0  # nothing to stream: no staging
        chunk = pick_chunk(min_g, lambda c: min_kv)
    if gpu_budget is not None and fixed(chunk, min_g) + min_kv > gpu_budget:
        w = weight_bytes(cfg, dtype_bytes)
        act = fixed(chunk, min_g) - w - reserve_bytes
        if policy == "gpu":
            advice = "a shorter context, the 'auto' policy or a larger --gpu-memory"
        elif chunk_size is not None and w + reserve_bytes + min_kv < gpu_budget:
            advice = "a smaller --chunk-size or a larger --gpu-memory"
        else:
            advice = "a larger --gpu-memory"
        raise CapacityError(
            f"{context} tokens need {_gb(w + act + reserve_bytes + min_kv)} of GPU memory "
            f"(weights {_gb(w)}, activations of a {chunk}-token chunk {_gb(act)}, "
            f"reserve {_gb(reserve_bytes)}, KV {_gb(min_kv)}), --gpu-memory is {_gb(gpu_budget)}; "
            f"use {advice}"
        )

    def make(g: int, resident: int, staging_tokens: int, c: int) -> KVPlan:
        n = placed(g)
        pk = sizing(g)
        staged = resident < n or pk is not None  # packed resident slices unpack through staging
        plan = KVPlan(
            policy=policy,
            group_size=g,
            resident_slices=resident,
            chunk_size=c,
            staging_buffers=2 if staged else 0,
            staging_tokens=(staging_tokens if resident < n else capacity) if staged else 0,
            context=context,
            capacity_tokens=capacity,
            num_slices=n,
            slice_token_bytes=kv_token_bytes(cfg, g, dtype_bytes),
            packed=pk,
            packed_tail_tokens=0 if pk is None else pk.tail_tokens(c, block_size),
            unpack_scratches=scratches,
            window_slices=windowed * (cfg.num_kv_heads // g),
            window_tokens=0
            if not windowed
            else window_tokens(cfg.sliding_window or 0, c, context, block_size),
            compact_slices=n_compact(g),
            compact_tokens=compact_tokens(c),
        )
        if host_budget is not None and plan.host_kv_bytes > host_budget:
            raise HostCapacityError(
                f"{context} tokens need {_gb(plan.host_kv_bytes)} of host memory for the offloaded KV "
                f"({plan.streamed_slices} slices of {_gb(plan.slice_bytes(cfg, capacity, dtype_bytes))}), "
                f"--host-memory is {_gb(host_budget)}; use a shorter context or a larger --host-memory"
            )
        return plan

    if policy == "gpu":
        return on_cpu(make(min_g, placed(min_g), 0, chunk))
    if policy == "auto":
        g = group_size or cfg.num_kv_heads
        # NOTE: everything stays resident if it does with a chunk of at least MIN_CHUNK tokens;
        # a smaller chunk would trade PCIe time for host-bound prefill.
        c = pick_chunk(g, lambda c: all_resident_kv(g, c), floor=min(MIN_CHUNK, chunk))
        if gpu_budget is None or fixed(c, g) + all_resident_kv(g, c) <= gpu_budget:
            return on_cpu(make(g, placed(g), 0, c))
    if policy in ("layer", "head"):
        g = min_g
        avail = None if gpu_budget is None else gpu_budget - fixed(chunk, g)
        tok = kv_token_bytes(cfg, g, dtype_bytes)
        return on_cpu(make(g, 0, _staging_tokens(avail, capacity, tok, block_size), chunk))
    assert gpu_budget is not None
    candidates = [group_size] if group_size else _divisors(cfg.num_kv_heads)
    best: tuple[float, int, KVPlan] | None = None
    feasible: list[KVPlan] = []
    host_error: CapacityError | None = None
    scratch_need = 0  # with a codec: GPU bytes the smallest slicing needed and did not have
    for g in candidates:
        tok = kv_token_bytes(cfg, g, dtype_bytes)

        def stream_kv(_c: int, g: int = g) -> int:  # the least a streaming plan needs
            return staging_kv(g, block_size)

        c = pick_chunk(g, stream_kv)
        pk = sizing(g)
        scratch = 0 if pk is None else scratches * pk.scratch_bytes(capacity)
        avail = gpu_budget - fixed(c, g) - scratch
        n = placed(g)
        staging = _staging_tokens(avail, capacity, tok, block_size)
        if staging == 0:
            need = fixed(c, g) + scratch + 2 * block_size * tok
            scratch_need = need if not scratch_need else min(scratch_need, need)
            continue
        resident = (
            max(0, min((avail - 2 * capacity * tok) // slice_kv(g, c), n - 1)) if staging == capacity else 0
        )
        try:
            plan = make(g, resident, staging, c)
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
            f"{context} tokens of packed KV need {_gb(scratch_need)} of GPU memory to stream a slice "
            f"(its packed rows unpack through a scratch of the whole slice), --gpu-memory is "
            f"{_gb(gpu_budget)}; use a shorter context or a larger --gpu-memory"
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
        chosen = _fastest_split(cfg, chosen, finer, split_hw, dtype_bytes)
    return chosen


# A slicing other than the least-streaming one is taken for its CPU split only when the split's
# simulation makes its decode step at least this much faster (the model's error on the H200
# was a few percent: docs/cpu_attention.md).
SPLIT_MARGIN = 0.02


def _fastest_split(
    cfg: ModelConfig, chosen: KVPlan, options: list[KVPlan], hw: Hardware, dtype_bytes: int
) -> KVPlan:
    """Among finer slicings each with its CPU split, the one whose simulated decode step is
    fastest, where it beats `chosen` (the least-streaming slicing's) by SPLIT_MARGIN. Finer slices let
    the CPU take a layer's share more evenly: on the H200 at 512K under 24 GiB one KV head a
    slice decoded at 0.671 s/token against 0.709 for four, on one machine start (simulated
    0.634 and 0.671; `bench/results/cpu_attention_512k_g1_merged.json`,
    `cpu_attention_decode_wide.json`); over int4 KV one head a slice 0.275 against four heads'
    0.315 on two starts (`cpu_attention_int4_512k_g1.json`, `cpu_attention_int4_512k_wide.json`).
    `hw`'s CPU rate is the one the split attends at (a quantized cache's packed rate)."""

    def step(plan: KVPlan) -> float:
        return decode_step_s(cfg, plan.slice_shape(cfg), hw, dtype_bytes, plan.cpu_slices)

    base = step(chosen)
    best, best_s = chosen, base
    for plan in options:
        if plan.cpu_slices and (t := step(plan)) < best_s:
            best, best_s = plan, t
    return best if best_s < base * (1 - SPLIT_MARGIN) else chosen


def _staging_tokens(avail: int | None, capacity: int, token_bytes: int, block_size: int) -> int:
    """Tokens per ping-pong buffer: the whole slice if two fit in `avail`, else whole blocks."""
    if avail is None or 2 * capacity * token_bytes <= avail:
        return capacity
    return max(avail, 0) // (2 * token_bytes) // block_size * block_size  # 0: not even one block


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


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"
