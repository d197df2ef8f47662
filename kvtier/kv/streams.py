"""CUDA streams and events for transfers, with a synchronous stand-in on the CPU.

Ordering between compute and copies is expressed only with events (`record` / `wait`); the
host never blocks inside the layer loop.
"""

from __future__ import annotations

import contextlib

import torch

Event = torch.cuda.Event


class Streams:
    """The compute stream plus one host-to-device and one device-to-host copy stream, and one
    that unpacks quantized loads (`StoreOptions.unpack_stream`)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.unpack = torch.cuda.Stream(device) if self.cuda else None

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

    def on_h2d(self) -> contextlib.AbstractContextManager[None]:
        return _On(self.h2d) if self.h2d is not None else contextlib.nullcontext()

    def on_d2h(self) -> contextlib.AbstractContextManager[None]:
        return _On(self.d2h) if self.d2h is not None else contextlib.nullcontext()

    def on_unpack(self) -> contextlib.AbstractContextManager[None]:
        return _On(self.unpack) if self.unpack is not None else contextlib.nullcontext()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class _On:
    """Make `stream` current inside a `with` block. Lighter than `torch.cuda.stream`, whose
    device bookkeeping costs microseconds that head-wise offload pays twice per slice step; it
    is used only when the stream belongs to another device than the current one."""

    __slots__ = ("ctx", "prev", "stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        self.ctx: torch.cuda.StreamContext | None = None
        if torch.cuda.current_device() == self.stream.device_index:
            self.prev = torch.cuda.current_stream()
            torch.cuda.set_stream(self.stream)
        else:
            self.ctx = torch.cuda.stream(self.stream)
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is None:
            torch.cuda.set_stream(self.prev)
        else:
            self.ctx.__exit__(*exc)
