"""What a lossy KV method does to a plan's bytes: KV kept per tier, and PCIe bytes per decode step.

A plan (`KVPlan`) says which slices are resident and which are streamed; a lossy method changes
how many tokens a slice keeps (eviction, head-wise sparsity) or how many bytes a streamed token
costs (a packed host tier). The store counts the same quantities in its `TierAccount`, and the
tests check that the two agree.

```
 slices:  [ evicted (always resident, keep `kept` tokens) | others: plan.resident_slices resident,
                                                              the rest streamed               ]
 a streamed slice at n tokens loads:  coded(n) / group rows  +  (n - coded(n)) full tokens
```
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import ModelConfig
from kvtier.planner.memory import kv_token_bytes
from kvtier.planner.packed import PackedFormat
from kvtier.planner.placement import KVPlan


@dataclass(frozen=True)
class LossyKV:
    """Bytes of one sequence's KV at `context` tokens under a plan and a lossy method."""

    context: int
    gpu_stored: int  # KV bytes held by GPU-resident slices (evicted ones keep `kept` tokens; packed
    # ones their rows and uncoded tokens)
    host_stored: int  # KV bytes a streamed slice loads, summed: packed rows + full-precision tokens
    pcie_per_decode: int  # bytes copied to the GPU for one decode step at `context` tokens
    streamed_slices: int
    evicted_slices: int


def lossy_kv(
    cfg: ModelConfig,
    plan: KVPlan,
    context: int,
    *,
    dtype_bytes: int,
    codec: PackedFormat | None = None,
    evicted_slices: int = 0,
    kept_tokens: int | None = None,
) -> LossyKV:
    """Predict the bytes of `plan` at `context` stored tokens with a lossy method.

    `codec`: a packing codec (every slice stores packed rows for its coded tokens: streamed ones
    in host memory, loaded as such; resident ones in GPU memory).
    `evicted_slices` / `kept_tokens`: slices an evictor compacts (all of them for `--evict`, the
    streaming heads for `--head-sparsity`) and the tokens each keeps (`--kv-budget`, or sinks +
    recent). Evicted slices stay resident; the plan's resident count applies to the others.
    """
    num_slices = cfg.num_layers * (cfg.num_kv_heads // plan.group_size)
    token = kv_token_bytes(cfg, plan.group_size, dtype_bytes)
    others = num_slices - evicted_slices
    resident = min(plan.resident_slices, others)
    streamed = others - resident
    kept = context if kept_tokens is None else min(kept_tokens, context)
    if codec is None:
        load = context * token
    else:
        coded = codec.frozen_tokens(context)
        load = (
            coded // codec.group * codec.row_bytes(plan.group_size, cfg.head_dim) + (context - coded) * token
        )
    # NOTE: with a packing codec the resident slices hold packed rows too, in GPU memory.
    return LossyKV(
        context=context,
        gpu_stored=evicted_slices * kept * token + resident * (context * token if codec is None else load),
        host_stored=streamed * load,
        pcie_per_decode=streamed * load,
        streamed_slices=streamed,
        evicted_slices=evicted_slices,
    )
