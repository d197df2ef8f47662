"""`LLM.generate` with a list of prompts: all at once through the continuous-batching engine
`kvtier serve` uses (`kvtier.engine.batch`), over the page pool for a lossless method, or each
prompt over a store of its own (in the same forward) for a lossy one; and which calls go there
(`runs_batched`: also one prompt under `single_batched`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch
from tqdm import tqdm

from kvtier.engine.batch.config import BatchConfig, ModelHost
from kvtier.engine.batch.core import BatchEngine
from kvtier.engine.batch.sequence import Delta, OwnStore, Sequence
from kvtier.engine.config import EngineConfig
from kvtier.engine.outputs import GenerationStats, RequestOutput
from kvtier.engine.prompts import Prompt
from kvtier.engine.runner import prefill_spans
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.tiered import StoreHost
from kvtier.errors import CapacityError
from kvtier.kv.store import TieredKVStore
from kvtier.methods import MethodChoice, PlanInputs, plan_for
from kvtier.parallel.group import RankGroup
from kvtier.planner.memory import weight_bytes


class BatchHost(ModelHost, StoreHost, Protocol):
    """What batched generation needs of a loaded model (`kvtier.engine.llm.LLM` is one)."""

    config: EngineConfig
    parallel: RankGroup | None

    def plan_inputs(
        self, context: int, method: MethodChoice, new_tokens: int | None = None
    ) -> PlanInputs: ...


BATCHABLE = ("auto", "gpu")  # placements a list of prompts is batched under (KV on the device)


def runs_batched(llm: BatchHost, prompts: int, method: MethodChoice) -> bool:
    """Whether a call's `prompts` (how many) under `method` go to the batch engine
    (`generate_batched`, which may send them back): in one process, with the KV on the device
    (`BATCHABLE`: the LLM's placement and the request's), several prompts, or one that
    `_one_batched` takes."""
    batchable = method.kv in BATCHABLE and llm.method.kv in BATCHABLE
    return batchable and llm.parallel is None and (prompts > 1 or _one_batched(llm, method))


def _one_batched(llm: BatchHost, method: MethodChoice) -> bool:
    """Whether one prompt runs through the batch engine (`EngineConfig.single_batched`): a
    lossless method with `kv="auto"` on a dense model (no MoE: the batch engine was never
    run with experts) whose scores the paged kernels compute; `generate_batched` sends it back
    to the tiered store when its KV does not fit the device. `--kv gpu` keeps the tiered store's
    resident path."""
    on = llm.config.single_batched
    if on is None:
        on = llm.device.type == "cuda"
    cfg = llm.model_config
    return on and method.lossless and method.kv == "auto" and cfg.plain_scores and cfg.moe is None


def generate_batched(
    llm: BatchHost,
    batch: list[Prompt],
    encoded: list[list[int]],
    params: SamplingParams,
    progress: bool,
    method: MethodChoice,
    step_tokens: int | None = None,
    prefill_cudnn: bool = True,
) -> list[RequestOutput] | None:
    """All prompts at once through the continuous-batching engine (one forward per step for
    every sequence), as `kvtier serve` runs them: over the page pool for a lossless method,
    else each over a store of its own with `method` (`own_stores`). None when one of them
    does not fit (too long for the pool, or its store would stream): then they run one at a
    time, each planned alone.

    `step_tokens`: the tokens of a batch step (None: `batch_step_tokens`); `prefill_cudnn`:
    prefill chunks on cuDNN where the device prefers it (no tiered run shares this engine)."""
    cuda = llm.device.type == "cuda"
    if cuda:  # the call's peak, as a request alone reports it (`gpu_total`)
        torch.cuda.reset_peak_memory_stats(llm.device)
    # A lossy method, or scores the paged kernels cannot compute (soft-capping, latent
    # attention): every prompt over a store of its own, and no sequence takes pages.
    own_only = not method.lossless or not llm.model_config.plain_scores
    if step_tokens is None:
        step_tokens = batch_step_tokens(llm, encoded, params, method)
    config = BatchConfig(
        max_num_seqs=min(len(batch), 256), max_num_batched_tokens=step_tokens, prefill_cudnn=prefill_cudnn
    )
    if own_only:
        config = replace(config, num_pages=1, num_host_pages=0, prefix_caching=False)
        engine = BatchEngine(llm, config)
    else:
        sized = _sized_engine(llm, config, encoded, params)
        base = base_step_tokens(llm)
        if sized is None and step_tokens > base:  # the larger step's activations did not fit
            sized = _sized_engine(llm, replace(config, max_num_batched_tokens=base), encoded, params)
        if sized is None:
            return None
        engine = sized
    tokens: list[list[int]] = [[] for _ in batch]
    done: list[float] = [0.0] * len(batch)
    # one prompt: no bar (a bar of one request says nothing; on CUDA its prefill takes seconds)
    quiet = not progress or len(batch) == 1
    bar = tqdm(total=len(batch), unit="req", desc="generate", file=sys.stderr, disable=quiet)

    def sink_for(i: int) -> Callable[[Delta], None]:
        def sink(d: Delta) -> None:
            tokens[i].extend(d.token_ids)
            if d.finish_reason is not None:
                done[i] = time.perf_counter()
                bar.update(1)

        return sink

    seqs = [engine.make_sequence(ids, params, sink_for(i)) for i, ids in enumerate(encoded)]
    if not own_only and any(engine.needs_offload(ids, params) for ids in encoded):
        return None
    if own_only and not own_stores(llm, seqs, params, method, config.max_num_batched_tokens):
        return None
    own = [(s.own.store.account, s.own.describe) if s.own is not None else None for s in seqs]
    captured = 0.0
    if engine.decoder is not None and not own_only:  # graphs now, not in the first decode step's time
        t0 = time.perf_counter()
        engine.decoder.capture_all()
        captured = time.perf_counter() - t0
    start = time.perf_counter()
    for seq in seqs:
        engine.add(seq)
    with bar:
        engine.run_until_idle()
    pool_pages = engine.store.num_pages
    total = {"gpu_total": int(torch.cuda.max_memory_allocated(llm.device))} if cuda else {}
    pool = engine.store.bytes_per_page * pool_pages
    outputs = []
    for prompt, ids, seq, toks, end, mine in zip(batch, encoded, seqs, tokens, done, own, strict=True):
        first = seq.first_token_at or end
        if mine is None:
            peak = {"gpu_kv" if cuda else "host_kv": pool, **total}
            plan = {"policy": "batched", "method": f"paged batch of {len(batch)}", "pages": pool_pages}
            if engine.decoder is not None and engine.decoder.graphs:
                plan["cuda_graphs_capture_s"] = round(captured, 3)
        else:  # its own store (the CPU's "gpu" tier is its memory)
            account, describe = mine
            peak = {"gpu_kv": account.peak["gpu"], "host_kv": account.peak["host"], **total}
            plan = {"policy": "batched", "method": f"{describe}, own store, batch of {len(batch)}"}
        stats = GenerationStats(
            prompt_tokens=len(ids),
            generated_tokens=len(toks),
            prefill_s=first - start,
            decode_s=end - first,
            peak_bytes=peak,
            plan=plan,
        )
        text, reason = llm.text_and_reason(toks, params)
        outputs.append(
            RequestOutput(prompt if isinstance(prompt, str) else None, ids, text, toks, reason, stats)
        )
    return outputs


def batch_step_tokens(
    llm: BatchHost, encoded: list[list[int]], params: SamplingParams, method: MethodChoice
) -> int:
    """Tokens per batch step: 8,192 on CUDA (2,048 on the CPU), or for one prompt the prefill
    chunk the planner gives it (`plan_for`, as the tiered store would run it) when that is more:
    each chunk costs a forward's host work and a gather of the prefix, so a 16K prompt in one
    chunk prefills faster than in two. (A pool that cannot hold the larger step's activations
    takes the base step: `generate_batched`.)"""
    base = base_step_tokens(llm)
    if len(encoded) != 1:
        return base
    context = len(encoded[0]) + params.max_tokens
    try:
        chunk = plan_for(llm.plan_inputs(context, method, params.max_tokens), method).plan.chunk_size
    except CapacityError:  # nothing fits: the pool's sizing says so in its own words
        return base
    return max(base, min(chunk, len(encoded[0])))


def base_step_tokens(llm: BatchHost) -> int:
    """A batch step's tokens for several prompts: 8,192 on CUDA, 2,048 on the CPU."""
    return 8192 if llm.device.type == "cuda" else 2048


