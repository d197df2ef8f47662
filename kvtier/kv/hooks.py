"""What the tiered store is configured with besides a plan: storage granularity, and the hooks
lossy policies plug in (a codec that stores tokens coded, an evictor that drops tokens).

A codec is one protocol, `KVCodec`, checked when the store is built (`packing_codec`); each
layer sees the part of it it needs:

```
 KVCodec (here)                          everything; the store packs, loads and unpacks rows
 ├─ PackedFormat (kvtier.planner.packed)   group, residual, frozen_tokens, row_bytes: sizes
 ├─ RoundTripCodec (here)                  frozen_tokens, roundtrip: the values given back
 └─ pack, unpack, unpack_into              rows of bytes
```

A `RoundTripCodec` with none of the packing members is a simulated codec: the store keeps its
round trip in place, at full size (a format's quality before it has a packed layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kvtier.errors import ConfigError
from kvtier.kv.host_flag import HANDOFFS
from kvtier.kv.layout import KVLayout
from kvtier.kv.mapped import RESULTS
from kvtier.planner.packed import PackedFormat


@dataclass(frozen=True)
class StoreOptions:
    """Storage granularity: token blocks, and host extents (the unit of one PCIe copy).

    Extents are sized in bytes, so a finer head group does not mean more, smaller copies: the
    host issues each copy, and ~10K copies per decode step would make the CPU the bottleneck.
    `extent_blocks` overrides the size (in blocks) for tests.
    """

    block_size: int = 256
    extent_bytes: int = 64 << 20
    extent_blocks: int | None = None
    # A quantized cache's loads unpacked on a stream of their own, from two alternating row
    # scratches, and slices packed on the device loaded there too, so the H2D stream only
    # copies (`kvtier.kv.packed.PackedTier.load_into`). False: all on the H2D stream, where the
    # link waits for them. None: as the plan says (`KVPlan.unpack_scratches`).
    unpack_stream: bool | None = None
    # Who waits for CPU-attended slices' results at decode: "gpu", the CUDA stream (the host
    # goes on issuing; `kvtier.kv.host_flag`), "host", the main thread, or "auto" (KVTIER_CPU_HANDOFF,
    # else the stream where the driver's stream waits pass a self-test, else the host).
    cpu_handoff: str = "auto"
    # How CPU-attended slices' results reach the merge on CUDA: "copy" (an H2D copy, on the copy
    # engines beside the link's loads), "mapped" (the merge's kernels read the pinned buffer in
    # place, `kvtier.kv.mapped`), or "auto" (KVTIER_CPU_RESULTS, else mapped where libcuda's
    # calls are there).
    cpu_results: str = "auto"

    def __post_init__(self) -> None:
        if self.cpu_handoff not in HANDOFFS:
            raise ConfigError(f"cpu_handoff {self.cpu_handoff!r}: use one of {', '.join(HANDOFFS)}")
        if self.cpu_results not in RESULTS:
            raise ConfigError(f"cpu_results {self.cpu_results!r}: use one of {', '.join(RESULTS)}")


@runtime_checkable
class RoundTripCodec(Protocol):
    """The values a codec gives back; with no packing members, a simulated codec."""

    def frozen_tokens(self, length: int) -> int:
        """How many leading tokens are stored coded once `length` tokens are stored (the rest
        stay full precision). Non-decreasing in `length`."""
        ...

    def roundtrip(self, kv: torch.Tensor) -> torch.Tensor:
        """Quantize and dequantize kv [n, 2, G, D] (n a whole number of the codec's token
        groups); returns a new tensor of the same shape and dtype. Pure."""
        ...


@runtime_checkable
class KVCodec(PackedFormat, RoundTripCodec, Protocol):
    """A lossy storage format for KV tokens, packed `group` tokens to a row of bytes (see
    `kvtier.policies.quant`). `roundtrip(kv)` must equal `unpack(pack(kv), ...)` exactly:
    packed slices and slices rounded in place then attend the same values."""

    def pack(self, kv: torch.Tensor) -> torch.Tensor:
        """kv [n, 2, G, D] (n a multiple of `group`) -> rows [n / group, row_bytes(G, D)] uint8,
        on kv's device. Pure."""
        ...

    def unpack(self, rows: torch.Tensor, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """rows [m, row_bytes] uint8 -> kv [m * group, 2, heads, head_dim] in `dtype`. Pure."""
        ...

    def unpack_into(self, rows: torch.Tensor, dst: torch.Tensor) -> bool:
        """Unpack rows [m, row_bytes] into dst [m * group, 2, G, D] on the current stream with a
        fused kernel, if the codec has one for dst's device (equal to `unpack` up to the rounding
        of a fused multiply-add). Returns False, with dst untouched, when it has not: the store
        then copies `unpack`'s result."""
        ...


def packing_codec(codec: object) -> KVCodec | None:
    """`codec` as a packing codec, or None for no codec or a simulated `RoundTripCodec`.

    Raises `ConfigError` naming the members an object lacks: one that is neither protocol, or
    a packing codec with only some of `KVCodec`'s members."""
    if codec is None:
        return None
    if isinstance(codec, KVCodec):
        if codec.group < 1 or codec.residual < 0:
            raise ConfigError(
                f"{type(codec).__name__}: group ({codec.group}) must be >= 1 and residual "
                f"({codec.residual}) >= 0"
            )
        return codec
    missing = [m for m in _members(KVCodec) if not hasattr(codec, m)]
    packing_only = set(_members(KVCodec)) - set(_members(RoundTripCodec))
    if isinstance(codec, RoundTripCodec) and packing_only <= set(missing):
        return None
    raise ConfigError(
        f"{type(codec).__name__} is not a KV codec: it lacks {', '.join(missing)} "
        "(see kvtier.kv.hooks.KVCodec)"
    )


def can_pack(codec: object) -> bool:
    """Whether `codec` meets the whole `KVCodec` protocol (stores packed rows)."""
    return isinstance(codec, KVCodec)


def _members(protocol: type) -> list[str]:
    return [name for name in dir(protocol) if not name.startswith("_")]


class Evictor(Protocol):
    """Decides which tokens the slices of one sequence keep (see `kvtier.policies.evict`)."""

    def bind(self, layout: KVLayout, capacity: int) -> frozenset[int]:
        """Start a new sequence: reset state, validate against the store's capacity (raises
        `ConfigError`), and return the slices this evictor may compact."""
        ...

    def keep(self, slice_id: int, length: int, new_tokens: int) -> torch.Tensor | None:
        """After a step of `new_tokens` tokens, with `length` tokens stored in the slice: the token
        indices to keep per KV head, [G, K] ascending, or None to keep all."""
        ...
