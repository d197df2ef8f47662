"""The server's page pool is sized within the memory budget, not the GPU's free memory.

Exact page counts from the numbers (llama-3-8b in bf16 on a 24 GiB budget), and the clean
CapacityError for a budget that leaves no pool or a --num-pages / --num-host-pages that does not
fit (on the CPU: host memory available) before anything is allocated.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvtier.engine.batch import sizing
from kvtier.engine.batch.sizing import (
    MIN_PAGES,
    PoolBudget,
    measure_pool_budget,
    offload_gpu_budget,
    step_activation_bytes,
)
from kvtier.engine.llm import LLM
from kvtier.errors import CapacityError
from kvtier.loading.presets import preset_config
from kvtier.planner.memory import GPU_RESERVE_BYTES, activation_bytes, weight_bytes
from kvtier.serve.engine import ServeConfig, ServeEngine
from tests.hf_reference import make_hf_model

GiB = 1024**3
LLAMA3 = preset_config("llama-3-8b")
PAGE = 16 * LLAMA3.kv_bytes_per_token(2)  # 16 tokens x 32 layers x 8 KV heads x 128 x K,V x bf16


def llama3_in(budget: int) -> PoolBudget:
    """llama-3-8b bf16 weights loaded, the default 512-token step of up to 64 sequences."""
    act = step_activation_bytes(LLAMA3, 512, 64, 2)
    return PoolBudget("GPU", "--gpu-memory", budget, weight_bytes(LLAMA3, 2), act, GPU_RESERVE_BYTES, 512)


def test_llama3_8b_pool_in_a_24_gib_budget() -> None:
    assert PAGE == 2 * 1024**2
    assert weight_bytes(LLAMA3, 2) == 16_060_522_496  # 8.03e9 parameters
    # The planner's prefill activations of 512 tokens, plus fp32 + bf16 logits of 63 more rows.
    assert step_activation_bytes(LLAMA3, 512, 64, 2) == activation_bytes(LLAMA3, 512, 2) + 63 * 128256 * 6
    assert step_activation_bytes(LLAMA3, 512, 64, 2) == 101_679_104
    budget = llama3_in(24 * GiB)
    # 24 GiB - 16.06e9 weights - 101.7e6 activations - 0.5 GiB reserve = 9_070_731_264 B = 4325.3 pages
    assert budget.room == 9_070_731_264
    assert budget.default_pages(PAGE) == 4325
    assert budget.default_pages(PAGE, cap=1024) == 1024
    # The startup line says where the budget goes.
    assert budget.describe(4325 * PAGE) == (
        "--gpu-memory (24.00 GiB) = 14.96 GiB weights + 8.45 GiB KV pool + 96.97 MiB step activations"
        " + 512.00 MiB reserve + 536.00 KiB unused"
    )
    budget.check(4325, PAGE)
    with pytest.raises(CapacityError, match=r"--num-pages 4326 needs 8.45 GiB .* at most 4325 pages fit"):
        budget.check(4326, PAGE)


def test_a_budget_without_room_for_a_pool_names_the_numbers() -> None:
    with pytest.raises(CapacityError) as e:
        llama3_in(15 * GiB).default_pages(PAGE)
    msg = str(e.value)
    assert "--gpu-memory (15.00 GiB) - 14.96 GiB in use (weights) - 96.97 MiB of activations" in msg
    assert f"under the {MIN_PAGES} pages (32.00 MiB)" in msg and "Raise --gpu-memory" in msg
    assert llama3_in(16 * GiB).default_pages(PAGE) == 229  # 16 GiB leaves 458.5 MiB
    with pytest.raises(
        CapacityError, match=r"--num-pages 10000000000 needs 19073.49 TiB .* at most 32997 pages fit"
    ):
        llama3_in(80 * GiB).check(10**10, PAGE)


def test_offloaded_requests_plan_within_the_budget_minus_the_pool() -> None:
    pool = 4325 * PAGE
    weights = weight_bytes(LLAMA3, 2)
    # An H200 with --gpu-memory 24GiB: 120 GiB free is not ours to plan with.
    assert offload_gpu_budget(24 * GiB, weights + pool, 120 * GiB, pool) == 24 * GiB - pool
    # Another process holds most of the GPU: what we hold plus what is free, minus the pool.
    assert offload_gpu_budget(24 * GiB, weights + pool, GiB // 2, pool) == weights + GiB // 2
    assert offload_gpu_budget(GiB, weights + pool, 0, pool) == 0
    # A batch step's activations and gather are allocated beside the request: not its to plan with.
    assert offload_gpu_budget(24 * GiB, weights + pool, 120 * GiB, pool, GiB) == 23 * GiB - pool
    # Another request's store (running, or being freed) holds memory outside the pool.
    assert offload_gpu_budget(24 * GiB, weights + pool, 120 * GiB, pool, GiB, 2 * GiB) == 21 * GiB - pool


def test_a_tiered_run_beside_a_full_batch_step_stays_in_the_budget() -> None:
    """The H200 case that ran over (26.37 GB against 24 GiB): a pool sized from memory, a batch
    step of 8192 tokens and a request over a store of its own, all at once."""
    weights = weight_bytes(LLAMA3, 2)
    act = step_activation_bytes(LLAMA3, 8192, 64, 2)
    context = 600_000_000  # the CUDA context: nvidia-smi's 26.37 GB was the 25.77 GB cap plus ~0.6 GB
    base = PoolBudget(
        "GPU", "--gpu-memory", 24 * GiB, weights, act, GPU_RESERVE_BYTES, 8192, gather=1 / 32, context=context
    )
    budget = base.with_default_offload()
    assert budget.offload == base.room // 4 and budget.offload > GiB  # ~2 GiB kept for such requests
    pool = budget.default_pages(PAGE) * PAGE
    gather = int(pool * budget.gather)
    planned = offload_gpu_budget(24 * GiB, weights + pool, 120 * GiB, pool, act + gather + context)
    run_room = planned - weights - GPU_RESERVE_BYTES  # what the planner gives the request's buffers
    assert run_room >= budget.offload
    assert context + weights + pool + gather + act + run_room + GPU_RESERVE_BYTES <= 24 * GiB
    # The default term is at most OFFLOAD_RESERVE_MAX, and messages name it.
    big = dataclasses.replace(base, budget=80 * GiB).with_default_offload()
    assert big.offload == sizing.OFFLOAD_RESERVE_MAX
    with pytest.raises(CapacityError, match=r"4.00 GiB kept for offloaded requests \(--offload-reserve\)"):
        big.check(10**7, PAGE)


def test_the_h200_case_measures_the_budget_not_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--gpu-memory 24GiB` on a 141 GiB H200 with llama-3-8b loaded: 4194 pages, not 80% of 125 GiB
    (4325 pages would fit without a step's gather of one layer's share, 1/32 of the pool)."""
    weights = weight_bytes(LLAMA3, 2)
    free = 141 * GiB - weights
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 141 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: weights)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: weights)  # nothing outside it
    cuda = torch.device("cuda", 0)
    budget = measure_pool_budget(LLAMA3, cuda, torch.bfloat16, 24 * GiB, True, 512, 64)
    assert budget == dataclasses.replace(llama3_in(24 * GiB), gather=1 / 32)
    assert budget is not None and budget.default_pages(PAGE) == 4194
    # No --gpu-memory: the whole GPU, less what another process holds (here all but 20 GiB).
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (20 * GiB, 141 * GiB))
    budget = measure_pool_budget(LLAMA3, cuda, torch.bfloat16, 141 * GiB, False, 512, 64)
    assert budget is not None and (budget.budget, budget.label) == (
        weights + 20 * GiB,
        "the GPU memory free now plus this process's",
    )
    # NOTE: what the allocator does not hold is taken for this process's context, up to
    # CONTEXT_MAX: here the other process's 121 GiB, so the most.
    assert budget.context == sizing.CONTEXT_MAX
    room = 20 * GiB - budget.activation - GPU_RESERVE_BYTES - sizing.CONTEXT_MAX
    assert budget.default_pages(PAGE) == room // int(PAGE * (1 + 1 / 32))
    # The H200 alone, with a 600 MB context: it comes off the pool, and messages name it.
    ctx = 600_000_000
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free - ctx, 141 * GiB))
    budget = measure_pool_budget(LLAMA3, cuda, torch.bfloat16, 24 * GiB, True, 512, 64)
    assert budget is not None and budget.context == ctx
    assert budget.room == llama3_in(24 * GiB).room - ctx
    with pytest.raises(CapacityError, match=r"572.20 MiB of CUDA context - a 512.00 MiB reserve"):
        budget.check(10**7, PAGE)
    pool = budget.default_pages(PAGE) * PAGE
    assert " KV pool + " in budget.describe(pool) and " + 572.20 MiB CUDA context + " in budget.describe(pool)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder: Path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama-gqa", folder)  # 3 layers, 2 KV heads of 16: 12 KiB a 16-token page in fp32
    return LLM(str(folder), device="cpu", dtype="fp32", kv="gpu")


