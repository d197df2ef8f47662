"""The prefix cache's host tier on the store's `HostArena`: slabs that waste little of the pinned
allocator's power-of-two rounding, every slot its own memory, bytes counted in the host tier,
pages back bit for bit."""

from __future__ import annotations

import pytest
import torch

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
    for t in layers:
        t[2].zero_()
    cache.load(b"h2", 5)
    assert all(torch.equal(t[5], b) for t, b in zip(layers, before, strict=True))
