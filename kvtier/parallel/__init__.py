"""Tensor parallelism over KV-head groups (and pipeline parallelism by layers), on
torch.distributed (NCCL on GPUs, gloo on the CPU).

Each of N ranks holds num_kv_heads / N KV heads with their query heads and 1/N of the MLP, as
a `CausalLM` sharded in place by `tensor.shard_` (Megatron's split: q/k/v and gate/up cut by
output rows, o_proj and down_proj by input columns and followed by one all-reduce each);
embeddings, norms and the LM head are whole on every rank. A rank's KV lives in its own
`TieredKVStore` over `kvtier.planner.sharding.rank_config`, on its own GPU and host tiers,
streamed over its own link: attention needs no communication. Rank 0's sampled token is
broadcast, so every rank feeds the same token.

- `group`: joining (or starting) the process group, the collectives the model and engine use.
- `tensor`: the transform (`shard_`, `RowParallelLinear`) and rank-shaped random models.
- `pipeline`: the alternative split by layers: a stage's layers, hooks that receive and send
  the hidden states at its boundaries (`stage_`).
- `load`: a rank's part of a checkpoint, read slice by slice.
- `spawn`: `kvtier generate --tensor-parallel N` / `LLM(tensor_parallel=N)` outside torchrun:
  the calling process becomes rank 0 and starts ranks 1..N-1 itself, which then run the calls
  rank 0 makes (`Workers`, `serve_calls`).

May import: `kvtier.errors`, `kvtier.config`, `kvtier.model`, `kvtier.planner`, `kvtier.loading`.
"""
