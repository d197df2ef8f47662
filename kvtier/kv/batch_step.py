"""The `Attention` of a batch step whose token stream mixes paged sequences and sequences with
a store of their own.

The stream holds the paged sequences' tokens first, then each own-store sequence's, in order:

    stream   [ paged tokens (PagedKVStore: prefills, batched decodes) | seq A's n_A | seq B's n_B ]
    rows     0 ............................................. P-1      P .. P+n_A-1  ...

Per layer the paged rows go to the page pool's attention in one call and each own store
attends its own rows (its method's kernel, codec or evictor), so every request of the batch
shares the same projections and MLPs, whatever its method.
"""

from __future__ import annotations

import torch

from kvtier.kv.paged import PagedKVStore
from kvtier.kv.store import TieredKVStore


class MixedStep:
    """Callable as `kvtier.attention.Attention` for one step; the caller has run
    `paged.begin_step` (when `paged_tokens` > 0) and each own store's `begin_step(n)`."""

    def __init__(self, paged: PagedKVStore, paged_tokens: int, own: list[tuple[int, TieredKVStore]]) -> None:
        self.paged = paged
        self.paged_tokens = paged_tokens
        self.own = own  # (tokens, store) in stream order, after the paged rows

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H_q, D], k/v [T, H_kv, D] before RoPE -> [T, H_q, D]; appends each row's k/v to
        its sequence's pages or store."""
        p = self.paged_tokens
        parts = [self.paged(layer, q[:p], k[:p], v[:p])] if p else []
        a = p
        for n, store in self.own:
            parts.append(store(layer, q[a : a + n], k[a : a + n], v[a : a + n]))
            a += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)
