"""Filling a store with synthetic KV, so benchmarks can reach long contexts without a prefill."""

from __future__ import annotations

import torch

from kvtier.kv.store import TieredKVStore


def fill_synthetic(store: TieredKVStore, tokens: int, seed: int = 0) -> None:
    """Give every slice `tokens` tokens of random KV and set the store's length to `tokens`.

    Resident slices get fresh random values; host slices get copies of one random extent (a
    memcpy, since generating 100 GB of random numbers on the CPU would take minutes). Values do
    not affect the timing of copies and attention, but are never zero (zeros can run faster).
    """
    if store.length:
        raise ValueError("fill_synthetic needs an empty store")
    gen = torch.Generator(device=store.device).manual_seed(seed)
    for buf in store.resident.values():
        if tokens > buf.shape[0]:
            raise ValueError(f"{tokens} tokens exceed the resident capacity {buf.shape[0]}")
        buf[:tokens].normal_(generator=gen)
    if store.hosts:
        pattern = torch.randn(store.arena.extent_shape, generator=torch.Generator().manual_seed(seed))
        pattern = pattern.to(store.layout.dtype)
        for host in store.hosts.values():
            host.reserve(store.layout.round_up(tokens))
            for ext in host.extents:
                ext.copy_(pattern)
    store.length = store.position = tokens