def _sized_engine(
    llm: BatchHost, config: BatchConfig, encoded: list[list[int]], params: SamplingParams
) -> BatchEngine | None:
    """The engine with a page pool of what the prompts need at most (their prompts and new
    tokens, a page of slack each), when the memory budget holds that; else, for several
    prompts, the pool sized from the budget (they then wait for pages as a server's requests
    would), and for one, None (it never fits: the tiered store plans it). No host tier: a
    call's prompts are all known, so pinning host pages would only cost time."""
    page = config.page_size
    need = sum(-(-(len(ids) + params.max_tokens + 1) // page) + 1 for ids in encoded)
    config = replace(config, num_host_pages=0)
    try:
        return BatchEngine(llm, replace(config, num_pages=need))
    except CapacityError:
        return BatchEngine(llm, config) if len(encoded) > 1 else None


def own_stores(
    llm: BatchHost, seqs: list[Sequence], params: SamplingParams, method: MethodChoice, max_chunk: int
) -> bool:
    """Give each sequence a store of its own under `method`, planned within an equal share of
    the GPU budget's KV room; False (none kept) when one of them would stream or fit nowhere."""
    budget = llm.gpu_budget()
    share = None
    if budget is not None:
        itemsize = llm.dtype.itemsize
        weights = weight_bytes(llm.model_config, itemsize)
        share = weights + max(0, budget - weights) // len(seqs)
    made: list[TieredKVStore] = []
    try:
        for seq in seqs:
            context = len(seq.prompt) + params.max_tokens
            inputs = llm.plan_inputs(context, method, params.max_tokens)
            placed = plan_for(replace(inputs, gpu_budget=share), method)
            store, parts = llm.make_store(
                placed.plan, context, placed.cache_tokens, method, hip_prune_bytes=placed.prune_bytes
            )
            made.append(store)
            if not store.all_on_device:
                raise CapacityError("a store would stream")
            chunk = min(placed.plan.chunk_size, max_chunk)
            seq.own = OwnStore(store, prefill_spans(len(seq.prompt), chunk, store), parts.describe)
    except CapacityError:
        for store in made:
            store.close()
        for seq in seqs:
            seq.own = None
        return False
    return True
