"""The server's engine with requests that do not fit its page pool or name their own method:
served over the tiered store beside the batch, token for token as `LLM.generate` gives them,
without holding the batch's steps."""

from __future__ import annotations

from queue import Queue

import pytest

from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import PromptError
from kvtier.serve.engine import ServeConfig, ServeEngine
from tests.serve_helpers import alone, collect, gqa_llm, prompts, tokens_of


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return gqa_llm(tmp_path_factory)


def test_request_longer_than_the_pool_is_served_with_offload(llm: LLM) -> None:
    """Prompt + max_tokens past the whole page pool: served offloaded (head streaming from the
    host tier), greedy tokens equal to the offline `LLM.generate`; past the model's length: refused."""
    ids = prompts()[3]  # 40 tokens; the pool holds 4 pages x 4 = 16
    params = SamplingParams(max_tokens=6)
    expected = llm.generate(ids, params)[0].token_ids
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=4, num_host_pages=0))
    assert engine.needs_offload(ids, params)
    from kvtier.serve.metrics import render

    during: list[dict[str, int]] = []
    long_q: Queue[Delta] = Queue()

    def long_sink(d: Delta) -> None:
        long_q.put(d)
        during.append(engine.tiered_bytes())

    engine.submit(ids, params, long_sink)
    short_q = collect(engine, prompts()[0], SamplingParams(max_tokens=3))
    engine.run_until_idle()
    # While it ran its store held host slices (and staging buffers); afterwards nothing.
    assert during[0]["host"] > 0 and during[0]["gpu"] > 0
    assert engine.tiered_bytes() == {"gpu": 0, "host": 0}
    assert 'kvtier:kv_tiered_bytes{model_name="m",tier="host"} 0' in render(engine, "m").splitlines()
    assert tokens_of(long_q) == (list(expected), "length")
    assert tokens_of(short_q) == (alone(llm, prompts()[0], 3)[1], "length")
    assert engine.offloaded == 1 and engine.kv.pool.num_free == 4
    moved = engine.transfer_bytes()
    assert moved[("h2d", "tiered")] > 0 and engine.num_tiered == (0, 0)  # its KV streamed from the host
    text = render(engine, "m")
    labels = 'model_name="m",direction="h2d",source="tiered"'
    assert f"kvtier:kv_transfer_bytes_total{{{labels}}} {moved[('h2d', 'tiered')]}" in text.splitlines()
    with pytest.raises(PromptError, match="limit"):
        engine.check(ids, SamplingParams(max_tokens=llm.max_model_len))


@pytest.mark.parametrize(
    ("spec", "in_batch"),
    [
        ("int8", True),
        ("window,kv_budget=16", True),
        ("snapkv,kv_budget=40,kv=head", True),  # an evictor keeps its budget on the GPU: never streams
        ("quest,kv_budget=8,quest_page=4", True),
        ("hip,hip_preset=fast", True),
        ("duo,head_sparsity=0.5,kv_budget=72", True),
        ("head", False),
    ],
)
def test_request_with_its_own_method_equals_generate_with_it(llm: LLM, spec: str, in_batch: bool) -> None:
    """A request naming a method runs over a store of its own with it: its tokens equal
    `LLM.generate(method=spec)`, while two lossless requests batch beside it unchanged. A store
    wholly in device memory joins the batch's forward; one that streams runs tiered."""
    from kvtier.methods import parse_choice

    ids, params = prompts()[3], SamplingParams(max_tokens=6)
    expected = llm.generate(ids, params, method=spec)[0].token_ids
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64))
    own: Queue[Delta] = Queue()
    engine.submit(ids, params, own.put, method=parse_choice(spec))
    others = [collect(engine, p, SamplingParams(max_tokens=4)) for p in prompts()[:2]]
    engine.run_until_idle()
    assert tokens_of(own) == (list(expected), "length")
    assert [tokens_of(q) for q in others] == [(alone(llm, p, 4)[1], "length") for p in prompts()[:2]]
    assert (engine.own_store_requests, engine.offloaded) == ((1, 0) if in_batch else (0, 1))
    assert not engine.has_work


