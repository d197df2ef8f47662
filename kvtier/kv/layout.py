"""How the KV cache is addressed: (layer, KV-head group, token block).

A *slice* is the KV of one (layer, group) pair: all tokens of `group_size` adjacent KV heads.
Slices are the unit of placement (resident on the GPU or streamed from host memory); token
blocks are the unit of allocation inside a slice.

Every tier stores a slice token-major, `[tokens, 2, group_size, head_dim]` (index 1 selects
K or V), so any run of consecutive tokens is one contiguous range that crosses PCIe in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError


@dataclass(frozen=True)
class KVLayout:
    """Shapes of the KV store of one sequence."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    q_per_kv: int
    group_size: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.group_size <= 0 or self.num_kv_heads % self.group_size:
            raise ConfigError(
                f"head group size {self.group_size} must divide the model's {self.num_kv_heads} KV heads"
            )
        if self.block_size <= 0:
            raise ConfigError(f"block size must be positive, got {self.block_size}")

    @classmethod
    def of(cls, cfg: ModelConfig, group_size: int, block_size: int, dtype: torch.dtype) -> KVLayout:
        """The layout of `cfg`'s KV in slices of `group_size` KV heads and blocks of `block_size`."""
        return cls(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            q_per_kv=cfg.q_per_kv,
            group_size=group_size,
            block_size=block_size,
            dtype=dtype,
        )

    @property
    def num_groups(self) -> int:
        return self.num_kv_heads // self.group_size

    @property
    def num_slices(self) -> int:
        return self.num_layers * self.num_groups

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one slice (K and V of `group_size` heads)."""
        return 2 * self.group_size * self.head_dim * self.dtype.itemsize

    def slice_index(self, layer: int, group: int) -> int:
        """Position of (layer, group) in execution order: layer-major."""
        return layer * self.num_groups + group

    def kv_heads(self, group: int) -> slice:
        return slice(group * self.group_size, (group + 1) * self.group_size)

    def q_heads(self, group: int) -> slice:
        r = self.q_per_kv * self.group_size
        return slice(group * r, (group + 1) * r)

    def round_up(self, tokens: int) -> int:
        """Tokens rounded up to whole blocks."""
        return -(-tokens // self.block_size) * self.block_size


def spread(n_total: int, n_chosen: int) -> list[bool]:
    """`n_chosen` of `n_total` positions, spread evenly (for interleaving resident slices with
    streamed ones, so transfers always have compute to hide behind)."""
    return [(i + 1) * n_chosen // n_total > i * n_chosen // n_total for i in range(n_total)]
