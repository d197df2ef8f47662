"""Serving one request that is too long for the page pool: alone, through a tiered store.

The request runs to completion with the offload policy ("head" on the CPU, so its KV really
streams from the host tier; "auto" on CUDA within the server's GPU budget minus the page pool).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvtier.engine.runner import generate_tokens
from kvtier.planner.hardware import detect_hardware, host_memory_available
from kvtier.planner.placement import plan_kv
from kvtier.serve.sequence import Sequence

if TYPE_CHECKING:
    from kvtier.serve.engine import ServeEngine


def generate_offloaded(engine: ServeEngine, seq: Sequence) -> list[int]:
    """Greedy or sampled tokens of `seq`, generated with its KV in the tiered store."""
    llm, params = engine.llm, seq.params
    context = len(seq.prompt) + params.max_tokens
    itemsize = torch.empty((), dtype=llm.dtype).element_size()
    cuda = engine.device.type == "cuda"
    plan = plan_kv(
        llm.model_config,
        context,
        policy="auto" if cuda else "head",  # on the CPU "auto" would keep it all resident
        gpu_budget=engine.offload_gpu_budget(),  # the server's budget minus the page pool
        dtype_bytes=itemsize,
        chunk_size=llm.config.chunk_size,
        group_size=llm.config.head_group,
        block_size=llm.config.block_size,
        hardware=detect_hardware(engine.device),
        host_budget=host_memory_available() if cuda else None,
    )
    store, _ = llm.make_store(plan, context)
    eos = frozenset() if params.ignore_eos else engine.eos

    def should_stop(tokens: list[int]) -> bool:
        if engine.closing or tokens[-1] in eos:  # the server is shutting down: stop now
            return True
        if params.stop and llm.tokenizer is not None:
            with engine.tokenizer_lock:
                text = llm.tokenizer.decode(tokens, skip_special_tokens=True)
            return any(s in text for s in params.stop)
        return False

    try:
        tokens, _ = generate_tokens(
            engine.model,
            store,
            torch.tensor(seq.prompt, dtype=torch.long, device=engine.device),
            seq.sampler,
            params.max_tokens,
            plan.chunk_size,
            should_stop,
        )
    finally:
        store.close()
    return tokens
