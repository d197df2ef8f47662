"""Lossy methods through `kvtier.hf.TieredCache`: the registry's parts run inside HF's model and
give the tokens of kvtier's own runner with the same method; methods that need un-rotated keys
or kvtier's own model are refused with a message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.engine.runner import generate_tokens
from kvtier.engine.sampling import Sampler
from kvtier.errors import ConfigError
from kvtier.hf import TieredCache, cache_keyword
from kvtier.methods import parse_choice
from tests.hf_reference import make_hf_model

NEW = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("llama")
    return make_hf_model("llama-gqa", folder), folder


def hf_tokens(model: Any, ids: torch.Tensor, cache: TieredCache) -> list[int]:
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, **{cache_keyword(model): cache})
    return [int(t) for t in out[0, ids.shape[1] :]]


def runner(folder: Path, ids: torch.Tensor, spec: str) -> tuple[list[int], dict[str, int]]:
    """kvtier's own runner under `spec`, the whole prompt as one prefill step (as `generate`
    runs it): greedy tokens and the KV bytes its store holds per tier at the end."""
    llm = LLM(str(folder), device="cpu")
    method = parse_choice(spec)
    context = ids.shape[1] + NEW
    plan = llm.placement(context, method).plan
    store, _ = llm.make_store(plan, context, method=method)
    sampler = Sampler(SamplingParams(max_tokens=NEW), llm.device)
    tokens, _ = generate_tokens(llm.model, store, ids[0], sampler, NEW, ids.shape[1], lambda _: False)
    return tokens, store.stored_bytes()


@pytest.mark.parametrize(
    "spec", ["kv=head,kv_quant=int4", "int8", "window,kv_budget=24", "h2o,kv_budget=24", "quest,kv_budget=32"]
)
def test_lossy_method_equals_kvtiers_own_runner(llama: tuple[Any, Path], spec: str) -> None:
    model, folder = llama
    # 200 prompt tokens: past the codecs' 128-token full-precision window, so 64 are stored packed.
    ids = torch.randint(1, 211, (1, 200), generator=torch.Generator().manual_seed(5))
    cache = TieredCache(model, kv=spec, context=ids.shape[1] + NEW)
    assert cache.parts.describe != "lossless"
    tokens, stored = runner(folder, ids, spec)
    assert hf_tokens(model, ids, cache) == tokens
    assert cache.store.stored_bytes() == stored
    full = cache.get_seq_length() * cache.model_config.kv_bytes_per_token(4)
    assert sum(stored.values()) < full or spec.startswith("quest")  # Quest reads fewer, keeps all


@pytest.mark.parametrize(
    "spec,match",
    [
        ("streaming,kv_budget=16", "un-rotated"),
        ("hip", "un-rotated"),
        ("head,head_sparsity=0.5", "head sparsity"),
    ],
)
def test_methods_needing_unrotated_keys_or_kvtiers_model_are_refused(
    llama: tuple[Any, Path], spec: str, match: str
) -> None:
    model, _ = llama
    with pytest.raises(ConfigError, match=match):
        TieredCache(model, kv=spec, context=64)


def test_snapkvs_plan_counts_the_new_tokens_it_is_told(llama: tuple[Any, Path]) -> None:
    """SnapKV keeps every decoded token: told `new_tokens`, the cache plans what it keeps; not
    told, up to the whole context."""
    from kvtier.errors import ConfigError

    model, _ = llama
    spec, context = "snapkv,kv_budget=40", 4096
    told = TieredCache(model, kv=spec, context=context, new_tokens=NEW, chunk_size=256)
    assert told.plan.context == told.plan.compact_tokens < context
    assert TieredCache(model, kv=spec, context=context, chunk_size=256).plan.context == context
    with pytest.raises(ConfigError, match="new_tokens"):
        TieredCache(model, kv=spec, context=context, new_tokens=context + 1)
