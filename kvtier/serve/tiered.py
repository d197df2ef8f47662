"""A request served over its own tiered store, one step at a time between batch steps.

Two kinds of request run this way: one whose prompt + max_tokens needs more pages than the
whole page pool (its KV is planned like `kvtier generate` plans it: head/layer slices streamed
from the host tier, within the server's GPU budget minus the pool), and one that names a
method (`"method": "quest,kv_budget=1k"` in the body: any registered method, over the same
store `kvtier generate` uses). The engine advances each such run by one prefill chunk or one
decode token per loop iteration, between the batch's steps, so the batch keeps going and the
run's tokens stream like any other request's.

    engine loop:  [batch step] [run A: chunk] [batch step] [run A: chunk] ... [run A: token] ...
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Protocol

import torch

from kvtier.engine.batch.sequence import Sequence
from kvtier.engine.llm import LLM
from kvtier.engine.runner import prefill_spans
from kvtier.kv.store import TieredKVStore
from kvtier.methods import MethodChoice, plan_for
from kvtier.model.llama import CausalLM


class OffloadHost(Protocol):
    """What a tiered run needs of the serving engine (`ServeEngine` is one)."""

    llm: LLM
    model: CausalLM
    device: torch.device
    eos: frozenset[int]
    tokenizer_lock: threading.Lock

    def offload_gpu_budget(self) -> int | None: ...


def run_method(engine: OffloadHost, seq: Sequence) -> MethodChoice:
    """The method `seq` runs with: its own (`seq.method`) or the server's, placed by the planner
    ("head" on the CPU for a request too long for the pool, so its KV really streams)."""
    if seq.method is not None:
        return seq.method
    # NOTE: on the CPU "auto" would keep it resident
    return replace(engine.llm.method, kv="auto" if engine.device.type == "cuda" else "head")


class TieredRun:
    """`seq` over a fresh `TieredKVStore`: `step()` runs one prefill chunk or decode token.

    Raises `CapacityError` at construction when the request fits nowhere in what is free now.
    """

    def __init__(self, engine: OffloadHost, seq: Sequence) -> None:
        llm = engine.llm
        self.seq, self.model, self.device = seq, engine.model, engine.device
        self.method = run_method(engine, seq)
        context = len(seq.prompt) + seq.params.max_tokens
        inputs = replace(llm.plan_inputs(context, self.method), gpu_budget=engine.offload_gpu_budget())
        placement = plan_for(inputs, self.method)
        self.plan = placement.plan
        self.store: TieredKVStore | None
        self.store, _ = llm.make_store(self.plan, context, placement.cache_tokens, self.method)
        self.ids = torch.tensor(seq.prompt, dtype=torch.long, device=engine.device)  # [N]
        self.spans = prefill_spans(len(seq.prompt), self.plan.chunk_size, self.store)
        self.done_spans = 0
        self.token: torch.Tensor | None = None  # the last sampled token (0-d, on the device)
        self.h2d_bytes = self.d2h_bytes = 0  # what its store moved over PCIe (set by `close`)

    @property
    def prefilling(self) -> bool:
        return self.done_spans < len(self.spans)

    def step(self) -> int | None:
        """One prefill chunk (None, or the first token after the last chunk) or one decode token."""
        store = self.store
        assert store is not None, "the run was closed"
        if self.prefilling:
            s, e = self.spans[self.done_spans]
            last = e == len(self.seq.prompt)
            none = torch.empty(0, dtype=torch.long, device=self.device)
            store.begin_step(e - s)
            logits = self.model(self.ids[s:e], store, logits_at=None if last else none, mlp_chunk=e - s)
            store.end_step()
            self.done_spans += 1
            if not last:
                return None
        else:
            assert self.token is not None
            store.begin_step(1)
            logits = self.model(self.token.view(1), store)
            store.end_step()
        self.token = self.seq.sampler(logits[-1])
        return int(self.token)

    def close(self) -> None:
        """Free the store (its GPU buffers and pinned host memory); keep its PCIe byte counts."""
        if self.store is not None:
            self.h2d_bytes, self.d2h_bytes = self.store.account.h2d_bytes, self.store.account.d2h_bytes
            self.store.close()
            self.store = None
