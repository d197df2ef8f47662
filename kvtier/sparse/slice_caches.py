"""`SliceCaches`: the upkeep of `HipKernel`'s per-slice GPU block caches, a mixin.

A streamed slice's `BlockCache` is allocated at its first decode step (in the slice's decode
memory when the store placed it: `_arena`), filled after each full decode step with what the
steps until the next stage-0 refresh read (`_fill`), and, after a step whose blocks overflowed
it, left holding what the next steps read first (`_keep_read`). Which blocks: `keep_blocks` and
`refresh_blocks` (`kvtier.sparse.cache_blocks`). `_covers` and `_append_only` say when a decode
step can run on the cache without a lookup. The mixin holds no state of its own: it declares
the attributes of `HipKernel` (`kvtier.sparse.kernel`) it uses, and `HipKernel` sets them. A
base of `CachedDecode` (`kvtier.sparse.cached_decode`), through which `HipKernel` has it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvtier.attention.interface import Alloc, SliceStep
from kvtier.kv.device_memory import CachingMemory, DeviceMemory, RegionMemory
from kvtier.sparse.cache_blocks import keep_blocks, refresh_blocks
from kvtier.sparse.config import HipConfig
from kvtier.sparse.decode_buffer import DecodeState
from kvtier.sparse.decode_memory import slice_decode_bytes
from kvtier.sparse.gpu_cache import BlockCache, BlockTable
from kvtier.sparse.stats import HipStats


class SliceCaches:
    """The block cache methods of `HipKernel`: allocate, fill and keep each streamed slice's GPU
    block cache (see the module doc). Mutates the kernel's block caches, decode memory and
    stats."""

    # Of `HipKernel` (see its `__init__`).
    cfg: HipConfig
    stats: HipStats
    _cache: dict[tuple[int, int, int], DecodeState]  # (layer, group, head) -> decode state
    _gpu: dict[tuple[int, int], BlockCache]  # (layer, group) -> block cache
    _streamed: set[tuple[int, int]]  # slices the store streams (asked about)
    _cover_tokens: dict[int, int]  # heads -> tokens a refresh interval reads
    _alloc: Alloc | None  # where decode memory comes from (None: the caching allocator)
    _arenas: dict[tuple[int, int], RegionMemory]  # slice -> its decode memory in `_alloc`'s

    def _arena(self, sl: tuple[int, int], row: torch.Tensor) -> DeviceMemory | None:
        """Slice `sl`'s decode memory (row: one of its tokens [2, G, D]), carved from the placed
        memory at the first call (None: nothing placed); what outgrows it spills."""
        if self._alloc is None:
            return None
        arena = self._arenas.get(sl)
        if arena is None:
            g, d = row.shape[-2], row.shape[-1]
            size = slice_decode_bytes(d, self.cfg, g, row.element_size(), sl in self._streamed)
            arena = RegionMemory(self._alloc((size,), torch.uint8), spill=CachingMemory(row.device))
            self._arenas[sl] = arena
        return arena

    def _keep_read(self, cache: BlockCache, table: BlockTable, step: SliceStep, groups: int) -> None:
        """After a step whose blocks did not all fit the cache (a stage reran over more
        candidates than it holds): keep, of what the step read, the blocks the next steps read
        first (`_keep_blocks`: the new final selection before older candidates), copied from
        the step's overflow. Without this the next steps miss the new selection."""
        assert table.extra is not None
        extra, b = table.extra, cache.block
        keep = self._keep_blocks(step, groups, extra.device, cache.slots, within=table.blocks)

        def load(missing: torch.Tensor) -> torch.Tensor:  # blocks not in the bank: in the overflow
            j = torch.searchsorted(table.blocks, missing)
            return extra[table.base[j][:, None] + torch.arange(b, device=extra.device)]  # [k, b, 2, G, D]

        kept = cache.ensure(keep, load)
        # The new token's block, which the step read, is keep's last (the largest id): it may
        # have moved into the bank.
        cache.tail = kept.base[-1:] // b if kept.last_in_bank else None

    def _append_only(self, cache: BlockCache, step: SliceStep, groups: int) -> bool:
        """Whether a decode step at step.start reads nothing stored: no stage is due and every
        decode buffer of the slice ends at step.start, so the query attends its buffer plus the
        new token (`AttendBuffer.step`). The cache then only appends the token (no lookup, no
        sync); an evicted block, if a later rerun reads it, is a miss fetched then."""
        s, n = step.start, len(self.cfg.chunk_sizes)
        if cache.end != s or (s % cache.block and cache.tail is None):
            return False
        for st in self._states(step, groups):
            due = st.first_due(self.cfg.refresh, st.step + 1)
            if due < n or st.attn.end != s or st.position >= s or s < st.window_start:
                return False
        return True

    def _covers(self, cache: BlockCache, groups: int) -> bool:
        """Whether `cache` holds everything the steps of one refresh interval read, so they
        cannot miss (the default capacity, `HipConfig.offload_cache_tokens`)."""
        heads = groups if self.cfg.per_head else 1
        if heads not in self._cover_tokens:  # NOTE: memoized: `replace` costs ~50 us a call
            self._cover_tokens[heads] = replace(self.cfg, cache_tokens=None).offload_cache_tokens(heads)
        return cache.slots * cache.block >= self._cover_tokens[heads]

    def _states(self, step: SliceStep, groups: int) -> list[DecodeState]:
        """The decode states of a slice: one per KV head with `per_head`, else one."""
        heads = range(groups) if self.cfg.per_head else (-1,)
        return [self._cache[(step.layer, step.group, h)] for h in heads]

    def _keep_blocks(
        self,
        step: SliceStep,
        groups: int,
        device: torch.device,
        slots: int,
        within: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`keep_blocks` of the slice's decode states (see `kvtier.sparse.cache_blocks`)."""
        return keep_blocks(self.cfg, self._states(step, groups), step.start, device, slots, within)

    def _cache_for(self, kv: torch.Tensor, step: SliceStep) -> BlockCache:
        sl = (step.layer, step.group)
        if sl not in self._gpu:
            heads = kv.shape[2] if self.cfg.per_head else 1
            slots, b = self.cfg.offload_cache_slots(heads), self.cfg.cache_block
            arena = self._arena(sl, kv[0])
            alloc = None if arena is None else arena.empty
            self._gpu[sl] = BlockCache(slots, b, tuple(kv.shape[1:]), kv.dtype, kv.device, alloc)
        return self._gpu[sl]

    def _fill(self, kv: torch.Tensor, step: SliceStep) -> None:
        """After a full decode step of a streamed slice: cache what later steps will read (GPU to GPU)."""
        cache = self._cache_for(kv, step)
        if cache.end != step.start:
            cache.clear()  # a new sequence, or tokens the cache never saw
        b, n = cache.block, kv.shape[0]

        def load(missing: torch.Tensor) -> torch.Tensor:
            rows = missing[:, None] * b + torch.arange(b, device=kv.device)  # [k, b]
            return kv[rows.clamp(max=n - 1)]  # [k, b, 2, G, D]; rows past the end never read

        if self._covers(cache, kv.shape[2]):
            static = refresh_blocks(self.cfg, self._states(step, kv.shape[2]), step.start, kv.device, cache)
            if static is not None:
                cache.refill(static, load, tail=static.shape[0] - 1)
                cache.end = step.start + 1
                self.stats.cache.refresh_inserted += static.shape[0]
                return
        blocks = self._keep_blocks(step, kv.shape[2], kv.device, cache.slots)
        table = cache.ensure(blocks, load)
        cache.write(table, step.start, kv[step.start])
        cache.end = step.start + 1
        self.stats.cache.refresh_reused += table.hits
        self.stats.cache.refresh_inserted += table.stored
