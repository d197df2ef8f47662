"""Decode attention of some streamed slices on the CPU, where their KV already is.

At a decode step (one new token) the plan's `cpu_slices` streamed slices are not copied over
PCIe: the layer's query goes to the host, the CPU attends each such slice's stored tokens
(`kvtier.attention.cpu_decode`), and the partial (out, lse) comes back and merges exactly with
the new token's own attention by log-sum-exp, as sequence blocks do. The new token's K/V is
written to the host tier as for any streamed slice. Prefill streams these slices as usual.
Over a quantized host tier (`kvtier.kv.packed`) the CPU reads a slice's packed rows in place
and its full-precision tail, the values a load to the GPU would unpack.

```
 layer l (has CPU slices):
   main thread: q -> host (async) | start CPU slices | GPU slices: take, attend | wait CPU, merge
   CPU pool:                        [ wait q ][ attend the CPU slices of layer l ....... ]
   GPU:         .................   [ attend the streamed / resident slices of layer l ]  [merge]
```

The CPU work of layer l overlaps the GPU's (and the link's) work of the same layer; the
layer's output waits for both. On CUDA (`StoreOptions.cpu_handoff`, "auto" by default) it is the
CUDA stream that waits for the CPU, not the main thread (`kvtier.kv.host_flag`), so the host's
issuing of what follows is off the CPU's path, and the merge reads the CPU's results in place
(`kvtier.kv.mapped`).
Which slices: `kvtier.planner.cpu_split.cpu_slice_flags`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from kvtier.attention.cpu_decode import CpuDecoder, PendingDecode
from kvtier.attention.dense import attend_self_lse, merge_stacked
from kvtier.attention.row_formats import KIVI_GROUP, ROW_KINDS, RowFormat
from kvtier.config import ModelConfig
from kvtier.kv.host_flag import HostFlag
from kvtier.kv.host_slice import HostSlice
from kvtier.kv.layout import KVLayout
from kvtier.kv.mapped import device_view, results_mode
from kvtier.kv.packed import PackedTier
from kvtier.kv.streams import Streams
from kvtier.planner.cpu_split import cpu_slice_flags
from kvtier.planner.hardware import Hardware, detect_hardware

# The store's own attention of one (layer, group) slice: (layer, group, q, kv_new) -> out.
AttendSlice = Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]
# The store's write-back of a streamed slice's new tokens: (slice, new, after) -> event.
WriteBack = Callable[[int, torch.Tensor, torch.cuda.Event | None], torch.cuda.Event | None]


@functools.cache
def shared_decoder() -> CpuDecoder:
    """One CPU attention pool per process, shared by every store (its threads are the cores')."""
    return CpuDecoder()


class CpuSlices:
    """The slices a store attends on the CPU at decode, and the attention of layers that have some."""

    def __init__(
        self,
        layout: KVLayout,
        hosts: dict[int, HostSlice],
        count: int,
        device: torch.device,
        streams: Streams,
        decoder: CpuDecoder | None = None,
        packed: PackedTier | None = None,
        handoff: str = "auto",
        results: str = "auto",
    ) -> None:
        on_device = packed.device_slices if packed is not None else frozenset()  # packed, on the GPU
        resident = [s not in hosts or s in on_device for s in range(layout.num_slices)]
        flags = cpu_slice_flags(layout.num_layers, layout.num_groups, resident, count)
        self.slices = frozenset(s for s, f in enumerate(flags) if f)
        self.layers = frozenset(s // layout.num_groups for s in self.slices)
        self._groups = {  # layer -> its CPU slices' groups, ascending
            li: tuple(g for g in range(layout.num_groups) if layout.slice_index(li, g) in self.slices)
            for li in self.layers
        }
        self._head_index: dict[int, tuple[slice | torch.Tensor, slice | torch.Tensor]] = {}
        self.layout = layout
        self.hosts = hosts
        self.device = device
        self.streams = streams
        self.decoder = decoder or shared_decoder()
        # A quantized host tier: a CPU slice's coded tokens are packed rows there, attended in
        # place (`CpuDecoder.start_rows`), and only its uncoded tail is in `hosts`.
        self.packed = packed
        self.wait_s = 0.0  # seconds the host waited for CPU results, summed (bench/tiered_store.py)
        # When a list: each layer's (layer, CPU jobs, entry, wait start, wait end), perf_counter
        # seconds (bench/tiered_store.py --trace-cpu; the jobs' own times: `decoder.trace`)
        self.trace: list[tuple[int, int, float, float, float]] | None = None
        # The GPU's stream waits for the CPU's results (`kvtier.kv.host_flag`), else the host does
        self.flag = HostFlag.make(device, handoff) if self.slices else None
        self._ticket = 0  # the flag's value once the latest layer's CPU results are in
        self._signals: list[Future[None]] = []  # the layers' signals since `end_step`
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}  # `_buffer`'s, per (use, layer)
        # "mapped": the merge reads each layer's results in place (`kvtier.kv.mapped`), else a copy
        self.results = results_mode(results, device)
        self._views: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}  # (address, shape) -> view
        self._last_layer = max(self.layers, default=-1)

    def begin_step(self, n_new: int) -> frozenset[int]:
        """The slices this step attends on the CPU (none unless it decodes one token)."""
        return self.slices if n_new == 1 else frozenset()

    def end_step(self) -> None:
        """Wait for this step's CPU attention and raise its first error (with a `HostFlag` the
        layers did not wait on the host)."""
        self._collect(keep=0)

    def _collect(self, keep: int) -> None:
        """Wait for all but the last `keep` layers' signals, oldest first, and forget them; on a
        CPU job's error forget every signal (each still releases its stream) and raise it."""
        while len(self._signals) > keep:
            signal = self._signals.pop(0)
            try:
                signal.result()
            except BaseException:
                self._signals.clear()
                raise

    def attend_layer(
        self,
        layer: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        length: int,
        attend_slice: AttendSlice,
        write_back: WriteBack,
    ) -> torch.Tensor:
        """Attention of one decode token at `layer` over `length` stored tokens: q [1, H_q, D]
        (rotated), kv [1, 2, H_kv, D] the token's own K/V. CPU slices start first, the others run
        through the store's `attend_slice`, the CPU slices' new tokens go to the host through
        `write_back`, then the CPU results are merged; returns [1, H_q, D].

        The layer's CPU slices are merged together: their results land in one buffer (pinned on
        CUDA) that crosses to the device in one asynchronous copy, or that the merge reads in
        place with `cpu_results="mapped"` (`kvtier.kv.mapped`), and their new tokens' own
        attention and the merge (`merge_stacked`: one pass over all parts) run once over all their
        heads. What follows the wait is kept short: until the next layer's query reaches the CPU,
        its threads are idle (`bench/tiered_store.py --trace-cpu`). NOTE: a copy from pageable
        memory would make the host wait for the device's queue every layer."""
        entry = time.perf_counter()
        lay = self.layout
        on_cpu = self._groups[layer]
        n, r, d = len(on_cpu), lay.q_per_kv * lay.group_size, lay.head_dim
        pending: list[PendingDecode] = []
        results: torch.Tensor | None = None  # [parts, n, r * D + r]: each part's out, then its lse
        if length > 0:
            hosts = [self.hosts[lay.slice_index(layer, g)] for g in on_cpu]
            q_host, ready = self._query_to_host(layer, q[0], hosts)
            jobs = [
                self._jobs(lay.slice_index(layer, g), q_host[lay.q_heads(g)], length, ready) for g in on_cpu
            ]
            parts = len(jobs[0])  # NOTE: the same for every slice: one length, layout and codec
            assert all(len(j) == parts for j in jobs)
            results = self._buffer(("results", layer), (parts, n, r * d + r), torch.float32)
            for i, slice_jobs in enumerate(jobs):
                for p, job in enumerate(slice_jobs):
                    pending.append(job((results[p, i, : r * d].view(r, d), results[p, i, r * d :])))
        outs: dict[int, torch.Tensor] = {}
        for g in range(lay.num_groups):
            if g not in on_cpu:
                outs[g] = attend_slice(layer, g, q[:, lay.q_heads(g)], kv[:, :, lay.kv_heads(g)])
        q_heads, kv_heads = self._heads(layer)
        new = kv[:, :, kv_heads]  # [1, 2, n * G, D]
        part = attend_self_lse(q[:, q_heads], new[:, 0], new[:, 1])  # [1, n * r, D], [1, n * r]
        # The CPU slices' new tokens go to the host now, not after the merge: the copies need only
        # kv, and the CPU reads none of them (its jobs read the tokens before position `length`).
        # NOTE: the event after the copies out of kv: a write-back reads them on another stream.
        news = [(lay.slice_index(layer, g), kv[:, :, lay.kv_heads(g)].contiguous()) for g in on_cpu]
        after = self.streams.record()
        for sid, token in news:
            write_back(sid, token, after)
        if results is not None:
            t0 = time.perf_counter()
            if self.flag is not None:  # the stream waits, the host goes on issuing
                self._ticket += 1
                flag, ticket = self.flag, self._ticket
                self._signals.append(self.decoder.signal(pending, lambda: flag.set(ticket)))
                flag.gpu_wait(ticket)
                # NOTE: at most one CPU layer ahead of the CPU. Everything the chain needs when
                # the CPU finishes layer l - 1 is issued by now (up to this layer's wait), and
                # the host's queue stays short: a launch into a full queue blocks, and one that
                # blocks holding the GIL would stop the CPU threads too. After the step's last
                # CPU layer the host waits for it all, so nothing the caller does next (a
                # sync, a token's read) waits on the CPU's threads (~0.3 ms of issuing a step).
                self._collect(keep=0 if layer == self._last_layer else 1)
            else:
                for started in pending:
                    started.result()
            t1 = time.perf_counter()
            self.wait_s += t1 - t0
            if self.trace is not None:
                self.trace.append((layer, len(pending), entry, t0, t1))
            res = self._on_device(results)
            cpu_out = res[..., : r * d].reshape(-1, 1, n * r, d)  # [parts, 1, n * r, D]
            cpu_lse = res[..., r * d :].reshape(-1, 1, n * r)
            # NOTE: one merge of the new token's part and every CPU part (a packed slice's rows
            # and its tail's pieces): from here to the next layer's query is the CPU's idle time
            part = merge_stacked(torch.cat((part[0][None], cpu_out)), torch.cat((part[1][None], cpu_lse)))
        merged = part[0].to(q.dtype)
        for i, g in enumerate(on_cpu):
            outs[g] = merged[:, i * r : (i + 1) * r]
        return torch.cat([outs[g] for g in range(lay.num_groups)], dim=1)

    def _heads(self, layer: int) -> tuple[slice | torch.Tensor, slice | torch.Tensor]:
        """The query and KV heads of `layer`'s CPU slices: slices where the groups are adjacent,
        else index tensors on the device (made once)."""
        heads = self._head_index.get(layer)
        if heads is None:
            lay, groups = self.layout, self._groups[layer]
            if groups[-1] - groups[0] + 1 == len(groups):
                heads = (
                    slice(lay.q_heads(groups[0]).start, lay.q_heads(groups[-1]).stop),
                    slice(lay.kv_heads(groups[0]).start, lay.kv_heads(groups[-1]).stop),
                )
            else:
                qi = [h for g in groups for h in range(lay.num_kv_heads * lay.q_per_kv)[lay.q_heads(g)]]
                ki = [h for g in groups for h in range(lay.num_kv_heads)[lay.kv_heads(g)]]
                heads = (torch.tensor(qi, device=self.device), torch.tensor(ki, device=self.device))
            self._head_index[layer] = heads
        return heads

    def _jobs(
        self, sid: int, q: torch.Tensor, length: int, ready: torch.cuda.Event | None
    ) -> list[Callable[[tuple[torch.Tensor, torch.Tensor]], PendingDecode]]:
        """The CPU attention of q [H_q_g, D] over slice `sid`'s `length` stored tokens, as starts
        that each take where to write (out, lse): one over full-precision extents, or with a
        quantized host tier one over the packed rows of its coded tokens and one per stored
        piece of its uncoded tail."""
        host, dec = self.hosts[sid], self.decoder
        if self.packed is None:
            return [functools.partial(self._start, host.extents, q, length, ready)]
        lay, codec = self.layout, self.packed.codec
        rows = min(self.packed.coded, length) // codec.group
        jobs = []
        if rows:
            extents = self.packed.rows[sid].extents
            g, d = lay.group_size, lay.head_dim
            jobs.append(lambda into: dec.start_rows(q, codec, extents, rows, g, d, ready, into))
        for view in host.views(rows * codec.group, length):
            jobs.append(functools.partial(self._start, [view], q, view.shape[0], ready))
        return jobs

    def _start(
        self,
        extents: list[torch.Tensor],
        q: torch.Tensor,
        length: int,
        ready: torch.cuda.Event | None,
        into: tuple[torch.Tensor, torch.Tensor],
    ) -> PendingDecode:
        return self.decoder.start(q, extents, length, ready, into)

    def _on_device(self, results: torch.Tensor) -> torch.Tensor:
        """A layer's results buffer as the merge reads it: copied (asynchronously), or mapped."""
        if self.results != "mapped":
            return results.to(self.device, non_blocking=True)
        key = (results.data_ptr(), tuple(results.shape))
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = device_view(results, self.device)
        return view

    def _buffer(self, key: tuple[str, int], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of `shape` kept per `key` for every step (pinned on CUDA), grown when a
        step needs more. NOTE: reused, not allocated, each layer: a pinned allocation in the
        loop may be a `cudaHostAlloc`, which CUDA lists among the calls that synchronize with
        the device, made while the stream may be waiting for the CPU threads (whose own CUDA
        calls, and event records when they drop a pinned tensor, would then queue behind it: a
        suspected cause of hangs with the stream's wait, `kvtier.kv.host_flag`). Reuse is safe:
        a step's CPU jobs of a layer start after its query, which the stream copies after the
        last step's copy (or mapped read, in the merge) of the layer's results."""
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != dtype or buf.numel() < math.prod(shape):
            if buf is not None:  # NOTE: its views go with it (a view starts where its buffer does)
                self._views = {k: v for k, v in self._views.items() if k[0] != buf.data_ptr()}
            buf = torch.empty(math.prod(shape), dtype=dtype, pin_memory=self.device.type == "cuda")
            self._buffers[key] = buf
        return buf[: math.prod(shape)].view(shape)

    def _query_to_host(
        self, layer: int, q: torch.Tensor, hosts: list[HostSlice]
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """q [H_q, D] on the host, and the event the CPU tasks wait for: the copy, and the last
        write-back into the slices they read."""
        if q.device.type == "cpu":
            return q, None
        # NOTE: the compute stream waits for the slices' last write-backs before the copy, so one
        # event covers both; a pinned destination keeps the copy asynchronous.
        self.streams.wait([h.last_write for h in hosts])
        q_host = self._buffer(("q", layer), tuple(q.shape), q.dtype)
        q_host.copy_(q, non_blocking=True)
        return q_host, self.streams.record()


def hardware_for(
    device: torch.device, cpu_attention: str | int, dtype: torch.dtype, cfg: ModelConfig
) -> Hardware:
    """The device's hardware numbers (`detect_hardware`); on CUDA with `cpu_attention="auto"`,
    with this host's CPU attention and memory read rates measured (`measured_rates`, once per
    process), which the planner's CPU/link split needs."""
    hw = detect_hardware(device)
    if device.type != "cuda" or cpu_attention != "auto":
        return hw
    attn, read = measured_rates(dtype, cfg.head_dim, cfg.q_per_kv)
    packed = measured_packed_rates(cfg.head_dim, cfg.q_per_kv)
    return dataclasses.replace(hw, cpu_attention_bw=attn, host_read_bw=read, cpu_packed_bw=packed)


def _best(fn: Callable[[], object], reps: int = 3) -> float:
    """The fastest of `reps` calls, seconds."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


@functools.cache
def measured_packed_rates(
    head_dim: int, q_per_kv: int, bf16_bytes: int = 256 << 20
) -> tuple[tuple[str, float], ...]:
    """(row format, packed bytes per second) of CPU attention over packed rows on this machine, for
    each format the native kernel reads in place (`ROW_KINDS`; none without the kernel: the
    torch path unpacks first, slower than the link), over the tokens of `bf16_bytes` of bf16 KV
    (`measured_rates`' slice); measured once per process. Zero rows: the kernel's arithmetic
    does not depend on the values."""
    dec = shared_decoder()
    if dec.lib is None:
        return ()
    tokens = max(KIVI_GROUP, bf16_bytes // (2 * head_dim * 2))
    q = torch.full((q_per_kv, head_dim), 0.01)
    out = []
    for fmt in ROW_KINDS:
        rows_of = RowFormat(fmt)
        rows = torch.zeros(tokens // rows_of.group, rows_of.row_bytes(1, head_dim), dtype=torch.uint8)
        n = rows.shape[0]
        seconds = _best(lambda: dec.start_rows(q, rows_of, [rows], n, 1, head_dim).result())  # noqa: B023
        out.append((fmt, rows.numel() / seconds))
    return tuple(out)


@functools.cache
def measured_rates(dtype: torch.dtype, head_dim: int, q_per_kv: int) -> tuple[float, float]:
    """(CPU attention KV read rate, host memory read rate) of this machine, B/s, measured once
    per process: the shared pool over one 256 MiB slice of one KV head in `dtype` (past the
    caches), and a threaded fp32 sum over as many bytes. Takes about a second (plus the kernel's build
    on first use)."""
    nbytes = 256 << 20
    item = dtype.itemsize
    tokens = nbytes // (2 * head_dim * item)
    ext = torch.full((tokens, 2, 1, head_dim), 0.01, dtype=dtype)
    q = torch.full((q_per_kv, head_dim), 0.01, dtype=dtype)
    dec = shared_decoder()

    attn = nbytes / _best(lambda: dec.attend(q, [ext], tokens))
    flat = ext.view(-1) if dtype == torch.float32 else torch.ones(nbytes // 4)
    read = flat.numel() * flat.element_size() / _best(flat.sum)
    return attn, read
