"""The bytes of HiP's decode memory in a store's region (`HipKernel.place_caches`), per slice."""

from __future__ import annotations

from kvtier.kv.device_memory import ALIGN
from kvtier.sparse.config import HipConfig


def slice_decode_bytes(head_dim: int, hip: HipConfig, group: int, dtype_bytes: int, streamed: bool) -> int:
    """Bytes of one slice's decode memory in the store's region (`HipKernel`'s slice arena):
    the gathered attention rows of each of its decode queries (keys and values of
    `decode_buffer_tokens` rows; a query per KV head with `per_head`) and, for a streamed slice,
    its block cache's bank; each piece aligned as `RegionMemory` places it."""
    queries = group if hip.per_head else 1
    rows = hip.decode_buffer_tokens() * (group // queries) * head_dim * dtype_bytes
    size = queries * 2 * _aligned(rows)
    if streamed:
        slots = hip.offload_cache_slots(group if hip.per_head else 1)
        size += _aligned(slots * hip.cache_block * 2 * group * head_dim * dtype_bytes)
    return size


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
