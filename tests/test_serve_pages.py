"""The serve block pool and prefix cache: exact page ids, refcounts, LRU order, host tier."""

from __future__ import annotations

import pytest
import torch

from kvtier.kv.pages import PagePool
from kvtier.kv.prefix_cache import HostPageCache, extend_hashes, root_hash


def test_free_ids_go_out_lowest_first() -> None:
    pool = PagePool(4)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    pool.release(1)
    assert pool.free == [1, 3]
    assert pool.allocate() == 1  # the lowest: sequences fill the pool from the bottom
    assert pool.allocate() == 3
    assert pool.allocate() is None
    assert pool.num_free == 0 and pool.num_used == 4


def test_runs_are_lent_from_the_top_and_evict_cached_pages_in_their_way() -> None:
    evicted: list[tuple[int, bytes]] = []
    pool = PagePool(10, on_evict=lambda p, h: evicted.append((p, h)))
    pages = [pool.allocate() for _ in range(4)]  # 0 1 2 3
    assert pool.register(3, b"h3")
    pool.release(3)  # idle cached: a run may take it
    pool.release(1)  # free
    assert pool.largest_run() == 7  # 3 .. 9
    assert pool.take_run(5) == 5  # the highest stretch: 5 .. 9
    assert pool.num_lent == 5 and pool.num_used == 2 + 5
    assert pool.take_run(3) is None  # 1 and 3, 4 are what is left: no 3 in a row
    assert pool.take_run(2) == 3  # 3 .. 4: evicts the cached page 3
    assert evicted == [(3, b"h3")] and pool.lookup(b"h3") is None
    assert pool.allocate() == 1 and pool.allocate() is None  # runs never hand out their ids
    pool.return_run(5)
    assert pool.free == [5, 6, 7, 8, 9] and pool.lent == {3: 2}
    assert pool.allocate() == 5
    assert pages == [0, 1, 2, 3]


def test_compaction_moves_the_fewest_pages_down_to_free_ids_and_skips_lent_runs() -> None:
    pool = PagePool(12)
    held = [pool.allocate() for _ in range(12)]  # 0 .. 11
    assert pool.take_run(1) is None
    for p in held:
        if p not in (1, 6, 7):
            pool.release(p)
    assert pool.register(6, b"h6")
    # 0 | 1 | 2 .. 5 | 6 7 | 8 .. 11: the longest free stretch is 4
    assert pool.largest_run() == 4 and pool.compaction(4) == []
    # 5 ids: windows 0 .. 4, 1 .. 5, 2 .. 6 and 7 .. 11 hold one page each; the highest goes:
    # page 7 to the lowest free id outside 7 .. 11
    assert pool.compaction(5) == [(7, 0)]
    pool.move(7, 0)
    assert pool.ref[0] == 1 and pool.ref[7] == 0 and pool.largest_run() == 5
    assert pool.take_run(4) == 8  # lent 8 .. 11; free 2 .. 5 and 7
    # 7 ids: 0 .. 6 and 1 .. 7 are the windows without a lent page, and neither has free ids
    # outside it for the pages it holds (3 for 1, and 2 for none)
    assert pool.compaction(7) == []
    pool.return_run(8)
    # now 2 .. 8 up to 5 .. 11 hold one page (6), and 5 .. 11 is the highest: 6 goes to 2
    assert pool.compaction(7) == [(6, 2)]
    pool.move(6, 2)
    assert pool.lookup(b"h6") == 2 and pool.page_hash[6] is None and pool.ref[2] == 1
    assert pool.largest_run() == 9 and pool.take_run(9) == 3
    assert pool.num_free == 0


