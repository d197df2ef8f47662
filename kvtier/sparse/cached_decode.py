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

The stage pieces both halves run (`_stages`, `_window_start`, `_middle`) are its base
`StagePieces` (`kvtier.sparse.stage_pieces`); the upkeep of the block caches (allocate, fill,
keep) its base `SliceCaches` (`kvtier.sparse.slice_caches`). The mixins hold no state of their
own: each declares the attributes of `HipKernel` (`kvtier.sparse.kernel`) it uses, and
`HipKernel` sets them and provides `_heads`.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from kvtier.attention.interface import ExtentKeys, Fetch, SliceStep
from kvtier.sparse.cache_blocks import fetch_blocks, needed_positions
from kvtier.sparse.decode_buffer import KV, DecodeState, attend_rebuilt, buffer_kernel, step_buffers
from kvtier.sparse.decode_graph import LayerGraphs
from kvtier.sparse.gpu_cache import BlockCache, PositionedKV, block_ids
from kvtier.sparse.host_keys import HostKeys, host_landmark_keys
from kvtier.sparse.landmarks import Landmarks
from kvtier.sparse.layer_rerun import rerun_stages
from kvtier.sparse.prompt_stage0 import prompt_chunks, prompt_stage0
from kvtier.sparse.slice_caches import SliceCaches
from kvtier.sparse.stage_pieces import StagePieces


