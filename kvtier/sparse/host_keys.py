"""A streamed slice's stored keys, read from the host tier in ranges: stage 0 without the slice.

A decode step that reruns HiP's first stage scores every key between the sinks and the window.
Streaming the whole slice for it sends keys *and* values over PCIe (~1.3 s a rerun at 512K on
the H200); the scoring needs the keys alone, read slab by slab (`ScoreFn.bisected` reads
`keys[lo:hi]` when the candidates are a range), so `HostKeys` stands in for the slice's key
tensor and fetches each range when it is indexed:

    keys = HostKeys(fetch, length, groups, head_dim)      # like kv[:, 0]: [length, G, D]
    keys[lo:hi]  -> fetch.keys(lo, hi)                     # [hi - lo, G, D] on the device

Only ranges: gathering scattered positions this way would be one host read each (later stages
read their candidates through the block cache instead).
"""

from __future__ import annotations

import torch

from kvtier.attention.interface import Fetch


class HostKeys:
    """Keys [length, G, D] of a streamed slice (`head`: of that KV head only, [length, 1, D]),
    read from the host tier through `fetch` range by range. Positions at or past what is
    stored must never be read (stage 0's candidates end before the window)."""

    def __init__(
        self, fetch: Fetch, length: int, groups: int, head_dim: int, head: int | None = None
    ) -> None:
        self.fetch, self.length, self.groups, self.head_dim = fetch, length, groups, head_dim
        self.head = head

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.length, 1 if self.head is not None else self.groups, self.head_dim))

    def __getitem__(self, index: slice) -> torch.Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("HostKeys reads ranges of positions only (keys[lo:hi])")
        lo, hi, _ = index.indices(self.length)
        k = self.fetch.keys(lo, max(lo, hi))  # [n, G, D]
        return k if self.head is None else k[:, self.head : self.head + 1]


def host_landmark_keys(fetch: Fetch, where: torch.Tensor, head: int | None = None) -> torch.Tensor | None:
    """The keys [C, G, D] at where [C, G] (a position for each of G KV heads: `Landmarks`'),
    read from the host tier by `Fetch.pages` of one token each, a KV head at a time: a token's
    whole row (keys and values of the slice's heads) crosses PCIe for each, ~2 GB over a 512K
    prefill of Llama-3-8B's 32 layers against ~34 GB for every key. `head`: the slice's KV head
    the G = 1 positions are of (`per_head`). None from a tier `pages` cannot read (quantized)."""
    ones = torch.ones(where.shape[0], dtype=torch.long, device=where.device)
    cols = []
    for j in range(where.shape[1]):
        try:
            rows = fetch.pages(where[:, j].contiguous(), ones, 1)  # [C, 2, G_slice, D]
        except NotImplementedError:
            return None
        cols.append(rows[:, 0, j if head is None else head])
    return torch.stack(cols, dim=1)
