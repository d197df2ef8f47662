"""A layer's cached HiP decode step replayed as one CUDA graph (opt-in: `KVTIER_HIP_GRAPHS=1`).

A decode step of a layer whose streamed slices all hold their selections (no stage reruns, no
new cache block) runs the same operators every step (`CachedDecode.attend_cached_layer`): rotate
the query and the new key at the step's position, append the token to each slice's block cache
and to each decode query's `AttendBuffer`, attend every buffer (three Triton launches). On the
GPU machine's host each operator costs ~30 us (bench/results/hip_decode_profile_lean_512k_int4_
probes_g4_cprofile_cached.json: 125 operators in a 4.4 ms step of 8 slices), so a layer's ~12
cost ~0.4 ms, where the GPU works a few microseconds. Here those operators read every value that
changes between steps from one small device tensor, so one CUDA graph a layer, captured once,
replays them; the host writes that tensor, copies the step's q and rows into the graph's inputs
and launches it (four calls):

    inputs  [1 + 4B] int64: the position, then META of the B buffers (`triton_decode.buffers_meta`)
    body    new rows into each slice's block cache at tail * block + position % block;
            q and the new keys rotated at inputs[0]; `attend_buffers_meta` (rows put, attended)

A graph stays valid while what it baked in stays: the tensors it reads and writes (the banks and
their tail slots, the buffers, the RoPE table), the launch's key splits and the shapes
(`_signature`); a step whose signature differs captures again. The body computes what
`step_buffers`'s CUDA path computes, operator for operator, so the outputs are bitwise the
same. Where Triton runs on CPU tensors (its interpreter: the tests) the body runs eagerly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

import torch

from kvtier.sparse.decode_buffer import AttendBuffer
from kvtier.sparse.gpu_cache import BlockCache
from kvtier.sparse.rope_ext import RopeTable


def graphs_enabled() -> bool:
    """Whether HiP kernels made now replay their cached decode steps as CUDA graphs
    (`KVTIER_HIP_GRAPHS=1`; off until measured on a GPU)."""
    return os.environ.get("KVTIER_HIP_GRAPHS", "0") not in ("", "0")


@dataclass
class _Layer:
    """One layer's graph: its static inputs, its output and the signature it was made for."""

    signature: tuple[Any, ...]
    inputs: torch.Tensor  # [1 + 4B] int64: position, META
    q: torch.Tensor  # [1, H_q, D] the step's query (un-rotated when the kernel rotates)
    kv: torch.Tensor  # [1, 2, H_kv, D] the step's new rows
    graph: Any = None  # torch.cuda.CUDAGraph once captured (None: the body runs eagerly)
    out: torch.Tensor | None = None  # the graph's output [B, H_q_b, D]


