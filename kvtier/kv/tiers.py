"""Byte accounting per tier, and the host-memory arena.

The store counts every buffer it allocates, so the bytes per tier are exact and testable on
any machine (torch's own counters exist only on CUDA).
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from kvtier.errors import ConfigError
from kvtier.kv.host_register import RegisteredPool, registered_huge

Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""Uninitialised device tensor of a shape and dtype (`kvtier.kv.device_memory.DeviceMemory.empty`)."""

GPU, HOST = "gpu", "host"

HOST_PINS = ("alloc", "huge")
# the host slabs of KVTIER_HOST_PIN=huge, kept between stores as PyTorch's pinned allocator keeps
# its blocks (`release_pinned_cache` unregisters them)
HUGE_SLABS = RegisteredPool(registered_huge)


def host_pin() -> str:
    """`KVTIER_HOST_PIN`: how a store pins its host slabs. "alloc" (unset, the default): PyTorch's
    pinned allocator (`cudaHostAlloc`); "huge": registered memory in transparent huge pages
    (`kvtier.kv.host_register`), opt-in: on an H100 host it pinned a 512K store's ~68 GB in 3.44 s
    against 27.17, but that store's decode, which reads the host tier in place, ran 18.4 tok/s
    against 30.5 (bench/results/hip_cli_speed_512k_fast_landmarks_layer_probes_stage0_{huge,alloc}.json)."""
    raw = os.environ.get("KVTIER_HOST_PIN", "").strip().lower() or "alloc"
    if raw not in HOST_PINS:
        raise ConfigError(f"KVTIER_HOST_PIN={raw!r}: use alloc (the default) or huge")
    return raw


@dataclass
class TierAccount:
    """Bytes allocated per tier (now and peak) and bytes moved between tiers.

    `h2d_bytes` also counts copies whose size only the GPU knows (`add_h2d`: Quest's selected
    pages), read back when `h2d_bytes` is next read or added to (a sync then, typically after
    the step's sampled token was read, so nothing waits)."""

    allocated: dict[str, int] = field(default_factory=lambda: {GPU: 0, HOST: 0})
    peak: dict[str, int] = field(default_factory=lambda: {GPU: 0, HOST: 0})
    d2h_bytes: int = 0
    _h2d: int = 0
    _h2d_pending: list[torch.Tensor] = field(default_factory=list)  # device byte counts, unread

    @property
    def h2d_bytes(self) -> int:
        """Bytes copied host to device, the device's counts (`add_h2d`) included."""
        if self._h2d_pending:
            self._h2d += int(torch.stack(self._h2d_pending).sum())
            self._h2d_pending.clear()
        return self._h2d

    @h2d_bytes.setter
    def h2d_bytes(self, nbytes: int) -> None:
        """Set the total (`+=` read it first, device counts included)."""
        self._h2d_pending.clear()
        self._h2d = nbytes

    def add_h2d(self, nbytes: torch.Tensor) -> None:
        """Count a host-to-device copy of `nbytes` (an int64 [] tensor, any device) without reading
        it; counts are summed on their device every 256."""
        self._h2d_pending.append(nbytes)
        if len(self._h2d_pending) >= 256:
            self._h2d_pending[:] = [torch.stack(self._h2d_pending).sum()]

    def alloc(self, tier: str, nbytes: int) -> None:
        self.allocated[tier] += nbytes
        self.peak[tier] = max(self.peak[tier], self.allocated[tier])

    def free(self, tier: str, nbytes: int) -> None:
        self.allocated[tier] -= nbytes


