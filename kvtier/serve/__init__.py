"""`kvtier serve`: an OpenAI-compatible server with continuous batching, paged KV and prefix caching.

Layers, from the bottom up (dependencies point one way):

    pages.py          PagePool: page ids, refcounts, free list, hash -> page map, LRU of cached pages
    prefix_cache.py   chained page hashes; HostPageCache, the host tier that evicted pages go to
    paged_store.py    PagedKVStore: per-layer page tensors; the `Attention` of one batch step
                      (batched decode through `kvtier.attention.paged_decode` on CUDA)
    graphs.py         DecodeRunner: decode-only steps from static buffers, as CUDA graphs per bucket
    kv_manager.py     KVCacheManager: per-sequence block tables over the pool, prefix matching
    sequence.py       Sequence (one request's tokens, pages, progress) and Delta (what it emits)
    scheduler.py      Scheduler: continuous batching, chunked prefill, preemption by recompute
    stopping.py       EOS / stop strings / max_tokens, and how much text may be sent yet
    tiered.py         TieredRun: a request over a tiered store of its own (too long for the pool,
                      or a method of its own), advanced a step at a time between batch steps
    engine.py         ServeEngine: the step loop in a background thread; thread-safe submit/abort
    protocol.py       OpenAI request parsing and validation; APIError
    app.py            the FastAPI app; metrics.py the Prometheus text; server.py uvicorn runners

May import: the engine, the methods registry and below. Imported by the CLI.
"""
