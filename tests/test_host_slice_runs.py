"""A host slice's reads copy runs of memory-adjacent extents at once (`HostSlice.runs`): packed
rows, whose extents a slice reserves in one go, took one copy per 16 MiB extent, each issued by
the host. The runs must cover exactly the pieces, never join extents apart in memory (another
slab, or one given out of order), and stay within the byte limit."""

from __future__ import annotations

import torch

from kvtier.kv.host_slice import MERGED_READ_BYTES, HostSlice
from kvtier.kv.tiers import HostArena, TierAccount

E, ROW = 4, 8  # tokens an extent, bytes a token: an extent is 32 bytes, a slab 3 extents (96)


def sliced(extents: int) -> HostSlice:
    arena = HostArena((E, ROW), torch.uint8, pin=False, account=TierAccount(), slab_bytes=3 * E * ROW)
    host = HostSlice(arena, E)
    host.reserve(extents * E)
    for i, ext in enumerate(host.extents):  # token t holds bytes t * ROW ..
        ext.copy_(torch.arange(i * E * ROW, (i + 1) * E * ROW).view(E, ROW).to(torch.uint8))
    return host


def reference(host: HostSlice, start: int, end: int) -> torch.Tensor:
    return torch.cat([host.extents[t // E][t % E][None] for t in range(start, end)])


def test_adjacent_extents_read_as_one_run_up_to_a_slab() -> None:
    host = sliced(5)  # extents 0-2 in slab 0, 3-4 in slab 1
    runs = host.runs(1, 19)
    assert [(at, n) for _, at, n in runs] == [(0, 11), (11, 7)]  # tokens 1-11 in slab 0, 12-18 in slab 1
    dst = torch.zeros(18, ROW, dtype=torch.uint8)
    host.read_into(dst, 1, 19)
    assert torch.equal(dst, reference(host, 1, 19))


def test_runs_stay_within_the_byte_limit_and_cover_the_range() -> None:
    host = sliced(5)
    runs = host.runs(0, 12, limit=2 * E * ROW)  # two extents a run at most
    assert [(at, n) for _, at, n in runs] == [(0, 8), (8, 4)]
    assert all(src.shape[0] * ROW <= 2 * E * ROW for src, _, _ in runs)
    assert MERGED_READ_BYTES == 64 << 20  # the lossless tier's extent: its copies stay as they were


def test_extents_out_of_memory_order_are_not_joined() -> None:
    host = sliced(3)
    host.extents[0], host.extents[1] = host.extents[1], host.extents[0]  # slab rows 1, 0, 2
    assert [(at, n) for _, at, n in host.runs(0, 12)] == [(0, 4), (4, 4), (8, 4)]  # none adjacent
    dst = torch.zeros(12, ROW, dtype=torch.uint8)
    host.read_into(dst, 0, 12)
    assert torch.equal(dst, reference(host, 0, 12))
