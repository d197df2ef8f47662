"""`LLM`, `SamplingParams` and the sampler, and the chunked-prefill / decode loop (`runner`):
one request at a time over a `TieredKVStore`, planned by `kvtier.methods.plan_for`, under the
method the request names. `batch/`: continuous batching of many requests over the paged KV
(scheduler, sequences, stopping, pool sizing, decode CUDA graphs, `BatchEngine`), which
`LLM.generate` uses for a list of prompts and `kvtier serve` runs in a thread.

    llm.py       LLM: its options, loaded model, planning and `generate`
    config.py    EngineConfig (frozen options) and their resolution against the machine
    ranks.py     the tensor- or pipeline-parallel split checked, the rank group joined
    load.py      the model on its device: the memory cap, the weights (or a rank's part), fusion
    prompts.py   a call's prompts to token ids, the length check, stop rules, output text
    batched.py   a call's prompts through the batch engine at once, and which calls go there
    tiered.py    one prompt over a tiered store of its own: plan, store, run, stats
    runner.py    the per-sequence loop: chunked prefill through the store, then decode
    sampling.py  SamplingParams and the sampler
    outputs.py   RequestOutput and GenerationStats

May import: the methods registry and everything below it (store, planner, model, loading).
Imported by eval, serve and the CLI.
"""
