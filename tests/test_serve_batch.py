"""A batch step over paged KV equals running each sequence alone through `TieredKVStore`."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.batch.sequence import Sequence
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.kv.paged import PagedKVStore, SeqStep
from kvtier.serve.engine import ServeConfig, ServeEngine
from tests.serve_helpers import CPU, alone, collect, gqa_llm, prompts, tokens_of


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return gqa_llm(tmp_path_factory)


def test_one_batch_step_mixes_prefill_and_decode_exactly(llm: LLM) -> None:
    """Sequence A decodes while B prefills, in one flat stream; logits match running alone."""
    a, b = prompts()[1], prompts()[2]
    ref_a, tok_a = alone(llm, a, 2)
    ref_b, _ = alone(llm, b, 1)
    store = PagedKVStore(llm.model_config, num_pages=16, page_size=4, device=CPU, dtype=torch.float32)
    table_a, table_b = (7, 2, 9, 0, 1, 3, 4), (5, 6, 8)  # pages need not be contiguous or ordered
    store.begin_step([SeqStep(table_a, 0, len(a))])
    first = llm.loaded.model(torch.tensor(a), store)[-1]
    store.end_step()
    assert torch.allclose(first, ref_a[0], atol=1e-5)
    store.begin_step([SeqStep(table_a, len(a), 1), SeqStep(table_b, 0, len(b))])
    ids = torch.tensor([tok_a[0], *b])
    logits = llm.loaded.model(ids, store, logits_at=torch.tensor([0, len(b)]))
    store.end_step()
    assert torch.allclose(logits[0], ref_a[1], atol=1e-5)
    assert torch.allclose(logits[1], ref_b[0], atol=1e-5)
    assert int(logits[0].argmax()) == tok_a[1]


def test_batch_prefill_keeps_off_cudnn(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prefill call of a batch step asks `attend` for no cuDNN (whose per-shape graph
    builds and kernel loads stalled the batch on the H200), alone or beside other sequences."""
    import kvtier.kv.paged as paged

    asked: list[bool] = []

    def spy(q: torch.Tensor, kv: torch.Tensor, *args: object, cudnn: bool = True) -> torch.Tensor:
        asked.append(cudnn)
        return paged_attend(q, kv, cudnn=cudnn)

    paged_attend = paged.attend
    monkeypatch.setattr(paged, "attend", spy)
    a, b = prompts()[1], prompts()[2]
    store = PagedKVStore(llm.model_config, num_pages=16, page_size=4, device=CPU, dtype=torch.float32)
    store.begin_step([SeqStep((7, 2, 9, 0, 1, 3, 4), 0, len(a))])
    llm.loaded.model(torch.tensor(a), store)
    store.end_step()
    store.begin_step([SeqStep((5, 6, 8), 0, len(b)), SeqStep((10, 11, 12), 0, 3)])
    llm.loaded.model(torch.tensor([*b, *a[:3]]), store)
    store.end_step()
    layers = llm.model_config.num_layers
    assert asked == [False] * (3 * layers)


@pytest.mark.parametrize("budget,num_pages", [(64, 64), (7, 64), (16, 12)])
def test_engine_batches_greedy_equal_alone(llm: LLM, budget: int, num_pages: int) -> None:
    """Continuous batching with chunked prefill (budget 7) and preemption (12 pages) is exact."""
    params = SamplingParams(max_tokens=6)
    expected = [alone(llm, ids, 6)[1] for ids in prompts()]
    cfg = ServeConfig(page_size=4, num_pages=num_pages, num_host_pages=8, max_num_batched_tokens=budget)
    engine = ServeEngine(llm, cfg)
    queues = [collect(engine, ids, params) for ids in prompts()]
    engine.run_until_idle()
    got = [tokens_of(q) for q in queues]
    assert got == [(e, "length") for e in expected]
    assert engine.kv.pool.num_free == num_pages
    if num_pages == 12:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("budget,num_pages", [(64, 64), (16, 12)])
def test_static_decode_steps_equal_alone(llm: LLM, budget: int, num_pages: int) -> None:
    """Decode-only steps from the static buffers (the path CUDA graphs replay), padded to a
    bucket with scratch-page rows, give the tokens of each sequence alone, also as sequences
    finish and the batch shrinks and after preemptions."""
    params = [SamplingParams(max_tokens=m) for m in (6, 3, 5, 6)]
    expected = [alone(llm, ids, p.max_tokens)[1] for ids, p in zip(prompts(), params, strict=True)]
    cfg = ServeConfig(
        page_size=4, num_pages=num_pages, num_host_pages=8, max_num_batched_tokens=budget, static_decode=True
    )
    engine = ServeEngine(llm, cfg)
    assert engine.decoder is not None and not engine.decoder.graphs  # eager on the CPU
    queues = [collect(engine, ids, p) for ids, p in zip(prompts(), params, strict=True)]
    engine.run_until_idle()
    assert [tokens_of(q) for q in queues] == [(e, "length") for e in expected]
    assert engine.kv.pool.num_free == num_pages


