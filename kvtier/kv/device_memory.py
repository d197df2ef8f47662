"""Where a store's full-precision GPU buffers come from: the caching allocator, or a region of
device memory that someone else owns (a run of the server's KV pages, `PagedKVStore.page_run`).

A `TieredKVStore` takes its resident slices of the whole capacity, an evictor's slices (once, at
what they keep plus a step), a quantized cache's packed rows on the device and its staging
buffers from a `DeviceMemory`; everything else it allocates (windows, per-step temporaries)
stays with PyTorch's caching allocator. A method's own decode state (HiP's RoPE table, decode
rows and block caches, Quest's page bounds) comes from the store's memory too, after its
buffers, when that is a region (`kvtier.attention.interface.PlacesCaches`).
In the server a long request is thus a tiered store over the same pages the batch uses: its
buffers are views of page runs borrowed from the pool (`kvtier.kv.pages.PagePool.take_run`),
not memory of its own.

    region (a page run, bytes)  |resident s0 ......|resident s7 ......|staging 0 |staging 1 |  |
                                ^ 0                                                        used ^
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from kvtier.errors import CapacityError
from kvtier.kv.layout import KVLayout
from kvtier.kv.tiers import device_slab_bytes
from kvtier.planner.placement import KVPlan

ALIGN = 512  # bytes every buffer of a region starts on (covers every dtype and vector loads)


class DeviceMemory(Protocol):
    """Hands out uninitialised device tensors; freed as a whole by whoever owns the memory."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class CachingMemory:
    """`torch.empty` on `device`: PyTorch's caching allocator (the default)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)


class RegionMemory:
    """Bump allocation of aligned tensors out of one flat byte tensor `region` (a view); a
    request that no longer fits goes to `spill` (the caching allocator) when given, else raises
    CapacityError (the region was sized from `region_buffers` for the store's plan, so that is a
    sizing bug, not a user's mistake). Requests are placed first-fit in the order they come, as
    `fitting` simulates.

    Nothing is freed one by one: the region's owner takes it back whole once the store is closed.
    """

    def __init__(self, region: torch.Tensor, spill: DeviceMemory | None = None) -> None:
        assert region.dtype == torch.uint8 and region.dim() == 1, "a region is a flat byte tensor"
        self.region = region
        self.spill = spill
        self.used = 0
        self.spilled = 0  # bytes handed to `spill`

    @property
    def capacity(self) -> int:
        return self.region.numel()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        itemsize = dtype.itemsize
        nbytes = math.prod(shape) * itemsize
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.capacity:
            if self.spill is not None:
                self.spilled += nbytes
                return self.spill.empty(shape, dtype)
            raise CapacityError(
                f"a store asked its device region for {nbytes:,} more bytes at {start:,} of "
                f"{self.capacity:,}: the region was sized too small for its plan"
            )
        self.used = start + nbytes
        return self.region[start : start + nbytes].view(dtype).view(shape)


def fitting(sizes: list[int], capacity: int) -> int:
    """The bytes of a region of `capacity` that `RegionMemory` fills with buffers of `sizes`
    (in request order, first-fit, the rest spilled): the region's `used` afterwards."""
    used = 0
    for n in sizes:
        start = -(-used // ALIGN) * ALIGN
        if start + n <= capacity:
            used = start + n
    return used


def region_buffers(
    layout: KVLayout, plan: KVPlan, capacity: int, windowed: int = 0, packing: bool = False
) -> list[int]:
    """The bytes of each buffer a `TieredKVStore` of `plan` at `capacity` tokens takes from its
    `DeviceMemory`, in the order it asks for them: its full-precision resident slices of the
    whole capacity, then an evictor's compact slices (of `KVPlan.compact_tokens`; `--evict`
    compacts every slice), then its staging buffers. `windowed`: slices of layers whose sliding
    window binds (resident, window-sized, from the caching allocator). `packing`: a packing codec
    (`plan.packed`): its resident slices stay packed on the device (`kvtier.kv.packed`), so the
    store asks for their full-precision tail rings, the staging buffers, their packed rows and
    the scratch loads unpack from (`packed_buffers`)."""
    cap = layout.round_up(max(capacity, 1))
    token = layout.token_bytes
    others = layout.num_slices - windowed
    placed = others - plan.compact_slices  # head sparsity's compact slices are not placed
    if packing and plan.packed is not None:
        return packed_buffers(layout, plan, cap, min(plan.resident_slices, placed))
    whole = 0 if packing else min(plan.resident_slices, placed)
    staged = placed - (0 if packing else whole)
    kept = min(layout.round_up(plan.compact_tokens), cap) if plan.compact_tokens else cap
    if plan.compact_tokens and not plan.compact_slices:  # `--evict`: every slice at what it keeps
        buffers = [kept * token] * whole
    else:  # the placed resident slices, then the compact ones (the store's order)
        buffers = [cap * token] * whole + [kept * token] * plan.compact_slices
    if staged > 0:
        tokens = layout.round_up(plan.staging_tokens or cap)
        buffers += [tokens * token] * (plan.staging_buffers or 2)
    return buffers


def packed_buffers(layout: KVLayout, plan: KVPlan, cap: int, on_device: int) -> list[int]:
    """`region_buffers` of a quantized store (`plan.packed`) with `on_device` slices packed on
    the device, in the store's order: their tail rings' slabs (`SliceStorage`), the staging
    buffers (every slice is staged), their packed rows' slabs and the unpack scratch
    (`PackedTier`)."""
    sizing = plan.packed
    assert sizing is not None
    token = layout.token_bytes
    buffers: list[int] = []
    if on_device:
        extent_tokens = layout.round_up(sizing.uncoded + plan.chunk_size)
        buffers += _slabs(extent_tokens * token, 2 * on_device)  # a ring of two extents a slice
    ring = layout.round_up(plan.staging_tokens or cap)
    buffers += [ring * token] * (plan.staging_buffers or 2)
    if on_device:
        rows, per = -(-cap // sizing.group), sizing.extent_rows(cap)
        buffers += _slabs(per * sizing.row_bytes, on_device * -(-rows // per))
    buffers.append((ring // sizing.group + 2) * sizing.row_bytes)
    return buffers


def _slabs(extent_bytes: int, extents: int) -> list[int]:
    """The slabs a device `HostArena` allocates for `extents` extents (`device_slab_bytes`)."""
    per = max(1, device_slab_bytes(extent_bytes, extents) // extent_bytes)
    return [per * extent_bytes] * -(-extents // per)
