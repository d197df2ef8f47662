"""`kvtier.hf.TieredCache` inside `model.generate`: every lossless placement gives the greedy
tokens of transformers' default `DynamicCache`, for each supported family (tiny random models, CPU)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.errors import CapacityError
from kvtier.hf import TieredCache, cache_keyword, prefill_in_chunks
from kvtier.methods import plan_for
from kvtier.planner.memory import GPU_RESERVE_BYTES, weight_bytes
from kvtier.planner.placement import KVPlan
from tests.hf_reference import make_hf_model

PROMPT, NEW = 45, 8
CONTEXT = PROMPT + NEW
FAMILIES = ("llama-gqa", "mistral", "qwen2-bias", "qwen3-qknorm")


def prompt(n: int = PROMPT, seed: int = 7) -> torch.Tensor:
    """[1, n] token ids; never 0, the tiny models' pad id (generate would read it as padding)."""
    return torch.randint(1, 211, (1, n), generator=torch.Generator().manual_seed(seed))


def generate(model: Any, ids: torch.Tensor, cache: Any = None, **kw: Any) -> list[int]:
    """Greedy new tokens; `cache` passed by the keyword this transformers version prefers."""
    extra = {} if cache is None else {cache_keyword(model): cache}
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, **extra, **kw)
    return [int(t) for t in out[0, ids.shape[1] :]]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[int]]:
    """A tiny model of one family and its reference tokens with HF's default cache (SDPA)."""
    model = make_hf_model(request.param, tmp_path_factory.mktemp(request.param))
    return model, generate(model, prompt())


def partial_auto_budget(model: Any) -> int:
    """A GPU budget under which `auto` keeps some slices resident and streams the others."""
    inputs = TieredCache(model, kv="gpu", context=CONTEXT).plan_inputs()
    floor = GPU_RESERVE_BYTES + weight_bytes(inputs.cfg, inputs.dtype_bytes)
    for budget in range(floor, floor + (1 << 24), 4096):
        try:
            plan = plan_for(replace(inputs, kv="auto", gpu_budget=budget)).plan
        except CapacityError:
            continue
        if 0 < plan.resident_slices < plan.num_slices:
            return budget
    raise AssertionError("no budget gives a partly resident plan")


@pytest.mark.parametrize("spec", ["gpu", "layer", "head", "auto-streaming"])
def test_lossless_placements_equal_dynamic_cache(family: tuple[Any, list[int]], spec: str) -> None:
    model, ref = family
    if spec == "auto-streaming":
        cache = TieredCache(model, kv="auto", gpu_memory=partial_auto_budget(model), context=CONTEXT)
        assert 0 < cache.plan.resident_slices < cache.plan.num_slices
    else:
        cache = TieredCache(model, kv=spec, context=CONTEXT)
    assert generate(model, prompt(), cache) == ref
    # The last new token is never fed back: the store holds the prompt and NEW - 1 tokens.
    assert cache.get_seq_length() == PROMPT + NEW - 1
    plan, cfg = cache.plan, cache.model_config
    streamed = plan.num_slices - plan.resident_slices
    token_bytes = 2 * plan.group_size * cfg.head_dim * 4  # K and V of one slice's token, fp32
    # Every streamed slice went to the host tier once per token, nothing more.
    assert cache.store.account.d2h_bytes == streamed * (PROMPT + NEW - 1) * token_bytes
    assert cache.store.stored_bytes()["host"] == streamed * (PROMPT + NEW - 1) * token_bytes


def test_cpu_attended_slices_equal_dynamic_cache(family: tuple[Any, list[int]]) -> None:
    """Three of the streamed slices attended where the host KV is at decode (`cpu_attention`)."""
    model, ref = family
    cache = TieredCache(model, kv="head", context=CONTEXT, cpu_attention=3)
    cpu = cache.store.cpu
    assert cache.plan.cpu_slices == 3 and cpu is not None
    layers: list[int] = []
    attend_layer = cpu.attend_layer

    def counted(layer: int, *args: Any) -> torch.Tensor:
        layers.append(layer)
        return attend_layer(layer, *args)

    cpu.attend_layer = counted  # type: ignore[method-assign]
    assert generate(model, prompt(), cache) == ref
    # Every decode forward (NEW - 1 of them) attended the CPU slices' layers on the host.
    assert layers == sorted(cpu.layers) * (NEW - 1)


def test_sequence_blocks_and_chunked_prefill_equal_dynamic_cache(family: tuple[Any, list[int]]) -> None:
    """Staging buffers of 16 tokens (the prefix streams in blocks merged by log-sum-exp) and a
    prompt fed 7 tokens per forward by `prefill_in_chunks`, then `generate` for the last token."""
    model, ref = family
    plan = KVPlan("head", 1, 0, 7, 2, 16, num_slices=6)
    cache = TieredCache(model, kv="head", context=CONTEXT, plan=plan, block_size=8)
    ids = prompt()
    assert prefill_in_chunks(model, cache, ids) == PROMPT - 1
    assert cache.get_seq_length() == PROMPT - 1
    assert generate(model, ids, cache) == ref
    assert cache.store.account.peak["gpu"] == 2 * 16 * 2 * cache.model_config.head_dim * 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_hf_model("llama-gqa", tmp_path_factory.mktemp("llama"))


def test_generate_prefill_chunk_size_equals_dynamic_cache(llama: Any) -> None:
    """transformers' own chunked prefill (`prefill_chunk_size`) over the tiered store."""
    ref = generate(llama, prompt())
    cache = TieredCache(llama, kv="layer", context=CONTEXT)
    assert generate(llama, prompt(), cache, prefill_chunk_size=9) == ref


def test_a_second_turn_continues_the_cache(llama: Any) -> None:
    """Prompt, answer, more prompt: the cache keeps the first turn, as DynamicCache does."""
    from transformers import DynamicCache

    first = prompt(30, seed=1)
    dyn = DynamicCache(config=llama.config)
    tiered = TieredCache(llama, kv="head", context=128)
    a = generate(llama, first, dyn)
    b = generate(llama, first, tiered)
    assert a == b
    second = torch.cat([first, torch.tensor([a]), prompt(11, seed=2)], dim=1)
    assert generate(llama, second, dyn) == generate(llama, second, tiered)
    assert tiered.get_seq_length() == dyn.get_seq_length()


def test_reset_empties_the_store(llama: Any) -> None:
    cache = TieredCache(llama, kv="head", context=CONTEXT)
    first = generate(llama, prompt(), cache)
    cache.reset()
    assert cache.get_seq_length() == 0
    assert generate(llama, prompt(), cache) == first


def test_the_model_runs_as_before_with_other_caches(tmp_path: Path) -> None:
    """After a TieredCache switched the model to "kvtier" attention, HF's own caches run SDPA:
    a plain generate, a chunked prefill (a step after cached tokens) and a padded batch."""
    model = make_hf_model("llama-gqa", tmp_path)
    ids = prompt()
    padded = torch.cat([prompt(), torch.cat([torch.zeros(1, 5, dtype=torch.long), prompt(40, 3)], 1)])
    mask = (padded != 0).long()
    before = (
        generate(model, ids),
        generate(model, ids, prefill_chunk_size=9),
        model.generate(padded, attention_mask=mask, max_new_tokens=NEW, do_sample=False).tolist(),
    )
    TieredCache(model, context=CONTEXT)
    assert model.config._attn_implementation == "kvtier"
    after = (
        generate(model, ids),
        generate(model, ids, prefill_chunk_size=9),
        model.generate(padded, attention_mask=mask, max_new_tokens=NEW, do_sample=False).tolist(),
    )
    assert after == before
