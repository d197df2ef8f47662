"""`LLM`, `SamplingParams` and the sampler, and the chunked-prefill / decode loop (`runner`):
one request at a time over a `TieredKVStore`, planned by `kvtier.methods.plan_for`, under the
method the request names.

May import: the methods registry and everything below it (store, planner, model, loading).
Imported by eval, serve and the CLI.
"""
