"""A store over a region of memory (what the server lends a tiered request: a run of its KV
pages) takes exactly what `region_buffers` lists, placed by `fitting` and in that order (for
every placement policy, head sparsity's compact slices and a quantized store's packed rows), and
gives the same logits as over the caching allocator. A region too small raises `CapacityError`;
one with a spill places first fit as `fitting` says; device slabs divide their extents exactly
within the cap.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvtier.engine.llm import LLM
from kvtier.errors import CapacityError
from kvtier.kv.device_memory import RegionMemory, fitting, region_buffers
from kvtier.kv.layout import KVLayout
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.methods import parse_choice
from kvtier.planner.placement import KVPlan
from kvtier.policies import PolicyParts
from tests.serve_helpers import gqa_llm

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return gqa_llm(tmp_path_factory)


PLANS = [
    KVPlan("gpu", group_size=2, resident_slices=3, chunk_size=64, staging_buffers=0, staging_tokens=0),
    KVPlan("head", group_size=1, resident_slices=0, chunk_size=16, staging_buffers=2, staging_tokens=48),
    KVPlan("auto", group_size=1, resident_slices=2, chunk_size=16, staging_buffers=3, staging_tokens=24),
    KVPlan("layer", group_size=2, resident_slices=1, chunk_size=16, staging_buffers=2, staging_tokens=48),
]


@pytest.mark.parametrize("plan", PLANS, ids=[p.policy for p in PLANS])
def test_a_store_over_a_region_takes_region_bytes_and_equals_the_allocator(llm: LLM, plan: KVPlan) -> None:
    ids = torch.randint(1, 211, (37,), generator=torch.Generator().manual_seed(5))
    lay = KVLayout.of(llm.model_config, plan.group_size, 8, torch.float32)

    def check(store: TieredKVStore, inside: Callable[[torch.Tensor], bool]) -> None:
        bufs = list(store.resident.values()) + (store.ring.buffers if store.ring else [])
        assert bufs and all(inside(b) for b in bufs)

    same_over_a_region(
        llm, plan, PolicyParts(), ids, 48, region_buffers(lay, plan, 48), check, chunk=len(ids)
    )


def test_a_region_too_small_raises_capacity_error() -> None:
    memory = RegionMemory(torch.zeros(1024, dtype=torch.uint8))
    assert memory.empty((64,), torch.float32).shape == (64,)
    with pytest.raises(CapacityError, match="sized too small"):
        memory.empty((200,), torch.float32)


def test_a_region_with_a_spill_places_first_fit_as_fitting_says() -> None:
    from kvtier.kv.device_memory import CachingMemory, fitting

    region = torch.zeros(3000, dtype=torch.uint8)
    memory = RegionMemory(region, spill=CachingMemory(CPU))
    sizes = [1200, 2000, 600, 100]  # bytes: 1200 fits, 2000 spills, 600 and 100 fit after it
    inside = []
    for n in sizes:
        t = memory.empty((n // 4,), torch.float32)
        inside.append(region.data_ptr() <= t.data_ptr() < region.data_ptr() + 3000)
    assert inside == [True, False, True, True]
    # 1200 at 0; 600 at 1536 (aligned to 512); 100 at 2560
    assert memory.spilled == 2000 and memory.used == fitting(sizes, 3000) == 2560 + 100


def test_head_sparsitys_store_over_a_region_takes_what_region_buffers_says(llm: LLM) -> None:
    """Head sparsity mixes compact slices (at `compact_tokens`) with placed ones (whole, or
    streamed through staging): the store asks for the whole ones, then the compact ones, then
    staging, as `region_buffers` lists them, and gives the allocator's logits."""
    plan = KVPlan(
        "auto", group_size=1, resident_slices=2, chunk_size=16, staging_buffers=2, staging_tokens=40,
        compact_slices=3, compact_tokens=72 + 16,
    )  # fmt: skip
    parts = parse_choice("duo,head_sparsity=0.5,kv_budget=72").build(
        llm.model_config, CPU, llm.loaded.model, None, context=120
    )
    ids = torch.randint(1, 211, (96,), generator=torch.Generator().manual_seed(6))
    lay = KVLayout.of(llm.model_config, plan.group_size, 8, torch.float32)
    sizes = region_buffers(lay, plan, 120)
    assert len(sizes) == 2 + 3 + 2 and sizes[2] < sizes[0]  # whole, compact, staging

    def check(store: TieredKVStore, inside: Callable[[torch.Tensor], bool]) -> None:
        assert sorted(store.slice_length) == [72] * 3 + [100] * 3  # the streaming heads evicted
        bufs = list(store.resident.values()) + (store.ring.buffers if store.ring else [])
        assert len(bufs) == 7 and all(inside(b) for b in bufs)

    same_over_a_region(llm, plan, parts, ids, 120, sizes, check)


