"""Attention of the slices a store attends through its staging ring (`kvtier.kv.staging`):
streamed slices, from host memory, and a quantized cache's slices packed on the device.

A step starts with its schedule of loads: every such slice in order, but those attended on the
CPU (`kvtier.kv.cpu_attend`) and those a caching kernel serves from its own GPU cache, whole or
in sequence blocks of a buffer each. The layers then take the loads in that order, a slice one
of three ways:

```
 loaded     fits a buffer: its S stored tokens loaded, the step's T appended, the kernel attends
 in blocks  does not fit (dense kernel only): blocks of a buffer loaded one after another, the
            partial results merged by log-sum-exp, so GPU memory does not grow with the context
 cached     a caching kernel attends from its own cache; only what it fetches moves (SliceReader)
```

Either way the step's new tokens go back to the slice's host tier (`kvtier.kv.write_back`).
"""

from __future__ import annotations

from typing import cast

import torch

from kvtier.attention.dense import attend_prefix_lse, attend_self_lse, merge_into
from kvtier.attention.interface import (
    CachingSliceKernel,
    DenseKernel,
    LayerCachedKernel,
    SliceKernel,
    SliceStep,
)
from kvtier.attention.spec import LayerAttention
from kvtier.errors import CapacityError
from kvtier.kv.host_slice import HostSlice
from kvtier.kv.layout import KVLayout
from kvtier.kv.packed import PackedTier
from kvtier.kv.reader import SliceReader
from kvtier.kv.staging import Load, StagingRing
from kvtier.kv.streams import Event, Streams
from kvtier.kv.tiers import TierAccount
from kvtier.kv.write_back import HostWrites


