"""`kvtier serve`: an OpenAI-compatible server with continuous batching, paged KV and prefix caching.

The batching itself is `kvtier.engine.batch` (scheduler, sequences, pool sizing, decode graphs)
over `kvtier.kv.paged` (pages, prefix cache, host tier). Here, from the bottom up:

    tiered.py         TieredRun: a request over a tiered store of its own (too long for the pool,
                      or a method of its own), advanced a step at a time between batch steps
    offload_host.py   OffloadEngine: the BatchEngine as a tiered run's host: the GPU budget it is
                      planned within, what stores hold, the pool pages it borrows, compaction
    engine.py         ServeEngine: the BatchEngine in a background thread; thread-safe
                      submit/abort, tiered runs, shutdown
    protocol.py       OpenAI request parsing and validation; APIError
    app.py            the FastAPI app; metrics.py the Prometheus text; server.py uvicorn runners

May import: the engine, the methods registry and below. Imported by the CLI.
"""
