"""A store's copies of new tokens to the host tier, now or deferred to the next step.

Streamed slices are attended from staging buffers, and the step's new tokens of each go back to
its host slice on the D2H stream once the layer's attention is done (the only KV that ever moves
device -> host). Queued there, a copy waits on the device for its layer, and device-to-host
copies run in the order queued, across streams: on the H200 a server's token read-back waited
108 ms behind a tiered request's 32 queued write-backs (bench/results/serve_gpu_24gib_trace_b.json).
So a store whose steps are launched only once the last one has finished (the server's tiered
runs) defers a decode step's copies to the next step's start, when nothing they wait for is
still running:

    step t:      [layer 0 .. layer L-1]            kept: new tokens of t (clones, on the device)
    step t + 1:  flush: copies of t, ready at once | loads of t + 1 wait for them (last_write)
"""

from __future__ import annotations

import torch

from kvtier.kv.host_slice import HostSlice
from kvtier.kv.streams import Streams
from kvtier.kv.tiers import TierAccount


class HostWrites:
    """Writes of new tokens into `hosts` (slice -> host slice); `on_device` slices' host copies
    are mirrors that never cross PCIe, so their bytes are not counted."""

    def __init__(
        self, hosts: dict[int, HostSlice], streams: Streams, account: TierAccount, on_device: frozenset[int]
    ) -> None:
        self.hosts, self.streams, self.account, self.on_device = hosts, streams, account, on_device
        self.defer = False  # decode steps' writes wait for `flush` (see the module docstring)
        self._kept: list[tuple[int, torch.Tensor, torch.cuda.Event | None, int]] = []

    def write(
        self, sid: int, new: torch.Tensor, after: torch.cuda.Event | None, at: int, decode: bool
    ) -> torch.cuda.Event | None:
        """Copy new [T, 2, G, D] to slice `sid`'s host tier at token `at`, after `after` (an event
        on the current stream); a decode step's is kept for `flush` when `defer` is on. Returns
        the copy's event (None when kept, or on the CPU)."""
        return self.write_all([(sid, new)], after, at, decode)

    def write_all(
        self, writes: list[tuple[int, torch.Tensor]], after: torch.cuda.Event | None, at: int, decode: bool
    ) -> torch.cuda.Event | None:
        """`write` of several slices' new tokens (sid, [T, 2, G, D]) after one event, with one
        switch to the copy stream and one wait for them all (a layer's cached slices)."""
        if self.defer and decode:
            # NOTE: clones, since `new` may be a view into a staging buffer that is reused as
            # soon as the compute stream is done with it; the event orders the flush after them.
            kept = [(sid, new.clone()) for sid, new in writes]
            ready = self.streams.record()
            self._kept.extend((sid, new, ready, at) for sid, new in kept)
            return None
        return self._copy(writes, after, at)

    def flush(self) -> None:
        """Queue the kept writes, in order (before anything reads the host slices again)."""
        kept, self._kept = self._kept, []
        for sid, new, after, at in kept:
            self._copy([(sid, new)], after, at)

    def drop(self) -> None:
        """Forget the kept writes (the store is closing: nothing reads its host tier again)."""
        self._kept.clear()

    def _copy(
        self, writes: list[tuple[int, torch.Tensor]], after: torch.cuda.Event | None, at: int
    ) -> torch.cuda.Event | None:
        with self.streams.on_d2h():
            self.streams.wait([after])
            for sid, new in writes:
                self.hosts[sid].write(at, new)
            written = self.streams.record()
        for sid, new in writes:
            if self.streams.d2h is not None:
                new.record_stream(self.streams.d2h)
            self.hosts[sid].last_write = written
            if sid not in self.on_device:
                self.account.d2h_bytes += new.numel() * new.element_size()
        return written
