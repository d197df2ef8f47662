"""kvtier.eval's runner and results on the CPU: `run_eval` wired to a fake LLM that answers from
the prompt (methods, partial results, resuming, reloads), and the aggregates of its records.

Only tokenization here (the embedded SmolLM2's tokenizer); no model forward pass.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from kvtier.errors import ConfigError
from kvtier.eval.results import EvalResult, Record, aggregate
from kvtier.eval.runner import EvalConfig, run_eval
from kvtier.eval.specs import parse_methods
from kvtier.eval.tasks import TaskSpec


@pytest.fixture(scope="module")
def tok(embedded_hf_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_hf_dir))


# -- runner (a fake LLM that answers from the prompt) ---------------------------------------------


class FakeLLM:
    """Answers every passkey prompt correctly, except for requests under kv="layer"."""

    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, model: str | None = None, *, device: str = "auto", **kw: Any) -> None:
        self.tokenizer, self.max_model_len = FakeLLM.tokenizer_, 8192
        self.methods: list[str] = []
        FakeLLM.made.append(kw)

    tokenizer_: Any = None

    def max_model_len_for(self, method: Any) -> int:
        return self.max_model_len

    def generate(
        self, prompts: list[list[int]], params: Any, chat: bool = False, method: Any = None
    ) -> list[Any]:
        self.methods.append(method.kv)
        key = re.findall(r"pass key is (\d+)", self.tokenizer.decode(prompts[0]))[0]
        text = " 1." if method.kv == "layer" else f" {key}."
        stats = SimpleNamespace(prefill_s=0.5, decode_s=0.1)
        return [SimpleNamespace(text=text, stats=stats)]


def test_run_eval_scores_each_method_on_the_same_prompts(tok: Any, tmp_path: Path) -> None:
    FakeLLM.tokenizer_, FakeLLM.made = tok, []
    spec = TaskSpec("passkey", (1024, 2048), samples=2)
    cfg = EvalConfig(spec, parse_methods(["auto", "layer"]))
    result = run_eval(cfg, command="kvtier eval passkey", progress=False, llm_factory=FakeLLM)
    assert len(FakeLLM.made) == 1  # one load; each method is chosen per request
    assert len(result.records) == 8
    by = {(c["method"], c["length"]): c["score"] for c in result.aggregates()["by_length"]}
    assert by == {("auto", 1024): 1.0, ("auto", 2048): 1.0, ("layer", 1024): 0.0, ("layer", 2048): 0.0}
    auto = [r for r in result.records if r.method == "auto"]
    layer = [r for r in result.records if r.method == "layer"]
    assert [r.expected for r in auto] == [r.expected for r in layer]
    meta = result.summary()
    assert meta["seed"] == 0 and meta["command"] == "kvtier eval passkey" and "records" not in meta
    assert {"platform", "cpu", "torch", "device"} <= set(meta["machine"])
    assert "records" in result.to_json() and "layer" in result.table()
    result.save(tmp_path / "r.json")
    assert EvalResult.load(tmp_path / "r.json").to_json() == result.to_json()


def test_run_eval_hands_over_each_partial_result(tok: Any, tmp_path: Path) -> None:
    FakeLLM.tokenizer_ = tok
    cfg = EvalConfig(TaskSpec("passkey", (1024,), samples=3), parse_methods(["auto"]))
    out = tmp_path / "r.json"
    seen: list[tuple[int, bool]] = []

    def save(partial: EvalResult) -> None:
        partial.save(out)
        seen.append((len(EvalResult.load(out).records), partial.meta["complete"]))

    result = run_eval(cfg, progress=False, llm_factory=FakeLLM, after_each=save)
    assert seen == [(1, False), (2, False)]  # the finished run is the caller's to save
    assert result.meta["complete"] is True and len(result.records) == 3
    assert not (tmp_path / "r.json.part").exists()


def test_run_eval_keeps_the_records_it_resumes_and_runs_the_rest(tok: Any) -> None:
    """Records of an earlier run of the grid (`--resume`) are kept for the samples they match
    (method, cell, index, prompt length, expected answer); only the others are generated."""
    FakeLLM.tokenizer_ = tok
    cfg = EvalConfig(TaskSpec("passkey", (1024,), samples=3), parse_methods(["auto"]))
    first = run_eval(cfg, progress=False, llm_factory=FakeLLM)
    kept = [replace(r, answer="kept") for r in first.records[:2]]
    stale = replace(first.records[2], expected=("0",))  # another prompt: run again
    calls: list[int] = []

    class Counting(FakeLLM):
        def generate(self, *a: Any, **k: Any) -> list[Any]:
            calls.append(1)
            return super().generate(*a, **k)

    again = run_eval(cfg, progress=False, llm_factory=Counting, done=[*kept, stale])
    assert [r.answer for r in again.records[:2]] == ["kept", "kept"] and len(calls) == 1
    assert again.records[2] == first.records[2] and again.meta["resumed"] == 2


def test_run_eval_loads_again_only_for_engine_options(tok: Any) -> None:
    FakeLLM.tokenizer_, FakeLLM.made = tok, []
    cfg = EvalConfig(
        TaskSpec("passkey", (1024,)), parse_methods(["auto", "head,head_group=1", "auto,chunk_size=256"])
    )
    run_eval(cfg, progress=False, llm_factory=FakeLLM)
    assert [m.get("chunk_size") for m in FakeLLM.made] == [None, 256]


def test_eval_gpu_memory_is_every_methods_budget_unless_one_names_its_own() -> None:
    methods = parse_methods(["auto", "head,gpu_memory=8GiB"])
    cfg = EvalConfig(TaskSpec("passkey", (1024,)), methods, gpu_memory="24GiB")
    assert [cfg.llm_kwargs(m)["gpu_memory"] for m in methods] == ["24GiB", "8GiB"]
    assert "gpu_memory" not in EvalConfig(TaskSpec("passkey", (1024,)), methods).llm_kwargs(methods[0])


def test_run_eval_refuses_lengths_past_the_model(tok: Any) -> None:
    FakeLLM.tokenizer_ = tok
    cfg = EvalConfig(TaskSpec("niah", (16384,)), parse_methods(None))
    with pytest.raises(ConfigError, match="--max-model-len"):
        run_eval(cfg, progress=False, llm_factory=FakeLLM)


def test_aggregate_groups_in_order() -> None:
    cells = [(0.0, 0, 1.0), (0.0, 1, 0.0), (50.0, 0, 1.0)]
    recs = [Record("m", "niah", 1024, d, i, 1000, (d,), ("1",), "", s) for d, i, s in cells]
    assert aggregate(recs, ("depth",)) == [
        {"depth": 0.0, "n": 2, "score": 0.5},
        {"depth": 50.0, "n": 1, "score": 1.0},
    ]
    assert "niah" in EvalResult({"task": "niah"}, recs).table()


def test_subtask_mean_weighs_each_subtask_equally(tmp_path: Path) -> None:
    """RULER's mean is over subtasks, not samples: 3 samples of one and 1 of another count alike."""
    scores = [("a", 1.0), ("a", 1.0), ("a", 1.0), ("b", 0.0)]
    recs = [Record("m", t, 4096, None, i, 4000, (), ("x",), "", s) for i, (t, s) in enumerate(scores)]
    result = EvalResult({"task": "ruler"}, recs)
    mean = {"method": "m", "length": 4096, "subtasks": 2, "score": 0.5}
    assert result.aggregates()["subtask_mean"] == [mean]
    assert "mean of 2 subtasks at 4K: 50.0%" in result.table()
    result.save(tmp_path / "r.json")
    assert EvalResult.load(tmp_path / "r.json").to_json() == result.to_json()
    one = EvalResult({"task": "passkey"}, [r for r in recs if r.task == "a"])
    assert "subtask_mean" not in one.aggregates()


def test_a_sample_whose_method_ran_lossless_is_marked(tok: Any) -> None:
    """`LLM.exact_note`: a sample whose method dropped nothing at its length ran lossless; its
    record, the aggregates and the table say so."""

    class Exact(FakeLLM):
        def generate(
            self, prompts: list[list[int]], params: Any, chat: bool = False, method: Any = None
        ) -> Any:
            out = super().generate(prompts, params, chat, method)
            out[0].stats.plan = {"ran_lossless": "attention=hip drops nothing"} if method.kv == "head" else {}
            return out

    FakeLLM.tokenizer_ = tok
    cfg = EvalConfig(TaskSpec("passkey", (1024,), samples=2), parse_methods(["auto", "head"]))
    result = run_eval(cfg, progress=False, llm_factory=Exact)
    assert [r.ran_lossless for r in result.records] == [False, False, True, True]
    overall = {c["method"]: c for c in result.aggregates()["overall"]}
    assert "ran_lossless" not in overall["auto"] and overall["head"]["ran_lossless"] == 2
    assert "2 sample(s) ran lossless" in result.table()
    assert Record.from_dict(result.records[2].to_dict()).ran_lossless is True