def test_decode_buckets_and_padding(llm: LLM) -> None:
    """Three rows run as a bucket of 4; the padded row writes only the scratch page."""
    from kvtier.engine.batch.graphs import DecodeRunner, buckets

    assert buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert buckets(6) == (1, 2, 4, 6) and buckets(1) == (1,)
    store = PagedKVStore(
        llm.model_config, num_pages=40, page_size=4, device=CPU, dtype=torch.float32, max_batch=8
    )
    ps = prompts()[:3]
    tables = [tuple(range(10 * i, 10 * i + 10)) for i in range(3)]
    refs = [alone(llm, p, 2) for p in ps]
    for p, table in zip(ps, tables, strict=True):
        store.begin_step([SeqStep(table, 0, len(p))])
        llm.loaded.model(torch.tensor(p), store)
        store.end_step()
    before = [t.clone() for t in store.pages]
    runner = DecodeRunner(llm.loaded.model, store)
    steps = [SeqStep(t, len(p), 1) for t, p in zip(tables, ps, strict=True)]
    logits = runner.run([r[1][0] for r in refs], steps)
    assert runner.bucket(3) == 4 and logits.shape[0] == 3
    for i in range(3):
        assert torch.allclose(logits[i], refs[i][0][1], atol=1e-5)
    written = {s.block_table[s.start // 4] for s in steps} | {store.scratch}
    for old, new in zip(before, store.pages, strict=True):
        changed = {int(p) for p in (old != new).flatten(1).any(1).nonzero().flatten()}
        assert changed <= written
    # the padded row wrote to the scratch page and attended its first slot
    stride = store.slot_stride  # flat slots from one page to the next: layers x page size
    assert stride == llm.model_config.num_layers * 4
    assert int(store.dec_write[3]) // stride == store.scratch and int(store.dec_lens[3]) == 1
    assert [int(x) for x in store.dec_lens[:3]] == [s.start + 1 for s in steps]
    slots = [s.block_table[s.start // 4] * stride + s.start % 4 for s in steps]
    assert [int(x) for x in store.dec_write[:3]] == slots


def test_decodes_of_many_sequences_attend_in_one_batched_call(llm: LLM) -> None:
    """Three decode tokens (batched, padded keys masked) and a prefill chunk in one step."""
    ps = prompts()
    refs = [alone(llm, p, 2) for p in ps[:3]]
    ref_d, _ = alone(llm, ps[3], 1)
    store = PagedKVStore(llm.model_config, num_pages=40, page_size=4, device=CPU, dtype=torch.float32)
    tables = [tuple(range(10 * i, 10 * i + 10)) for i in range(4)]
    for p, table in zip(ps[:3], tables, strict=False):
        store.begin_step([SeqStep(table, 0, len(p))])
        llm.loaded.model(torch.tensor(p), store)
        store.end_step()
    steps = [SeqStep(tables[i], len(ps[i]), 1) for i in range(3)] + [SeqStep(tables[3], 0, len(ps[3]))]
    store.begin_step(steps)
    assert store._dec_rows.tolist() == [0, 1, 2] and store._dec_slots.shape == (3, 24)
    ids = torch.tensor([refs[0][1][0], refs[1][1][0], refs[2][1][0], *ps[3]])
    logits = llm.loaded.model(ids, store, logits_at=torch.tensor([0, 1, 2, ids.shape[0] - 1]))
    store.end_step()
    for i in range(3):
        assert torch.allclose(logits[i], refs[i][0][1], atol=1e-5)
        assert int(logits[i].argmax()) == refs[i][1][1]
    assert torch.allclose(logits[3], ref_d[0], atol=1e-5)


def test_scheduler_splits_prefill_by_the_token_budget(llm: LLM) -> None:
    """Budget 7: decodes go first, prefills take what is left, in chunks."""
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=32, max_num_batched_tokens=7))
    a, b = prompts()[0], prompts()[1]  # 5 and 23 tokens
    for ids in (a, b):
        engine.submit(ids, SamplingParams(max_tokens=3), lambda d: None)
    plan: list[list[tuple[str, int]]] = []
    schedule = engine.scheduler.schedule

    def recording() -> list[tuple[Sequence, int]]:
        out = schedule()
        plan.append([(seq.request_id, n) for seq, n in out])
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    engine.run_until_idle()
    assert plan == [
        [("req-0", 5), ("req-1", 2)],  # A's whole prompt, B's first chunk
        [("req-0", 1), ("req-1", 6)],  # A decodes first, B gets the rest of the budget
        [("req-0", 1), ("req-1", 6)],
        [("req-1", 7)],  # A finished (3 tokens): B takes the whole budget
        [("req-1", 2)],
        [("req-1", 1)],
        [("req-1", 1)],
    ]


def test_preemption_restores_full_pages_from_the_cache_tiers_instead_of_recomputing(llm: LLM) -> None:
    """A preempted sequence's full pages stay cached (device LRU, then the host tier when the
    pool needs them), so its re-admission copies them back: only each preemption's partial last
    page is computed again. Tokens still equal running alone."""
    params = SamplingParams(max_tokens=6)
    expected = [alone(llm, ids, 6)[1] for ids in prompts()]
    engine = ServeEngine(
        llm, ServeConfig(page_size=4, num_pages=12, num_host_pages=16, max_num_batched_tokens=16)
    )
    queues = [collect(engine, ids, params) for ids in prompts()]
    run = 0
    step = engine.step

    def counting() -> int:
        nonlocal run
        n = step()
        run += n
        return n

    engine.step = counting  # type: ignore[method-assign]
    engine.run_until_idle()
    assert [tokens_of(q) for q in queues] == [(e, "length") for e in expected]
    preemptions = engine.scheduler.num_preemptions
    needed = sum(len(p) for p in prompts()) + len(prompts()) * (params.max_tokens - 1)
    assert preemptions > 0 and engine.kv.host.loaded > 0  # pages came back from the host tier
    assert run - needed < preemptions * 4  # at most a partial page per preemption recomputed


def test_metrics_histograms_count_every_request_and_token(llm: LLM) -> None:
    """/metrics' latency histograms (vLLM's names): one time-to-first-token and one end-to-end
    observation per request, one time-per-output-token per later token, batched or tiered;
    buckets cumulative up to +Inf = _count."""
    from kvtier.methods import parse_choice
    from kvtier.serve.metrics import render

    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64, num_host_pages=0))
    new = 4
    for ids in prompts()[:3]:
        collect(engine, ids, SamplingParams(max_tokens=new))
    collect(engine, prompts()[3], SamplingParams(max_tokens=new))
    engine.submit(prompts()[3], SamplingParams(max_tokens=new), lambda d: None, method=parse_choice("head"))
    engine.run_until_idle()
    assert engine.offloaded == 1  # the last one ran tiered
    lines = render(engine, "m").splitlines()

    def sample(name: str, extra: str = "") -> float:
        labels = ",".join(x for x in ('model_name="m"', extra) if x)
        prefix = f"kvtier:{name}{{{labels}}} "
        return float(next(line for line in lines if line.startswith(prefix)).split()[-1])

    n = 5
    for name, count in (
        ("time_to_first_token_seconds", n),
        ("time_per_output_token_seconds", n * (new - 1)),
        ("e2e_request_latency_seconds", n),
    ):
        assert f"# TYPE kvtier:{name} histogram" in lines
        assert sample(f"{name}_count") == count and sample(f"{name}_sum") > 0
        buckets = [line for line in lines if line.startswith(f"kvtier:{name}_bucket{{")]
        cumulative = [float(b.split()[-1]) for b in buckets]
        assert cumulative == sorted(cumulative) and cumulative[-1] == count
        assert buckets[-1].startswith(f'kvtier:{name}_bucket{{model_name="m",le="+Inf"}}')


