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

Offloaded KV (decode steps of slices the store streams, from GPU block caches): the
`CachedDecode` mixin, `kvtier.sparse.cached_decode`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvtier.attention.interface import Alloc, SliceStep
from kvtier.errors import ConfigError
from kvtier.kv.device_memory import RegionMemory
from kvtier.model.rope import Rotary
from kvtier.sparse.block_sparse import attend_blocks, use_triton
from kvtier.sparse.cached_decode import CachedDecode
from kvtier.sparse.config import HipConfig
from kvtier.sparse.decode_buffer import KV, AttendBuffer, DecodeState
from kvtier.sparse.decode_graph import LayerGraphs
from kvtier.sparse.gpu_cache import BlockCache
from kvtier.sparse.graph_setting import graphs_setting, graphs_wanted
from kvtier.sparse.landmarks import Landmarks, key_scores, landmark_keys
from kvtier.sparse.prefill import prune_whole_blocks
from kvtier.sparse.prompt_stage0 import prompt_stage0
from kvtier.sparse.rope_ext import RopeTable, table_positions
from kvtier.sparse.stats import HipStats


class HipKernel(CachedDecode):
    """Sparse attention over one slice: `__call__(q [T, H_q_g, D], kv [S+T, 2, G, D], step)`.

    With `cfg.extend`, q and kv are un-rotated (store built with rotate_keys=False) and `rotary`
    is required; otherwise they arrive rotated at true positions. Mutates only its decode cache,
    its GPU block caches and stats, never kv. Also a `CachingSliceKernel`: see `CachedDecode`.
    """

    def __init__(self, cfg: HipConfig, rotary: Rotary | None = None, capacity: int | None = None) -> None:
        if cfg.extend and rotary is None:
            raise ConfigError("hip extend=True needs the model's Rotary: keys are rotated in the kernel")
        if capacity is not None and cfg.capacity is None:
            cfg = replace(cfg, capacity=capacity)  # its caches and decode rows are bounded by it
        self.cfg = cfg
        self.capacity = cfg.capacity  # the request's tokens (None: not known), for a placed RoPE table
        self.rotary = RopeTable(rotary) if cfg.extend and rotary is not None else None
        self.stats = HipStats(decode_recomputes=[0] * len(cfg.chunk_sizes))
        self._cache: dict[tuple[int, int, int], DecodeState] = {}
        self._landmarks: dict[tuple[int, int, int], Landmarks] = {}  # `cfg.stage0_landmarks`' per slice
        self._gpu: dict[tuple[int, int], BlockCache] = {}  # (layer, group) -> block cache
        self._streamed: set[tuple[int, int]] = set()  # slices the store streams (asked about)
        self._cover_tokens: dict[int, int] = {}  # heads -> tokens a refresh interval reads
        # Stage 0's selection scored from host keys this step (`_refresh_from_host`), by
        # (layer, group, head): `_decode` takes it instead of rerunning stage 0.
        self._stage0: dict[tuple[int, int, int], torch.Tensor] = {}
        # Where block caches' banks come from (`place_caches`; None: the caching allocator).
        self._alloc: Alloc | None = None
        # With `place_caches`: each slice's decode memory (`slice_decode_bytes`), carved once at
        # its first decode step, and the gathered rows of each decode query kept in it.
        self._arenas: dict[tuple[int, int], RegionMemory] = {}
        self._rows: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # Decode steps of a layer as CUDA graphs (`KVTIER_HIP_GRAPHS`, `graphs_wanted`)
        self._graph_setting = graphs_setting()
        self._graphs: LayerGraphs | None = None
        self.allow_graphs(True)

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
        """Forget every cached decode selection and free the block caches (a new sequence;
        caches placed in the store's memory are kept, emptied)."""
        self._cache.clear()
        self._drop_caches()
        self._streamed.clear()
        self._stage0.clear()
        self._landmarks.clear()

    def begin_prefill(self) -> None:
        """Before a prefill step (the store calls it): the step re-prunes every slice and the
        next decode step refills the block caches, so drop the caches and decode selections now,
        which also frees their memory before the chunk's activations exist
        (`kvtier.sparse.planning` plans the larger of the two phases). Caches placed in the
        store's memory (`place_caches`) are only emptied: that memory is not freed piecewise."""
        self._cache.clear()
        self._drop_caches()
        self._stage0.clear()

    def place_caches(self, alloc: Alloc) -> None:
        """Allocate decode memory with `alloc` from now on (`PlacesCaches`: the store's region of
        a server's lent pages): the RoPE table (at the capacity's positions, when known), then
        at its first decode step each slice's arena of its decode queries' gathered rows and,
        streamed, its block cache's bank, as `kvtier.sparse.hip_method_buffers` lists them."""
        self._alloc = alloc
        self.allow_graphs(False)  # "auto": their pool would lie outside the region (`graphs_wanted`)
        if self.rotary is not None and self.capacity is not None:
            self.rotary.place(alloc, table_positions(self.capacity))

    def allow_graphs(self, allowed: bool) -> None:
        """`ReplaysGraphs`: whether `KVTIER_HIP_GRAPHS=auto` (the default) may replay decode
        steps as CUDA graphs; "on" and "off" stand. Call before the first decode step."""
        allowed = allowed and self._alloc is None  # placed memory stays placed
        wanted = graphs_wanted(self._graph_setting, torch.cuda.is_available(), allowed)
        self._graphs = (self._graphs or LayerGraphs()) if wanted else None

    def _placed_rows(
        self, key: tuple[int, int, int], new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decode query `key`'s gathered keys and values [rows, G, D] in its slice's arena
        (new: its token's row [2, G, D]), allocated once; None without placed memory."""
        if key not in self._rows:
            arena = self._arenas.get((key[0], key[1]))  # `_heads` carved it with the whole row
            if arena is None:
                return None
            shape = (self.cfg.decode_buffer_tokens(), *new.shape[1:])
            self._rows[key] = (arena.empty(shape, new.dtype), arena.empty(shape, new.dtype))
        return self._rows[key]

    def _drop_caches(self) -> None:
        if self._graphs is not None:
            self._graphs.clear()
        if self._alloc is None:
            self._gpu.clear()
            return
        for cache in self._gpu.values():
            cache.invalidate()

    def counters(self) -> dict[str, object]:
        """`CountingKernel`: decode's stage reruns per stage, the block caches' hit rate, and with
        decode graphs on (`graphs_wanted`) their captures, replays and steps by kind."""
        out: dict[str, object] = {
            "decode_recomputes": list(self.stats.decode_recomputes),
            "cache_hit_rate": round(self.stats.hit_rate, 4),
        }
        if self.cfg.prompt_landmarks:  # slices whose first query after a prefill scored them
            out["prompt_landmarks"] = self.stats.prompt_landmarks
        if self._graphs is not None:
            g = self._graphs
            kinds = {"cached" if k == 0 else f"from_stage{k}": n for k, n in sorted(g.steps.items())}
            graphs: dict[str, object] = {"captures": g.captures, "replays": g.replays, "steps": kinds}
            if g.declined:  # layer steps the graphs left to run op by op, by why
                graphs["declined"] = dict(sorted(g.declined.items()))
            out["decode_graphs"] = graphs
        return out

    def gpu_cache_bytes(self) -> int:
        """GPU bytes of the block caches of streamed slices (proportional to cache capacity)."""
        return sum(c.nbytes() for c in self._gpu.values())

    def attend_buffer_bytes(self) -> int:
        """GPU bytes of the decode queries' gathered attention rows (`AttendBuffer`s)."""
        return sum(st.attn.nbytes() for st in self._cache.values())

    # -- attention --------------------------------------------------------------------------

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor:
        out = self._heads(q, kv, kv[step.start], step)
        sl = (step.layer, step.group)
        if q.shape[0] == 1 and sl in self._streamed:  # prefill: `begin_prefill` dropped the caches
            self._fill(kv, step)
        return out

    def _heads(self, q: torch.Tensor, kv: KV, new: torch.Tensor, step: SliceStep) -> torch.Tensor:
        """q [T, H_q_g, D] over kv; `new` [2, G, D] is the row at step.start (decode's token)."""
        if q.shape[0] == 1 and self._alloc is not None:
            self._arena((step.layer, step.group), new)
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
        return self._prefill(q, kv, step, head)

    def _prefill(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep, head: int) -> torch.Tensor:
        """Every block of `block_q` queries of q [T, H_q, D] pruned from scratch, all blocks of
        the chunk in one batch (`prune_whole_blocks`: a short last block and blocks among the
        sinks too), then one attention over all blocks."""
        cfg, t = self.cfg, q.shape[0]
        bq = cfg.block_q
        starts = [self._window_start(step.start + b) for b in range(0, t, bq)]
        ends = [min(step.start + b + bq, step.start + t) for b in range(0, t, bq)]
        marks = None
        # this chunk's keys scored, then stage 0 on every chunk's best; not for a request too short
        # for stage 0 to prune (its candidates, past the sinks, within the stage's budget)
        pruned = cfg.capacity is None or cfg.capacity - cfg.sink > cfg.stage_budgets(step.layer)[0]
        if cfg.stage0_landmarks and pruned:
            sl = (step.layer, step.group, head)
            lm = self._landmarks.setdefault(sl, Landmarks(cfg.sink, cfg.chunk_sizes[0]))
            fast = q.is_cuda and use_triton()
            scores = key_scores(q, kv[step.start : step.start + t, 0], step.start, self.rotary, triton=fast)
            lm.update(scores, step.start)
            marks = lm.positions()  # None: no landmarks for some chunk (stage 0 bisects)
        keys = kv[:, 0]
        prefix, held = prune_whole_blocks(q, step.start, keys, starts, cfg, step.layer, self.rotary, marks)
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
            w0 = self._decode_window_start(step.start)
            cand = self._middle(w0, q.device)
            if scored is None and isinstance(kv, torch.Tensor):  # the first query after a prefill?
                keys = kv[:, 0]
                scored = prompt_stage0(
                    cfg, self._landmarks.get(key), q, step.start, step.layer, w0, self.rotary,
                    lambda where: landmark_keys(keys, where, where.shape[0]),
                )  # fmt: skip
                self.stats.prompt_landmarks += scored is not None
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
                placed = AttendBuffer(self._placed_rows(key, new))
                st = DecodeState(outputs=outs, computed_at=[0] * len(outs), window_start=w0, attn=placed)
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


def _head(kv: KV, h: int) -> KV:
    """KV head h of a slice, keeping the head axis: [S, 2, 1, D]."""
    if isinstance(kv, torch.Tensor):
        return kv[:, :, h : h + 1]
    return kv.map(lambda t: t[:, :, h : h + 1])
