"""The method registry: a method defined outside kvtier is one `register` call away from the CLI
(`generate --help`, `plan`), eval's `--method`, `LLM.generate(method=...)` and a run.

The toys live here, not in kvtier: an evictor that keeps every other token of the budget's
span plus the newest ones, and a lossless packing codec (raw float32 rows, from the codec test).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.cli.main import main
from kvtier.errors import ConfigError
from kvtier.eval.specs import parse_method
from kvtier.kv.layout import KVLayout
from kvtier.methods import (
    REGISTRY,
    BuildContext,
    MethodChoice,
    MethodEntry,
    choices,
    register,
    spec_names,
    unregister,
)
from kvtier.policies import PolicyParts
from tests.hf_reference import make_hf_model
from tests.test_quantized_kv import RawBytes

PROMPT = list(range(3, 60))


class KeepRecent:
    """A toy evictor: each KV head keeps its newest `budget` tokens (every slice)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def bind(self, layout: KVLayout, capacity: int) -> frozenset[int]:
        if self.budget >= capacity:
            raise ConfigError(f"toy budget {self.budget} is not below the capacity {capacity}")
        self.group = layout.group_size
        return frozenset(range(layout.num_slices))

    def keep(self, slice_id: int, length: int, new_tokens: int) -> torch.Tensor | None:
        if length <= self.budget:
            return None
        return torch.arange(length - self.budget, length).expand(self.group, -1)


def _toy_evict(ctx: BuildContext) -> PolicyParts:
    budget = int(ctx.options["kv_budget"])
    return PolicyParts(evictor=KeepRecent(budget), describe=f"toy-recent budget {budget}")


def _toy_codec(_: BuildContext) -> PolicyParts:
    return PolicyParts(codec=RawBytes(), describe="toy-raw")


@pytest.fixture
def toys() -> Iterator[None]:
    register(
        MethodEntry(
            "toy-recent",
            "evict",
            "keeps the newest tokens (a test's toy)",
            _toy_evict,
            takes=("kv_budget",),
            requires=("kv_budget",),
        )
    )
    register(
        MethodEntry("toy-raw", "kv_quant", "raw float32 rows (a test's toy)", _toy_codec, codec=RawBytes)
    )
    try:
        yield
    finally:
        unregister("toy-recent")
        unregister("toy-raw")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama-gqa", folder)
    return folder