class StagedSlices:
    """The slices `hosts` of one store, loaded through `ring` (see the module docstring)."""

    def __init__(
        self,
        ring: StagingRing,
        hosts: dict[int, HostSlice],
        layout: KVLayout,
        kernel: SliceKernel,
        attn: tuple[LayerAttention, ...],
        *,
        device: torch.device,
        streams: Streams,
        account: TierAccount,
        writes: HostWrites,
        packed: PackedTier | None,
        unpack_stream: bool,
        caching_memory: bool,
    ) -> None:
        self.ring, self.hosts, self.layout, self.kernel, self.attn = ring, hosts, layout, kernel, attn
        self.device, self.streams, self.account, self.writes = device, streams, account, writes
        self.packed = packed
        self.unpack_stream = unpack_stream  # `StoreOptions.unpack_stream`, as the store resolved it
        self.caching_memory = caching_memory  # the ring's buffers are the caching allocator's
        # Slices this step that the kernel serves from its own GPU cache (nothing streamed).
        self.cached: frozenset[int] = frozenset()
        # The kernel's protocols, asked once (a protocol's isinstance costs 5-10 us a call)
        self._caching = cast(CachingSliceKernel, kernel) if isinstance(kernel, CachingSliceKernel) else None

    def _schedule(self, length: int, n_new: int, cpu: frozenset[int]) -> list[Load]:
        """The loads of a step of `n_new` tokens after `length` stored, in the order the layers
        take them: every slice but `cpu` (attended on the CPU) and those the kernel serves from
        its own cache (which it sets `cached` to)."""
        s, cap = length, self.ring.tokens
        loads = []
        self.cached = frozenset()
        kernel = self._caching
        if kernel is not None:
            lay = self.layout
            self.cached = frozenset(
                sid
                for sid in self.hosts
                if not kernel.needs_slice(
                    SliceStep(*divmod(sid, lay.num_groups), s, self.attn[sid // lay.num_groups]), n_new
                )
            )
        for sid in sorted(set(self.hosts) - self.cached - cpu):
            if s + n_new <= cap:
                loads.append(Load(sid, 0, s))
            else:
                loads.extend(Load(sid, a, min(a + cap, s)) for a in range(0, s, cap))
        return loads

    def start(self, length: int, n_new: int, cpu: frozenset[int]) -> None:
        """Begin a step of `n_new` tokens after `length` stored: start its loads (`_schedule`,
        `StagingRing.start`), packed rows unpacked on the way; a decode step that loads nothing
        gives the ring's buffers back when `idle_in_decode`."""
        read = self._read_packed if self.packed is not None else None
        schedule = self._schedule(length, n_new, cpu)
        if not schedule and n_new == 1 and self.idle_in_decode():
            self.ring.give_back()  # made again by the next step that loads a slice
        self.ring.start(schedule, self.hosts, read)

    def idle_in_decode(self) -> bool:
        """Whether decode never loads a slice into the staging buffers (a caching kernel that
        serves every decode step itself) and their bytes would go back to the caching allocator,
        where the kernel's decode caches are allocated (not a region someone else owns)."""
        caching = self._caching is not None and not self._caching.decode_streams
        return caching and self.caching_memory

    def _read_packed(
        self, sid: int, dst: torch.Tensor, start: int, end: int, free: list[Event | None]
    ) -> tuple[int, Event | None]:
        assert self.packed is not None
        if self.unpack_stream:
            return self.packed.load_into(sid, self.hosts[sid], dst, start, end, self.streams, free)
        self.streams.wait(free)
        return self.packed.read_into(sid, self.hosts[sid], dst, start, end), None

    def attend(
        self, sid: int, step: SliceStep, q: torch.Tensor, kv_new: torch.Tensor, length: int, decode: bool
    ) -> torch.Tensor:
        """Append the step's kv_new [T, 2, G, D] to slice `sid` of `length` stored tokens and
        attend q [T, H_q_g, D] (`decode`: the step is one token)."""
        s, t = step.start, q.shape[0]
        if sid in self.cached:
            return self._attend_cached(sid, step, q, kv_new, length, decode)
        if s + t <= self.ring.tokens:
            return self._attend_loaded(sid, step, q, kv_new, length, decode)
        if not isinstance(self.kernel, DenseKernel):
            raise CapacityError(
                f"slice ({step.layer}, {step.group}) needs {s + t} tokens but a staging buffer holds "
                f"{self.ring.tokens}; this attention method needs whole slices on the GPU: "
                "give it more --gpu-memory or a finer --head-group"
            )
        return self._attend_blocks(sid, step, q, kv_new, length, decode)

    def _attend_loaded(
        self, sid: int, step: SliceStep, q: torch.Tensor, kv_new: torch.Tensor, length: int, decode: bool
    ) -> torch.Tensor:
        s, t = length, q.shape[0]
        loaded = self.ring.take(Load(sid, 0, s))
        buf = loaded.view
        buf[s : s + t] = kv_new
        out = self.kernel(q, buf[: s + t], step)
        computed = self.streams.record()
        written = self.writes.write(sid, buf[s : s + t], computed, length, decode=decode)
        self.ring.release(loaded, [computed, written])
        return out

    def _attend_cached(
        self, sid: int, step: SliceStep, q: torch.Tensor, kv_new: torch.Tensor, length: int, decode: bool
    ) -> torch.Tensor:
        """A caching kernel serves the step from its GPU cache; only tokens it reads through
        `fetch` (ranges or gathered positions) move."""
        kernel = cast(CachingSliceKernel, self.kernel)  # NOTE: only caching kernels have cached slices
        fetch = SliceReader(
            sid,
            self.hosts[sid],
            self.layout,
            length,
            device=self.device,
            streams=self.streams,
            account=self.account,
            packed=self.packed,
        )
        new = kv_new.contiguous()  # [T, 2, G, D]
        out = kernel.attend_cached(q, new, step, fetch)
        self.writes.write(sid, new, self.streams.record(), length, decode=decode)
        return out

    def attend_layer_cached(
        self,
        layer: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        stored: list[int],
        length: int,
        decode: bool,
    ) -> torch.Tensor | None:
        """A decode step of a layer whose slices are all cached, through the kernel's
        `attend_cached_layer` (None: some slice is not cached, or the kernel declined); `stored`:
        the store's tokens per slice."""
        lay = self.layout
        sids = [lay.slice_index(layer, g) for g in range(lay.num_groups)]
        if not all(sid in self.cached for sid in sids):
            return None
        steps = [SliceStep(layer, g, stored[sid], self.attn[layer]) for g, sid in enumerate(sids)]
        out = cast(LayerCachedKernel, self.kernel).attend_cached_layer(q, kv, steps)
        if out is None:
            return None
        t, d = kv.shape[0], kv.shape[-1]
        # NOTE: one copy for the layer: each slice's rows [T, 2, G, D] are then contiguous (T = 1)
        per_slice = (
            kv.view(t, 2, lay.num_groups, lay.group_size, d).transpose(1, 2).contiguous()
        )  # [T, S, 2, G, D]
        news = [(sid, per_slice[:, g]) for g, sid in enumerate(sids)]
        self.writes.write_all(news, self.streams.record(), length, decode=decode)
        return out

    def _attend_blocks(
        self, sid: int, step: SliceStep, q: torch.Tensor, kv_new: torch.Tensor, length: int, decode: bool
    ) -> torch.Tensor:
        """The slice does not fit a staging buffer: stream its prefix in sequence blocks and merge
        the partial results by log-sum-exp, so GPU memory does not grow with the context."""
        s, cap = length, self.ring.tokens
        acc = None
        for a in range(0, s, cap):
            loaded = self.ring.take(Load(sid, a, min(a + cap, s)))
            acc = merge_into(acc, attend_prefix_lse(q, loaded.view[: min(cap, s - a)], step.attn))
            self.ring.release(loaded, [self.streams.record()])
        out = merge_into(acc, attend_self_lse(q, kv_new[:, 0], kv_new[:, 1], step.attn))[0].to(q.dtype)
        new = kv_new.contiguous()  # [T, 2, G, D]
        self.writes.write(sid, new, self.streams.record(), length, decode=decode)
        return out
