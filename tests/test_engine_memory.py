"""Engine-level memory behaviour: contexts that cannot fit fail before allocating, and a failing
run frees every tier."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.errors import CapacityError
from kvtier.kv import store as store_module
from tests.hf_reference import make_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama-gqa", folder)
    return folder


def test_budget_too_small_fails_before_allocating(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[object] = []
    original = store_module.TieredKVStore.__init__

    def spy(self: object, *a: object, **kw: object) -> None:
        built.append(self)
        original(self, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module.TieredKVStore, "__init__", spy)
    llm = LLM(str(tiny), device="cpu", kv="head", gpu_memory="64KiB")
    with pytest.raises(CapacityError, match="--gpu-memory"):
        llm.generate(list(range(1, 40)), SamplingParams(max_tokens=4))
    assert built == []


def test_failure_mid_run_frees_every_tier(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stores: list[store_module.TieredKVStore] = []
    original = store_module.TieredKVStore.begin_step

    def begin_step(self: store_module.TieredKVStore, n_new: int) -> None:
        stores.append(self)
        if self.length > 20:
            raise torch.OutOfMemoryError("simulated out of memory")
        original(self, n_new)

    monkeypatch.setattr(store_module.TieredKVStore, "begin_step", begin_step)
    llm = LLM(str(tiny), device="cpu", kv="head", head_group=1, chunk_size=8)
    with pytest.raises(CapacityError, match="All KV memory was freed") as err:
        llm.generate(list(range(1, 40)), SamplingParams(max_tokens=4))
    # the message names kvtier's own line that asked for the memory (here: the store's caller)
    assert re.search(r", at kvtier/[\w/]+\.py:\d+ in \w+\)", str(err.value)), str(err.value)
    account = stores[-1].account
    assert account.peak["host"] > 0 and account.peak["gpu"] > 0
    assert account.allocated == {"gpu": 0, "host": 0}
