"""The tiered store's resident slices: one full-precision GPU buffer per slice, sized from the
plan when the store is built, reallocated as a slice grows or shrinks.

```
 kind      first size                                          from
 whole     the store's capacity                                the store's DeviceMemory
 bounded   an evictor's planned size (KVPlan.compact_tokens)   the store's DeviceMemory
 evicted   an evictor's, in a plan without that size: a block  the caching allocator
 windowed  its window plus a step (kvtier.kv.windowed)         the caching allocator
```

A buffer that must grow is reallocated from the caching allocator (`reallocate`): whole slices
double past the capacity (only in memory the store owns), an evictor's double when a step
outgrows them, windowed ones grow for a step longer than the plan's chunk. An evictor's slice
that a compaction (`compact`) left mostly free shrinks, unless bounded: those keep their size.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch

from kvtier.config import ModelConfig
from kvtier.kv.device_memory import DeviceMemory
from kvtier.kv.layout import KVLayout
from kvtier.kv.tiers import GPU, TierAccount
from kvtier.planner.memory import window_tokens
from kvtier.planner.placement import KVPlan


@dataclass(frozen=True)
class ResidentSizes:
    """Tokens of each kind of resident slice when the store is built (see the module docstring)."""

    capacity: int  # whole slices: the store's capacity, in whole blocks
    block_size: int  # an evicted slice's first size
    evictable: frozenset[int]  # slices an evictor compacts
    bounded: frozenset[int]  # evictable slices allocated once at `bounded_tokens`
    bounded_tokens: int
    windowed: frozenset[int]  # slices of layers whose sliding window binds
    window_tokens: int  # 0 without a sliding window

    @classmethod
    def of(
        cls,
        cfg: ModelConfig,
        plan: KVPlan,
        layout: KVLayout,
        capacity: int,
        evictable: frozenset[int],
        windowed: Collection[int],
    ) -> ResidentSizes:
        """The sizes of a store of `plan` at `capacity` tokens, with an evictor's `evictable`
        slices and the `windowed` ones."""
        cap = layout.round_up(max(capacity, 1))
        window = 0
        if cfg.sliding_window is not None:
            # NOTE: the plan's size when plan_kv made it (the bytes it counted), else the same formula.
            window = plan.window_tokens or window_tokens(
                cfg.sliding_window, plan.chunk_size, capacity, layout.block_size
            )
        # An evictor's slices are allocated once at what the plan says they may hold
        # (`KVPlan.compact_tokens`: kept tokens plus a step's), from the store's memory like the
        # whole slices; a plan without that size (made by hand) starts them at a block and grows
        # them by doubling. A step that outgrows the planned size grows its slice the same way.
        bounded = min(layout.round_up(plan.compact_tokens), cap) if plan.compact_tokens else 0
        return cls(
            capacity=cap,
            block_size=layout.block_size,
            evictable=evictable,
            bounded=frozenset(evictable - set(windowed) if bounded else ()),
            bounded_tokens=bounded,
            windowed=frozenset(windowed),
            window_tokens=window,
        )


def allocate_resident(
    slices: Iterable[int],
    sizes: ResidentSizes,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    memory: DeviceMemory,
    device: torch.device,
    account: TierAccount,
) -> dict[int, torch.Tensor]:
    """A buffer [tokens, *shape] for each of `slices` (slice -> buffer), whole and bounded ones
    from `memory`, the others from the caching allocator; their bytes are counted on the GPU."""
    resident: dict[int, torch.Tensor] = {}
    # NOTE: whole slices first, then the bounded ones, as `region_buffers` sizes them.
    for s in sorted(slices, key=lambda s: (s in sizes.bounded, s)):
        tokens = sizes.block_size if s in sizes.evictable else sizes.capacity
        if s in sizes.bounded:
            tokens = sizes.bounded_tokens
        whole = (s not in sizes.evictable or s in sizes.bounded) and s not in sizes.windowed
        if s in sizes.windowed:
            tokens = sizes.window_tokens
        if whole:
            resident[s] = memory.empty((tokens, *shape), dtype)
        else:
            resident[s] = torch.empty(tokens, *shape, dtype=dtype, device=device)
        account.alloc(GPU, resident[s].numel() * resident[s].element_size())
    return resident


def reallocate(old: torch.Tensor, stored: int, tokens: int, account: TierAccount) -> torch.Tensor:
    """A new buffer of `tokens` tokens (caching allocator) holding the first `stored` tokens of
    old [C, 2, G, D]; the GPU account trades old's bytes for the new buffer's."""
    new = torch.empty(tokens, *old.shape[1:], dtype=old.dtype, device=old.device)
    new[:stored] = old[:stored]
    account.alloc(GPU, new.numel() * new.element_size())
    account.free(GPU, old.numel() * old.element_size())
    return new


def compact(buf: torch.Tensor, stored: int, keep: torch.Tensor) -> int:
    """Keep tokens `keep` [G, K] (ascending per KV head) of the `stored` tokens of buf
    [C, 2, G, D], in order, at its front; returns K, the tokens it now stores.

    ```
    before: [t0 t1 t2 t3 t4 t5 t6 t7]   keep[g] = [0, 1, 5, 6, 7]
    after:  [t0 t1 t5 t6 t7 | free  ]   5 tokens stored; the store's position unchanged
    ```
    """
    g, k = keep.shape
    src = buf[:stored].permute(2, 0, 1, 3)  # [G, n, 2, D]
    idx = keep.to(buf.device, non_blocking=True)[:, :, None, None].expand(g, k, 2, buf.shape[-1])
    kept = torch.gather(src, 1, idx).permute(1, 2, 0, 3)  # [K, 2, G, D]
    buf[:k] = kept
    return k
