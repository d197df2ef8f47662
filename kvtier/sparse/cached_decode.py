"""`CachedDecode`: the offloaded decode path of `HipKernel` (its `CachingSliceKernel` half), a mixin.

Offloaded KV (`CachingSliceKernel`): for a slice the store streams from host memory, only a
decode step where stage 0 is due (or the first) needs the whole slice; the kernel then also
fills the slice's GPU `BlockCache` with what the steps until the next stage-0 refresh can read
(sinks, stage-0 selection, window; with a cache that covers the interval, by a static-shape
`refill` without host syncs; a smaller cache keeps the final selection first). Those steps
stream nothing: they run the same code on a `PositionedKV` view of the cache, `fetch`ing only
missing blocks from the host, so outputs are bitwise those of the non-offloaded kernel. Which
blocks are read and kept: `kvtier.sparse.cache_blocks`. With `HipConfig.host_scoring` no decode
step streams: stage 0 is scored on keys read from the host tier (`HostKeys`).

It also holds the stage pieces both halves run (`_stages`, `_window_start`, `_middle`). The
mixin holds no state of its own: it declares the attributes of `HipKernel`
(`kvtier.sparse.kernel`) it uses, and `HipKernel` sets them and provides `_heads`.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import cast

import torch

from kvtier.attention.interface import Alloc, ExtentKeys, Fetch, SliceStep
from kvtier.kv.device_memory import CachingMemory, DeviceMemory, RegionMemory
from kvtier.sparse.block_sparse import use_triton
from kvtier.sparse.cache_blocks import fetch_blocks, keep_blocks, needed_positions, refresh_blocks
from kvtier.sparse.config import HipConfig
from kvtier.sparse.decode_buffer import KV, DecodeState, step_buffers
from kvtier.sparse.decode_memory import slice_decode_bytes
from kvtier.sparse.gpu_cache import BlockCache, BlockTable, PositionedKV, block_ids
from kvtier.sparse.host_keys import HostKeys
from kvtier.sparse.prefill import prune_blocks
from kvtier.sparse.pruning import run_stages
from kvtier.sparse.rope_ext import RopeTable
from kvtier.sparse.stats import HipStats


class CachedDecode:
    """The `CachingSliceKernel` methods of `HipKernel`: decode steps of streamed slices served
    from per-slice GPU block caches (see the module doc). Mutates the kernel's block caches,
    decode states and stats."""

    # Of `HipKernel` (see its `__init__`).
    cfg: HipConfig
    rotary: RopeTable | None  # context extension: keys rotated in the kernel
    stats: HipStats
    _cache: dict[tuple[int, int, int], DecodeState]  # (layer, group, head) -> decode state
    _gpu: dict[tuple[int, int], BlockCache]  # (layer, group) -> block cache
    _streamed: set[tuple[int, int]]  # slices the store streams (asked about)
    _cover_tokens: dict[int, int]  # heads -> tokens a refresh interval reads
    _stage0: dict[tuple[int, int, int], torch.Tensor]  # stage 0 scored from host keys this step
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

    # -- CachingSliceKernel -----------------------------------------------------------------

    @property
    def decode_streams(self) -> bool:
        """Whether a decode step may need a slice whole: not with `HipConfig.host_scoring`."""
        return not self.cfg.host_scoring

    def needs_slice(self, step: SliceStep, n_new: int) -> bool:
        """Whether a step of a streamed slice needs it whole: prefill, or (without
        `HipConfig.host_scoring`, which scores stage 0 on host keys and serves every decode step
        from the block cache) stage 0 is due or the block cache is not in step.

        Records that the slice is streamed (so its full decode steps fill its block cache).
        """
        sl = (step.layer, step.group)
        self._streamed.add(sl)
        if n_new > 1:
            return True
        if self.cfg.host_scoring:
            return False
        cache = self._gpu.get(sl)
        if cache is None or cache.end != step.start:
            return True
        return self._stage0_due(step)

    def attend_cached(
        self, q: torch.Tensor, kv_new: torch.Tensor, step: SliceStep, fetch: Fetch
    ) -> torch.Tensor:
        """A decode step from the slice's block cache: q [1, H_q_g, D], kv_new [1, 2, G, D].

        With a cache that holds a whole refresh interval (`_covers`) nothing can miss, and the
        step runs without a single host-device sync: the view reads every slot, the new token
        is appended by tensor ops. A smaller cache does the same on steps that read nothing
        stored (`_append_only`); otherwise blocks are looked up and misses fetched (syncs).
        """
        cache = self._cache_for(kv_new, step)
        b, s = cache.block, step.start
        fresh = int(s % b == 0)  # the new token starts a block: nothing stored to look up
        st = self.stats.cache
        groups = kv_new.shape[2]
        host = self._stage0_due(step)  # `needs_slice` said no: `HipConfig.host_scoring`
        if host:
            if cache.end != s:  # a new sequence, or the slice's first decode step
                cache.clear()
                cache.end = s  # nothing cached is stale: what the step reads is fetched
            needed = self._refresh_from_host(q, step, fetch, groups)
        elif self._covers(cache, groups) or self._append_only(cache, step, groups):
            cache.append(s, kv_new[0])
            st.cached_steps += 1
            st.appended += fresh
            return self._heads(q, PositionedKV.of(cache, cache.table(), s + 1), kv_new[0], step)
        else:
            needed = needed_positions(self.cfg, self._states(step, groups), s, kv_new.device)
        blocks = block_ids(needed, b)
        table = cache.ensure(blocks, lambda missing: fetch_blocks(missing, cache.block, s, fetch, kv_new, st))
        cache.write(table, s, kv_new[0])
        cache.end = s + 1
        st.lookups += blocks.numel() - fresh
        st.hits += table.hits
        st.misses += blocks.numel() - fresh - table.hits
        st.appended += fresh
        out = self._heads(q, PositionedKV.of(cache, table, s + 1), kv_new[0], step)
        if table.extra is not None:
            # NOTE: a cache that covers an interval holds a refresh's reads and the appends until
            # the next one (`offload_cache_tokens`); its later steps read it without a lookup.
            assert not (host and self._covers(cache, groups)), "a covering cache overflowed"
            self._keep_read(cache, table, step, groups)
        return out

    def attend_cached_layer(
        self, q: torch.Tensor, kv_new: torch.Tensor, steps: list[SliceStep]
    ) -> torch.Tensor | None:
        """A decode step of a layer whose slices are all cached, in one go when no slice reads
        anything stored: q [1, H_q, D], kv_new [1, 2, H_kv, D], steps[i] of the i-th slice (equal
        head groups, in order). Returns [1, H_q, D], or None (nothing done) when some slice's
        step reruns a stage or looks blocks up: the store then calls `attend_cached` a slice
        at a time.

        Each slice appends the token to its block cache and each decode query to its
        `AttendBuffer`; the queries are rotated, their rows written and all attended in one
        launch each (`step_buffers`), with the outputs of `attend_cached` slice by slice.
        """
        n_stages = len(self.cfg.chunk_sizes)
        groups = kv_new.shape[2] // len(steps)
        caches, states = [], []
        for step in steps:
            cache = self._gpu.get((step.layer, step.group))
            if q.shape[0] != 1 or cache is None or self._stage0_due(step):
                return None
            if not (self._covers(cache, groups) or self._append_only(cache, step, groups)):
                return None
            s = step.start
            for st in self._states(step, groups):
                due = st.first_due(self.cfg.refresh, st.step + 1)
                if due < n_stages or st.attn.end != s or st.position >= s or s < st.window_start:
                    return None
                states.append(st)
            caches.append(cache)
        stats = self.stats.cache
        for i, (cache, step) in enumerate(zip(caches, steps, strict=True)):
            cache.append(step.start, kv_new[0, :, i * groups : (i + 1) * groups])
            stats.cached_steps += 1
            stats.appended += int(step.start % cache.block == 0)
        for st in states:
            st.step += 1
            st.position = steps[0].start
        entries = len(states)  # one per slice, or one per KV head with `per_head`
        rows = kv_new[0].view(2, entries, -1, kv_new.shape[-1]).transpose(0, 1)  # [E, 2, G_e, D]
        qs = q[0].reshape(entries, -1, q.shape[-1])  # [E, H_q_e, D]
        out = step_buffers([st.attn for st in states], qs, rows, steps[0].start, self.rotary)
        return out.view(1, -1, q.shape[-1])

    def _stage0_due(self, step: SliceStep) -> bool:
        """Whether this decode step of a slice runs stage 0: its first (no decode state, or a
        new sequence), or a rerun."""
        st = self._cache.get((step.layer, step.group, 0 if self.cfg.per_head else -1))
        if st is None or step.start <= st.position:
            return True
        return st.first_due(self.cfg.refresh, st.step + 1) == 0

    def _refresh_from_host(self, q: torch.Tensor, step: SliceStep, fetch: Fetch, groups: int) -> torch.Tensor:
        """Stage 0 of a decode step, scored on keys read from the host tier (`HostKeys`), kept in
        `_stage0` for `_decode`; returns the positions the rest of the step reads (sinks, the
        new stage-0 selection, the new window), for the block cache to provide.

        Scores, slabs and the selection are those of stage 0 over the whole slice: the same
        keys in the same ranges (`ScoreFn.bisected` with `span`), so the outputs are too."""
        cfg, s, layer = self.cfg, step.start, step.layer
        w0 = self._window_start(s)
        cand = self._middle(w0, q.device)
        pos = torch.full((1,), s, dtype=torch.long, device=q.device)
        heads = range(groups) if cfg.per_head else (-1,)
        r = q.shape[1] // groups
        parts = [torch.arange(min(cfg.sink, s + 1), device=q.device)]
        # NOTE: the length of the slice a streamed step would see (its kv includes the new
        # token at s, never a candidate): the scoring bounds its RoPE positions by it.
        extents = fetch.key_extents(w0) if self._probing(q) else None  # stage 0 reads [sink, w0)
        in_place = None if extents is None else replace(extents, length=s + 1)
        for h in heads:
            qh = q if h < 0 else q[:, h * r : (h + 1) * r]
            keys: HostKeys | ExtentKeys
            if in_place is not None:
                keys = in_place if h < 0 else in_place.of_head(h)
            else:
                keys = HostKeys(fetch, s + 1, groups, q.shape[2], head=None if h < 0 else h)
            (out,) = self._stages(qh, pos, keys, layer, cand, 0, upto=1)
            self._stage0[(layer, step.group, h)] = out
            parts.append(out)
        parts.append(torch.arange(min(w0, s + 1), s + 1, device=q.device))  # w0 > s: all sinks
        return torch.cat(parts)

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

    # -- block cache ------------------------------------------------------------------------

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

    # -- pieces ---------------------------------------------------------------------------------

    def _window_start(self, first_query: int) -> int:
        """w0 of a query block: the window covers [w0, query] for every query of the block."""
        return max(self.cfg.sink, first_query - self.cfg.window + 1)

    def _middle(self, w0: int, device: torch.device) -> torch.Tensor:
        """Stage-0 candidates: every key between the sinks and the window, [max(w0 - sink, 0)]."""
        return torch.arange(self.cfg.sink, w0, device=device)

    def _stages(
        self,
        q: torch.Tensor,
        pos: torch.Tensor,
        kv: KV | HostKeys | ExtentKeys,
        layer: int,
        cand: torch.Tensor,
        first: int,
        upto: int | None = None,
    ) -> list[torch.Tensor]:
        """Stages first..upto - 1 (all by default) over kv: a whole slice, a `PositionedKV` view,
        or a slice's keys on the host (stage 0 alone: read in ranges, or in place by probe)."""
        cfg = self.cfg
        n = len(cfg.chunk_sizes) if upto is None else upto
        if isinstance(kv, ExtentKeys):  # stage 0 alone
            assert first == 0 and n == 1, "keys in place serve stage 0 alone"
            return [self._stage0_probes(q, pos, kv, layer, cand)]
        if not isinstance(kv, HostKeys) and self._probing(q):
            return self._stages_probed(q, pos, kv, layer, cand, first, n)
        whole = not isinstance(kv, PositionedKV)  # stage 0's candidates are a range: `span`
        if isinstance(kv, torch.Tensor):
            keys: object = kv[:, 0]
        else:
            keys = kv if isinstance(kv, HostKeys) else kv.map(lambda t: t[:, 0])
        return run_stages(
            q,
            pos,
            cast(torch.Tensor, keys),  # NOTE: a view is only indexed by positions, host keys by ranges
            cand,
            chunk_sizes=cfg.chunk_sizes[:n],
            budgets=cfg.stage_budgets(layer)[:n],
            strides=cfg.query_strides[:n],
            mode=cfg.scoring_rope(layer),
            rotary=self.rotary,
            window=cfg.window,
            first=first,
            head_score=cfg.head_score,
            span=cfg.sink if first == 0 and whole else None,  # see `_middle`
        )

    def _probing(self, q: torch.Tensor) -> bool:
        """Whether the stages score their chunks on the bisection's probes with Triton
        (`HipConfig.probe_scoring`): on CUDA, or on CPU tensors under Triton's interpreter."""
        if not self.cfg.probe_scoring or not use_triton():
            return False
        return q.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

    def _stages_probed(
        self, q: torch.Tensor, pos: torch.Tensor, kv: KV, layer: int, cand: torch.Tensor, first: int, n: int
    ) -> list[torch.Tensor]:
        """`_stages` first..n - 1 scored on their probes (`bisect_triton`): stage 0 over the
        slice's keys (a range), later stages over their candidates' keys in the slice or, in a
        `PositionedKV` view, where the block cache holds them (by address)."""
        cfg, outs = self.cfg, []
        for i in range(first, n):
            if i == 0:
                assert isinstance(kv, torch.Tensor), "stage 0 needs the whole slice or its keys"
                cand = self._stage0_probes(q, pos, kv[:, 0], layer, cand)
                outs.append(cand)
                continue
            m, chunk, budget = cand.numel(), cfg.chunk_sizes[i], cfg.stage_budgets(layer)[i]
            if -(-m // chunk) > budget // chunk:  # else every candidate is kept (`prune_stage`)
                if isinstance(kv, torch.Tensor):
                    keys, at = kv[:, 0], None
                else:
                    keys, addresses = kv.key_addresses(cand)
                    at = addresses[None]
                valid = torch.full((1,), m, dtype=torch.long, device=q.device)
                kept, _ = prune_blocks(
                    q[None], pos[None], keys, cand[None], valid, chunk, budget,
                    mode=cfg.scoring_rope(layer), rotary=self.rotary, window=cfg.window, triton=True,
                    head_score=cfg.head_score, addresses=at, length=kv.shape[0],
                )  # fmt: skip
                cand = kept[0] if m % chunk == 0 else kept[0][kept[0] >= 0]  # no padding: no sync
            outs.append(cand)
        return outs

    def _stage0_probes(
        self,
        q: torch.Tensor,
        pos: torch.Tensor,
        keys: torch.Tensor | ExtentKeys,
        layer: int,
        cand: torch.Tensor,
    ) -> torch.Tensor:
        """Stage 0 of one decode query q [1, H_q, D] at pos [1] over cand == arange(sink, w0),
        its chunks scored on the bisection's probes alone (`prune_blocks` with `bisect_triton`,
        as a prefill block of one query): keys [S, G, D] of the staged slice, or `ExtentKeys`
        read in place from host memory. Returns the kept positions, sorted."""
        cfg = self.cfg
        n, chunk, budget = cand.numel(), cfg.chunk_sizes[0], cfg.stage_budgets(layer)[0]
        valid = torch.full((1,), n, dtype=torch.long, device=q.device)
        kept, _ = prune_blocks(
            q[None], pos[None], keys, None, valid, chunk, budget, mode=cfg.scoring_rope(layer),
            rotary=self.rotary, window=cfg.window, first=cfg.sink, width=n, triton=True,
            head_score=cfg.head_score,
        )  # fmt: skip
        if n % chunk == 0 or -(-n // chunk) <= budget // chunk:  # no padding: no boolean mask (a sync)
            return kept[0]
        return kept[0][kept[0] >= 0]

    # -- provided by HipKernel (a stub that types the calls above) -------------------------

    def _heads(self, q: torch.Tensor, kv: KV, new: torch.Tensor, step: SliceStep) -> torch.Tensor:
        raise NotImplementedError
