"""A layer's HiP decode steps over streamed slices replayed as CUDA graphs, one a layer and kind
of step (on by default on CUDA: `kvtier.sparse.graph_setting`).

Two kinds of step run the same operators every time:
- **cached** (`CachedDecode.attend_cached_layer`, no stage due): rotate the query and the new
  key at the step's position, append the token to each slice's block cache (a block it starts
  taken on the host first, `BlockCache.start_block`) and to each decode query's `AttendBuffer`,
  attend every buffer (three Triton launches);
- **rerun of stages first..** (`CachedDecode._refresh_layer`, first 1 or 2, scored on probes):
  the same, after the stages prune every slice in one batch (`layer_rerun.rerun_stages`) and
  each buffer's prefix (sinks and selection) is gathered and rotated anew
  (`AttendBuffer.rewrite_prefix`: the window rows stay, as the window's start does).

On the GPU machine's host each operator costs ~30 us (bench/results/hip_decode_profile_lean_
512k_int4_probes_g4_cprofile_cached.json: 125 operators in a 4.4 ms step of 8 slices), so a
cached layer's ~12 cost ~0.4 ms and a rerun's ~100 a few, where the GPU works microseconds.
Here those operators read every value that changes between steps from one small device tensor,
so a graph, captured once, replays them; the host writes that tensor, copies the step's q, rows
(and a rerun's input selections) into the graph's inputs and launches it:

    inputs  [2 + 4B] int64: the position, the window's start, then META of the B buffers
            (`triton_decode.buffers_meta`)
    cached  new rows into each slice's block cache at tail * block + position % block;
            q and the new keys rotated at inputs[0]; `attend_buffers_meta` (rows put, attended)
    rerun   the new rows into the caches; the stages; each buffer's prefix rewritten; as cached

A graph stays valid while what it baked in stays: the tensors it reads and writes (the banks,
their tail slots and slot tables, the buffers, the RoPE table), the launch's key splits and the
shapes (`_signature`); a step whose signature differs captures again. The bodies compute what
the eager steps compute, operator for operator, so the outputs are bitwise the same. Where
Triton runs on CPU tensors (its interpreter: the tests) they run eagerly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from kvtier.sparse.config import HipConfig
from kvtier.sparse.decode_buffer import AttendBuffer
from kvtier.sparse.gpu_cache import BlockCache, PositionedKV
from kvtier.sparse.graph_recorders import CudaRecorder, Recorder
from kvtier.sparse.layer_rerun import rerun_stages
from kvtier.sparse.rope_ext import RopeTable

Stages = list[tuple[torch.Tensor, torch.Tensor]]  # per stage: kept [E, K], counts [E]


@dataclass
class _Graph:
    """One layer's graph of one kind: its static inputs, its output and its signature."""

    signature: tuple[Any, ...]
    inputs: torch.Tensor  # [2 + 4B] int64: position, window start, META
    q: torch.Tensor  # [1, H_q, D] the step's query (un-rotated when the kernel rotates)
    kv: torch.Tensor  # [1, 2, H_kv, D] the step's new rows
    cand: torch.Tensor | None = None  # [E, N] a rerun's input: the previous stage's selections
    kept: Stages | None = None  # a rerun's stage outputs, copied out of the graph's pool
    graph: Any = None  # torch.cuda.CUDAGraph once captured (None: the body runs eagerly)
    out: Any = None  # the graph's output (the body's return value)


