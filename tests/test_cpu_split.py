"""The planner's CPU/link split of streamed slices at decode (`kvtier.planner.cpu_split`): the
spread of CPU slices, the contention model, the simulation against the H200's measured decode
(lossless and int4), and `auto`'s choice, with the rates it is given or measures."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.kv.layout import spread as store_spread
from kvtier.loading.presets import preset_config
from kvtier.planner.cpu_split import (
    SliceShape,
    choose_cpu_slices,
    cpu_slice_flags,
    decode_step_s,
    parse_mode,
    split_rates,
    spread,
)
from kvtier.planner.hardware import HARDWARE, Hardware
from kvtier.planner.placement import KVPlan, plan_kv

H200 = HARDWARE["h200"]
LLAMA3 = preset_config("llama-3-8b")
NEEDS_CXX = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def test_planner_spread_is_the_stores() -> None:
    for n in range(1, 40):
        for k in range(n + 1):
            assert spread(n, k) == store_spread(n, k)


def test_cpu_slices_spread_over_layers_last_groups_first() -> None:
    # 3 layers x 4 groups, slices 0 and 6 resident; 5 CPU slices, 1, 2, 2 per layer, the last
    # streamed groups of each layer.
    resident = [s in (0, 6) for s in range(12)]
    flags = cpu_slice_flags(3, 4, resident, 5)
    assert [s for s, f in enumerate(flags) if f] == [3, 5, 7, 10, 11]
    # A layer with too few streamed slices passes its share on: layer 0 streams only slice 1.
    few = cpu_slice_flags(3, 4, [s in (0, 2, 3) for s in range(12)], 6)
    assert [s for s, f in enumerate(few) if f] == [1, 5, 6, 7, 10, 11]
    assert sum(cpu_slice_flags(3, 4, resident, 10)) == 10
    with pytest.raises(ConfigError, match="only 10 slices are streamed"):
        cpu_slice_flags(3, 4, resident, 11)


def test_modes_parse_and_clamp() -> None:
    assert parse_mode("auto") == "auto" and parse_mode("off") == "off" and parse_mode("7") == 7
    with pytest.raises(ConfigError, match="auto, off or a number"):
        parse_mode("some")
    shape = SliceShape(32, 4, 10, 524288, 1024, 1, 2)
    assert choose_cpu_slices(LLAMA3, shape, H200, 2, 500) == 118  # at most the streamed slices
    assert choose_cpu_slices(LLAMA3, shape, H200, 2, "off") == 0
    assert choose_cpu_slices(LLAMA3, shape, HARDWARE["rtx4090"], 2, "auto") == 0  # CPU rate unknown


def test_the_simulation_matches_the_measured_h200_decode() -> None:
    """Link only (the runs had no CPU attention): within 5% of every streamed H200 decode at 128K
    and 512K in bench/results/tiered_store.json. (At 32K head-wise, host-bound, it is 2x low.)"""
    rows = json.loads(Path("bench/results/tiered_store.json").read_text())["rows"]
    checked = 0
    for row in rows:
        p = row.get("plan")
        if not p or not p.get("staging_buffers") or row["context"] < 131072:
            continue
        ctx, g = row["context"], p["group_size"]
        blocks = -(-(-(-ctx // 256) * 256) // p["staging_tokens"])
        shape = SliceShape(32, 8 // g, p["resident_slices"], ctx, 512 * g, blocks, p["staging_buffers"])
        assert decode_step_s(LLAMA3, shape, H200, 2, 0) == pytest.approx(row["decode_s_per_token"], rel=0.05)
        checked += 1
    assert checked == 6


def test_auto_splits_on_the_h200_and_gives_a_two_core_cpu_nothing() -> None:
    plan = plan_kv(LLAMA3, 524288, gpu_budget=24 * 10**9, hardware=H200, cpu_attention="auto")
    assert plan.cpu_slices > 0
    shape = plan.slice_shape(LLAMA3)
    split, link = (decode_step_s(LLAMA3, shape, H200, 2, k) for k in (plan.cpu_slices, 0))
    assert split < 0.85 * link  # 0.90 s against 1.15 (bench/results/cpu_attention_cpu.json)
    assert (
        plan.pcie_bytes_per_decode_token
        == ((plan.streamed_slices - plan.cpu_slices) * 524288 + plan.streamed_slices) * plan.slice_token_bytes
    )
    # One worker thread at ~6 GB/s (this machine's order of magnitude): no count beats the link.
    two_core = replace(H200, cpu_attention_bw=6e9, host_read_bw=20e9)
    for policy, group in (("layer", None), ("head", 1), ("head", 2), ("auto", None)):
        kw = {"policy": policy, "group_size": group, "gpu_budget": 24 * 10**9}
        assert plan_kv(LLAMA3, 524288, hardware=two_core, cpu_attention="auto", **kw).cpu_slices == 0
        assert plan_kv(LLAMA3, 524288, hardware=H200, **kw).cpu_slices == 0  # plan_kv's default: off


def test_contention_leaves_the_link_its_rate_and_the_cpu_the_rest() -> None:
    # the preset: the link at 55 GB/s, the CPU at 104 - 55 = 49 (fitted to the decode sweeps)
    preset = split_rates(H200)
    assert preset is not None and preset.contention == "measured"
    assert (preset.pcie_bw, preset.cpu_bw) == (pytest.approx(55e9), pytest.approx(49e9))
    measured = split_rates(replace(H200, cpu_attention_bw=30e9, host_combined_bw=120e9))
    assert measured is not None and (measured.pcie_bw, measured.cpu_bw) == (55e9, 30e9)  # no contention
    read = split_rates(replace(H200, cpu_attention_bw=80e9, host_combined_bw=0.0))
    assert read is not None and read.contention == "host read rate"
    assert (read.pcie_bw, read.cpu_bw) == (pytest.approx(55e9), pytest.approx(47e9))
    factor = split_rates(replace(H200, cpu_attention_bw=45e9, host_read_bw=0.0, host_combined_bw=0.0))
    assert factor is not None and factor.contention == "factor"
    assert factor.pcie_bw + factor.cpu_bw == pytest.approx(75e9)
    slow_host = split_rates(replace(H200, host_combined_bw=50e9))
    assert slow_host is not None and (slow_host.pcie_bw, slow_host.cpu_bw) == (50e9, 0.0)
    assert split_rates(HARDWARE["rtx4090"]) is None


def test_the_simulation_matches_the_h200_cpu_slice_sweeps() -> None:
    """Decode with 0 to 44 streamed slices on the CPU at 128K and 512K (the H200 runs with the
    counts forced; two staging buffers, the plans of those runs): within 7% of each measured step
    but one, and 5% on average; the best count it finds is within a few of the measured best.
    The one: 17 of 34 slices at 128K ran 0.172 s, the simulation says 0.145 (16% low); past the
    balance point the CPU costs more there than the model knows (the planner picks 11-12)."""
    res = Path("bench/results")
    rows = [
        r
        for name in ("cpu_attention_sweep_128k", "cpu_attention_sweep_512k", "cpu_attention_decode")
        for r in json.loads((res / f"{name}.json").read_text())["rows"]
    ]
    errors = []
    for row in rows:
        p, ctx = row["plan"], row["context"]
        g = p["group_size"]
        blocks = -(-(-(-ctx // 256) * 256) // p["staging_tokens"])
        shape = SliceShape(32, 8 // g, p["resident_slices"], ctx, 512 * g, blocks, p["staging_buffers"])
        predicted = decode_step_s(LLAMA3, shape, H200, 2, p["cpu_slices"])
        errors.append(predicted / row["decode_s_per_token"] - 1)
    assert len(errors) == 9
    assert sorted(abs(e) for e in errors)[-2] < 0.07 and min(errors) > -0.17
    assert sum(abs(e) for e in errors) / len(errors) < 0.05
    # measured best: 10 of 34 at 128K (of 0, 4, 10, 17), 32 of 58 at 512K (of 0, 20, 32, 44)
    for ctx, measured_best in ((131072, 10), (524288, 32)):
        p = next(r["plan"] for r in rows if r["context"] == ctx)
        shape = SliceShape(32, 2, p["resident_slices"], ctx, 2048, 1, 2)
        assert abs(choose_cpu_slices(LLAMA3, shape, H200, 2, "auto") - measured_best) <= 6


def test_a_third_staging_buffer_is_bought_with_a_resident_slice_where_it_pays() -> None:
    budget = 24 * 2**30
    for ctx in (131072, 524288):
        off = plan_kv(LLAMA3, ctx, gpu_budget=budget, hardware=H200, group_size=4)
        split = plan_kv(LLAMA3, ctx, gpu_budget=budget, hardware=H200, cpu_attention="auto", group_size=4)
        assert (off.staging_buffers, off.cpu_slices) == (2, 0)
        assert split.staging_buffers == 3 and split.resident_slices == off.resident_slices - 1
        assert split.gpu_kv_bytes <= off.gpu_kv_bytes
        two = replace(off, cpu_slices=choose_cpu_slices(LLAMA3, off.slice_shape(LLAMA3), H200, 2, "auto"))
        t3, t2 = (decode_step_s(LLAMA3, p.slice_shape(LLAMA3), H200, 2, p.cpu_slices) for p in (split, two))
        assert t3 < t2
    # nothing resident to give: two buffers stay
    layer = plan_kv(LLAMA3, 524288, policy="layer", gpu_budget=budget, hardware=H200, cpu_attention="auto")
    assert layer.resident_slices == 0 and layer.staging_buffers == 2 and layer.cpu_slices > 0


def test_auto_takes_finer_slices_where_their_cpu_split_decodes_faster() -> None:
    """With CPU attention, `auto` compares slicings by their split's simulated decode step, not
    by streamed bytes alone: at 512K under 24 GiB one KV head a slice (0.634 s simulated) over
    four (0.671). On the H200, one machine start, they decoded at 0.671 and 0.709 s/token
    (bench/results/cpu_attention_512k_g1_merged.json, cpu_attention_decode_wide.json). Without
    CPU attention, or with a group given, the slicing is the least-streaming one as before."""
    budget = 24 * 2**30
    off = plan_kv(LLAMA3, 524288, gpu_budget=budget, hardware=H200)
    split = plan_kv(LLAMA3, 524288, gpu_budget=budget, hardware=H200, cpu_attention="auto")
    four = plan_kv(LLAMA3, 524288, gpu_budget=budget, hardware=H200, cpu_attention="auto", group_size=4)
    assert off.group_size == 4 and four.group_size == 4 and split.group_size == 1
    t1, t4 = (decode_step_s(LLAMA3, p.slice_shape(LLAMA3), H200, 2, p.cpu_slices) for p in (split, four))
    assert t1 < t4 * 0.98 and abs(t1 - 0.634) < 0.01 and abs(t4 - 0.671) < 0.01
    assert split.gpu_kv_bytes <= budget  # the finer plan is one the budget holds
    # where no slicing splits better by the margin, the least-streaming one stays
    short = plan_kv(LLAMA3, 32768, gpu_budget=budget, hardware=H200, cpu_attention="auto")
    assert short.streamed_slices == 0


def test_kvplan_checks_its_cpu_slices() -> None:
    KVPlan("head", 1, 2, 16, 2, 64, num_slices=6, cpu_slices=4)
    with pytest.raises(ConfigError, match="cpu_slices"):
        KVPlan("head", 1, 2, 16, 2, 64, num_slices=6, cpu_slices=5)
    assert plan_kv(LLAMA3, 4096, policy="head", gpu_budget=None, cpu_attention=3).cpu_slices == 3
    assert plan_kv(LLAMA3, 4096, policy="gpu", gpu_budget=None, cpu_attention=3).cpu_slices == 0


def test_a_quantized_cache_splits_at_the_cpus_packed_rate() -> None:
    """int4 host KV: the link and the CPU read packed rows. With the kernel's H200 rate over
    4-bit rows then (14.5 GB/s at 15 threads, bench/results/cpu_attention_rows_h200.json) the
    simulation gives the measured 512K decode with 20 and 40 CPU slices within 2%
    (bench/results/cpu_attention_int4_512k.json); "auto" splits where the packed rate is known
    and high enough, and gives nothing where it is unknown or slow."""
    from kvtier.policies.quant import KiviCodec

    rows = json.loads(Path("bench/results/cpu_attention_rows_h200.json").read_text())["results"]
    rate = next(r["read_gb_s"] for r in rows if r["case"] == "kivi4" and r["threads"] == 15) * 1e9
    sweep = json.loads(Path("bench/results/cpu_attention_int4_512k.json").read_text())["rows"]
    codec = KiviCodec(bits=4)
    per_token = codec.row_bytes(4, 128) / codec.group  # a slice of 4 KV heads
    for row in sweep:
        p, ctx = row["plan"], row["context"]
        shape = SliceShape(32, 2, p["resident_slices"], ctx, 2048, 1, p["staging_buffers"], per_token)
        assert shape.context * per_token * (64 - 16 - p["cpu_slices"]) == pytest.approx(
            row["h2d_bytes_per_token"], rel=0.01
        )  # what the link carried: the packed rows of the streamed slices
        if p["cpu_slices"]:
            got = decode_step_s(LLAMA3, shape, replace(H200, cpu_attention_bw=rate), 2, p["cpu_slices"])
            assert got == pytest.approx(row["decode_s_per_token"], rel=0.02)

    def planned(hw_rates: tuple[tuple[str, float], ...], mode: str | int = "auto") -> KVPlan:
        hw = replace(H200, cpu_packed_bw=hw_rates)
        return plan_kv(LLAMA3, 524288, gpu_budget=24 * 10**9, hardware=hw, cpu_attention=mode, codec=codec)

    fast = planned((("kivi4", 2.5 * rate),))
    assert fast.cpu_slices > 0 and fast.packed is not None
    shape = fast.slice_shape(LLAMA3)
    assert shape.read_token_bytes == pytest.approx(fast.packed.row_bytes / fast.packed.group)
    hw = replace(H200, cpu_attention_bw=2.5 * rate)
    assert decode_step_s(LLAMA3, shape, hw, 2, fast.cpu_slices) < decode_step_s(LLAMA3, shape, hw, 2, 0)
    assert planned((("kivi4", 0.3 * rate),)).cpu_slices == 0  # slower than it is worth
    assert planned((("kivi8", 2.5 * rate),)).cpu_slices == 0  # a rate for other rows only
    assert planned(()).cpu_slices == 0  # not measured
    assert planned((), 6).cpu_slices == 6  # a number is taken as given
    assert H200.cpu_packed_rate("kivi4") == 22.5e9  # the preset's, measured there
    assert replace(H200, cpu_packed_bw=()).cpu_packed_rate("kivi4") == 0.0
    assert replace(H200, cpu_packed_bw=(("kivi4", 1.0),)).cpu_packed_rate("kivi4") == 1.0


@NEEDS_CXX
def test_the_packed_rates_are_measured_for_every_row_format_the_kernel_reads() -> None:
    from kvtier.attention.row_formats import ROW_KINDS, RowFormat, native_row_format
    from kvtier.kv.cpu_attend import measured_packed_rates
    from kvtier.policies.quant import Fp8Codec, KiviCodec

    rates = measured_packed_rates(64, 2, bf16_bytes=2 << 20)
    assert [f for f, _ in rates] == list(ROW_KINDS) and all(r > 0 for _, r in rates)
    formats = [native_row_format(c) for c in (KiviCodec(bits=4), KiviCodec(bits=8), Fp8Codec())]
    assert formats == ["kivi4", "kivi8", "fp8"]
    assert native_row_format(KiviCodec(bits=4, group=8, residual=8)) is None
    for name in ROW_KINDS:  # a stand-in has its codec's layout and row size
        assert native_row_format(RowFormat(name)) == name
    assert RowFormat("kivi4").row_bytes(2, 64) == KiviCodec(bits=4).row_bytes(2, 64)
    assert RowFormat("fp8").row_bytes(2, 64) == Fp8Codec().row_bytes(2, 64)


def test_auto_takes_finer_slices_over_a_quantized_cache_too() -> None:
    """int4 host KV at 512K under 24 GiB: with a packed CPU rate like the H200's measured ones
    (the planner split 48-54 one-head CPU slices there) `auto` takes a finer slicing than the
    least-streaming four heads, whose split the simulation makes >= 2% faster; on the H200 one
    head a slice decoded at 0.275 s/token against 0.315 for four, two machine starts
    (bench/results/cpu_attention_int4_512k_g1.json, cpu_attention_int4_512k_wide.json). Before,
    auto left a quantized cache's slicing alone. Without a packed rate nothing changes."""
    from kvtier.policies.quant import KiviCodec

    codec, budget = KiviCodec(bits=4), 24 * 2**30
    hw = replace(H200, cpu_packed_bw=(("kivi4", 30e9),))

    def planned(hw: Hardware, **kw: object) -> KVPlan:
        return plan_kv(LLAMA3, 524288, gpu_budget=budget, hardware=hw, codec=codec, **kw)  # type: ignore[arg-type]

    auto, four = planned(hw, cpu_attention="auto"), planned(hw, cpu_attention="auto", group_size=4)
    assert four.group_size == 4 and auto.group_size < 4 and auto.cpu_slices > 0
    split = replace(H200, cpu_attention_bw=30e9)
    t_auto, t_four = (
        decode_step_s(LLAMA3, p.slice_shape(LLAMA3), split, 2, p.cpu_slices) for p in (auto, four)
    )
    assert t_auto < t_four * 0.98
    assert auto.gpu_kv_bytes <= budget
    unmeasured = planned(replace(H200, cpu_packed_bw=()), cpu_attention="auto")
    assert (unmeasured.group_size, unmeasured.cpu_slices) == (4, 0)