def with_host_memory(monkeypatch: pytest.MonkeyPatch, available: int) -> None:
    monkeypatch.setattr(sizing, "host_memory_available", lambda: available)
    monkeypatch.setattr("kvtier.engine.batch.core.host_memory_available", lambda: available)


def test_cpu_pool_is_checked_against_host_memory_before_allocating(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = 16 * llm.model_config.kv_bytes_per_token(4)
    assert page == 12 * 1024
    act = step_activation_bytes(llm.model_config, 512, 64, 4)
    with_host_memory(monkeypatch, GiB)
    engine = ServeEngine(llm, ServeConfig())
    assert (engine.store.num_pages, engine.kv.host.num_slots) == (1024, 1024)  # the CPU default
    with pytest.raises(CapacityError, match=r"--num-pages 10000000000 needs 111.76 TiB on the host"):
        ServeEngine(llm, ServeConfig(num_pages=10**10))
    with pytest.raises(CapacityError, match=r"--num-host-pages 10000000000 needs .* on the host"):
        ServeEngine(llm, ServeConfig(num_pages=64, num_host_pages=10**10))
    # Little host memory: the default pool shrinks to what fits, the host tier to a quarter of the rest.
    with_host_memory(monkeypatch, act + 100 * page + 1)
    engine = ServeEngine(llm, ServeConfig())
    assert (engine.store.num_pages, engine.kv.host.num_slots) == (100, 0)
    with_host_memory(monkeypatch, act + 10 * page)
    with pytest.raises(CapacityError, match="no room for the KV page pool on the host"):
        ServeEngine(llm, ServeConfig())
