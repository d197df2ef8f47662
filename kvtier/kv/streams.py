"""CUDA streams and events for transfers, with a synchronous stand-in on the CPU.

Ordering between compute and copies is expressed only with events (`record` / `wait`); the
host never blocks inside the layer loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

Event = torch.cuda.Event


class Streams:
    """The compute stream plus one host-to-device and one device-to-host copy stream."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None

    def record(self) -> Event | None:
        """An event marking all work queued so far on the current stream."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    @staticmethod
    def wait(events: list[Event | None]) -> None:
        """Make the current stream wait for `events` (no host blocking)."""
        for ev in events:
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)

    @contextlib.contextmanager
    def on_h2d(self) -> Iterator[None]:
        with torch.cuda.stream(self.h2d) if self.h2d is not None else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def on_d2h(self) -> Iterator[None]:
        with torch.cuda.stream(self.d2h) if self.d2h is not None else contextlib.nullcontext():
            yield

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
