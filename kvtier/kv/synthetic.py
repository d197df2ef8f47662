"""Filling a store with synthetic KV, so benchmarks can reach long contexts without a prefill."""

from __future__ import annotations

import torch

from kvtier.kv.store import TieredKVStore


def fill_synthetic(store: TieredKVStore, tokens: int, seed: int = 0) -> None:
    """Give every slice `tokens` tokens of random KV and set the store's length to `tokens`.

    Resident slices get fresh random values; host slices get copies of one random extent (a
    memcpy, since generating 100 GB of random numbers on the CPU would take minutes). Values do
    not affect the timing of copies and attention, but are never zero (zeros can run faster).
    Slices an evictor owns get only the tokens it would keep, windowed slices the window's
    earlier tokens; with a packing codec the host slices' coded tokens get packed rows, as after
    a real prefill.
    """
    if store.length:
        raise ValueError("fill_synthetic needs an empty store")
    if tokens < 0:
        raise ValueError(f"fill_synthetic needs tokens >= 0, got {tokens}")
    gen = torch.Generator(device=store.device).manual_seed(seed)
    lay = store.layout
    for sid in list(store.resident):
        n = tokens
        if sid in store._windowed:  # a windowed layer keeps only the window's earlier tokens
            n = min(tokens, store._windowed[sid] - 1)
        if store.evictor is not None and sid in store._evictable:
            keep = store.evictor.keep(sid, tokens, tokens)
            n = tokens if keep is None else keep.shape[1]
            store._resize_slice(sid, lay.round_up(n + lay.block_size))
        buf = store.resident[sid]
        if n > buf.shape[0]:
            raise ValueError(f"{n} tokens exceed the resident capacity {buf.shape[0]}")
        buf[:n].normal_(generator=gen)
        store.slice_length[sid] = n
    if store.hosts:
        pattern = torch.randn(
            next(iter(store.hosts.values())).extents[0].shape, generator=torch.Generator().manual_seed(seed)
        )
        pattern = pattern.to(store.layout.dtype)
        for sid, host in store.hosts.items():
            host.reserve(store.layout.round_up(tokens))
            for ext in host.extents:
                ext.copy_(pattern)
            store.slice_length[sid] = tokens
    if store.packed is not None:
        packed = store.packed
        coded = packed.codec.frozen_tokens(tokens)
        packed.reserve(lay.round_up(tokens))
        extent = packed.arenas[0].extent_shape[0] * packed.codec.group
        kv = torch.randn(extent, 2, lay.group_size, lay.head_dim, generator=gen, device=store.device)
        rows = packed.codec.pack(kv.to(lay.dtype))
        for r in packed.rows.values():
            for ext in r.extents:
                ext.copy_(rows)
        packed.coded = store._coded = coded
    store.length = store.position = tokens
