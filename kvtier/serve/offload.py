"""Serving one request that is too long for the page pool: alone, through a tiered store.

The request runs to completion with the offload policy ("head" on the CPU, so its KV really
streams from the host tier; "auto" on CUDA within the server's GPU budget minus the page pool).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Protocol

import torch

from kvtier.engine.llm import LLM
from kvtier.engine.runner import generate_tokens
from kvtier.methods import plan_for
from kvtier.model.llama import CausalLM
from kvtier.serve.sequence import Sequence


class OffloadHost(Protocol):
    """What an offloaded request needs of the serving engine (`ServeEngine` is one)."""

    llm: LLM
    model: CausalLM
    device: torch.device
    eos: frozenset[int]
    tokenizer_lock: threading.Lock

    @property
    def closing(self) -> bool: ...

    def offload_gpu_budget(self) -> int | None: ...


def generate_offloaded(engine: OffloadHost, seq: Sequence) -> list[int]:
    """Greedy or sampled tokens of `seq`, generated with its KV in the tiered store."""
    llm, params = engine.llm, seq.params
    context = len(seq.prompt) + params.max_tokens
    cuda = engine.device.type == "cuda"
    method = replace(llm.method, kv="auto" if cuda else "head")  # on the CPU "auto" keeps it resident
    inputs = replace(
        llm.plan_inputs(context, method),
        gpu_budget=engine.offload_gpu_budget(),  # the server's budget minus the page pool
    )
    plan = plan_for(inputs, method).plan
    store, _ = llm.make_store(plan, context, method=method)
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
