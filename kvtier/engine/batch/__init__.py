"""Continuous batching over paged KV: `BatchEngine` (core.py) steps many sequences through one
forward per step.

    sequence.py   Sequence (one request's tokens, pages, progress) and Delta (what it emits)
    kv_manager.py KVCacheManager: per-sequence block tables over the page pool, prefix matching
    scheduler.py  Scheduler: decodes first, chunked prefill in the token budget, preemption
    stopping.py   EOS / stop strings / max_tokens, and how much text may be sent yet
    sizing.py     the page pool sized from the GPU budget (and checked against it)
    graphs.py     DecodeRunner: decode-only steps from static buffers, CUDA graphs per bucket
    config.py     BatchConfig (pool and batch sizes, the tiered launcher), ModelHost
    latency.py    request latency histograms (time to first token, per output token, end to end)
    core.py       BatchEngine

May import: `kvtier.engine.sampling`, the methods registry and below (`kvtier.kv.paged` holds
the pages). Imported by `kvtier.engine.llm` and `kvtier.serve`.
"""
