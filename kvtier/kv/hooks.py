"""What the tiered store is configured with besides a plan: storage granularity, and the hooks
lossy policies plug in (a codec that stores tokens coded, an evictor that drops tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.kv.layout import KVLayout


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


class KVCodec(Protocol):
    """A lossy storage format for KV tokens (see `kvtier.policies.quant`)."""

    def frozen_tokens(self, length: int) -> int:
        """How many leading tokens are stored coded once `length` tokens are stored (the rest
        stay full precision). Non-decreasing in `length`."""
        ...

    def roundtrip(self, kv: torch.Tensor) -> torch.Tensor:
        """Quantize and dequantize kv [n, 2, G, D] (n a whole number of the codec's token
        groups); returns a new tensor of the same shape and dtype. Pure."""
        ...


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
