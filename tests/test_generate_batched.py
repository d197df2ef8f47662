"""`LLM.generate` with a list of prompts runs them batched, through the serving engine's
continuous batching, and gives each prompt's tokens of running it alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from tests.hf_reference import make_hf_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder: Path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama-gqa", folder)  # 3 layers, 4 query heads, 2 KV heads, vocab 211
    return LLM(str(folder), device="cpu", dtype="fp32")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 211, (n,), generator=g).tolist() for n in (7, 30, 3, 64, 19)]


def test_a_list_of_prompts_is_batched_and_equals_each_alone(llm: LLM) -> None:
    params = SamplingParams(max_tokens=9)
    alone = [llm.generate(p, params)[0] for p in prompts()]
    batched = llm.generate(prompts(), params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert [o.finish_reason for o in batched] == ["length"] * 5
    assert all(o.stats.plan["policy"] == "batched" for o in batched)
    assert all(o.stats.plan["policy"] != "batched" for o in alone)
    assert [o.stats.prompt_tokens for o in batched] == [len(p) for p in prompts()]
    assert all(o.stats.generated_tokens == 9 and o.stats.decode_s > 0 for o in batched)


@pytest.mark.parametrize("method", ["int8", "window,kv_budget=16", "hip,hip_preset=fast"])
def test_a_lossy_method_batches_each_prompt_over_a_store_of_its_own(llm: LLM, method: str) -> None:
    """A lossy method's prompts run batched too, each over its own store in the batch's forward,
    with the tokens of running each alone under that method."""
    params = SamplingParams(max_tokens=5)
    outs = llm.generate(prompts()[:3], params, method=method)
    assert all(o.stats.plan["policy"] == "batched" and "own store" in o.stats.plan["method"] for o in outs)
    assert all(o.stats.peak_bytes["gpu_kv"] > 0 for o in outs)
    assert [o.token_ids for o in outs] == [
        llm.generate(p, params, method=method)[0].token_ids for p in prompts()[:3]
    ]


def test_an_offloading_placement_runs_one_at_a_time(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4)
    for method in ("head", "int8,kv=head"):
        outs = llm.generate(prompts()[:2], params, method=method)
        assert all(o.stats.plan["policy"] != "batched" for o in outs)
        assert [o.token_ids for o in outs] == [
            llm.generate(p, params, method=method)[0].token_ids for p in prompts()[:2]
        ]
