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


@pytest.fixture(scope="module")
def llm_one(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """The same tiny model, with one prompt batched as on CUDA (`single_batched`)."""
    folder: Path = tmp_path_factory.mktemp("gqa1")
    make_hf_model("llama-gqa", folder)
    return LLM(str(folder), device="cpu", dtype="fp32", single_batched=True)


def test_one_prompt_runs_batched_over_a_pool_of_its_size_and_equals_the_tiered_store(
    llm: LLM, llm_one: LLM
) -> None:
    """What `kvtier generate` runs on CUDA: one lossless prompt through the batch engine (its
    decode steps static, graphs on CUDA), over a pool of the pages it needs, with the tokens of
    the tiered store's run (`single_batched` off: the CPU's default)."""
    params = SamplingParams(max_tokens=9)
    for ids in prompts():
        one = llm_one.generate(ids, params)[0]
        tiered = llm.generate(ids, params)[0]
        assert tiered.stats.plan["policy"] != "batched"
        assert one.stats.plan["policy"] == "batched"
        assert one.token_ids == tiered.token_ids
        # the pool: the prompt and new tokens, a page of slack (16-token pages)
        assert one.stats.plan["pages"] == -(-(len(ids) + 9 + 1) // 16) + 1
        assert one.stats.generated_tokens == 9 and one.stats.decode_s > 0


def test_one_long_prompt_prefills_in_the_planned_chunk_with_the_tokens_of_smaller_steps(
    tmp_path: Path,
) -> None:
    """One prompt's batch steps take the planner's prefill chunk (here the whole 3,000-token
    prompt in one step, where a list's steps take 2,048 on the CPU): the tokens equal those of
    2,048-token steps and of the tiered store."""
    from kvtier.engine.batched import batch_step_tokens, generate_batched
    from kvtier.methods.spec import parse_choice

    make_hf_model("llama-gqa", tmp_path)
    long = LLM(str(tmp_path), device="cpu", dtype="fp32", single_batched=True, max_model_len=4096)
    ids = torch.randint(1, 211, (3000,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=4)
    auto = parse_choice("auto")
    assert batch_step_tokens(long, [ids], params, auto) == 3000
    assert batch_step_tokens(long, [ids, ids[:9]], params, auto) == 2048
    one = long.generate(ids, params)[0]
    small = generate_batched(long, [ids], [ids], params, False, auto, step_tokens=2048)
    tiered = long.generate(ids, params, method="gpu")[0]
    assert small is not None and one.stats.plan["policy"] == "batched" != tiered.stats.plan["policy"]
    assert one.token_ids == small[0].token_ids == tiered.token_ids


def test_one_prompt_whose_larger_step_does_not_fit_takes_the_base_step(
    llm_one: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the pool cannot hold a planned step's activations, one prompt still runs batched,
    in steps of the base size, rather than going back to the tiered store."""
    from kvtier.engine import batched
    from kvtier.engine.batch.core import BatchEngine
    from kvtier.errors import CapacityError

    real = BatchEngine.__init__
    steps: list[int] = []

    def init(self: BatchEngine, host: object, cfg: object) -> None:
        tokens = cfg.max_num_batched_tokens  # type: ignore[attr-defined]
        if tokens > 2048:
            raise CapacityError("the step's activations do not fit")
        steps.append(tokens)
        real(self, host, cfg)  # type: ignore[arg-type]

    monkeypatch.setattr(BatchEngine, "__init__", init)
    monkeypatch.setattr(batched, "batch_step_tokens", lambda *a: 4096)
    out = llm_one.generate(prompts()[3], SamplingParams(max_tokens=3))[0]
    assert out.stats.plan["policy"] == "batched" and steps == [2048]


@pytest.mark.parametrize("method", ["int8", "gpu", "head"])
def test_one_prompt_keeps_the_tiered_store_for_a_lossy_method_or_a_named_placement(
    llm_one: LLM, method: str
) -> None:
    """A lossy method, or a placement the user named (`--kv gpu` is the store's resident path,
    the reference the GPU smoke compares placements against), runs over the tiered store."""
    out = llm_one.generate(prompts()[1], SamplingParams(max_tokens=4), method=method)[0]
    assert out.stats.plan["policy"] != "batched"


def test_one_prompt_that_the_paged_kernels_cannot_mask_runs_tiered(tmp_path: Path) -> None:
    """A sliding-window model's prompt longer than its window: the paged kernels do not mask
    windows, so the batch engine hands it back and the tiered store runs it."""
    make_hf_model("mistral-window", tmp_path)  # window of 8 tokens
    one = LLM(str(tmp_path), device="cpu", dtype="fp32", single_batched=True)
    ids = prompts()[1]
    out = one.generate(ids, SamplingParams(max_tokens=4))[0]
    assert out.stats.plan["policy"] != "batched"


def test_a_pool_of_the_prompts_size_that_does_not_fit(llm_one: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the memory budget cannot hold the pool a call needs, one prompt goes to the tiered
    store (which plans it, offloading if it must) and a list runs over a pool sized from the
    budget, as a server's would."""
    from kvtier.engine import batched
    from kvtier.errors import CapacityError

    real = batched.BatchEngine

    def tight(host: object, config: object) -> object:
        if getattr(config, "num_pages", None) is not None:
            raise CapacityError("the budget holds no such pool")
        return real(host, config)  # type: ignore[arg-type]

    monkeypatch.setattr(batched, "BatchEngine", tight)
    params = SamplingParams(max_tokens=3)
    assert llm_one.generate(prompts()[0], params)[0].stats.plan["policy"] != "batched"
    outs = llm_one.generate(prompts()[:2], params)
    assert all(o.stats.plan["policy"] == "batched" for o in outs)