class LayerGraphs:
    """The cached decode steps of a kernel's layers, a CUDA graph each (see the module
    docstring): recorded and replayed on CUDA, the same body run eagerly on CPU tensors."""

    def __init__(self) -> None:
        self._layers: dict[int, _Layer] = {}
        self._pool: Any = None  # the graphs' shared memory pool (after the first capture)
        self.captures = self.replays = self.eager = 0

    def clear(self) -> None:
        """Drop every graph (their caches and buffers are going away)."""
        self._layers.clear()

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
        and buffers' host state on; None, having done nothing, where the step starts a cache
        block or a buffer is full (the caller then runs it as before)."""
        if position % caches[0].block == 0 or any(c.tail is None or c.end != position for c in caches):
            return None
        if any(b.k is None or b.length >= b.capacity or b.end != position for b in bufs):
            return None
        from kvtier.sparse.triton_decode import buffers_meta  # NOTE: Triton only when used

        d = q.shape[-1]
        qs = q[0].reshape(len(bufs), -1, d)
        keys = [cast(torch.Tensor, b.k) for b in bufs]
        values = [cast(torch.Tensor, b.v) for b in bufs]
        meta, splits = buffers_meta(qs, keys, values, [b.length + 1 for b in bufs])
        tables = None if rotary is None else rotary.tables(position + 1, q)
        sig = _signature(q, kv_new, caches, keys, values, splits, tables)
        g = self._layers.get(layer)
        if g is None or g.signature != sig:
            inputs = torch.empty(1 + len(meta), dtype=torch.int64, device=q.device)
            g = _Layer(sig, inputs, torch.empty_like(q), torch.empty_like(kv_new))
            self._layers[layer] = g
        g.inputs.copy_(torch.tensor([position, *meta], dtype=torch.int64), non_blocking=True)
        g.q.copy_(q)
        g.kv.copy_(kv_new)
        if not q.is_cuda:
            out = _body(g, caches, bufs, rotary, splits)
            self.eager += 1
        else:
            if g.graph is None:
                self._record(g, caches, bufs, rotary, splits)
            g.graph.replay()
            self.replays += 1
            out = cast(torch.Tensor, g.out)
        for c in caches:
            c.advance(position)
        for b in bufs:
            b.length += 1
            b.end = position + 1
        return out

    def _record(
        self,
        g: _Layer,
        caches: list[BlockCache],
        bufs: list[AttendBuffer],
        rotary: RopeTable | None,
        splits: int,
    ) -> None:
        """Warm up on a side stream, then capture `_body` into g. The warm-up writes the step's
        own rows where the replay writes them again (the same values), so it changes nothing a
        later step reads; its output is dropped."""
        dev = g.q.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            _body(g, caches, bufs, rotary, splits)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # NOTE: thread-local: a server's other threads (a host-tier allocation, say) may call
        # CUDA while a request's layer captures, which the global mode would count against it
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            g.out = _body(g, caches, bufs, rotary, splits)
        self._pool = graph.pool()
        g.graph = graph
        self.captures += 1


def _signature(
    q: torch.Tensor,
    kv_new: torch.Tensor,
    caches: list[BlockCache],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    splits: int,
    tables: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[Any, ...]:
    """What a layer's graph baked in: shapes and dtypes, every tensor's address, the splits."""
    return (
        tuple(q.shape),
        q.dtype,
        tuple(kv_new.shape),
        splits,
        tuple((c.bank.data_ptr(), cast(torch.Tensor, c.tail).data_ptr()) for c in caches),
        tuple((k.data_ptr(), v.data_ptr()) for k, v in zip(keys, values, strict=True)),
        None if tables is None else (tables[0].data_ptr(), tables[1].data_ptr()),
    )


def _body(
    g: _Layer, caches: list[BlockCache], bufs: list[AttendBuffer], rotary: RopeTable | None, splits: int
) -> torch.Tensor:
    """The step's device work from g's static tensors alone (what the graph records): as
    `attend_cached_layer`'s appends and `step_buffers`'s CUDA path, positions read from
    g.inputs. Returns [B, H_q_b, D]."""
    from kvtier.sparse.triton_decode import attend_buffers_meta

    pos = g.inputs[:1]  # [1]
    e, d = len(bufs), g.q.shape[-1]
    groups = g.kv.shape[2] // len(caches)
    for i, cache in enumerate(caches):
        cache.append_at(pos, g.kv[0, :, i * groups : (i + 1) * groups])
    qs = g.q[0].reshape(e, -1, d)  # [B, H_q_b, D]
    rows = g.kv[0].view(2, e, -1, d).transpose(0, 1)  # [B, 2, G_b, D]
    k, v = rows[:, 0], rows[:, 1]
    if rotary is not None:
        h, gb = qs.shape[1], k.shape[1]
        x = torch.cat((qs.reshape(1, e * h, -1), k.reshape(1, e * gb, -1)), dim=1)
        both = rotary.rotate_at_index(x, pos)
        qs, k = both[0, : e * h].view_as(qs), both[0, e * h :].view_as(k)
    return attend_buffers_meta(qs, cast(torch.Tensor, bufs[0].k), g.inputs[1:], splits, new=(k, v))
