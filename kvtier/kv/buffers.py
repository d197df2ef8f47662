"""The buffers of one tiered store, allocated from its plan when the store is built.

A store asks its `DeviceMemory` for them in this order, which `region_buffers` and
`packed_buffers` (`kvtier.kv.device_memory`) follow to size a region someone else owns:

```
 resident slices  whole ones, then an evictor's bounded ones   kvtier.kv.resident
 extent storage   a packing codec's tail rings on the device   kvtier.kv.slices
 staging ring     the buffers staged slices are loaded into    kvtier.kv.staging
 packed rows      on the device, then the unpack scratch       kvtier.kv.packed
```

The other resident slices (windowed, an evictor's unbounded ones) come from the caching
allocator and the host extents from host memory, in the same pass. A kernel's decode caches
come after all of these (`kvtier.attention.interface.PlacesCaches`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from kvtier.config import ModelConfig
from kvtier.kv.device_memory import DeviceMemory
from kvtier.kv.hooks import KVCodec, StoreOptions
from kvtier.kv.layout import KVLayout
from kvtier.kv.packed import PackedTier
from kvtier.kv.resident import ResidentSizes, allocate_resident
from kvtier.kv.slices import SlicePlaces, SliceStorage, extent_tokens, place_slices
from kvtier.kv.staging import StagingRing
from kvtier.kv.streams import Streams
from kvtier.kv.tiers import TierAccount
from kvtier.planner.placement import KVPlan


@dataclass(frozen=True)
class StoreBuffers:
    """Where each slice lives and the buffers that hold it (see the module docstring)."""

    places: SlicePlaces
    bounded: frozenset[int]  # resident slices of an evictor allocated once (`ResidentSizes`)
    resident: dict[int, torch.Tensor]  # slice -> [tokens, 2, G, D]
    storage: SliceStorage  # the extents of every staged slice
    ring: StagingRing | None  # None: no slice is staged
    packed: PackedTier | None  # a packing codec's rows


def allocate_buffers(
    cfg: ModelConfig,
    plan: KVPlan,
    layout: KVLayout,
    capacity: int,
    options: StoreOptions,
    packer: KVCodec | None,
    evictable: frozenset[int],
    windowed: Collection[int],
    *,
    device: torch.device,
    memory: DeviceMemory,
    streams: Streams,
    account: TierAccount,
    unpack_stream: bool,
) -> StoreBuffers:
    """The buffers of a store of `plan` at `capacity` tokens, with a packing codec `packer`, an
    evictor's `evictable` slices and the `windowed` ones; their bytes are counted in `account`.
    `unpack_stream`: packed loads unpack on a stream of their own (two scratches)."""
    shape = (2, layout.group_size, layout.head_dim)
    # With a packing codec every slice keeps its coded tokens as packed rows (kvtier.kv.slices):
    # streamed ones in host memory, the plan's resident ones in GPU memory; both are unpacked
    # into the staging buffers when attended. Only the uncoded tail (plus one step's tokens)
    # stays full precision, in a ring of two extents (`extent_tokens`).
    packing = packer is not None
    places = place_slices(layout.num_slices, plan.resident_slices, evictable | frozenset(windowed), packing)
    staged = places.staged
    sizes = ResidentSizes.of(cfg, plan, layout, capacity, evictable, windowed)
    cap = sizes.capacity
    resident = allocate_resident(
        places.resident, sizes, shape, layout.dtype, memory=memory, device=device, account=account
    )
    storage = SliceStorage(
        places,
        layout,
        extent_tokens(options, layout, cap, packer, plan.chunk_size),
        cap,
        packing=packing,
        device=device,
        account=account,
        memory=memory,
    )
    ring: StagingRing | None = None
    if staged:
        # NOTE: a plan that keeps everything resident has no staging buffers; packed
        # slices on the GPU still need two to unpack into, of the whole slice.
        ring = StagingRing(
            plan.staging_buffers or 2,
            layout.round_up(plan.staging_tokens or cap),
            shape,
            layout.dtype,
            memory,
            streams,
            account,
        )
    # A packing codec keeps coded tokens packed (kvtier.kv.packed): loads of streamed slices
    # move packed bytes over PCIe; values are identical to the codec's round trip.
    packed: PackedTier | None = None
    if packer is not None and ring is not None:
        packed = PackedTier(
            packer,
            layout,
            staged,
            cap,
            scratch_tokens=ring.tokens,
            device=device,
            account=account,
            device_slices=places.on_device,
            memory=memory,
            scratches=2 if unpack_stream else 1,
        )
    return StoreBuffers(places, sizes.bounded, resident, storage, ring, packed)
