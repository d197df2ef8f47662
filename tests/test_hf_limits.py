"""What `kvtier.hf` refuses, and how: unsupported transformers versions, models and generation
modes each raise a `KvtierError` that says what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from kvtier.errors import CapacityError, ConfigError, ModelLoadError
from kvtier.hf import SUPPORTED, TieredCache, cache_keyword, check_version, installed_version
from kvtier.hf.versions import UnsupportedTransformersError
from tests.hf_reference import make_hf_model


@pytest.mark.parametrize("version", ["5.17.0", "5.24.0", "5.30.0rc1", "5.99.1"])
def test_supported_versions_pass(version: str) -> None:
    assert str(check_version(version)) == version


@pytest.mark.parametrize("version", ["4.57.1", "5.16.2", "6.0.0", "6.0.0.dev0", "7.1"])
def test_unsupported_versions_name_the_supported_range(version: str) -> None:
    with pytest.raises(UnsupportedTransformersError, match=f"transformers {version} is installed") as e:
        check_version(version)
    assert SUPPORTED == ">=5.17.0,<6.0.0" and SUPPORTED in str(e.value) and "pip install" in str(e.value)


def test_missing_or_unreadable_version() -> None:
    with pytest.raises(UnsupportedTransformersError, match="needs Hugging Face transformers"):
        check_version(None)
    with pytest.raises(UnsupportedTransformersError, match="cannot read the transformers version"):
        check_version("five")


def test_the_installed_version_is_the_one_imported() -> None:
    assert installed_version() == transformers.__version__


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_hf_model("llama-gqa", tmp_path_factory.mktemp("llama"))


def ids(n: int = 20, batch: int = 1) -> torch.Tensor:
    return torch.randint(1, 211, (batch, n), generator=torch.Generator().manual_seed(3))


def generate(model: Any, cache: TieredCache, inputs: torch.Tensor, **kw: Any) -> Any:
    return model.generate(inputs, max_new_tokens=4, do_sample=False, **{cache_keyword(model): cache}, **kw)


def test_a_batch_of_two_is_refused(llama: Any) -> None:
    with pytest.raises(ConfigError, match="batch size must be 1, got 2"):
        generate(llama, TieredCache(llama, context=64), ids(batch=2))


def test_padding_is_refused(llama: Any) -> None:
    mask = torch.ones(1, 20, dtype=torch.long)
    mask[0, :3] = 0
    with pytest.raises(ConfigError, match="padding"):
        generate(llama, TieredCache(llama, context=64), ids(), attention_mask=mask)


def test_beam_search_is_refused(llama: Any) -> None:
    with pytest.raises(ConfigError, match=r"batch size must be 1, got 2 \(.*num_beams > 1"):
        generate(llama, TieredCache(llama, context=64), ids(), num_beams=2)


def test_a_sequence_longer_than_the_plan_is_refused(llama: Any) -> None:
    cache = TieredCache(llama, kv="head", context=22)
    with pytest.raises(CapacityError, match=r"planned for 22 tokens.*context=.*at least 23"):
        generate(llama, cache, ids())
    assert cache.get_seq_length() == 22  # the steps that fit ran


def test_the_default_context_is_the_models_trained_length(llama: Any) -> None:
    cache = TieredCache(llama, kv="layer")
    assert cache.context == llama.config.max_position_embeddings == cache.plan.context


def test_a_forward_that_failed_midway_needs_a_reset(llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = TieredCache(llama, kv="head", context=64)
    calls = {"n": 0}
    real = cache.store.__class__.__call__

    def failing(self: Any, layer: int, *a: Any) -> Any:
        calls["n"] += 1
        if layer == 1 and calls["n"] < 3:
            raise RuntimeError("simulated failure in layer 1")
        return real(self, layer, *a)

    monkeypatch.setattr(cache.store.__class__, "__call__", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        generate(llama, cache, ids())
    with pytest.raises(ConfigError, match=r"stopped before its last layer.*cache\.reset"):
        generate(llama, cache, ids())
    monkeypatch.undo()
    cache.reset()
    assert generate(llama, cache, ids()).shape == (1, 24)


def test_switching_the_attention_away_is_caught(tmp_path: Path) -> None:
    model = make_hf_model("llama-gqa", tmp_path)
    cache = TieredCache(model, context=64)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ConfigError, match="switched to 'sdpa'"):
        generate(model, cache, ids())


def test_moving_the_model_after_building_the_cache_is_caught(tmp_path: Path) -> None:
    model = make_hf_model("llama-gqa", tmp_path)
    cache = TieredCache(model, context=64)
    model.to(torch.float64)
    with pytest.raises(ConfigError, match="build it after moving the model"):
        generate(model, cache, ids())


def test_sliding_window_models_are_refused(tmp_path: Path) -> None:
    model = make_hf_model("mistral", tmp_path, sliding_window=32)
    with pytest.raises(ConfigError, match="sliding-window attention"):
        TieredCache(model, context=64)


def test_other_model_types_are_refused() -> None:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        TieredCache(model)
