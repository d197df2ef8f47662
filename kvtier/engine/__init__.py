"""`LLM`, `SamplingParams` and the sampler, and the chunked-prefill / decode loop (`runner`):
one request at a time over a `TieredKVStore`, planned by `kvtier.methods.plan_for`, under the
method the request names. `batch/`: continuous batching of many requests over the paged KV
(scheduler, sequences, stopping, pool sizing, decode CUDA graphs, `BatchEngine`), which
`LLM.generate` uses for a list of prompts and `kvtier serve` runs in a thread.

May import: the methods registry and everything below it (store, planner, model, loading).
Imported by eval, serve and the CLI.
"""