def test_refcounts_and_cached_pages_go_to_lru_tail_first() -> None:
    evicted: list[tuple[int, bytes]] = []
    pool = PagePool(3, on_evict=lambda p, h: evicted.append((p, h)))
    a, b, c = (pool.allocate() for _ in range(3))
    assert (a, b, c) == (0, 1, 2)
    assert pool.register(0, b"h0") and pool.register(1, b"h1")
    assert not pool.register(2, b"h0")  # the hash is already cached on page 0
    pool.touch(0)  # a second sequence shares page 0
    assert pool.ref == [2, 1, 1]
    for page in (1, 0):  # a sequence frees its pages tail first
        pool.release(page)
    assert pool.ref == [1, 0, 1] and list(pool.lru) == [1]
    pool.release(0)
    pool.release(2)  # unhashed: back to the free list
    assert list(pool.lru) == [1, 0] and pool.free == [2]
    assert pool.num_free == 3
    assert pool.allocate() == 2
    assert pool.allocate() == 1  # evicts the LRU's oldest cached page
    assert evicted == [(1, b"h1")] and pool.lookup(b"h1") is None
    assert pool.lookup(b"h0") == 0
    pool.touch(0)  # a prefix hit revives an idle cached page
    assert list(pool.lru) == [] and pool.ref[0] == 1


def test_reset_cache_frees_idle_pages() -> None:
    pool = PagePool(2)
    pool.allocate()
    pool.register(0, b"x")
    pool.release(0)
    assert pool.reset_cache() == 1
    assert pool.free == [0, 1] and pool.lookup(b"x") is None


def test_hashes_chain_the_whole_prefix() -> None:
    root = root_hash("model|fp32")
    a: list[bytes] = []
    extend_hashes(a, [1, 2, 3, 4, 5, 6, 7], 2, root, 7)
    assert len(a) == 3  # full pages only
    b: list[bytes] = []
    extend_hashes(b, [9, 2, 3, 4], 2, root, 4)
    assert a[0] != b[0] and a[1] != b[1]  # same page tokens, different parent
    c: list[bytes] = []
    extend_hashes(c, [1, 2, 3, 4], 2, root_hash("other"), 4)
    assert c[0] != a[0]  # the salt separates models / dtypes


def test_host_tier_saves_loads_and_drops_oldest() -> None:
    dev = [torch.arange(3 * 2 * 1.0).view(3, 2, 1, 1, 1) + 100 * layer for layer in range(2)]
    host = HostPageCache(dev, num_slots=2)
    assert host.save(0, b"a") and host.save(1, b"b") and host.save(2, b"c")
    assert b"a" not in host and host.dropped == 1  # full: the oldest is dropped
    host.flush()
    dev[0].zero_()
    host.load(b"b", 0)
    assert dev[0][0].flatten().tolist() == [2.0, 3.0]
    assert b"b" not in host and host.num_used == 1 and list(host.free) == [1]


def test_host_tier_loads_many_pages_across_slabs_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_slots` copies each slab's slots in runs: pages from three slabs land in the
    device pages they are given, in any order, and the slots are free afterwards."""
    import kvtier.kv.prefix_cache as prefix_cache

    dev = [torch.arange(8 * 2 * 1.0).view(8, 2, 1, 1, 1) + 100 * layer for layer in range(2)]
    page_bytes = dev[0][0].numel() * dev[0].element_size()
    monkeypatch.setattr(prefix_cache, "slab_bytes", lambda *a: 2 * page_bytes)  # 2 slots a slab
    host = prefix_cache.HostPageCache(dev, num_slots=6)
    assert len(host.arenas[0].slabs()) == 3
    for page in range(6):
        assert host.save(page, bytes([page]))
    host.flush()
    want = {layer: [t.clone() for t in dev[layer][:6]] for layer in range(2)}
    for t in dev:
        t.zero_()
    pairs = [(host.take(bytes([p])), dst) for p, dst in [(5, 0), (0, 7), (3, 2), (4, 3)]]
    host.load_slots(pairs)
    for layer in range(2):
        for p, dst in [(5, 0), (0, 7), (3, 2), (4, 3)]:
            assert torch.equal(dev[layer][dst], want[layer][p])
        assert float(dev[layer][1].abs().sum()) == 0.0  # untouched
    assert host.num_used == 2 and sorted(host.free) == sorted(s for s, _ in pairs)
