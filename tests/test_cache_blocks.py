"""`kvtier.sparse.cache_blocks`: what a HiP block cache reads of its misses and keeps after an
overflowing step; `BlockCache.ensure`'s syncs."""

from __future__ import annotations

import pytest
import torch

from kvtier.sparse.cache_blocks import fetch_blocks, keep_blocks
from kvtier.sparse.config import HipConfig
from kvtier.sparse.decode_buffer import DecodeState
from kvtier.sparse.gpu_cache import BlockCache, CacheStats, block_ids
from kvtier.sparse.opcount import OpCounter


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

    def pages(self, pages: torch.Tensor, counts: torch.Tensor, page: int) -> torch.Tensor:
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


def keep_blocks_tier_by_tier(
    cfg: HipConfig, states: list[DecodeState], start: int, slots: int, within: torch.Tensor | None
) -> torch.Tensor:
    """The rule `keep_blocks` implements, one tier at a time: sinks and window, then the final
    selection, then each earlier stage's output, each tier's new blocks by id while room is
    left; then only the blocks in `within`."""
    b = cfg.cache_block
    w0 = min(st.window_start for st in states)
    edges = torch.cat((torch.arange(min(cfg.sink, start + 1)), torch.arange(w0, start + 1)))
    tiers = [edges] + [
        torch.cat([st.outputs[i] for st in states]) for i in reversed(range(len(cfg.chunk_sizes)))
    ]
    chosen = block_ids(tiers[0], b)
    for tier in tiers[1:]:
        room = slots - chosen.numel()
        if room <= 0:
            break
        more = block_ids(tier, b)
        chosen = torch.cat((chosen, more[~torch.isin(more, chosen)][:room]))
    chosen = chosen.sort().values
    return chosen if within is None else chosen[torch.isin(chosen, within)]


@pytest.mark.parametrize("seed", range(6))
def test_keep_blocks_ranks_the_tiers_in_one_sync(seed: int) -> None:
    """The blocks kept after an overflowing step are those a tier-by-tier fill keeps (sinks and
    window, final selection, earlier stages, by id within a tier, all of the first tier even past
    `slots`), for caches smaller and larger than the tiers, with and without `within`; ranking
    them makes one host-device sync (the old fill made one a tier and one `unique` a tier)."""
    g = torch.Generator().manual_seed(seed)
    cfg = HipConfig(sink=16, window=64, chunk_sizes=(32, 8, 4), budgets=(256, 64, 16), cache_block=4)
    start = 3000 + seed * 17
    states = []
    for _ in range(1 + seed % 2):  # one state, or two (per-head selections)
        outs, cand = [], torch.arange(cfg.sink, start - cfg.window)
        for chunk, budget in zip(cfg.chunk_sizes, cfg.budgets, strict=True):
            chunks = (
                cand.view(-1, chunk)
                if cand.numel() % chunk == 0
                else cand[: cand.numel() // chunk * chunk].view(-1, chunk)
            )
            pick = torch.randperm(chunks.shape[0], generator=g)[: budget // chunk].sort().values
            cand = chunks[pick].flatten()
            outs.append(cand)
        states.append(
            DecodeState(outputs=outs, computed_at=[0, 0, 0], window_start=start - cfg.window - seed)
        )
    for slots in (3, 20, 40, 90, 400):
        for within in (None, torch.randperm(start // 4, generator=g)[: start // 8].sort().values):
            with OpCounter() as ops:
                got = keep_blocks(cfg, states, start, torch.device("cpu"), slots, within)
            assert torch.equal(got, keep_blocks_tier_by_tier(cfg, states, start, slots, within))
            assert ops.sync_total == 1, ops.syncs


def test_ensure_reads_counts_back_once_and_write_none() -> None:
    """`BlockCache.ensure` with misses and an overflow: the counts are read in one sync (a
    `tolist`), no other conversion or data-sized operator (`load` is the caller's); writing the
    newest token after it, into the overflow or the bank, reads nothing back."""
    cache = BlockCache(4, 2, (1,), torch.float32, torch.device("cpu"))

    def load(missing: torch.Tensor) -> torch.Tensor:
        return missing[:, None, None].float().expand(-1, 2, 1).clone()

    cache.ensure(torch.tensor([0, 1, 2]), load)
    reads: list[int] = []
    tolist = torch.Tensor.tolist
    with pytest.MonkeyPatch.context() as m, OpCounter() as ops:
        m.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.numel()) or tolist(t))
        table = cache.ensure(torch.tensor([1, 3, 4, 5, 6]), load)  # 1 hit, 4 misses, 3 free slots
        cache.write(table, 13, torch.tensor([-1.0]))  # block 6: the overflow's
        assert cache.tail is None
        hit_last = cache.ensure(torch.tensor([4, 5]), load)  # block 5 (last) is a hit
        cache.write(hit_last, 11, torch.tensor([-2.0]))
    assert reads == [3, 3] and ops.sync_total == 0, ops.syncs
    assert (table.hits, table.stored) == (1, 3) and table.extra is not None
    assert table.in_bank.tolist() == [True, True, True, True, False]
    assert table.extra[:, 0].tolist() == [6.0, -1.0]
    assert sorted(cache.ids.tolist()) == [1, 3, 4, 5]
    slot = cache.lookup(torch.tensor([5]))
    assert cache.tail is not None and cache.tail.tolist() == slot.tolist()
    assert cache.bank[slot[0], :, 0].tolist() == [5.0, -2.0]


def test_op_counter_attributes_operators_to_the_kvtier_function_that_ran_them() -> None:
    """`OpCounter(by_function=True)`: each operator under the innermost kvtier function on the
    stack (the cache's `lookup` inside `ensure` counts as `lookup`), all of them counted."""
    cache = BlockCache(4, 2, (1,), torch.float32, torch.device("cpu"))
    with OpCounter(by_function=True) as ops:
        cache.lookup(torch.tensor([0, 1]))
        torch.zeros(3).add_(1)  # outside kvtier
    assert ops.by_function is not None and sum(ops.by_function.values()) == ops.total
    assert ops.by_function["sparse/gpu_cache.py:lookup"] > 0
    assert ops.by_function.get("outside kvtier", 0) >= 2  # zeros, add_ (this file is under tests/)
    assert OpCounter().by_function is None
