"""A lossy request that drops nothing at its length runs lossless (`EngineConfig.exact_lossless`).

HiP keeps every key while the candidates between the sinks and a query's window fit each
stage's budget (`HipConfig.exact_tokens`): up to there it computes dense attention, so a short
request naming it may run on the lossless paths (on CUDA the batch engine and its graphs), and
says so. One token past, HiP prunes.
"""

from __future__ import annotations

from pathlib import Path
from queue import Queue

import pytest
import torch

from kvtier.attention.dense import attend
from kvtier.attention.interface import SliceStep
from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.methods import MethodChoice, method_spec, parse_choice
from kvtier.serve.engine import ServeConfig, ServeEngine
from kvtier.serve.metrics import render
from kvtier.sparse import HIP_PRESETS, HipConfig, HipKernel
from tests.hf_reference import make_hf_model

D = 16
# Small stages (as tests/test_hip.py's SPARSE): the final budget binds, 16 tokens in whole chunks.
SMALL = HipConfig(
    sink=4,
    window=16,
    block_q=8,
    chunk_sizes=(32, 8, 2),
    budgets=(96, 32, 16),
    wide_budget=24,
    extend=False,
)


def test_exact_tokens_of_the_presets() -> None:
    assert SMALL.exact_tokens == 4 + 16 + 16
    assert HIP_PRESETS["fast"].exact_tokens == HIP_PRESETS["lean"].exact_tokens == 256 + 1024 + 2048
    assert HIP_PRESETS["long"].exact_tokens == 256 + 2048 + 4096


@pytest.mark.parametrize("t", [1, 9])
def test_hip_is_dense_up_to_exact_tokens_and_prunes_past_them(t: int) -> None:
    """Queries ending at the last position of a context of `exact_tokens` attend every key (dense
    attention's output); one chunk of the final stage longer, some key is dropped."""
    n = SMALL.exact_tokens
    gen = torch.Generator().manual_seed(3)
    for s, dense in ((n, True), (n + 2, False)):
        q, kv = torch.randn(t, 4, D, generator=gen), torch.randn(s, 2, 2, D, generator=gen)
        out = HipKernel(SMALL)(q, kv, SliceStep(4, 0, s - t))  # layer 4: past the wide layers
        assert torch.allclose(out, attend(q, kv), rtol=0, atol=1e-6) is dense, (s, t)


def test_a_choice_is_exact_where_every_method_it_selects_drops_nothing() -> None:
    from kvtier.loading.presets import preset_config

    cfg = preset_config("smollm2-135m")  # 8K trained: `hip` resolves to `fast` up to there
    hip = parse_choice("hip")
    assert hip.exact_at(cfg, 3328) and not hip.exact_at(cfg, 3329)
    assert parse_choice("hip,hip_preset=long").exact_at(cfg, 6400)
    assert not parse_choice("hip,kv_quant=int4").exact_at(cfg, 100)  # the codec still rounds
    assert not parse_choice("int8").exact_at(cfg, 100)
    assert not MethodChoice().exact_at(cfg, 100)  # lossless already
    assert parse_choice("hip,kv=head,head_group=1").lossless_twin == MethodChoice(kv="head", head_group=1)
    assert method_spec(parse_choice("hip,hip_preset=lean,hip_host_keys=on")) == (
        "attention=hip,hip_preset=lean,hip_host_keys=on"
    )
    assert method_spec(MethodChoice()) == "auto"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama-gqa", path)  # 3 layers, 4 query heads, 2 KV heads, vocab 211
    return path


def test_generate_runs_a_short_hip_request_lossless_and_says_so(folder: Path) -> None:
    """With `exact_lossless` (the default on CUDA) a HiP request of at most 3,328 tokens (prompt
    plus output, `fast`) gives the lossless tokens and plan with a note; off (the CPU's default)
    HiP runs; past the length HiP runs either way."""
    ids = torch.randint(1, 211, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=6)
    lossless = LLM(str(folder), device="cpu", dtype="fp32").generate(ids, params)[0]
    on = LLM(str(folder), device="cpu", dtype="fp32", attention="hip", exact_lossless=True)
    out = on.generate(ids, params)[0]
    assert out.token_ids == lossless.token_ids
    assert out.stats.plan["method"] == "lossless"
    assert out.stats.plan["ran_lossless"] == "attention=hip drops nothing at 46 tokens (prompt plus output)"
    off = LLM(str(folder), device="cpu", dtype="fp32", attention="hip").generate(ids, params)[0]
    assert off.stats.plan["method"] == "hip fast (auto)" and "ran_lossless" not in off.stats.plan
    # a prompt and output past 3,328 tokens: HiP runs, also with the option on
    long_ids = torch.randint(1, 211, (3320,), generator=torch.Generator().manual_seed(5)).tolist()
    past = on.generate(long_ids, SamplingParams(max_tokens=9))[0]
    # (past the tiny model's trained length `auto` runs `lean`, whose limit is the same)
    assert past.stats.plan["method"] == "hip lean (auto)" and "ran_lossless" not in past.stats.plan