def test_packed_loads_count_their_unpack_on_the_link_stream() -> None:
    """int4 at 512K on the link alone: a load's unpack runs on the H2D stream and slices packed
    on the device load through the ring too, so the link waits for them (a traced step:
    bench/results/int4_512k_g1_trace.json). With `Hardware.unpack_bw` the simulation gives the
    measured steps of four heads a slice (H200) and one (H100, the same host kind) within 8%;
    without it, 13-14% short."""
    from kvtier.policies.quant import KiviCodec

    codec = KiviCodec(bits=4)
    for name, g in (("cpu_attention_int4_512k_wide", 4), ("int4_512k_g1_trace", 1)):
        row = json.loads(Path(f"bench/results/{name}.json").read_text())["rows"][0]
        p = row["plan"]
        assert p["group_size"] == g and p["cpu_slices"] == 0
        per_token = codec.row_bytes(g, 128) / codec.group
        shape = SliceShape(
            32, 8 // g, p["resident_slices"], row["context"], 512 * g, 1, p["staging_buffers"], per_token
        )
        measured = row["decode_s_per_token"]
        assert decode_step_s(LLAMA3, shape, H200, 2, 0) == pytest.approx(measured, rel=0.08)
        assert decode_step_s(LLAMA3, shape, replace(H200, unpack_bw=0.0), 2, 0) < measured * 0.87
