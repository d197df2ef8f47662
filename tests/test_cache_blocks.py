"""`kvtier.sparse.cache_blocks.fetch_blocks`: what a HiP block cache reads of its misses."""

from __future__ import annotations

import pytest
import torch

from kvtier.sparse.cache_blocks import fetch_blocks
from kvtier.sparse.gpu_cache import CacheStats


class Rows:
    """A `Fetch` over a tensor of stored rows [n, 2, G, D] that counts its calls."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv, self.calls = kv, 0

    def __call__(self, start: int, end: int) -> torch.Tensor:
        raise AssertionError("fetch_blocks reads through runs()")

    def runs(self, spans: list[tuple[int, int, int]], out: torch.Tensor) -> None:
        self.calls += 1
        for start, end, at in spans:
            out[at : at + end - start] = self.kv[start:end]

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        raise AssertionError("fetch_blocks reads through runs()")


def test_missing_blocks_are_read_in_one_call_and_rows_not_stored_are_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Runs of consecutive blocks, in one `runs` call; the block holding `stored` is read up to
    it and zero after, blocks wholly past it are zero; only the rows read are counted."""
    empty = torch.empty
    # fresh memory as garbage (NaN), so rows left unwritten show
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    block, stored = 4, 22  # blocks 0-4 stored, block 5 holds rows 20, 21 only
    kv = torch.randn(32, 2, 1, 3)
    fetch = Rows(kv)
    stats = CacheStats()
    like = torch.empty(1, 2, 1, 3)
    got = fetch_blocks(torch.tensor([0, 2, 3, 5, 6]), block, stored, fetch, like, stats)
    assert got.shape == (5, block, 2, 1, 3) and fetch.calls == 1
    assert torch.equal(got[0], kv[0:4]) and torch.equal(got[1:3].flatten(0, 1), kv[8:16])
    assert torch.equal(got[3, :2], kv[20:22])
    assert not got[3, 2:].any() and not got[4].any()
    assert stats.fetched_bytes == (4 + 8 + 2) * like[0].numel() * like.element_size()
    # everything stored: no zeroing needed, every row read
    stats = CacheStats()
    got = fetch_blocks(torch.tensor([1, 4]), block, stored, fetch, like, stats)
    assert torch.equal(got[0], kv[4:8]) and torch.equal(got[1], kv[16:20])
    assert stats.fetched_bytes == 8 * like[0].numel() * like.element_size()
