"""Ping-pong GPU buffers that streamed slices are loaded into.

```
 schedule:  (L0,g0,0:S) (L0,g1,0:S) (L1,g0,0:S) ...      one load per slice, or several
 buffers:      buf0        buf1        buf0     ...       (sequence blocks) when S is large
 h2d stream: [load n+1 ]  [load n+2 ]                     waits: buffer free (compute + D2H done)
 compute   :      [attn n ]  [attn n+1]                   waits: its load's event
 d2h stream:           [new tokens n]                     waits: attn n's event
```

A load is issued `depth` slots ahead of the one being computed, so transfers hide behind
compute and cross layer boundaries. Only events order the streams; the result does not depend
on the order in which the copies happen to run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.kv.device_memory import DeviceMemory
from kvtier.kv.host_slice import HostSlice
from kvtier.kv.streams import Event, Streams
from kvtier.kv.tiers import GPU, TierAccount


@dataclass(frozen=True)
class Load:
    """Tokens [start, end) of streamed slice `slice_id`, placed at the start of a buffer."""

    slice_id: int
    start: int
    end: int


# read(slice_id, dst, start, end, free) -> (bytes sent, event): copy tokens [start, end) of a
# streamed slice into dst[: end - start], its writes of dst ordered after the `free` events (the
# buffer's last readers, the slice's last write-back), on the current stream or partly on
# another whose work the event marks (None: all on the current stream).
Reader = Callable[[int, torch.Tensor, int, int, list[Event | None]], tuple[int, Event | None]]


@dataclass
class Loaded:
    load: Load
    buffer: int
    view: torch.Tensor  # the whole buffer, [tokens, 2, G, D]
    ready: list[Event | None]  # all of them done: the buffer holds the load


class StagingRing:
    """`n` GPU buffers of `tokens` tokens each, filled from host slices in a fixed schedule."""

    def __init__(
        self,
        n: int,
        tokens: int,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        memory: DeviceMemory,
        streams: Streams,
        account: TierAccount,
    ) -> None:
        self.tokens = tokens
        self.streams = streams
        self.account = account
        self._make = lambda: [memory.empty((tokens, *shape), dtype) for _ in range(n)]
        self.buffers = self._make()
        self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers)
        account.alloc(GPU, self.nbytes)
        self._free_after: list[list[Event | None]] = [[] for _ in range(n)]
        self._next = 0
        self._schedule: deque[Load] = deque()
        self._inflight: deque[Loaded] = deque()
        self._hosts: dict[int, HostSlice] = {}
        self._read: Reader | None = None
        self.token_bytes = self.buffers[0][0].numel() * self.buffers[0].element_size()

    def start(self, schedule: list[Load], hosts: dict[int, HostSlice], read: Reader | None = None) -> None:
        """Begin a step: loads will be issued in `schedule` order, through `read` if given (e.g.
        packed tokens unpacked on the way), else as plain copies from `hosts`. Buffers given
        back (`give_back`) are made again first when the schedule loads anything."""
        if schedule and not self.buffers:
            self.buffers = self._make()
            self.account.alloc(GPU, self.nbytes)
        self._schedule = deque(schedule)
        self._hosts = hosts
        self._read = read
        self._inflight.clear()
        self._fill()

    def _fill(self) -> None:
        # Keep up to n - 1 loads ahead of the one in use.
        while self._schedule and len(self._inflight) < len(self.buffers) - 1:
            self._issue(self._schedule.popleft())

    def _issue(self, load: Load) -> None:
        b = self._next
        self._next = (b + 1) % len(self.buffers)
        buf = self.buffers[b]
        host = self._hosts[load.slice_id]
        with self.streams.on_h2d():
            # NOTE: the buffer may still be read by attention or by the D2H of new tokens of
            # the slice that used it last, and the host tokens may still be in flight from the
            # previous step's write-back: wait for all three before overwriting.
            free = [*self._free_after[b], host.last_write]
            aside: Event | None = None
            if self._read is None:
                self.streams.wait(free)
                host.read_into(buf, load.start, load.end)
                moved = (load.end - load.start) * self.token_bytes
            else:
                moved, aside = self._read(load.slice_id, buf, load.start, load.end, free)
            ready = [self.streams.record(), aside]
        self.account.h2d_bytes += moved
        self._inflight.append(Loaded(load, b, buf, ready))

    def take(self, load: Load) -> Loaded:
        """The buffer holding `load`, with the compute stream ordered after its copy; the next
        load of the schedule is issued at once, so it overlaps this slice's compute."""
        if not self._inflight and self._schedule:
            self._issue(self._schedule.popleft())
        loaded = self._inflight.popleft()
        if loaded.load != load:
            raise RuntimeError(f"staging schedule out of order: expected {load}, have {loaded.load}")
        self.streams.wait(loaded.ready)
        self._fill()
        return loaded

    def release(self, loaded: Loaded, after: list[Event | None]) -> None:
        """The buffer may be reused once the `after` events complete."""
        self._free_after[loaded.buffer] = after
        self._fill()

    def hold(self, n: int, first: int = 0) -> list[tuple[int, torch.Tensor]]:
        """Buffers first .. first + n - 1 (index, buffer [tokens, 2, G, D]) for the caller's own
        use outside any schedule, until `release_held` (a layer-by-layer prefill keeps a layer's
        slices in them: `kvtier.kv.layer_pass`), the current stream ordered after their last
        readers. Made again first if given back."""
        if first + n > len(self._free_after):
            raise ValueError(
                f"buffers {first}..{first + n - 1} asked of a staging ring of {len(self._free_after)}"
            )
        if not self.buffers:
            self.buffers = self._make()
            self.account.alloc(GPU, self.nbytes)
        for b in range(first, first + n):
            self.streams.wait(self._free_after[b])
        return [(b, self.buffers[b]) for b in range(first, first + n)]

    def release_held(self, b: int, after: list[Event | None]) -> None:
        """Buffer `b` of `hold` is the ring's again once the `after` events complete."""
        self._free_after[b] = after

    @property
    def slots(self) -> int:
        """How many buffers the ring has (also while given back)."""
        return len(self._free_after)

    def give_back(self) -> None:
        """Free the buffers while no step loads anything (decode served from a kernel's own
        cache), once every copy and read of them is done; `start` makes them again. Only for
        buffers of the caching allocator: their bytes become free for others."""
        if self.buffers:
            self.streams.synchronize()
            self.account.free(GPU, self.nbytes)
            self.buffers = []
            self._free_after = [[] for _ in self._free_after]

    def close(self) -> None:
        if self.buffers:
            self.account.free(GPU, self.nbytes)
        self.buffers.clear()