@pytest.mark.parametrize("codec", ["int4", "fp8"])
@pytest.mark.parametrize("resident", [0, 3])
def test_a_quantized_store_over_a_region_takes_what_region_buffers_says(
    llm: LLM, codec: str, resident: int
) -> None:
    """A quantized store keeps its resident slices packed on the device: their tail rings,
    the staging buffers, their packed rows and the unpack scratch all come from its memory, in
    the order `region_buffers` lists them, and its logits equal the caching allocator's."""
    from kvtier.planner.packed import PackedSizing

    parts = parse_choice(codec).build(llm.model_config, CPU, llm.loaded.model, None, context=96)
    packer = parts.codec
    sizing = PackedSizing.of(packer, 1, llm.model_config.head_dim)  # type: ignore[arg-type]
    plan = KVPlan(
        "auto", group_size=1, resident_slices=resident, chunk_size=16, staging_buffers=2,
        staging_tokens=96, packed=sizing,
    )  # fmt: skip
    ids = torch.randint(1, 211, (80,), generator=torch.Generator().manual_seed(8))
    lay = KVLayout.of(llm.model_config, 1, 8, torch.float32)
    sizes = region_buffers(lay, plan, 96, packing=True)
    assert len(sizes) == (2 + 1 if resident == 0 else 5)  # staging, scratch (+ tails, rows)

    def check(store: TieredKVStore, inside: Callable[[torch.Tensor], bool]) -> None:
        assert len(store.on_device) == resident and store.packed is not None
        rows = [slab for a in store.packed.arenas if a.device is not None for slab in a.slabs()]
        assert len(rows) == (1 if resident else 0)
        assert all(inside(t) for t in [*rows, *store.packed.scratches])

    same_over_a_region(llm, plan, parts, ids, 96, sizes, check)


@pytest.mark.parametrize("extents", [1, 2, 37, 64, 500, 1920])
@pytest.mark.parametrize("extent_mib", [1, 16, 100])
def test_device_slabs_divide_the_extents_exactly_within_the_cap(extents: int, extent_mib: int) -> None:
    """A device arena's slabs hold a whole share of its extents: no byte beyond what the planner
    counts, none over 64 MiB unless one extent is, and a run of lent pages can hold them apart."""
    from kvtier.kv.tiers import DEVICE_SLAB_BYTES, device_slab_bytes

    extent = extent_mib << 20
    slab = device_slab_bytes(extent, extents)
    per = slab // extent
    assert slab % extent == 0 and extents % per == 0
    assert slab <= max(DEVICE_SLAB_BYTES, extent)
    if extents % 4 == 0 and extent_mib == 16:
        assert per == 4  # the most that fit 64 MiB


def same_over_a_region(
    llm: LLM,
    plan: KVPlan,
    parts: PolicyParts,
    ids: torch.Tensor,
    capacity: int,
    sizes: list[int],
    check: Callable[[TieredKVStore, Callable[[torch.Tensor], bool]], None],
    chunk: int = 16,
) -> None:
    """A store of `plan` and `parts` over the caching allocator and over a region sized by
    `fitting(sizes)`: `chunk`-token prefill steps of `ids`, then 4 greedy tokens. The region's store
    uses exactly those bytes (up to the last alignment) and gives the same logits; `check` sees
    each store with a test of whether a tensor lies in the region (never, for the allocator's)."""
    need = fitting(sizes, 1 << 62)
    region = torch.zeros(need + 1000, dtype=torch.uint8)
    base, end = region.data_ptr(), region.data_ptr() + region.numel()
    memory = RegionMemory(region)
    outs = []
    for mem in (None, memory):
        store = TieredKVStore(
            llm.model_config, plan, device=CPU, dtype=torch.float32, capacity=capacity,
            options=StoreOptions(8), memory=mem, **parts.store_kwargs(),
        )  # fmt: skip
        logits = []
        for a in range(0, len(ids), chunk):
            store.begin_step(len(ids[a : a + chunk]))
            logits.append(llm.loaded.model(ids[a : a + chunk], store)[-1])
            store.end_step()
        for _ in range(4):
            store.begin_step(1)
            logits.append(llm.loaded.model(logits[-1].argmax().view(1), store)[-1])
            store.end_step()
        outs.append(torch.stack(logits))
        check(store, (lambda t: base <= t.data_ptr() < end) if mem is not None else (lambda t: True))
        store.close()
    assert memory.used <= need and need - memory.used < 512
    assert torch.equal(outs[0], outs[1])
