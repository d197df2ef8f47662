"""How a tiered request is planned over borrowed pool pages under a GPU budget (`plan_store`).

No weights: a stand-in engine (`bench/serve_lend_plans.py`'s `Server`, which prints the same
plans per method) carries Llama-3-8B's shapes, the H200's hardware numbers and the
budget a 24 GiB server leaves its long requests. The planner spends every byte it is given,
and buffers fill a run of pages only whole, so the first trial over the offered run puts more
in the reserve than the reserve holds; the plan must still borrow pages (it once borrowed none
at every budget where the reserve alone held no resident slice), and what it keeps outside the
run must fit the reserve.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from bench.serve_lend_plans import CFG, PAGE_BYTES
from bench.serve_lend_plans import Server as Engine
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import CapacityError
from kvtier.kv.device_memory import fitting, region_buffers
from kvtier.kv.layout import KVLayout
from kvtier.methods import MethodChoice, parse_choice, plan_for
from kvtier.methods.registry import Placement
from kvtier.planner.inputs import PlanInputs
from kvtier.planner.memory import GPU_RESERVE_BYTES, activation_bytes, weight_bytes
from kvtier.planner.placement import KVPlan
from kvtier.serve import store_plan
from kvtier.serve.store_plan import plan_store

CONTEXT = 262_144 + 16


def recorded_placements(monkeypatch: pytest.MonkeyPatch) -> list[Placement]:
    """Every placement `plan_store` gets from `plan_for` from now on, in order."""
    placements: list[Placement] = []

    def recorded(inputs: PlanInputs, choice: MethodChoice) -> Placement:
        placements.append(plan_for(inputs, choice))
        return placements[-1]

    monkeypatch.setattr(store_plan, "plan_for", recorded)
    return placements


def outside_the_run(plan: KVPlan, engine: Engine, placed: Placement | None = None) -> int:
    """GPU bytes the plan keeps beside the weights and outside its run of lent pages (with
    `placed`, its method's: the reserve, less its `method_buffers` that fit the run)."""
    layout = KVLayout.of(CFG, plan.group_size, 256, torch.bfloat16)
    buffers = region_buffers(layout, plan, CONTEXT, packing=plan.packed is not None)
    extra = 0 if placed is None else placed.reserve_bytes
    buffers += [] if placed is None else list(placed.method_buffers)
    used = fitting(buffers, engine.offer * PAGE_BYTES)
    act = activation_bytes(CFG, plan.chunk_size, 2, group_size=plan.group_size, context=CONTEXT)
    return act + plan.gpu_kv_bytes + extra - used


@pytest.mark.parametrize("budget_gb", [17.0, 17.5, 18.0, 19.0, 21.0])
def test_a_long_request_borrows_pages_and_keeps_the_rest_within_the_reserve(budget_gb: float) -> None:
    engine = Engine(budget=int(budget_gb * 1e9), offer=661)
    seq = SimpleNamespace(prompt=[1] * 262_144, params=SamplingParams(max_tokens=16), method=None)
    plan, _, first = plan_store(engine, seq)  # type: ignore[arg-type]
    assert first == 1 and len(engine.lent) == 1
    assert 0 < engine.lent[0] <= engine.offer
    room = engine.budget - weight_bytes(CFG, 2) - GPU_RESERVE_BYTES
    assert outside_the_run(plan, engine) <= room
    alone = Engine(budget=engine.budget, offer=0)
    plan_alone, _, none = plan_store(alone, seq)  # type: ignore[arg-type]
    assert none is None and not alone.lent
    # the borrowed bytes hold KV: more of it stays on the GPU than the reserve alone keeps
    assert plan.gpu_kv_bytes > plan_alone.gpu_kv_bytes
    assert replace(plan, chunk_size=plan_alone.chunk_size) == plan  # the reserve's chunk kept


@pytest.mark.parametrize("budget_gb", [20.0, 21.0])
@pytest.mark.parametrize("spec", ["hip,hip_preset=fast", "quest,kv_budget=2048"])
def test_a_sparse_request_borrows_pages_with_its_gpu_extras_counted_in_the_reserve(
    spec: str, budget_gb: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What HiP (decode buffers, RoPE table; block caches that miss the run) and Quest (page
    bounds that miss the run) keep on the GPU besides the store stays with the caching
    allocator: what the request keeps outside the run, those counted whole, fits the reserve,
    its buffers fill part of the run, and with the pages it keeps at least as much KV on the GPU
    as over the reserve alone."""
    engine = Engine(budget=int(budget_gb * 1e9), offer=661)
    method = parse_choice(spec)
    seq = SimpleNamespace(prompt=[1] * 262_144, params=SamplingParams(max_tokens=16), method=method)
    placements = recorded_placements(monkeypatch)
    plan, _, first = plan_store(engine, seq)  # type: ignore[arg-type]
    assert first == 1 and len(engine.lent) == 1
    placed = next(p for p in reversed(placements) if p.plan == plan)
    assert placed.reserve_bytes > 1e9  # HiP's ~1-3 GB, Quest's ~2 GB at 256K
    room = engine.budget - weight_bytes(CFG, 2) - GPU_RESERVE_BYTES
    assert outside_the_run(plan, engine, placed) <= room
    layout = KVLayout.of(CFG, plan.group_size, 256, torch.bfloat16)
    assert fitting(region_buffers(layout, plan, CONTEXT), engine.lent[0] * PAGE_BYTES) > 0
    alone = Engine(budget=engine.budget, offer=0)
    plan_alone, _, none = plan_store(alone, seq)  # type: ignore[arg-type]
    assert none is None and plan.gpu_kv_bytes >= plan_alone.gpu_kv_bytes


def planned_over_pages(
    monkeypatch: pytest.MonkeyPatch, budget: float, spec: str
) -> tuple[Engine, SimpleNamespace, KVPlan, Placement]:
    """A 256K request naming `spec` planned on a server of `budget` bytes offering 661 pages:
    the engine, the request, its plan (over one lent run) and the placement it came from."""
    engine = Engine(budget=int(budget), offer=661)
    method = parse_choice(spec)
    seq = SimpleNamespace(prompt=[1] * 262_144, params=SamplingParams(max_tokens=16), method=method)
    placements = recorded_placements(monkeypatch)
    plan, _, first = plan_store(engine, seq)  # type: ignore[arg-type]
    assert first == 1 and len(engine.lent) == 1
    return engine, seq, plan, next(p for p in reversed(placements) if p.plan == plan)


def test_hips_decode_memory_is_lent_pages_so_256k_fits_a_19_gb_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HiP's placement lists its RoPE table and each slice's decode arena (its decode rows and,
    streamed, the bank `CachedDecode` allocates: `method_buffers`), and `plan_store` fits them
    into the lent run after the store's buffers: at 19 GB a 256K request, which the reserve
    alone holds only with a block cache below the steps (its caches took 2.40 GB of it), runs
    with its caches in pool pages."""
    from kvtier.sparse import cache_bank_bytes, hip_config, hip_method_buffers
    from kvtier.sparse.rope_ext import table_bytes

    engine, seq, plan, placed = planned_over_pages(monkeypatch, 19e9, "hip")
    config = replace(hip_config("lean"), cache_tokens=placed.cache_tokens)  # `auto` past 8K: lean
    bank = cache_bank_bytes(CFG, config, plan.group_size, 2)
    assert plan.resident_slices == 0 < plan.streamed_slices  # every slice streams here
    flags = [True] * plan.num_slices
    assert placed.method_buffers == hip_method_buffers(CFG, config, plan.group_size, 2, CONTEXT, flags)
    rope, arenas = placed.method_buffers[:2], placed.method_buffers[2:]
    assert sum(rope) == table_bytes(CONTEXT, CFG.head_dim, 2) and len(arenas) == plan.num_slices
    assert all(a > bank for a in arenas)  # its bank and its decode rows
    layout = KVLayout.of(CFG, plan.group_size, 256, torch.bfloat16)
    run = engine.lent[0] * PAGE_BYTES
    store_only = fitting(region_buffers(layout, plan, CONTEXT), run)
    with_caches = fitting([*region_buffers(layout, plan, CONTEXT), *placed.method_buffers], run)
    assert with_caches - store_only >= bank  # at least one cache is in the run
    room = engine.budget - weight_bytes(CFG, 2) - GPU_RESERVE_BYTES
    assert outside_the_run(plan, engine, placed) <= room
    # over the reserve alone it fits only with a block cache below the steps (misses fetched)
    from kvtier.sparse import SMALL_CACHE_TOKEN_STEPS

    alone = recorded_placements(monkeypatch)
    plan_store(Engine(budget=engine.budget, offer=0), seq)  # type: ignore[arg-type]
    assert alone[-1].cache_tokens in SMALL_CACHE_TOKEN_STEPS
    assert placed.cache_tokens not in SMALL_CACHE_TOKEN_STEPS


def test_quests_page_bounds_are_lent_pages_so_256k_fits_a_17_5_gb_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Quest's placement lists one page bounds buffer per slice past its dense layers (their sum
    is its reserve), and `plan_store` fits them into the lent run: at 17.5 GB a 256K request,
    which the reserve alone cannot hold (~2 GB of bounds), runs with its bounds in pool pages."""
    from kvtier.policies.quest import bounded_slices, quest_gpu_bytes

    engine, seq, plan, placed = planned_over_pages(monkeypatch, 17.5e9, "quest,kv_budget=2048")
    assert len(placed.method_buffers) == bounded_slices(CFG, plan.group_size)
    assert sum(placed.method_buffers) == placed.reserve_bytes == quest_gpu_bytes(CFG, CONTEXT, 16, 2)
    layout = KVLayout.of(CFG, plan.group_size, 256, torch.bfloat16)
    run = engine.lent[0] * PAGE_BYTES
    with_bounds = fitting([*region_buffers(layout, plan, CONTEXT), *placed.method_buffers], run)
    assert with_bounds - fitting(region_buffers(layout, plan, CONTEXT), run) > placed.reserve_bytes / 2
    room = engine.budget - weight_bytes(CFG, 2) - GPU_RESERVE_BYTES
    assert outside_the_run(plan, engine, placed) <= room
    with pytest.raises(CapacityError):
        plan_store(Engine(budget=engine.budget, offer=0), seq)  # type: ignore[arg-type]


@pytest.mark.parametrize("budget_gb", [17.5, 21.0])
@pytest.mark.parametrize("spec", ["snapkv,kv_budget=2048", "h2o,kv_budget=2048"])
def test_an_evicting_request_keeps_its_slices_in_borrowed_pages(spec: str, budget_gb: float) -> None:
    """An evictor's store allocates each slice once, at what it keeps plus a chunk
    (`KVPlan.compact_tokens`), so its slices are a run of lent pages: only its activations stay
    in the reserve. At 17.5 GB the reserve alone cannot hold the request; with the pages it runs."""
    engine = Engine(budget=int(budget_gb * 1e9), offer=661)
    seq = SimpleNamespace(
        prompt=[1] * 262_144, params=SamplingParams(max_tokens=16), method=parse_choice(spec)
    )
    plan, _, first = plan_store(engine, seq)  # type: ignore[arg-type]
    assert first == 1 and len(engine.lent) == 1
    assert plan.streamed_slices == 0 and plan.compact_tokens == plan.context < CONTEXT
    assert engine.lent[0] * PAGE_BYTES >= plan.gpu_kv_bytes  # every slice in the run
    act = activation_bytes(CFG, plan.chunk_size, 2, group_size=plan.group_size, context=CONTEXT)
    assert outside_the_run(plan, engine) == act
    assert act <= engine.budget - weight_bytes(CFG, 2) - GPU_RESERVE_BYTES
    alone = Engine(budget=engine.budget, offer=0)
    if budget_gb < 18:
        with pytest.raises(CapacityError):
            plan_store(alone, seq)  # type: ignore[arg-type]


@pytest.mark.parametrize("budget_gb", [17.0, 21.0])
def test_a_head_sparsity_request_borrows_pages_for_more_resident_heads(budget_gb: float) -> None:
    """Head sparsity's compact slices and its placed slices (whole or staged) are a region too:
    with the pages the retrieval heads keep more KV on the GPU than over the reserve alone, and
    what stays outside the run fits the reserve."""
    engine = Engine(budget=int(budget_gb * 1e9), offer=661)
    seq = SimpleNamespace(
        prompt=[1] * 262_144,
        params=SamplingParams(max_tokens=16),
        method=parse_choice("duo,head_sparsity=0.5"),
    )
    plan, _, first = plan_store(engine, seq)  # type: ignore[arg-type]
    assert first == 1 and len(engine.lent) == 1 and plan.compact_slices > 0
    room = engine.budget - weight_bytes(CFG, 2) - GPU_RESERVE_BYTES
    assert outside_the_run(plan, engine) <= room
    alone = Engine(budget=engine.budget, offer=0)
    plan_alone, _, none = plan_store(alone, seq)  # type: ignore[arg-type]
    assert none is None and plan.resident_slices > plan_alone.resident_slices


@pytest.mark.parametrize("budget_gb", [19.0, 21.0])
@pytest.mark.parametrize("spec", ["int4", "int8"])
def test_a_quantized_request_keeps_its_packed_rows_in_borrowed_pages(spec: str, budget_gb: float) -> None:
    """A quantized store's resident slices stay packed on the device; their rows (in slabs of at
    most 64 MiB), tail rings and the unpack scratch fill the run of lent pages after the staging
    buffers, so more packed slices stay resident than over the reserve alone."""
    engine = Engine(budget=int(budget_gb * 1e9), offer=661)
    seq = SimpleNamespace(
        prompt=[1] * 262_144, params=SamplingParams(max_tokens=16), method=parse_choice(spec)
    )
    plan, _, first = plan_store(engine, seq)  # type: ignore[arg-type]
    assert first == 1 and len(engine.lent) == 1 and plan.packed is not None and plan.resident_slices
    layout = KVLayout.of(CFG, plan.group_size, 256, torch.bfloat16)
    buffers = region_buffers(layout, plan, CONTEXT, packing=True)
    assert len(buffers) > 2 + plan.resident_slices  # tails, staging, rows, scratch
    staging = plan.staging_buffers * plan.staging_tokens * plan.slice_token_bytes
    run = engine.lent[0] * PAGE_BYTES
    assert fitting(buffers, run) > max(staging + 0.15e9, run - 64e6)  # rows in the run, filled
    room = engine.budget - weight_bytes(CFG, 2) - GPU_RESERVE_BYTES
    assert outside_the_run(plan, engine) <= room
    alone = Engine(budget=engine.budget, offer=0)
    plan_alone, _, _ = plan_store(alone, seq)  # type: ignore[arg-type]
    assert plan.resident_slices > plan_alone.resident_slices
    assert plan.gpu_kv_bytes > plan_alone.gpu_kv_bytes + 1e9


def test_hip_over_packed_kv_lists_a_bank_for_every_staged_slice() -> None:
    """Over `--kv-quant` every slice is attended through staging (its packed rows unpacked
    there, on the device or from the host), so the kernel gives each one a block cache: HiP's
    `method_buffers` list a slice arena with its bank for all of them, device-packed ones too."""
    from kvtier.planner.hardware import hardware_preset
    from kvtier.sparse import hip_config, hip_method_buffers

    inputs = PlanInputs(CFG, 262_144, hardware=hardware_preset("h200"), dtype_bytes=2, gpu_budget=24 << 30)
    placed = plan_for(inputs, parse_choice("hip,kv_quant=int4"))
    plan = placed.plan
    assert plan.packed is not None and plan.resident_slices > 0  # some slices packed on the device
    config = replace(hip_config("lean"), cache_tokens=placed.cache_tokens)
    staged = hip_method_buffers(CFG, config, plan.group_size, 2, 262_144, [True] * plan.num_slices)
    assert placed.method_buffers == staged


# What a 24 GiB Llama-3-8B server leaves a request over a store of its own (the H200 smoke of
# 2026-12-05, bench/results/gpu_smoke_serve.json: 16.40 GB after HiP's 2.08 GB).
SERVER_24GIB = 18_480_000_000


def test_hip_requests_fit_a_24_gib_8b_server_whose_pool_keeps_every_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under 24 GiB the batch keeps an 8B model's whole pool (64 x 2,048 tokens), and the
    offload reserve is short of HiP's decode memory at the preset's budgets: the smoke's
    304-token HiP request failed with CapacityError. A short request's HiP memory is now bounded
    by its tokens (`HipConfig.capacity`), so it fits the reserve alone; a 128K one, which fits
    nowhere without pages, borrows the free pages the keep withheld, and only then."""
    hip = parse_choice("hip,hip_preset=fast")
    short = SimpleNamespace(prompt=[1] * 288, params=SamplingParams(max_tokens=16), method=hip)
    engine = Engine(budget=SERVER_24GIB, offer=0, wider=661)
    _, _, first = plan_store(engine, short)  # type: ignore[arg-type]
    assert first is None and not engine.lent
    long = SimpleNamespace(prompt=[1] * 131_072, params=SamplingParams(max_tokens=16), method=hip)
    with pytest.raises(CapacityError):
        plan_store(Engine(budget=SERVER_24GIB, offer=0), long)  # type: ignore[arg-type]
    engine = Engine(budget=SERVER_24GIB, offer=0, wider=661)
    _, _, first = plan_store(engine, long)  # type: ignore[arg-type]
    assert first == 1 and 0 < engine.lent[0] <= 661
    # At 16K the reserve alone holds it only with a block cache below the steps (a stopgap that
    # misses every step); the pages the keep withheld give it a whole one, so it borrows them.
    from kvtier.sparse import SMALL_CACHE_TOKEN_STEPS

    mid = SimpleNamespace(prompt=[1] * 16_384, params=SamplingParams(max_tokens=16), method=hip)
    placements = recorded_placements(monkeypatch)
    engine = Engine(budget=SERVER_24GIB, offer=0, wider=661)
    plan, _, first = plan_store(engine, mid)  # type: ignore[arg-type]
    assert first == 1 and engine.lent
    assert next(p for p in reversed(placements) if p.plan == plan).cache_tokens not in SMALL_CACHE_TOKEN_STEPS
    assert placements[0].cache_tokens in SMALL_CACHE_TOKEN_STEPS  # the reserve alone's


