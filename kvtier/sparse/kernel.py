"""`HipKernel`: InfiniteHiP sparse attention as a `SliceKernel` of the tiered KV store.

Prefill (T > 1): every block of `block_q` queries is pruned from scratch (the whole blocks of a
chunk together, `kvtier.sparse.prefill`) and attends its own selection (all blocks in one
batched attention). Decode (T == 1): each stage's selection is cached per (layer, group[, head])
and recomputed only every `refresh[i]` steps (or when an earlier stage was recomputed), so the
expensive first stage, the only one whose work grows with the context, runs rarely.

    decode step:   0   1   2   3   4   5   6   7   8      refresh = (4, 2, 1)
    stage 0        x               x               x
    stage 1        x       x       x       x       x
    stage 2        x   x   x   x   x   x   x   x   x

NOTE: while stage 0's selection is cached, tokens keep leaving the window; to lose none of them
the window of a cached decode step reaches back to where it started when stage 0 last ran (so
it grows by up to refresh[0] - 1 tokens between refreshes).

Between stage recomputations a decode query attends the same rows plus one new token, kept
gathered and rotated in an `AttendBuffer` (a step appends a row and attends: ~12 operators).

Offloaded KV (`CachingSliceKernel`): for a slice the store streams from host memory, only a
decode step where stage 0 is due (or the first) needs the whole slice; the kernel then also
fills the slice's GPU `BlockCache` with what the steps until the next stage-0 refresh can read
(sinks, stage-0 selection, window; with a cache that covers the interval, by a static-shape
`refill` without host syncs; a smaller cache keeps the final selection first). Those steps
stream nothing: they run the same code on a `PositionedKV` view of the cache, `fetch`ing only
missing blocks from the host, so outputs are bitwise those of the non-offloaded kernel. Which
blocks are read and kept: `kvtier.sparse.cache_blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import cast

import torch

from kvtier.attention.interface import Fetch, SliceStep
from kvtier.errors import ConfigError
from kvtier.model.rope import Rotary
from kvtier.sparse.block_sparse import attend_blocks
from kvtier.sparse.cache_blocks import fetch_blocks, keep_blocks, needed_positions, refresh_blocks
from kvtier.sparse.config import HipConfig
from kvtier.sparse.decode_buffer import KV, DecodeState
from kvtier.sparse.gpu_cache import BlockCache, BlockTable, CacheStats, PositionedKV, block_ids
from kvtier.sparse.host_keys import HostKeys
from kvtier.sparse.prefill import prune_whole_blocks
from kvtier.sparse.pruning import run_stages
from kvtier.sparse.rope_ext import RopeTable


@dataclass
class HipStats:
    """Counters (mutable, run-time): stage recomputations in decode, pruned query blocks."""

    decode_recomputes: list[int]
    prefill_blocks: int = 0
    keys_read: int = 0  # attended keys counted on the host so far (see `attended_keys`)
    keys_pending: list[torch.Tensor] = field(default_factory=list)  # device counts, not yet read
    cache: CacheStats = field(default_factory=CacheStats)  # GPU block caches of streamed slices

    def count_keys(self, n: int | torch.Tensor) -> None:
        """Add attended keys: a host int, or a device count that prefill does not wait for."""
        if isinstance(n, int):
            self.keys_read += n
            return
        self.keys_pending.append(n)
        if len(self.keys_pending) >= 256:  # folded on the device, still no sync
            self.keys_pending[:] = [torch.stack(self.keys_pending).sum()]

    @property
    def attended_keys(self) -> int:
        """Sum over prefill query blocks of keys attended (sink + selected + window). Reads the
        device counts prefill left (a sync), once."""
        if self.keys_pending:
            self.keys_read += int(torch.stack(self.keys_pending).sum())
            self.keys_pending.clear()
        return self.keys_read

    @property
    def hit_rate(self) -> float:
        """Block-cache hits per lookup on decode steps served without streaming (1.0 if none)."""
        return self.cache.hit_rate


class HipKernel:
    """Sparse attention over one slice: `__call__(q [T, H_q_g, D], kv [S+T, 2, G, D], step)`.

    With `cfg.extend`, q and kv are un-rotated (store built with rotate_keys=False) and `rotary`
    is required; otherwise they arrive rotated at true positions. Mutates only its decode cache,
    its GPU block caches and stats, never kv. Also a `CachingSliceKernel`: see the module doc.
    """

    def __init__(self, cfg: HipConfig, rotary: Rotary | None = None) -> None:
        if cfg.extend and rotary is None:
            raise ConfigError("hip extend=True needs the model's Rotary: keys are rotated in the kernel")
        self.cfg = cfg
        self.rotary = RopeTable(rotary) if cfg.extend and rotary is not None else None
        self.stats = HipStats(decode_recomputes=[0] * len(cfg.chunk_sizes))
        self._cache: dict[tuple[int, int, int], DecodeState] = {}
        self._gpu: dict[tuple[int, int], BlockCache] = {}  # (layer, group) -> block cache
        self._streamed: set[tuple[int, int]] = set()  # slices the store streams (asked about)
        self._cover_tokens: dict[int, int] = {}  # heads -> tokens a refresh interval reads
        # Stage 0's selection scored from host keys this step (`_refresh_from_host`), by
        # (layer, group, head): `_decode` takes it instead of rerunning stage 0.
        self._stage0: dict[tuple[int, int, int], torch.Tensor] = {}

    @property
    def last_query_alone(self) -> bool:
        """Whether the prefill loop should run the prompt's last token as a step of its own
        (`HipConfig.last_query_alone`)."""
        return self.cfg.last_query_alone

    @property
    def needs_unrotated_keys(self) -> bool:
        """True when the store must keep K and Q un-rotated (`rotate_keys=False`)."""
        return self.cfg.extend

    def reset(self) -> None:
        """Forget every cached decode selection and free the block caches (a new sequence)."""
        self._cache.clear()
        self._gpu.clear()
        self._streamed.clear()
        self._stage0.clear()

    def begin_prefill(self) -> None:
        """Before a prefill step (the store calls it): the step re-prunes every slice and the
        next decode step refills the block caches, so drop the caches and decode selections now,
        which also frees their memory before the chunk's activations exist
        (`kvtier.sparse.planning` plans the larger of the two phases)."""
        self._cache.clear()
        self._gpu.clear()
        self._stage0.clear()

    def gpu_cache_bytes(self) -> int:
        """GPU bytes of the block caches of streamed slices (proportional to cache capacity)."""
        return sum(c.nbytes() for c in self._gpu.values())

    def attend_buffer_bytes(self) -> int:
        """GPU bytes of the decode queries' gathered attention rows (`AttendBuffer`s)."""
        return sum(st.attn.nbytes() for st in self._cache.values())

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

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor:
        out = self._heads(q, kv, kv[step.start], step)
        sl = (step.layer, step.group)
        if q.shape[0] == 1 and sl in self._streamed:  # prefill: `begin_prefill` dropped the caches
            self._fill(kv, step)
        return out

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
        for h in heads:
            qh = q if h < 0 else q[:, h * r : (h + 1) * r]
            # NOTE: the length of the slice a streamed step would see (its kv includes the new
            # token at s, never a candidate): ScoreFn bounds its RoPE positions by it.
            keys = HostKeys(fetch, s + 1, groups, q.shape[2], head=None if h < 0 else h)
            (out,) = self._stages(qh, pos, keys, layer, cand, 0, upto=1)
            self._stage0[(layer, step.group, h)] = out
            parts.append(out)
        parts.append(torch.arange(w0, s + 1, device=q.device))
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

    # -- attention --------------------------------------------------------------------------

    def _heads(self, q: torch.Tensor, kv: KV, new: torch.Tensor, step: SliceStep) -> torch.Tensor:
        """q [T, H_q_g, D] over kv; `new` [2, G, D] is the row at step.start (decode's token)."""
        if not self.cfg.per_head:
            return self._slice(q, kv, new, step, -1)
        g = kv.shape[2]
        r = q.shape[1] // g
        outs = [
            self._slice(q[:, h * r : (h + 1) * r], _head(kv, h), new[:, h : h + 1], step, h) for h in range(g)
        ]
        return torch.cat(outs, dim=1)

    def _slice(self, q: torch.Tensor, kv: KV, new: torch.Tensor, step: SliceStep, head: int) -> torch.Tensor:
        t = q.shape[0]
        key = (step.layer, step.group, head)
        if t == 1:
            return self._decode(q, kv, new, step, key)
        assert isinstance(kv, torch.Tensor), "prefill needs the whole slice"
        return self._prefill(q, kv, step)

    def _prefill(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor:
        """Every block of `block_q` queries of q [T, H_q, D] pruned from scratch, all blocks of
        the chunk in one batch (`prune_whole_blocks`: a short last block and blocks among the
        sinks too), then one attention over all blocks."""
        cfg, t = self.cfg, q.shape[0]
        bq = cfg.block_q
        starts = [self._window_start(step.start + b) for b in range(0, t, bq)]
        ends = [min(step.start + b + bq, step.start + t) for b in range(0, t, bq)]
        prefix, held = prune_whole_blocks(q, step.start, kv[:, 0], starts, cfg, step.layer, self.rotary)
        self.stats.count_keys(held)
        self.stats.prefill_blocks += len(starts)
        self.stats.count_keys(sum(max(0, e - w) for e, w in zip(ends, starts, strict=True)))
        return attend_blocks(
            q, step.start, bq, kv, prefix, starts, rotary=self.rotary, mode=cfg.attention_rope
        )

    def _decode(
        self, q: torch.Tensor, kv: KV, new: torch.Tensor, step: SliceStep, key: tuple[int, int, int]
    ) -> torch.Tensor:
        """One decode query q [1, H_q, D] at step.start; `new` [2, G, D] is kv's row there.

        NOTE: a step that recomputes no stage and follows its previous step appends `new` to the
        gathered `AttendBuffer` (O(1) launches); any other step gathers sinks + selection +
        window afresh. Both attend the same rows, so which one ran never changes the output."""
        cfg = self.cfg
        st = self._cache.get(key)
        scored = self._stage0.pop(key, None)  # stage 0 from host keys (`_refresh_from_host`)
        if st is None or step.start <= st.position:  # first decode step, or a new sequence
            first = 0
            st = None
        else:
            st.step += 1
            first = st.first_due(self.cfg.refresh, st.step)
        whole = isinstance(kv, torch.Tensor)
        assert first > 0 or scored is not None or whole, "stage 0 needs the whole slice or its keys"
        if st is None or first == 0:
            w0 = self._window_start(step.start)
            cand = self._middle(w0, q.device)
        else:
            w0 = st.window_start
            cand = st.outputs[first - 1]
        if first < len(cfg.chunk_sizes):
            pos = torch.full((1,), step.start, dtype=torch.long, device=q.device)
            if first == 0 and scored is not None:
                outs = [scored, *self._stages(q, pos, kv, step.layer, scored, 1)]
            else:
                outs = self._stages(q, pos, kv, step.layer, cand, first)
            if st is None:
                st = DecodeState(outputs=outs, computed_at=[0] * len(outs), window_start=w0)
            else:
                st.outputs[first:] = outs
                st.computed_at[first:] = [st.step] * len(outs)
                if first == 0:
                    st.window_start = w0
            for i in range(first, len(cfg.chunk_sizes)):
                self.stats.decode_recomputes[i] += 1
        assert st is not None
        st.position = step.start
        self._cache[key] = st
        buf, end = st.attn, step.start + 1
        w0 = min(st.window_start, end)
        rope = self.rotary
        if first < len(cfg.chunk_sizes) or buf.end != step.start or step.start < w0:
            sinks = torch.arange(min(cfg.sink, end), device=q.device)
            prefix = torch.cat((sinks, st.outputs[-1]))
            spare = cfg.refresh[0] + 1  # the window grows by one row a step until stage 0 reruns
            buf.rebuild(kv, prefix, w0, end, spare, rope, cfg.attention_rope)
            return buf.attend(q, step.start, rope)
        return buf.step(q, new, step.start, rope)

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
            b = self.cfg.cache_block
            slots = -(-self.cfg.offload_cache_tokens(heads) // b)
            self._gpu[sl] = BlockCache(slots, b, tuple(kv.shape[1:]), kv.dtype, kv.device)
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
        kv: KV | HostKeys,
        layer: int,
        cand: torch.Tensor,
        first: int,
        upto: int | None = None,
    ) -> list[torch.Tensor]:
        """Stages first..upto - 1 (all by default) over kv: a whole slice, a `PositionedKV` view,
        or a slice's keys on the host (stage 0 alone, read in ranges)."""
        cfg = self.cfg
        n = len(cfg.chunk_sizes) if upto is None else upto
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


def _head(kv: KV, h: int) -> KV:
    """KV head h of a slice, keeping the head axis: [S, 2, 1, D]."""
    if isinstance(kv, torch.Tensor):
        return kv[:, :, h : h + 1]
    return kv.map(lambda t: t[:, :, h : h + 1])