class CachedDecode(SliceCaches, StagePieces):
    """The `CachingSliceKernel` methods of `HipKernel`: decode steps of streamed slices served
    from per-slice GPU block caches (see the module doc). Mutates the kernel's block caches,
    decode states and stats."""

    # Of `HipKernel` (see its `__init__`); the others it uses are declared by its bases.
    _stage0: dict[tuple[int, int, int], torch.Tensor]  # stage 0 scored from host keys this step
    _graphs: LayerGraphs | None  # cached layer steps as CUDA graphs (`kvtier.sparse.decode_graph`)
    _landmarks: dict[tuple[int, int, int], Landmarks]  # the prompt's, per slice (`stage0_landmarks`)

    # -- CachingSliceKernel -----------------------------------------------------------------

    @property
    def decode_streams(self) -> bool:
        """Whether a decode step may need a slice whole: not with `HipConfig.host_scoring`."""
        return not self.cfg.host_scoring

    def needs_slice(self, step: SliceStep, n_new: int) -> bool:
        """Whether a step of a streamed slice needs it whole: prefill, or (without
        `HipConfig.host_scoring`, which scores stage 0 on host keys and serves every decode step
        from the block cache) stage 0 is due or the block cache is not in step, unless the step
        scores stage 0 on the prompt's landmarks (`kvtier.sparse.prompt_stage0`).

        Records that the slice is streamed (so its full decode steps fill its block cache).
        """
        sl = (step.layer, step.group)
        self._streamed.add(sl)
        if n_new > 1:
            return True
        if self.cfg.host_scoring or self._on_prompt_landmarks(step):
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
        host = self._stage0_due(step)  # `needs_slice` said no: host keys, or the prompt's landmarks
        if host:
            if cache.end != s:  # a new sequence, or the slice's first decode step
                cache.clear()
                cache.end = s  # nothing cached is stale: what the step reads is fetched
            needed, blocks = self._refresh_from_host(q, step, fetch, groups)
        elif self._covers(cache, groups) or self._append_only(cache, step, groups):
            cache.append(s, kv_new[0])
            st.cached_steps += 1
            st.appended += fresh
            return self._heads(q, PositionedKV.of(cache, cache.table(), s + 1), kv_new[0], step)
        else:
            needed = needed_positions(self.cfg, self._states(step, groups), s, kv_new.device)
            blocks = None
        blocks = block_ids(needed, b) if blocks is None else blocks
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
        """A decode step of a layer whose slices are all cached, in one go: q [1, H_q, D], kv_new
        [1, 2, H_kv, D], steps[i] of the i-th slice (equal head groups, in order). Returns [1,
        H_q, D], or None (nothing done) when a slice reruns stage 0 or looks blocks up, or the
        slices rerun different stages, or a rerun is not scored on probes with one selection a
        slice: the store then calls `attend_cached` a slice at a time.

        When no slice reruns a stage, each appends the token to its block cache and each decode
        query to its `AttendBuffer`; the queries are rotated, their rows written and all
        attended in one launch each (`step_buffers`). When all rerun the same stages 1.., those
        run in one batch (`_refresh_layer`). Either way the outputs of `attend_cached` slice by
        slice.
        """
        n_stages = len(self.cfg.chunk_sizes)
        groups = kv_new.shape[2] // len(steps)
        caches, states, dues = [], [], set()
        for step in steps:
            cache = self._gpu.get((step.layer, step.group))
            if q.shape[0] != 1 or cache is None or self._stage0_due(step):
                return None
            # NOTE: a step that reruns a stage reads the cache: it passes only where the cache
            # covers a refresh interval (`_append_only` is for steps that rerun nothing)
            if not (self._covers(cache, groups) or self._append_only(cache, step, groups)):
                return None
            s = step.start
            for st in self._states(step, groups):
                due = st.first_due(self.cfg.refresh, st.step + 1)
                dues.add(due)
                if st.position >= s or s < st.window_start or (due == n_stages and st.attn.end != s):
                    return None
                states.append(st)
            caches.append(cache)
        if dues != {n_stages}:  # a rerun: of one stage in every slice, batched, or a slice at a time
            first = dues.pop() if len(dues) == 1 else -1
            # NOTE: batched only where each slice's stages are scored on their probes
            # (`_probing`) with one selection a slice
            if first <= 0 or self.cfg.per_head or not self._probing(q):
                return None
            return self._refresh_layer(q, kv_new, steps, caches, states, first)
        stats = self.stats.cache
        # One CUDA graph a layer, where `step_buffers` would run its Triton path
        if self._graphs is not None and buffer_kernel(q):
            bufs = [st.attn for st in states]
            graphed = self._graphs.step(steps[0].layer, q, kv_new, caches, bufs, steps[0].start, self.rotary)
            if graphed is not None:
                stats.cached_steps += len(caches)
                stats.appended += len(caches) * int(steps[0].start % caches[0].block == 0)
                for st in states:
                    st.step += 1
                    st.position = steps[0].start
                return graphed.view(1, -1, q.shape[-1])
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

    def _refresh_layer(
        self,
        q: torch.Tensor,
        kv_new: torch.Tensor,
        steps: list[SliceStep],
        caches: list[BlockCache],
        states: list[DecodeState],
        first: int,
    ) -> torch.Tensor:
        """A decode step of a layer whose slices all rerun stages first.. (none stage 0), from
        caches that cover a refresh interval: each stage scores every slice's candidates in one
        `prune_blocks`, a block a slice (its keys by address in its own block cache; candidates
        padded with -1 to the longest, each block's own count valid, as prefill batches its
        query blocks), then each slice rebuilds its `AttendBuffer` and all are attended in one
        launch. The same outputs as `attend_cached` slice by slice: a block's scores, top-k and
        attention do not depend on the others', and chunks past a block's candidates are dead.
        A stage's operators run once a layer, not once a slice; where a slice alone would strip
        padding (a host sync each), the layer reads all counts in one."""
        cfg, s, layer = self.cfg, steps[0].start, steps[0].layer
        if self._graphs is not None and buffer_kernel(q):  # one CUDA graph a layer and stage
            graphed = self._rerun_graphed(q, kv_new, layer, s, caches, states, first)
            if graphed is not None:
                return graphed
        entries = len(states)  # one a slice (not `per_head`)
        groups = kv_new.shape[2] // entries
        views = []
        for i, cache in enumerate(caches):
            cache.append(s, kv_new[0, :, i * groups : (i + 1) * groups])
            self.stats.cache.cached_steps += 1
            self.stats.cache.appended += int(s % cache.block == 0)
            views.append(PositionedKV.of(cache, cache.table(), s + 1))
        qs = q[0].reshape(entries, 1, -1, q.shape[-1])  # [E, 1, H_q_e, D]
        pos = torch.full((entries, 1), s, dtype=torch.long, device=q.device)
        counts = [st.outputs[first - 1].numel() for st in states]
        width = max(counts)
        padded = min(counts) < width
        pad = torch.nn.functional.pad
        cand = torch.stack(
            [
                pad(st.outputs[first - 1], (0, width - n), value=-1)
                for st, n in zip(states, counts, strict=True)
            ]
        )  # [E, width]
        # NOTE: counts from the device's copy, not a host list (whose copy would wait for the queue)
        valid = (cand >= 0).sum(dim=1) if padded else torch.full((entries,), width, device=q.device)
        outs, partial = rerun_stages(cfg, layer, qs, pos, views, cand, valid, first, self.rotary, s + 1)
        padded = padded or partial
        kept = torch.stack([n for _, n in outs]).tolist() if padded else None  # one sync a layer
        end = s + 1
        for e, (st, view) in enumerate(zip(states, views, strict=True)):
            sel = [c[e] if kept is None else c[e, : kept[j][e]] for j, (c, _) in enumerate(outs)]
            self._reran(st, first, sel, s)
            prefix = torch.cat((torch.arange(min(cfg.sink, end), device=q.device), st.outputs[-1]))
            w0 = min(st.window_start, end)
            st.attn.rebuild(view, prefix, w0, end, cfg.refresh[0] + 1, self.rotary, cfg.attention_rope)
        qh = q[0].reshape(entries, -1, q.shape[-1])  # [E, H_q_e, D]
        return attend_rebuilt([st.attn for st in states], qh, s, self.rotary).view(1, -1, q.shape[-1])

    def _rerun_graphed(
        self,
        q: torch.Tensor,
        kv_new: torch.Tensor,
        layer: int,
        s: int,
        caches: list[BlockCache],
        states: list[DecodeState],
        first: int,
    ) -> torch.Tensor | None:
        """`_refresh_layer`'s step as the layer's CUDA graph (`LayerGraphs.rerun`), with the
        decode states and stats moved on as it moves them; None where the graph declines."""
        assert self._graphs is not None
        w0 = min(states[0].window_start, s + 1)
        if any(min(st.window_start, s + 1) != w0 for st in states):
            self._graphs.decline(f"stage{first}: window starts differ")
            return None
        sels = [st.outputs[first - 1] for st in states]
        bufs = [st.attn for st in states]
        ran = self._graphs.rerun(layer, first, q, kv_new, caches, sels, w0, bufs, s, self.cfg, self.rotary)
        if ran is None:
            return None
        out, outs = ran
        self.stats.cache.cached_steps += len(caches)
        self.stats.cache.appended += len(caches) * int(s % caches[0].block == 0)
        for e, st in enumerate(states):
            self._reran(st, first, [c[e] for c, _ in outs], s)
        return out.view(1, -1, q.shape[-1])

    def _reran(self, st: DecodeState, first: int, selections: list[torch.Tensor], s: int) -> None:
        """A decode state after its stages first.. reran at position s with these selections."""
        st.step += 1
        st.outputs[first:] = selections
        st.computed_at[first:] = [st.step] * len(selections)
        st.position = s
        for i in range(first, len(self.cfg.chunk_sizes)):
            self.stats.decode_recomputes[i] += 1

    def _stage0_due(self, step: SliceStep) -> bool:
        """Whether this decode step of a slice runs stage 0: its first (no decode state, or a
        new sequence), or a rerun."""
        st = self._cache.get((step.layer, step.group, 0 if self.cfg.per_head else -1))
        if st is None or step.start <= st.position:
            return True
        return st.first_due(self.cfg.refresh, st.step + 1) == 0

    def _refresh_from_host(
        self, q: torch.Tensor, step: SliceStep, fetch: Fetch, groups: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage 0 of a decode step, scored on keys read from the host tier (`HostKeys`), or on
        the prompt's landmark keys alone (`kvtier.sparse.prompt_stage0`), kept in `_stage0` for
        `_decode`; returns the positions the rest of the step reads (sinks, the
        new stage-0 selection, the new window), for the block cache to provide, and their
        blocks where they are known without `unique` (a host sync): `_aligned_blocks`.

        Scores, slabs and the selection are those of stage 0 over the whole slice: the same
        keys in the same ranges (`ScoreFn.bisected` with `span`), so the outputs are too."""
        cfg, s, layer = self.cfg, step.start, step.layer
        w0 = self._decode_window_start(s)
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
            marks = self._landmarks.get((layer, step.group, h))
            read = partial(host_landmark_keys, fetch, head=None if h < 0 else h)
            on_marks = prompt_stage0(cfg, marks, qh, s, layer, w0, self.rotary, read)
            if on_marks is not None:
                self.stats.prompt_landmarks += 1
                self._stage0[(layer, step.group, h)] = on_marks
                parts.append(on_marks)
                continue
            keys: HostKeys | ExtentKeys
            if in_place is not None:
                keys = in_place if h < 0 else in_place.of_head(h)
            else:
                keys = HostKeys(fetch, s + 1, groups, q.shape[2], head=None if h < 0 else h)
            (out,) = self._stages(qh, pos, keys, layer, cand, 0, upto=1)
            self._stage0[(layer, step.group, h)] = out
            parts.append(out)
        parts.append(torch.arange(min(w0, s + 1), s + 1, device=q.device))  # w0 > s: all sinks
        blocks = self._aligned_blocks(parts[1], w0, s) if len(heads) == 1 else None
        return torch.cat(parts), blocks

    def _on_prompt_landmarks(self, step: SliceStep) -> bool:
        """Whether this step of a slice scores stage 0 on the prompt's landmarks
        (`prompt_chunks`): the first query after a prefill that scored them."""
        if not self.cfg.prompt_landmarks:
            return False
        marks = self._landmarks.get((step.layer, step.group, 0 if self.cfg.per_head else -1))
        w0 = self._decode_window_start(step.start)
        return prompt_chunks(self.cfg, marks, step.start, step.layer, w0) > 0

    def _aligned_blocks(self, selected: torch.Tensor, w0: int, s: int) -> torch.Tensor | None:
        """The sorted, distinct blocks of the sinks, stage 0's selection and the window [w0, s]
        when `HipConfig.align_window` makes them known without `unique`: the selection is whole
        chunks starting at sink + k * chunk_sizes[0], so with sinks and chunks whole blocks its
        every `cache_block`-th entry is a block's first, and the window starts a block. None
        otherwise."""
        cfg, b = self.cfg, self.cfg.cache_block
        if not cfg.align_window or cfg.sink % b or cfg.chunk_sizes[0] % b or not cfg.sink < w0 <= s:
            return None
        dev = selected.device
        sinks, window = torch.arange(cfg.sink // b, device=dev), torch.arange(w0 // b, s // b + 1, device=dev)
        return torch.cat((sinks, torch.div(selected[::b], b, rounding_mode="floor"), window))

    # -- provided by HipKernel (a stub that types the calls above) -------------------------

    def _heads(self, q: torch.Tensor, kv: KV, new: torch.Tensor, step: SliceStep) -> torch.Tensor:
        raise NotImplementedError
