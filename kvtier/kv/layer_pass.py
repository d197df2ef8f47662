"""A prefill step run layer by layer: the streamed slices of one layer stay in staging buffers
while the layer attends every chunk of the step, so the stored prefix never crosses PCIe again.

Run chunk by chunk (the default order), every chunk loads the whole prefix of every streamed
slice: a 512K-token prompt in 34 chunks of 15K sends ~1.1 TB of Llama-3-8B's KV to the GPU,
~20 s at 55 GB/s, which at 512K bounds HiP's prefill (its chunks' copies took as long as their
compute: bench/results/hip_offload_prefill_512k_lean_fast_b.json). Run layer by layer, a slice
is loaded once a layer (nothing, for a fresh prompt) and each chunk's new tokens still go back
to the host tier as they are made; the runner moves the chunks' hidden states instead
(`kvtier.engine.layer_prefill`: 8 KB a token for Llama-3-8B, ~64x less than its KV).

    chunk order:  c0: L0 L1 .. L31 | c1: L0 L1 .. L31 | ...    every chunk loads every slice
    layer order:  L0: c0 c1 .. c33 | L1: c0 c1 .. c33 | ...    a slice stays for its layer

A (layer, chunk) computes the same thing from the same KV in either order, so the outputs are
bitwise equal (tests/test_layer_pass.py).
"""

from __future__ import annotations

import torch

from kvtier.attention.interface import CachingSliceKernel, SliceStep
from kvtier.kv.host_slice import HostSlice
from kvtier.kv.layout import KVLayout
from kvtier.kv.staged_attend import StagedSlices
from kvtier.kv.streams import Event


def streamed_of_layer(layout: KVLayout, hosts: dict[int, HostSlice], layer: int) -> list[int]:
    """The slices of `layer` that live in the host tier (attended through staging), in order."""
    return [sid for g in range(layout.num_groups) if (sid := layout.slice_index(layer, g)) in hosts]


def pass_fits(staged: StagedSlices, stored: int, n_new: int) -> bool:
    """Whether a step of `n_new` tokens after `stored` can run layer by layer over a store's
    streamed slices: each fits a staging buffer whole, a layer's fit the ring at once, and a
    caching kernel wants them whole for this step (asked as the step's schedule would ask it,
    `CachingSliceKernel.needs_slice`, which also records them as streamed)."""
    ring, hosts, layout, kernel, attn = staged.ring, staged.hosts, staged.layout, staged.kernel, staged.attn
    if not hosts or stored + n_new > ring.tokens:
        return False
    if max(len(streamed_of_layer(layout, hosts, layer)) for layer in range(layout.num_layers)) > ring.slots:
        return False
    if isinstance(kernel, CachingSliceKernel):
        g = layout.num_groups
        steps = [SliceStep(*divmod(sid, g), stored, attn[sid // g]) for sid in hosts]
        return all([kernel.needs_slice(step, n_new) for step in steps])  # NOTE: asks every slice
    return True


class LayerPass:
    """The streamed slices' attention (`staged`'s, a store's) during one layer-by-layer prefill
    step of a store that held `stored` tokens before it: a layer's slices are held in the
    ring's buffers from its first chunk to its last (their prefix loaded once), each chunk's
    new tokens appended and written back to the host tier at their position."""

    def __init__(self, staged: StagedSlices, stored: int) -> None:
        self.ring, self.hosts, self.layout = staged.ring, staged.hosts, staged.layout
        self.kernel, self.streams, self.account, self.writes = (
            staged.kernel,
            staged.streams,
            staged.account,
            staged.writes,
        )
        self.stored = stored
        self._layer: int | None = None
        self._held: dict[int, tuple[int, torch.Tensor]] = {}  # slice -> (buffer index, buffer)
        self._written: dict[int, Event | None] = {}  # buffer index -> its last write-back

    def attend(self, sid: int, step: SliceStep, q: torch.Tensor, kv_new: torch.Tensor) -> torch.Tensor:
        """Append kv_new [T, 2, G, D] at step.start to slice `sid` and attend q [T, H_q_g, D]
        over its tokens so far (the kernel's `SliceKernel` call, as a loaded slice's)."""
        if step.layer != self._layer:
            self._hold(step.layer)
        b, buf = self._held[sid]
        s, t = step.start, q.shape[0]
        buf[s : s + t] = kv_new
        out = self.kernel(q, buf[: s + t], step)
        computed = self.streams.record()
        self._written[b] = self.writes.write(sid, buf[s : s + t], computed, s, decode=False)
        return out

    def _hold(self, layer: int) -> None:
        """Give the last layer's buffers back and hold this layer's slices, prefix loaded: in the
        other half of the ring where it has room for two layers, so the layer need not wait for
        the last one's write-backs out of the same buffers."""
        self.close()
        sids = streamed_of_layer(self.layout, self.hosts, layer)
        first = len(sids) * (layer % 2) if 2 * len(sids) <= self.ring.slots else 0
        for sid, (b, buf) in zip(sids, self.ring.hold(len(sids), first), strict=True):
            if self.stored:  # the prefix stored before the step, once for all the layer's chunks
                host = self.hosts[sid]
                with self.streams.on_h2d():
                    self.streams.wait([host.last_write])
                    host.read_into(buf, 0, self.stored)
                    ready = self.streams.record()
                self.streams.wait([ready])
                self.account.h2d_bytes += self.stored * self.ring.token_bytes
            self._held[sid] = (b, buf)
        self._layer = layer

    def close(self) -> None:
        """Give the held buffers back to the ring, free once their last reads are done."""
        done = self.streams.record()
        for b, _ in self._held.values():
            self.ring.release_held(b, [self._written.pop(b, None), done])
        self._held.clear()
        self._layer = None
