"""The tiered KV store, addressed by (layer, KV-head group, token block): layout, host arena and
extents, ping-pong staging buffers, CUDA streams and events, bytes per tier, the packed tier of
a codec, and the hooks lossy methods plug in (`KVCodec`, `Evictor`).

May import: `kvtier.errors`, `kvtier.config`, `kvtier.attention`, `kvtier.model`, `kvtier.planner`.
Never a concrete method: codecs, evictors and kernels come in through the hooks.
"""
