"""Where each slice of a store lives, and the extent storage of the slices not held whole on
the GPU.

```
 resident   full-precision GPU buffer of the whole capacity (evicted slices: of what they keep)
 on_device  packed rows + full-precision tail ring in GPU memory (a quantized cache's GPU tier)
 streamed   host memory (pinned on CUDA): full precision, or packed rows + tail ring
```

Evicted slices are always resident; the plan's resident count applies to the others, spread
over the layers (`kvtier.kv.layout.spread`). With a packing codec the plan's resident slices
are kept packed on the device instead of in full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.kv.device_memory import DeviceMemory
from kvtier.kv.hooks import StoreOptions
from kvtier.kv.host_slice import HostSlice
from kvtier.kv.layout import KVLayout, spread
from kvtier.kv.packed import TailHostSlice
from kvtier.kv.tiers import HostArena, TierAccount, device_slab_bytes, pin_threads
from kvtier.planner.packed import PackedFormat, uncoded_tokens


@dataclass(frozen=True)
class SlicePlaces:
    """The slices of each kind (see the module docstring)."""

    resident: frozenset[int]
    on_device: frozenset[int]
    streamed: tuple[int, ...]

    @property
    def staged(self) -> list[int]:
        """Slices attended through the staging buffers: on_device and streamed, in order."""
        return sorted(self.on_device | set(self.streamed))


def place_slices(
    num_slices: int, resident_count: int, evictable: frozenset[int], packing: bool
) -> SlicePlaces:
    """Resident: the evictable slices, plus `resident_count` of the others spread over the
    layers; with `packing`, the latter stay packed on the device instead."""
    others = [s for s in range(num_slices) if s not in evictable]
    chosen = {
        s
        for s, keep in zip(others, spread(len(others), min(resident_count, len(others))), strict=True)
        if keep
    }
    on_device = frozenset(chosen) if packing else frozenset()
    resident = evictable | (frozenset() if packing else frozenset(chosen))
    streamed = tuple(s for s in range(num_slices) if s not in resident and s not in on_device)
    return SlicePlaces(resident, on_device, streamed)


def extent_tokens(
    options: StoreOptions, layout: KVLayout, capacity: int, packer: PackedFormat | None, chunk: int
) -> int:
    """Tokens of one extent of a store of `capacity` tokens: `options`' size; with a packing
    codec, the uncoded tail plus one step's `chunk` tokens (all a slice keeps in full precision,
    in a ring of two extents)."""
    if packer is not None:
        return layout.round_up(uncoded_tokens(packer) + chunk)
    blocks = options.extent_blocks or max(1, options.extent_bytes // (layout.block_size * layout.token_bytes))
    # NOTE: never larger than the planned capacity, or short contexts would over-reserve.
    return layout.block_size * min(blocks, capacity // layout.block_size)


class SliceStorage:
    """Extent arenas (host, and device for on_device slices) and one extent list per slice."""

    def __init__(
        self,
        places: SlicePlaces,
        layout: KVLayout,
        extent_tokens: int,
        capacity: int,
        *,
        packing: bool,
        device: torch.device,
        account: TierAccount,
        memory: DeviceMemory | None = None,
    ) -> None:
        shape = (2, layout.group_size, layout.head_dim)
        extent_bytes = extent_tokens * layout.token_bytes
        pin = device.type == "cuda"
        streamed = len(places.streamed) * (2 if packing else 1)
        self.host = HostArena(
            (extent_tokens, *shape),
            layout.dtype,
            pin=pin,
            account=account,
            slab_bytes=extent_bytes * max(1, min(streamed, (1 << 30) // max(1, extent_bytes))),
        )
        self.device: HostArena | None = None
        if places.on_device:
            self.device = HostArena(
                (extent_tokens, *shape),
                layout.dtype,
                pin=pin,
                account=account,
                slab_bytes=device_slab_bytes(extent_bytes, 2 * len(places.on_device)),
                device=device,
                alloc=None if memory is None else memory.empty,
            )
        self.slices: dict[int, HostSlice] = {}
        for s in places.staged:
            arena = self.device if self.device is not None and s in places.on_device else self.host
            self.slices[s] = (
                TailHostSlice(arena, extent_tokens) if packing else HostSlice(arena, extent_tokens)
            )
        # Pre-allocate the planned capacity now: pinning memory mid-prefill stalls the GPU.
        on_host = [sl for sl in self.slices.values() if sl.arena is self.host]
        self.host.grow(sum(sl.extents_for(capacity) for sl in on_host), pin_threads() if pin else 1)
        for sl in self.slices.values():
            sl.reserve(capacity)

    def close(self) -> None:
        self.slices.clear()
        self.host.close()
        if self.device is not None:
            self.device.close()