def test_tiered_run_streams_and_interleaves_with_the_batch(llm: LLM) -> None:
    """The tiered run emits a delta per token (not one at the end), and batch steps run between
    its steps: the short request finishes before the long one."""
    from kvtier.methods import parse_choice

    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64))
    order: list[str] = []
    own: Queue[Delta] = Queue()

    def long_sink(d: Delta) -> None:
        own.put(d)
        order.append("long")

    engine.submit(prompts()[3], SamplingParams(max_tokens=8), long_sink, method=parse_choice("head"))
    engine.submit(prompts()[0], SamplingParams(max_tokens=3), lambda d: order.append("short"))
    engine.run_until_idle()
    deltas = [own.get() for _ in range(own.qsize())]
    assert len(deltas) == 8 and all(len(d.token_ids) == 1 for d in deltas)
    # One batch step, then one step of the tiered run, in turn.
    assert order[:6] == ["short", "long"] * 3 and order[6:] == ["long"] * 5


def test_a_tiered_step_still_on_the_device_does_not_hold_the_batch(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiered run's launched step that the device has not finished (`ready()` False, as on a
    GPU while its slices stream) is left in flight: batch steps go on meanwhile, its token is
    collected on a later loop iteration, and the tokens of both still equal running alone."""
    from kvtier.methods import parse_choice
    from kvtier.serve.tiered import TieredRun

    busy: dict[TieredRun, int] = {}
    launch = TieredRun.launch

    def slow_launch(run: TieredRun) -> None:
        launch(run)
        busy[run] = 3  # the device takes three polls to finish each step

    def ready(run: TieredRun) -> bool:
        if busy.get(run, 0) > 0:
            busy[run] -= 1
            return False
        return True

    monkeypatch.setattr(TieredRun, "launch", slow_launch)
    monkeypatch.setattr(TieredRun, "ready", ready)
    long_ids, params = prompts()[3], SamplingParams(max_tokens=4)
    expected = llm.generate(long_ids, params, method="head")[0].token_ids
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64))
    order: list[str] = []
    own: Queue[Delta] = Queue()

    def long_sink(d: Delta) -> None:
        own.put(d)
        order.append("long")

    engine.submit(long_ids, params, long_sink, method=parse_choice("head"))
    engine.submit(prompts()[0], SamplingParams(max_tokens=3), lambda d: order.append("short"))
    steps = 0
    step = engine.step

    def counting() -> int:
        nonlocal steps
        steps += 1
        return step()

    engine.step = counting  # type: ignore[method-assign]
    engine.run_until_idle()
    assert tokens_of(own) == (list(expected), "length")
    assert (
        order == ["short"] * 3 + ["long"] * 4
    )  # the batch finished while the run's first step was in flight
    assert steps == 3 and engine.offloaded == 1 and not engine.has_work


def test_a_method_whose_kv_fits_the_device_decodes_in_the_batch_s_steps(llm: LLM) -> None:
    """A request with its own method and every slice in device memory is no tiered run: its
    store is attended inside the batch's forward, so its decode tokens come in the same steps as
    the paged requests' (one forward, shared projections), and its tokens equal running alone."""
    from kvtier.methods import parse_choice

    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64))
    ids, params = prompts()[2], SamplingParams(max_tokens=5)
    expected = llm.generate(ids, params, method="int8")[0].token_ids
    per_step: list[list[str]] = []
    step = engine.step

    def recording() -> int:
        per_step.append([])
        return step()

    engine.step = recording  # type: ignore[method-assign]
    own: Queue[Delta] = Queue()

    def own_sink(d: Delta) -> None:
        own.put(d)
        per_step[-1].append("own")

    engine.submit(ids, params, own_sink, method=parse_choice("int8"))
    engine.submit(prompts()[1], params, lambda d: per_step[-1].append("paged"))
    engine.run_until_idle()
    assert tokens_of(own) == (list(expected), "length")
    assert engine.own_store_requests == 1 and engine.offloaded == 0
    assert engine.num_tiered == (0, 0) and engine.kv.pool.num_free == 64
    # The paged request started one step earlier (the own store is planned between steps); from
    # then on both emit in the same steps.
    assert per_step[0] == ["paged"] and all(s == ["paged", "own"] for s in per_step[1:5])
