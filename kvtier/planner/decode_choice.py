"""Choices `plan_kv` (`kvtier.planner.placement`) makes between candidate plans by their
simulated decode step (`kvtier.planner.cpu_split.decode_step_s`): a plan's CPU-attended slices
(`with_cpu_split`, and with them a third staging buffer where that pays), a finer slicing for
its CPU split (`fastest_split`), and a second unpack scratch for a packed cache
(`faster_scratches`).
"""

from __future__ import annotations

from dataclasses import replace

from kvtier.attention.row_formats import native_row_format
from kvtier.config import ModelConfig
from kvtier.planner.compact import CompactSlices
from kvtier.planner.cpu_split import choose_cpu_slices, decode_step_s
from kvtier.planner.hardware import Hardware
from kvtier.planner.kv_plan import KVPlan
from kvtier.planner.packed import PackedFormat

# A slicing other than the least-streaming one is taken for its CPU split only when the split's
# simulation makes its decode step at least this much faster (the model's error on the H200
# was a few percent: docs/cpu_attention.md).
SPLIT_MARGIN = 0.02


def with_cpu_split(
    plan: KVPlan,
    cfg: ModelConfig,
    *,
    hw: Hardware,
    link_hw: Hardware,
    dtype_bytes: int,
    cpu_attention: str | int,
    codec: PackedFormat | None,
    windowed: int,
    compact: CompactSlices | None,
) -> KVPlan:
    """The plan with its CPU-attended slices chosen (none where the CPU kernel's plain
    attention is not the model's, soft-capped or latent scores, and none next to windowed
    layers, which the CPU split does not model yet). A quantized cache splits at the CPU's
    measured rate over its packed rows (`Hardware.cpu_packed_bw`); without one, "auto"
    gives it none. `link_hw`: the link as the CPU split sees it (with two unpack scratches,
    packed loads unpack off its stream); `windowed`: the model's windowed layers at the
    context; `compact`: slices an evictor keeps small on the GPU."""
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


def fastest_split(
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


def faster_scratches(
    cfg: ModelConfig,
    one: KVPlan,
    two: KVPlan,
    hw: Hardware,
    codec: PackedFormat | None,
    dtype_bytes: int,
) -> KVPlan:
    """Of a packed cache's plans with one unpack scratch (`one`) and with two (`two`), the one
    whose simulated decode step is faster: a second scratch lets loads unpack off the link's
    stream, at the GPU bytes it takes (a resident slice, say). `one` where a CPU split was
    forced by count at an unknown CPU rate."""
    # NOTE: each with its own CPU split, which the CPU attends at its packed rate
    split_hw = hw.over_packed(native_row_format(codec)) if codec is not None else hw
    if (one.cpu_slices or two.cpu_slices) and split_hw.cpu_attention_bw <= 0:
        return one  # a split forced by count at an unknown CPU rate: nothing to simulate
    t_one = decode_step_s(cfg, one.slice_shape(cfg), split_hw, dtype_bytes, one.cpu_slices)
    t_two = decode_step_s(
        cfg, two.slice_shape(cfg), replace(split_hw, unpack_bw=0.0), dtype_bytes, two.cpu_slices
    )
    return two if t_two < t_one else one