class HostArena:
    """Host memory for streamed slices, handed out as fixed-size extents carved from slabs.

    On CUDA machines slabs are pinned (page-locked) so copies run at full PCIe speed
    asynchronously. Slabs are a power of two in size so PyTorch's pinned allocator, which rounds
    every request up to a power of two, wastes nothing. `close()` returns the memory.

    With `device`, the slabs live in that device's memory instead and count in the GPU tier
    (packed slices that stay on the GPU: `kvtier.kv.packed`), taken from `alloc` when given
    (a store's `DeviceMemory.empty`: in the server, a run of lent pool pages).
    """

    def __init__(
        self,
        extent_shape: tuple[int, ...],
        dtype: torch.dtype,
        pin: bool,
        account: TierAccount,
        slab_bytes: int = 1 << 30,
        device: torch.device | None = None,
        alloc: Allocate | None = None,
    ) -> None:
        self.extent_shape = extent_shape
        self.alloc = alloc if device is not None else None
        self.dtype = dtype
        self.device = device
        self.pin = pin and device is None
        self.huge = self.pin and host_pin() == "huge"  # slabs from HUGE_SLABS
        self.tier = HOST if device is None else GPU
        self.account = account
        numel = 1
        for n in extent_shape:
            numel *= n
        self.extent_numel = numel
        extent_bytes = numel * dtype.itemsize
        self.extents_per_slab = max(1, slab_bytes // extent_bytes)
        self._slabs: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []

    def take(self) -> torch.Tensor:
        """One extent [*extent_shape]; allocates a new slab when none is free."""
        if not self._free:
            self._add(self._new_slab())
        return self._free.pop()

    def grow(self, extents: int, threads: int = 1) -> None:
        """Make the slabs that `extents` more takes need beyond the free extents, pinned from
        `threads` threads at once (`pin_threads`) where they are pinned: a long prompt's store
        pins its whole host tier before the prefill (64 GiB at 512K for Llama-3-8B, 31-35 s of
        setup on an H100 host), one slab after another otherwise. The takes then hand out the
        same extents in the same order as without it."""
        count = -(-max(0, extents - len(self._free)) // self.extents_per_slab)
        if threads > 1 and count > 1:
            with ThreadPoolExecutor(min(threads, count)) as pool:
                for slab in pool.map(lambda _: self._new_slab(), range(count)):  # in order, as made
                    self._add(slab)
        else:
            for _ in range(count):
                self._add(self._new_slab())

    def _new_slab(self) -> torch.Tensor:
        numel = self.extents_per_slab * self.extent_numel
        if self.alloc is not None:
            return self.alloc((numel,), self.dtype)
        if self.huge:
            return HUGE_SLABS.take((numel,), self.dtype)
        return torch.empty(numel, dtype=self.dtype, device=self.device, pin_memory=self.pin)

    def _add(self, slab: torch.Tensor) -> None:
        """A new slab's extents, the free ones taken first-row first."""
        nbytes = slab.numel() * slab.element_size()
        self.account.alloc(self.tier, nbytes)
        if self.pin and (report := _PINNED.get()) is not None:
            report(nbytes)
        self._slabs.append(slab)
        n = self.extents_per_slab
        self._free[:0] = reversed(slab.view(n, *self.extent_shape).unbind(0))

    def slabs(self) -> list[torch.Tensor]:
        """Each slab as [extents_per_slab, *extent_shape]; `take` hands out a slab's extents
        in row order, so the k-th extent taken overall is row k % extents_per_slab of slab
        k // extents_per_slab while none has been given back."""
        return [slab.view(self.extents_per_slab, *self.extent_shape) for slab in self._slabs]

    def close(self) -> None:
        """Release all slabs: pinned ones go back to PyTorch's pinned allocator (registered ones
        to `HUGE_SLABS`, once the device has finished with them), which caches them for the next
        store until `release_pinned_cache`."""
        for slab in self._slabs:
            self.account.free(self.tier, slab.numel() * slab.element_size())
        if self.huge and self._slabs:
            if torch.cuda.is_available():  # no copy or kernel may still read a slab the next store takes
                torch.cuda.synchronize()
            HUGE_SLABS.give(self._slabs)
        self._slabs.clear()
        self._free.clear()


T = TypeVar("T")
_PINNED: ContextVar[Callable[[int], object] | None] = ContextVar("kvtier_pinned", default=None)


@contextmanager
def _set_within(var: ContextVar[T], value: T) -> Iterator[None]:
    """`var` is `value` within it, on this thread's context."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def reporting_pins(report: Callable[[int], object]) -> AbstractContextManager[None]:
    """Within it, each pinned host slab an arena makes (on this thread's context) is reported as
    `report(its bytes)`: a long prompt's store pins tens of GB before its prefill (a progress
    bar's updates, `kvtier.engine.progress.PinBar`)."""
    return _set_within(_PINNED, report)


_KEEP: ContextVar[bool] = ContextVar("kvtier_keep_pinned", default=False)


def keeping_pinned() -> AbstractContextManager[None]:
    """Within it (on this thread's context), a closing store leaves its pinned host memory in
    PyTorch's pinned cache, as `TieredKVStore.close(release_host=False)` does, for whoever opened
    it to return with `release_pinned_cache` when it suits: a one-shot `kvtier generate` prints
    its answer first (unpinning ~34 GB took 5.9 s on the H200; a 512K store holds ~68 GB)."""
    return _set_within(_KEEP, True)


def keeps_pinned() -> bool:
    """Whether this is within `keeping_pinned`."""
    return _KEEP.get()


def pin_threads() -> int:
    """`KVTIER_PIN_THREADS`: threads that make a store's pinned host slabs at once (`HostArena.grow`;
    unset: 1, one after another). 8 threads did not shorten a 512K setup on an H100 (25.2 and
    30.1 s against 28.5 on one start: hip_cli_speed_512k_fast_landmarks_layer_*_warm_pin8.json
    against ..._combined_stage0.json), so it stays off."""
    raw = os.environ.get("KVTIER_PIN_THREADS", "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"KVTIER_PIN_THREADS={raw!r}: give a number of threads, 1 or more")
    return int(raw)


def release_pinned_cache() -> None:
    """Return the pinned allocator's cached blocks to the OS (on CUDA). Slow: unpinning ~34 GB
    took 5.9 s on the H200 and CUDA synchronizes the device around it, so a server keeps the
    blocks for its next long request instead (`TieredKVStore.close(release_host=False)`).
    KVTIER_HOST_PIN=huge's kept slabs are unregistered and freed too."""
    if torch.cuda.is_available():
        HUGE_SLABS.close()
        torch._C._host_emptyCache()


def _release_at_exit() -> None:
    """`HUGE_SLABS.close()` as the process ends; a CUDA runtime already shut down refuses the
    unregistering, and the process's end releases the pages then anyway."""
    with contextlib.suppress(RuntimeError):
        HUGE_SLABS.close()


atexit.register(_release_at_exit)


# Slabs of a device arena (a quantized store's packed slices on the GPU) are at most this: small
# enough that a run of lent pool pages holds them in pieces (`kvtier.kv.device_memory`), and few
# enough (16 a GB, at most) to cost nothing to allocate.
DEVICE_SLAB_BYTES = 64 << 20


def device_slab_bytes(extent_bytes: int, extents: int, cap: int = DEVICE_SLAB_BYTES) -> int:
    """Slab size for `extents` extents of device memory: the most extents that divide `extents`
    evenly and fit `cap` (at least one), so no slab holds an extent nobody takes and the bytes
    are exactly what the planner counts (`PackedSizing.rows_bytes`)."""
    n = max(1, extents)
    per = max((d for d in range(1, n + 1) if n % d == 0 and d * extent_bytes <= cap), default=1)
    return per * extent_bytes


def balanced_slab_bytes(extent_bytes: int, extents: int, cap: int = 1 << 30) -> int:
    """Slab size for `extents` extents in slabs of at most `cap` bytes (or one extent), split
    evenly, so the last slab wastes at most one extent per slab. For device memory, where no
    power-of-two rounding applies."""
    per = max(1, cap // max(1, extent_bytes))
    slabs = -(-max(1, extents) // per)
    return extent_bytes * -(-max(1, extents) // slabs)
