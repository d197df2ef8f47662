"""Slices an evictor keeps compact on the GPU (head-wise sparsity's streaming heads).

The store holds every slice an evictor may compact on the GPU, allocated once at `keep` plus a
chunk (`KVPlan.compact_tokens`): a step's tokens land there before the evictor compacts the
slice back to `keep` tokens (`kvtier.kv.store`). `plan_kv` counts such slices
next to the placed ones: they take GPU bytes off the budget, and neither stream nor need the
host tier, so only the others are placed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.planner.memory import round_up


@dataclass(frozen=True)
class CompactSlices:
    """A `fraction` of all (layer, KV-head group) slices keeps at most `keep` tokens after each
    step (DuoAttention's streaming heads: sinks + recent)."""

    fraction: float
    keep: int

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0 or self.keep < 1:
            raise ConfigError(f"compact slices need a fraction in (0, 1) and keep >= 1, got {self}")

    def count(self, num_slices: int) -> int:
        """How many of `num_slices` slices are compact (the evictor rounds the same way)."""
        return round(self.fraction * num_slices)

    def tokens(self, chunk: int, block_size: int) -> int:
        """Tokens one compact slice is allocated (once, `kvtier.kv.store`): a step appends up
        to `chunk` tokens to the `keep` it holds."""
        return round_up(self.keep + chunk, block_size)

    def gpu_bytes(self, count: int, tokens: int, token_bytes: int) -> int:
        """GPU bytes of `count` compact slices of `tokens` tokens."""
        return count * tokens * token_bytes