def test_a_placed_request_is_logged_and_a_stopgap_cache_warned_of(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`kvtier serve` prints how each request over a store of its own was placed; a HiP request
    that only fits with a stopgap block cache (host-bound decode) is a warning that names the
    flag giving it a whole cache."""
    import logging

    hip = parse_choice("hip,hip_preset=fast")
    long = SimpleNamespace(prompt=[1] * 131_072, params=SamplingParams(max_tokens=16), method=hip)
    with caplog.at_level(logging.INFO, logger="kvtier.serve"):
        plan, _, _ = plan_store(Engine(budget=SERVER_24GIB, offer=0, wider=661), long)  # type: ignore[arg-type]
    (record,) = caplog.records
    assert record.levelno == logging.INFO and "a 131,088-token request, hip: kv=" in record.message
    assert f"{plan.group_size} KV head" in record.message and "pool pages borrowed" in record.message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvtier.serve"):  # the reserve alone, no pages
        plan_store(Engine(budget=SERVER_24GIB, offer=0), replace_prompt(long, 16_384))  # type: ignore[arg-type]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "stopgap" in record.message
    assert "--offload-reserve" in record.message


def replace_prompt(seq: SimpleNamespace, n: int) -> SimpleNamespace:
    return SimpleNamespace(prompt=[1] * n, params=seq.params, method=seq.method)
