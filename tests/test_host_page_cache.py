"""The prefix cache's host tier on the store's `HostArena`: slabs that waste little of the pinned
allocator's power-of-two rounding, every slot its own memory, bytes counted in the host tier,
pages back bit for bit."""

from __future__ import annotations

import pytest
import torch

import kvtier.kv.prefix_cache as prefix_cache
from kvtier.kv.prefix_cache import HostPageCache, slab_bytes
from kvtier.kv.tiers import HOST

PAGE = 16 * 2 * 8 * 128 * 2  # one layer's page of Llama-3-8B in bf16: 64 KiB


@pytest.mark.parametrize("slots", [1, 1000, 15_000, 20_000, 123_457])
def test_pinned_slabs_are_powers_of_two_that_waste_little(slots: int) -> None:
    size = slab_bytes(PAGE, slots, pinned=True)
    assert size & (size - 1) == 0 and PAGE <= size <= 1 << 30
    total = PAGE * slots
    slabs = -(-slots // (size // PAGE))
    assert slabs * size - total <= max(total // 32, size - total)  # one small slab may round up
    # One pinned tensor of them all, as before, rounds up to the next power of two.
    if slots == 20_000:
        one = 1 << (total - 1).bit_length()
        assert one - total > 0.5 * total and slabs * size - total < 0.03 * total


def test_a_small_host_tier_takes_a_small_slab() -> None:
    assert slab_bytes(PAGE, 1000, pinned=True) == 64 * 2**20  # not a 1 GiB slab for 62.5 MiB
    assert slab_bytes(12_288, 7, pinned=False) == 7 * 12_288  # unpinned: split evenly


def test_pages_round_trip_through_their_own_slots() -> None:
    layers = [torch.randn(6, 4, 2, 2, 8) for _ in range(3)]  # [num_pages, P, 2, H_kv, D]
    cache = HostPageCache(layers, num_slots=4)
    assert cache.account.allocated[HOST] >= 3 * 4 * layers[0][0].numel() * 4
    ptrs = {t.data_ptr() for per_layer in cache.slots for t in per_layer}
    assert len(ptrs) == 3 * 4  # no two slots share memory
    before = [t[2].clone() for t in layers]
    assert cache.save(2, b"h2")
    cache.flush()  # the copy, queued before anything writes page 2 again
    for t in layers:
        t[2].zero_()
    cache.load(b"h2", 5)
    assert all(torch.equal(t[5], b) for t, b in zip(layers, before, strict=True))


PER = 8  # slots a slab in the load tests below
DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # a dtype a layer: one staging buffer serves all


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits, so a comparison is bit for bit."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def saved_cache(
    monkeypatch: pytest.MonkeyPatch, num_slots: int = 40, num_pages: int = 48
) -> tuple[prefix_cache.HostPageCache, list[torch.Tensor], list[list[torch.Tensor]]]:
    """A host tier of `num_slots` slots in slabs of PER, slot s holding device page s of three
    layers, and the device pages set to -1 afterwards; returns it, the device pages [num_pages,
    P, 2, H_kv, D] per layer and the saved pages per layer and slot."""
    g = torch.Generator().manual_seed(0)
    dev = [torch.randn(num_pages, 4, 2, 2, 8, generator=g).to(dtype) for dtype in DTYPES]
    monkeypatch.setattr(prefix_cache, "slab_bytes", lambda page_bytes, *a: PER * page_bytes)
    cache = prefix_cache.HostPageCache(dev, num_slots=num_slots)
    assert cache._per == PER
    assert all(len(slabs) == -(-num_slots // PER) for slabs in cache._slabs)
    for page in range(num_slots):
        assert cache.save(page, bytes([page]))  # a fresh cache takes its slots in order
    cache.flush()
    want = [[t[slot].clone() for slot in range(num_slots)] for t in dev]
    for t in dev:
        t.fill_(-1)
    return cache, dev, want


def load_and_check(
    cache: prefix_cache.HostPageCache,
    dev: list[torch.Tensor],
    want: list[list[torch.Tensor]],
    slots: list[int],
) -> None:
    """Load `slots` into device pages in another order (slot i of the list to page perm[i]) and
    check every page bit for bit, the pages not loaded untouched and the slots freed in order."""
    perm = torch.randperm(len(dev[0]), generator=torch.Generator().manual_seed(1))[: len(slots)]
    pairs = [(cache.take(bytes([slot])), int(page)) for slot, page in zip(slots, perm, strict=True)]
    free_before, loaded_before = list(cache.free), cache.loaded
    cache.load_slots(pairs)
    for layer, t in enumerate(dev):
        for slot, page in pairs:
            assert torch.equal(bits(t[page]), bits(want[layer][slot])), (layer, slot, page)
        untouched = [p for p in range(len(t)) if p not in {page for _, page in pairs}]
        assert bool((t[untouched] == -1).all())
    assert list(cache.free) == free_before + slots
    assert cache.loaded == loaded_before + len(slots)


def test_slot_runs_split_at_gaps_and_slabs() -> None:
    runs, pages = prefix_cache.slot_runs([(9, 0), (3, 1), (7, 2), (8, 3), (4, 4), (12, 5)], per=8)
    assert runs == [(0, 3, 5), (0, 7, 8), (1, 0, 2), (1, 4, 5)]  # 7 and 8 are in two slabs
    assert pages == [1, 4, 2, 3, 0, 5]  # each sorted slot's page


SLOT_ORDERS = {
    "contiguous": (list(range(40)), False),  # 5 runs: one a slab
    "reversed": (list(range(39, -1, -1)), False),
    "two_slabs": (list(range(5, 13)), False),  # rows 5-7 of slab 0, 0-4 of slab 1
    "8_runs_of_three": ([s for s in range(32) if s % 4 < 3][::-1], False),  # max(8, 24 // 8)
    "9_runs_of_three": ([s for s in range(36) if s % 4 < 3][::-1], True),
    "every_other": (list(range(0, 40, 2)), True),  # 20 runs of one
    "every_third_shuffled": ([27, 3, 39, 12, 0, 21, 33, 6, 18, 30, 9, 36, 15, 24], True),
}


@pytest.mark.parametrize("order", list(SLOT_ORDERS))
def test_load_slots_puts_every_slot_in_its_page_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """Runs of consecutive slots are copied run by run; slots too scattered for that (more runs
    than max(8, k // 8)) are gathered on the host. Either way each page gets its own slot."""
    slots, gathered = SLOT_ORDERS[order]
    cache, dev, want = saved_cache(monkeypatch)
    load_and_check(cache, dev, want, slots)
    assert cache.gathered == int(gathered)
    assert (cache._staging is not None) == gathered  # the run path stages on the device


@pytest.mark.parametrize("order", ["contiguous", "every_third_shuffled"])
def test_loads_and_saves_go_a_chunk_of_pages_at_a_time(monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    """With CHUNK_BYTES of 3 pages (all three dtypes' pages), saving 40 pages and loading them
    back go 3 pages a gather, and every page still lands in its own place."""
    page = sum(
        torch.empty(4, 2, 2, 8, dtype=d).numel() * torch.empty((), dtype=d).element_size() for d in DTYPES
    )
    monkeypatch.setattr(prefix_cache, "CHUNK_BYTES", 3 * page)
    cache, dev, want = saved_cache(monkeypatch)
    assert cache.chunk_pages == 3
    gathers: list[int] = []
    chunk = prefix_cache.HostPageCache._load_chunk

    def counted(self: prefix_cache.HostPageCache, pairs: list[tuple[int, int]]) -> None:
        gathers.append(len(pairs))
        chunk(self, pairs)

    monkeypatch.setattr(prefix_cache.HostPageCache, "_load_chunk", counted)
    slots = SLOT_ORDERS[order][0]
    load_and_check(cache, dev, want, slots)
    assert max(gathers) == 3 and sum(gathers) == len(slots)


def test_the_host_staging_buffer_is_reused_and_grown_only_when_too_small(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache, dev, want = saved_cache(monkeypatch)
    load_and_check(cache, dev, want, list(range(1, 40, 4)))  # 10 runs of one
    assert cache._staging is not None
    first = cache._staging.data_ptr(), cache._staging.numel()
    assert first[1] == 10 * dev[0][0].numel() * 4  # float32's layer is the largest
    load_and_check(cache, dev, want, list(range(0, 40, 4)))  # as many: the same buffer
    assert (cache._staging.data_ptr(), cache._staging.numel()) == first and cache.gathered == 2
    load_and_check(cache, dev, want, [s for s in range(40) if s % 4 >= 2])  # 10 runs of two
    assert cache._staging.numel() == 2 * first[1] and cache.gathered == 3


def test_saves_are_copied_at_flush_in_runs_and_before_a_load_reuses_the_page() -> None:
    """`save` only takes a slot; `flush` copies every pending page (a dropped entry's pending
    copy replaced by its slot's new page), and `load_slots` flushes before it overwrites a
    page that was just saved, so the saved slot keeps the page's old contents."""
    g = torch.Generator().manual_seed(1)
    dev = [torch.randn(6, 4, 2, 2, 8, generator=g) for _ in range(2)]
    cache = HostPageCache(dev, num_slots=3)
    old = [t.clone() for t in dev]
    for page in (0, 1, 2, 3):  # the 4th drops page 0's entry and takes its slot
        assert cache.save(page, bytes([page]))
    assert cache._pending == {0: 3, 1: 1, 2: 2} and cache.dropped == 1
    cache.flush()
    assert not cache._pending
    for layer in range(len(dev)):
        for page in (1, 2, 3):
            assert torch.equal(cache.slots[layer][cache.lru[bytes([page])]], old[layer][page])
    # page 4 is saved (pending) and, in the same step, a host hit is loaded into it
    assert cache.save(4, b"four") is True  # drops page 1's entry (the oldest)
    cache.load_slots([(cache.take(bytes([2])), 4)])
    for layer, t in enumerate(dev):
        assert torch.equal(t[4], old[layer][2])  # the load landed
        assert torch.equal(cache.slots[layer][cache.lru[b"four"]], old[layer][4])  # saved first
