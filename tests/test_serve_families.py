"""`kvtier serve` for the families the page pool cannot attend: Gemma-2 (soft-capped scores,
sliding-window layers) and DeepSeek-V2 (latent attention, MoE). Every request then runs over a
store of its own, batched in the same forward (`BatchEngine.paged` is False); over HTTP with
the `openai` client each completion must equal `LLM.generate` of that prompt alone.

Tiny random models (tests/hf_reference.py) without a tokenizer: prompts are token ids, which
the completions API takes as lists of integers.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.serve.app import AppSettings, build_app
from kvtier.serve.engine import ServeConfig, ServeEngine
from kvtier.serve.server import ServerThread
from tests.hf_reference import make_hf_model


@pytest.fixture(scope="module", params=["gemma2", "deepseek-v2-lite"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LLM, str]]:
    folder: Path = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param, folder)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(str(folder), device="cpu", dtype="fp32", block_size=4)
    engine = ServeEngine(llm, ServeConfig(page_size=16, num_pages=64, max_num_seqs=8, threads=1))
    server = ServerThread(build_app(engine, AppSettings(model_name=request.param)))
    server.start()
    try:
        assert not engine.paged  # every request over a store of its own
        yield llm, server.url
    finally:
        server.stop()
        torch.set_num_threads(threads)


def test_the_server_answers_concurrent_requests_with_each_prompts_tokens(served: tuple[LLM, str]) -> None:
    """Over HTTP: four concurrent completions, each 200 with six tokens (the models have no
    tokenizer, so the text is empty and the tokens are compared through the engine below)."""
    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = _prompts()
    model = client.models.list().data[0].id

    def ask(prompt: list[int]) -> openai.types.Completion:
        return client.completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )

    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(ask, prompts))
    for reply, prompt in zip(replies, prompts, strict=True):
        assert reply.usage is not None
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), 6)
        assert reply.choices[0].finish_reason == "length"


def test_the_engine_batches_them_over_stores_of_their_own_with_the_tokens_alone(
    served: tuple[LLM, str],
) -> None:
    llm, _ = served
    prompts = _prompts()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    engine = ServeEngine(llm, ServeConfig(page_size=16, num_pages=64, max_num_seqs=8, threads=1))
    got: list[list[int]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        engine.submit(p, params, lambda d, i=i: got[i].extend(d.token_ids))
    engine.run_until_idle()
    assert got == alone and engine.own_store_requests == len(prompts)


def _prompts() -> list[list[int]]:
    """Prompts past Gemma-2's 8-token window, of different lengths, so a batch step mixes prefill
    chunks and decode tokens of requests at different positions."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 211, (n,), generator=gen).tolist() for n in (5, 13, 21, 30)]