def test_the_server_batches_a_short_hip_request_and_counts_it(folder: Path) -> None:
    """A request naming HiP that drops nothing joins the paged batch instead of a store of its
    own, with the lossless tokens; /metrics counts it. A placement it names is kept."""
    llm = LLM(str(folder), device="cpu", dtype="fp32", exact_lossless=True)
    ids = torch.randint(1, 211, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    params = SamplingParams(max_tokens=5)
    expected = llm.generate(ids, params)[0].token_ids
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=256))
    got: Queue[Delta] = Queue()
    engine.submit(ids, params, got.put, method=parse_choice("hip"))
    seen_tiered = engine.num_tiered
    engine.run_until_idle()
    out: list[int] = []
    while not got.empty():
        out += got.get().token_ids
    assert out == list(expected)
    assert seen_tiered == (0, 0) and engine.offloaded == 0 and engine.own_store_requests == 0
    engine.submit(ids, params, Queue().put, method=parse_choice("hip,kv=head"))
    engine.run_until_idle()
    assert engine.offloaded == 1  # a lossless run over its own head-wise store
    assert 'kvtier:requests_ran_lossless_total{model_name="m"} 2' in render(engine, "m").splitlines()


def test_the_cli_flag_and_its_stats_line(capsys: pytest.CaptureFixture[str]) -> None:
    """On the embedded model (a text prompt needs its tokenizer)."""
    from kvtier.cli.main import main

    base = ["generate", "--device", "cpu", "--prompt", "The capital of France is", "--max-new-tokens", "3"]
    assert main([*base, "--attention", "hip", "--exact-lossless", "on"]) == 0
    assert "ran lossless: attention=hip drops nothing at" in capsys.readouterr().err
    assert main([*base, "--attention", "hip", "--exact-lossless", "off", "--json"]) == 0
    assert "ran_lossless" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        main([*base, "--exact-lossless", "sometimes"])
    assert bad.value.code == 2 and "--exact-lossless" in capsys.readouterr().err


def test_evictors_and_quest_are_exact_within_their_budget(folder: Path) -> None:
    """An evictor evicts nothing, Quest reads every page and streaming heads keep every token
    while the context fits the budget: with the option on such a request runs lossless (with a
    budget past its capacity an evicting store refuses it), one token past it the method runs."""
    from kvtier.errors import ConfigError
    from kvtier.loading.presets import preset_config

    cfg = preset_config("smollm2-135m")
    for spec in (
        "h2o,kv_budget=64",
        "window,kv_budget=64",
        "snapkv,kv_budget=64",
        "quest,kv_budget=64",
        "duo,head_sparsity=0.5,kv_budget=64",  # streaming heads keep 64 tokens in all
    ):
        choice = parse_choice(spec)
        assert choice.exact_at(cfg, 64) and not choice.exact_at(cfg, 65), spec
    ids = torch.randint(1, 211, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    params = SamplingParams(max_tokens=6)
    lossless = LLM(str(folder), device="cpu", dtype="fp32").generate(ids, params)[0]
    on = LLM(str(folder), device="cpu", dtype="fp32", exact_lossless=True)
    for spec in ("h2o,kv_budget=64", "quest,kv_budget=64"):
        out = on.generate(ids, params, method=spec)[0]
        assert out.token_ids == lossless.token_ids and "ran_lossless" in out.stats.plan, spec
    assert (
        on.generate(ids, params, method="h2o,kv_budget=40")[0].stats.plan["method"] == "evict h2o budget 40"
    )
    off = LLM(str(folder), device="cpu", dtype="fp32").generate(ids, params, method="h2o,kv_budget=64")[0]
    assert off.stats.plan["method"] == "evict h2o budget 64" and off.token_ids == lossless.token_ids
    with pytest.raises(ConfigError, match="not below the context"):  # a budget past the capacity
        LLM(str(folder), device="cpu", dtype="fp32").generate(ids, params, method="h2o,kv_budget=4096")
    assert "ran_lossless" in on.generate(ids, params, method="h2o,kv_budget=4096")[0].stats.plan


def test_plan_says_where_hip_drops_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli.main import main

    base = ["plan", "--model", "llama-3-8b", "--gpu-memory", "24GiB", "--attention", "hip"]
    assert main([*base, "--context", "2K"]) == 0
    assert "it drops nothing up to 3,328 tokens: at this context it runs lossless" in capsys.readouterr().out
    assert main([*base, "--context", "4K"]) == 0
    out = capsys.readouterr().out
    assert "it drops nothing up to 3,328 tokens" in out and "runs lossless" not in out
