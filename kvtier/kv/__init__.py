"""The tiered KV store, addressed by (layer, KV-head group, token block): layout, host arena and
extents, ping-pong staging buffers, CUDA streams and events, bytes per tier, the packed tier of
a codec, the hooks lossy methods plug in (`KVCodec`, `Evictor`), and the windowed slices of
sliding-window layers (`windowed`). Also the paged layout that
many requests share (`paged.PagedKVStore`: per-layer page tensors; `pages.PagePool`;
`prefix_cache`: chained page hashes and the host tier evicted pages go to).

May import: `kvtier.errors`, `kvtier.config`, `kvtier.attention`, `kvtier.model`, `kvtier.planner`.
Never a concrete method: codecs, evictors and kernels come in through the hooks.
"""