@pytest.mark.parametrize("ahead,num_pages", [(2, 64), (3, 64), (2, 12)])
def test_decode_steps_ahead_equal_single_steps(llm: LLM, ahead: int, num_pages: int) -> None:
    """`decode_steps` > 1 (forwards queued on the device's own sampled tokens) gives each
    sequence the tokens of single steps: greedy ones equal alone, seeded sampled ones equal
    `decode_steps` 1, a sequence that stops on an end token mid-run drops what followed it;
    also under preemptions (12 pages)."""
    greedy = [SamplingParams(max_tokens=m) for m in (9, 3, 7, 8)]
    expected = [alone(llm, ids, p.max_tokens)[1] for ids, p in zip(prompts(), greedy, strict=True)]
    sampled = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=i) for i in range(4)]
    eos = expected[0][4]  # the fifth token of the first prompt ends it (and others where it comes)

    def serve(decode_steps: int, params: list[SamplingParams], stop: int | None = None) -> list[tuple]:
        cfg = ServeConfig(
            page_size=4, num_pages=num_pages, num_host_pages=8, max_num_batched_tokens=64,
            static_decode=True, decode_steps=decode_steps,
        )  # fmt: skip
        engine = ServeEngine(llm, cfg)
        if stop is not None:
            engine.eos = frozenset({stop})
        queues = [collect(engine, ids, p) for ids, p in zip(prompts(), params, strict=True)]
        engine.run_until_idle()
        assert engine.kv.pool.num_free == num_pages
        assert (engine.ahead_steps > 0) == (decode_steps > 1)
        return [tokens_of(q) for q in queues]

    assert serve(ahead, greedy) == [(e, "length") for e in expected]
    assert serve(ahead, sampled) == serve(1, sampled)
    stopped = serve(ahead, greedy, stop=eos)
    assert stopped == serve(1, greedy, stop=eos)
    assert stopped[0] == (expected[0][:5], "stop")