class LayerGraphs:
    """The decode steps of a kernel's layers as CUDA graphs, a layer and kind each (see the
    module docstring): recorded and replayed on CUDA, the same bodies run eagerly on CPU
    tensors. Counts: `captures`, `replays`, `eager` (bodies run without a graph), and `steps`
    by kind."""

    def __init__(self, recorder: Recorder | None = None) -> None:
        self._graphs: dict[tuple[int, int], _Graph] = {}  # (layer, first stage rerun; 0: none)
        # How bodies become graphs: `recorder` (a test's stand-in), else CUDA's on CUDA tensors
        self.recorder = recorder
        self._cuda = CudaRecorder()
        self.captures = self.replays = self.eager = 0
        self.steps = Counter[int]()  # steps run through a body, by the first stage rerun (0: none)
        self.declined = Counter[str]()  # steps left to run as before, by why (`decline`)
        self._made = Counter[tuple[int, int]]()  # graphs made, a layer and kind
        self._used = Counter[tuple[int, int]]()  # steps they ran

    def clear(self) -> None:
        """Drop every graph (their caches and buffers are going away)."""
        self._graphs.clear()

    def step(
        self,
        layer: int,
        q: torch.Tensor,
        kv_new: torch.Tensor,
        caches: list[BlockCache],
        bufs: list[AttendBuffer],
        position: int,
        rotary: RopeTable | None,
    ) -> torch.Tensor | None:
        """The decode step of `layer` at `position` that `attend_cached_layer` would run (no
        stage due, every cache covering the interval): q [1, H_q, D], kv_new [1, 2, H_kv, D];
        caches a slice each, bufs a decode query each (in slice order). Returns [B, H_q_b, D]
        (the graph's own output: valid until the layer's next step), having moved the caches'
        and buffers' host state on (a step that starts a cache block starts it first, outside
        the graph: `BlockCache.start_block`); None, having done nothing, where a cache is not
        at the position or a buffer is full (the caller then runs it as before)."""
        if not _appendable(caches, position):
            self.decline("cached: a cache not at the position")
            return None
        if self._unsteady((layer, 0)):
            self.decline("cached: unsteady")
            return None
        if any(b.k is None or b.length >= b.capacity or b.end != position for b in bufs):
            self.decline("cached: a buffer full or behind")
            return None
        meta, splits, tensors = _meta(q, bufs)
        tables = None if rotary is None else rotary.tables(position + 1, q)
        _start_blocks(caches, position)
        sig = (0, *_signature(q, kv_new, caches, tensors, splits, tables, False))
        g = self._graph((layer, 0), sig, q, kv_new, len(meta))
        g.inputs.copy_(torch.tensor([position, 0, *meta], dtype=torch.int64), non_blocking=True)
        out = self._run(g, lambda: _cached_body(g, caches, bufs, rotary, splits))
        self.steps[0] += 1
        self._used[(layer, 0)] += 1
        for c in caches:
            c.advance(position)
        for b in bufs:
            b.length += 1
            b.end = position + 1
        return cast(torch.Tensor, out)

    def rerun(
        self,
        layer: int,
        first: int,
        q: torch.Tensor,
        kv_new: torch.Tensor,
        caches: list[BlockCache],
        selections: list[torch.Tensor],
        window_start: int,
        bufs: list[AttendBuffer],
        position: int,
        cfg: HipConfig,
        rotary: RopeTable | None,
    ) -> tuple[torch.Tensor, Stages] | None:
        """The decode step of `layer` at `position` that `_refresh_layer` would run: stages
        first.. (1 or 2) of every slice, scored on probes; `selections` each slice's stage
        first - 1 output, `window_start` their window's start (min(w0, position + 1)). Returns
        the attention [B, H_q_b, D] and each stage's (kept, counts), the graph's own tensors
        (valid until the layer's next rerun from `first`), having moved the caches' and
        buffers' host state on (not the decode states'); None, having done nothing, where a
        shape could change: slices of different counts, a partial chunk kept, the prefix
        growing, a buffer full."""
        end = position + 1
        width = selections[0].numel()
        why = f"stage{first}"
        if not _appendable(caches, position):
            self.decline(f"{why}: a cache not at the position")
            return None
        if end <= cfg.sink:
            self.decline(f"{why}: within the sinks")
            return None
        if self._unsteady((layer, first)):
            self.decline(f"{why}: unsteady")
            return None
        if any(sel.numel() != width for sel in selections):
            self.decline(f"{why}: selections of different sizes")
            return None
        kept, limit, sizes = width, end, []
        for i in range(first, len(cfg.chunk_sizes)):
            chunk, budget = cfg.chunk_sizes[i], cfg.stage_budgets(layer)[i]
            c_count = -(-kept // chunk)
            if c_count > budget // chunk:
                if kept % chunk:
                    self.decline(f"{why}: a partial chunk kept")
                    return None
                limit = max(limit, end + cfg.window + c_count + 2)  # `scoring_queries`' bound
                kept = budget // chunk * chunk
            sizes.append(kept)
        prefix = cfg.sink + kept
        rows = prefix + position - window_start  # a buffer's rows now: prefix, window [w0, position)
        for b in bufs:
            if (
                b.k is None
                or b.n_prefix != prefix
                or b.end != position
                or not b.length == rows < b.capacity - 1
            ):
                self.decline(f"{why}: a buffer's prefix or rows change")
                return None
        meta, splits, tensors = _meta(q, bufs)
        tables = None if rotary is None else rotary.tables(limit, q)  # grown before, not inside
        _start_blocks(caches, position)  # before `_signature` remakes stale slot tables
        shape = (len(selections), width)
        sig = (first, *_signature(q, kv_new, caches, tensors, splits, tables, True), shape, prefix)
        g = self._graph((layer, first), sig, q, kv_new, len(meta), shape)
        if g.kept is None:  # NOTE: outside the graph's pool: the decode states keep them
            e = len(selections)
            g.kept = [
                (q.new_empty((e, k), dtype=torch.long), q.new_empty(e, dtype=torch.long)) for k in sizes
            ]
        g.inputs.copy_(torch.tensor([position, window_start, *meta], dtype=torch.int64), non_blocking=True)
        torch.stack(selections, out=g.cand)
        out = self._run(g, lambda: _rerun_body(g, caches, bufs, cfg, layer, first, rotary, splits, end))
        self.steps[first] += 1
        self._used[(layer, first)] += 1
        for c in caches:
            c.advance(position)
        for b in bufs:
            b.length += 1
            b.end = end
        return cast(tuple[torch.Tensor, Stages], out)

    def _graph(
        self,
        key: tuple[int, int],
        sig: tuple[Any, ...],
        q: torch.Tensor,
        kv_new: torch.Tensor,
        n_meta: int,
        cand: tuple[int, int] | None = None,
    ) -> _Graph:
        """The graph of `key` made for `sig` (a new one, not yet recorded, where it differs),
        with this step's q and rows in its inputs."""
        g = self._graphs.get(key)
        if g is None or g.signature != sig:
            inputs = torch.empty(2 + n_meta, dtype=torch.int64, device=q.device)
            sel = None if cand is None else torch.empty(cand, dtype=torch.long, device=q.device)
            g = _Graph(sig, inputs, torch.empty_like(q), torch.empty_like(kv_new), sel)
            self._graphs[key] = g
            self._made[key] += 1
        g.q.copy_(q)
        g.kv.copy_(kv_new)
        return g

    def decline(self, why: str) -> None:
        """Count a step left to run as before, and why (`HipKernel.counters`)."""
        self.declined[why] += 1

    def _unsteady(self, key: tuple[int, int]) -> bool:
        """Whether `key`'s graphs were made again so often that capturing costs more than it
        saves (8 made, each replayed under 4 times on average): its steps then run as before."""
        made = self._made[key]
        return made >= 8 and self._used[key] < 4 * made

    def _run(self, g: _Graph, body: Callable[[], Any]) -> Any:
        """body() eagerly (CPU tensors, no recorder), or g's graph replayed (recorded first if
        new)."""
        recorder = self.recorder if self.recorder is not None else self._cuda if g.q.is_cuda else None
        if recorder is None:
            self.eager += 1
            return body()
        if g.graph is None:
            g.graph, g.out = recorder.record(g.q.device, body)
            self.captures += 1
        g.graph.replay()
        self.replays += 1
        return g.out


def _appendable(caches: list[BlockCache], position: int) -> bool:
    """Whether every cache takes `position` by `append_at`: the next token, in its tail block
    or (`_start_blocks` first) one it starts."""
    first = position % caches[0].block == 0
    return all(c.end == position and (first or c.tail is not None) for c in caches)


def _start_blocks(caches: list[BlockCache], position: int) -> None:
    """Where `position` starts a block, each cache's `start_block` (what `append` does first):
    on the host before a graph replays, since which slot it takes is the caches' state."""
    if position % caches[0].block == 0:
        for c in caches:
            c.start_block(position)


def _meta(q: torch.Tensor, bufs: list[AttendBuffer]) -> tuple[list[int], int, list[torch.Tensor]]:
    """META of the buffers with this step's row appended, the key splits, and the buffers' key
    and value tensors."""
    from kvtier.sparse.triton_decode import buffers_meta  # NOTE: Triton only when used

    keys = [cast(torch.Tensor, b.k) for b in bufs]
    values = [cast(torch.Tensor, b.v) for b in bufs]
    qs = q[0].reshape(len(bufs), -1, q.shape[-1])
    meta, splits = buffers_meta(qs, keys, values, [b.length + 1 for b in bufs])
    return meta, splits, [t for kv in zip(keys, values, strict=True) for t in kv]


def _signature(
    q: torch.Tensor,
    kv_new: torch.Tensor,
    caches: list[BlockCache],
    buffers: list[torch.Tensor],
    splits: int,
    tables: tuple[torch.Tensor, torch.Tensor] | None,
    table: bool,
) -> tuple[Any, ...]:
    """What a layer's graph baked in: shapes and dtypes, every tensor's address (`table`: the
    caches' slot tables' too), the splits."""
    return (
        tuple(q.shape),
        q.dtype,
        tuple(kv_new.shape),
        splits,
        tuple(_cache_tensors(c, table) for c in caches),
        tuple(t.data_ptr() for t in buffers),
        None if tables is None else (tables[0].data_ptr(), tables[1].data_ptr()),
    )


def _cache_tensors(cache: BlockCache, table: bool) -> tuple[int, ...]:
    """A cache's tensors a body reads: its bank, its tail slot, and (`table`) its slot table's
    (made here, in place, when stale: never inside a body)."""
    ptrs = (cache.bank.data_ptr(), cast(torch.Tensor, cache.tail).data_ptr())
    if not table:
        return ptrs
    t = cache.table()
    return (*ptrs, t.blocks.data_ptr(), t.base.data_ptr())


def _append_rows(g: _Graph, caches: list[BlockCache], pos: torch.Tensor) -> None:
    """Each slice's new rows into its block cache at pos [1] (`BlockCache.append_at`)."""
    groups = g.kv.shape[2] // len(caches)
    for i, cache in enumerate(caches):
        cache.append_at(pos, g.kv[0, :, i * groups : (i + 1) * groups])


def _attend_new(g: _Graph, bufs: list[AttendBuffer], rotary: RopeTable | None, splits: int) -> torch.Tensor:
    """`step_buffers`'s CUDA path from g's tensors: q and the new keys rotated at inputs[0], the
    new rows put after each buffer's, every buffer attended. Returns [B, H_q_b, D]."""
    from kvtier.sparse.triton_decode import attend_buffers_meta

    e, d = len(bufs), g.q.shape[-1]
    qs = g.q[0].reshape(e, -1, d)  # [B, H_q_b, D]
    rows = g.kv[0].view(2, e, -1, d).transpose(0, 1)  # [B, 2, G_b, D]
    k, v = rows[:, 0], rows[:, 1]
    if rotary is not None:
        h, gb = qs.shape[1], k.shape[1]
        x = torch.cat((qs.reshape(1, e * h, -1), k.reshape(1, e * gb, -1)), dim=1)
        both = rotary.rotate_at_index(x, g.inputs[:1])
        qs, k = both[0, : e * h].view_as(qs), both[0, e * h :].view_as(k)
    return attend_buffers_meta(qs, cast(torch.Tensor, bufs[0].k), g.inputs[2:], splits, new=(k, v))


def _cached_body(
    g: _Graph, caches: list[BlockCache], bufs: list[AttendBuffer], rotary: RopeTable | None, splits: int
) -> torch.Tensor:
    """A cached step's device work from g's tensors alone (what its graph records): as
    `attend_cached_layer`'s appends and `step_buffers`'s CUDA path."""
    _append_rows(g, caches, g.inputs[:1])
    return _attend_new(g, bufs, rotary, splits)


def _rerun_body(
    g: _Graph,
    caches: list[BlockCache],
    bufs: list[AttendBuffer],
    cfg: HipConfig,
    layer: int,
    first: int,
    rotary: RopeTable | None,
    splits: int,
    length: int,
) -> tuple[torch.Tensor, Stages]:
    """A rerun's device work from g's tensors alone: as `_refresh_layer`'s appends and stages,
    its buffers' prefixes as its rebuilds leave them (`rewrite_prefix`), the attention as a
    cached step's. `length`: a bound on every position the step rotates at (the tables' size).
    Returns the attention and each stage's (kept, counts)."""
    pos = g.inputs[:1]
    _append_rows(g, caches, pos)
    views = [PositionedKV.of(c, c.table(), length) for c in caches]
    cand = cast(torch.Tensor, g.cand)
    e, d = cand.shape[0], g.q.shape[-1]
    qs = g.q[0].reshape(e, 1, -1, d)  # [E, 1, H_q_e, D]
    q_pos = pos.view(1, 1).expand(e, 1).contiguous()  # [E, 1]
    valid = torch.full((e,), cand.shape[1], device=cand.device)
    outs, _ = rerun_stages(cfg, layer, qs, q_pos, views, cand, valid, first, rotary, length)
    kept = cast(Stages, g.kept)
    for (k_to, n_to), (k, n) in zip(kept, outs, strict=True):
        k_to.copy_(k)
        n_to.copy_(n)
    sinks = torch.arange(cfg.sink, device=cand.device)
    for i, (buf, view) in enumerate(zip(bufs, views, strict=True)):
        prefix = torch.cat((sinks, kept[-1][0][i]))
        buf.rewrite_prefix(view, prefix, g.inputs[1:2], rotary, cfg.attention_rope, length)
    return _attend_new(g, bufs, rotary, splits), kept