def test_toys_reach_the_cli_help_and_plan(toys: None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    assert "toy-recent" in help_text and "toy-raw" in help_text
    plan = ["plan", "--model", "llama-3-8b", "--context", "128K", "--gpu-memory", "24GiB"]
    rc = main([*plan, "--kv-quant", "toy-raw", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    lossy = json.loads(out)["lossy"]
    # Raw float32 rows are twice bf16's bytes: the packed plan keeps fewer slices resident.
    assert lossy["method"] == "--kv-quant toy-raw" and lossy["host_kv_gb"] > 0


def test_toys_reach_eval_specs(toys: None) -> None:
    assert {"toy-recent", "toy-raw"} <= set(spec_names())
    m = parse_method("toy-recent,kv_budget=32")
    assert dict(m.kwargs) == {"evict": "toy-recent", "kv_budget": 32} and not m.lossless
    with pytest.raises(ConfigError, match="toy-recent needs kv_budget"):
        parse_method("toy-recent")
    assert dict(parse_method("toy-raw,kv=head").kwargs) == {"kv_quant": "toy-raw", "kv": "head"}


def test_toys_run_per_request_on_one_loaded_model(toys: None, tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", chunk_size=16)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = llm.generate(PROMPT, params)[0]
    # The lossless toy codec gives the lossless tokens, packed on the GPU tier and streamed.
    for spec in ("toy-raw", "toy-raw,kv=head,head_group=1"):
        out = llm.generate(PROMPT, params, method=spec)[0]
        assert out.token_ids == ref.token_ids and out.stats.plan["method"] == "toy-raw"
    # The toy evictor runs and is what the run reports; with a budget below the context it
    # equals the registry's own sliding window of the same budget.
    evicted = llm.generate(PROMPT, params, method=MethodChoice(evict="toy-recent", kv_budget=24))[0]
    window = llm.generate(PROMPT, params, method="window,kv_budget=24")[0]
    assert evicted.stats.plan["method"] == "toy-recent budget 24"
    assert evicted.token_ids == window.token_ids
    assert llm.method == MethodChoice()  # per-request choices leave the LLM's default alone


def test_names_are_defined_once() -> None:
    with pytest.raises(ConfigError, match="already registered"):
        register(MethodEntry("hip", "attention", "a second hip", _toy_codec))
    with pytest.raises(ConfigError, match="already registered"):
        register(MethodEntry("dense", "attention", "shadows --attention dense", _toy_codec))
    assert "hip" in REGISTRY and choices("attention")[0] == "dense"


def test_toys_run_from_the_command_line(
    toys: None, embedded_hf_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ["--model", str(embedded_hf_dir), "--device", "cpu"]
    gen = ["generate", *model, "--prompt", "The capital of France is", "--max-new-tokens", "2"]
    rc = main([*gen, "--evict", "toy-recent", "--kv-budget", "4", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["stats"]["plan"]["method"] == "toy-recent budget 4"
    ev = ["eval", "passkey", *model, "--lengths", "1k", "--samples", "1", "--method", "toy-raw"]
    rc = main([*ev, "--json", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["methods"][0]["label"] == "toy-raw"


def test_an_evictor_is_planned_for_the_tokens_it_keeps_not_the_context() -> None:
    """At 256K under 24 GiB (Llama-3-8B shapes) SnapKV with a 2K budget keeps ~1.0 GB on the GPU
    and nothing on the host (the lossless plan streams 27 GB), with the lossless plan's chunk;
    at 4M, where the host cannot hold the context, it still plans. SnapKV keeps what decode
    appends: its plan counts the request's new tokens, and without them the whole context."""
    from dataclasses import replace

    from kvtier.errors import CapacityError
    from kvtier.loading.presets import preset_config
    from kvtier.methods import parse_choice, plan_for
    from kvtier.planner.hardware import hardware_preset
    from kvtier.planner.inputs import PlanInputs

    cfg = preset_config("llama-3-8b")
    inputs = PlanInputs(
        cfg,
        262_144,
        hardware=hardware_preset("h200"),
        dtype_bytes=2,
        gpu_budget=24 << 30,
        host_budget=100 << 30,
    )
    lossless = plan_for(inputs).plan
    plan = plan_for(replace(inputs, new_tokens=256), parse_choice("snapkv,kv_budget=2048")).plan
    assert lossless.streamed_slices > 0 and lossless.host_kv_bytes > 20e9
    assert plan.streamed_slices == 0 and plan.host_kv_bytes == 0
    # What a slice is allocated: what it keeps plus a chunk.
    assert plan.chunk_size == lossless.chunk_size and plan.context == 2048 + plan.chunk_size + 256
    assert plan.compact_tokens == plan.context
    with pytest.raises(CapacityError):  # new tokens unknown: up to the whole context on the GPU
        plan_for(inputs, parse_choice("snapkv,kv_budget=2048"))
    h2o = plan_for(inputs, parse_choice("h2o,kv_budget=2048")).plan
    assert h2o.context == 2048 + h2o.chunk_size
    assert plan.gpu_kv_bytes == plan.context * cfg.kv_bytes_per_token(2)
    huge = replace(inputs, context=4 << 20)
    with pytest.raises(CapacityError):
        plan_for(huge)
    far = plan_for(huge, parse_choice("window,kv_budget=2048")).plan
    assert far.streamed_slices == 0 and far.context == 2048 + far.chunk_size
