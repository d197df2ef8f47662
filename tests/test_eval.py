"""kvtier.eval on the CPU: generators, needle placement, lengths, scoring, methods, runner wiring.

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
from kvtier.eval.grid import parse_depths, parse_lengths
from kvtier.eval.haystack import FILLER, Haystack, prose_text
from kvtier.eval.prompts import fit_size
from kvtier.eval.results import EvalResult, Record, aggregate
from kvtier.eval.ruler import RULER_SUBTASKS
from kvtier.eval.runner import EvalConfig, check_lengths, run_eval
from kvtier.eval.scoring import first_int, recall, score
from kvtier.eval.specs import parse_method, parse_methods
from kvtier.eval.tasks import PASSKEY_INTRO, PASSKEY_QUESTION, TaskSpec, generate_samples


@pytest.fixture(scope="module")
def tok(embedded_hf_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_hf_dir))


def _n(tok: Any, text: str) -> int:
    return len(tok(text, add_special_tokens=False, verbose=False)["input_ids"])


# -- generators ----------------------------------------------------------------------------------


def test_generators_are_deterministic_given_the_seed(tok: Any) -> None:
    spec = TaskSpec("ruler", (1024,), samples=2, seed=3)
    a, b = generate_samples(spec, tok), generate_samples(spec, tok)
    assert a == b
    other = generate_samples(TaskSpec("ruler", (1024,), samples=2, seed=4), tok)
    assert all(x.expected != y.expected for x, y in zip(a, other, strict=True))
    assert a[0].expected != a[1].expected  # samples differ from each other


def test_a_sample_does_not_change_when_the_grid_grows(tok: Any) -> None:
    small = generate_samples(TaskSpec("niah", (1024,), depths=(50.0,), seed=1), tok)
    big = generate_samples(TaskSpec("niah", (1024, 2048), depths=(0.0, 50.0), samples=3, seed=1), tok)
    assert small[0] in big


def test_a_later_sample_run_alone_is_the_grids(tok: Any) -> None:
    """--first-sample 1 --samples 2 makes samples 1-2 of a --samples 3 grid, the same prompts."""
    grid = generate_samples(TaskSpec("niah", (1024,), depths=(0.0, 50.0), samples=3, seed=2), tok)
    spec = TaskSpec("niah", (1024,), depths=(0.0, 50.0), samples=2, seed=2, first_sample=1)
    later = generate_samples(spec, tok)
    assert [s.index for s in later] == [1, 2, 1, 2]
    assert later == [s for s in grid if s.index > 0]


@pytest.mark.parametrize("task,haystack", [("passkey", "repeat"), ("passkey", "prose"), ("niah", "prose")])
def test_length_within_one_percent(tok: Any, task: str, haystack: str) -> None:
    spec = TaskSpec(task, (1024, 3000, 8192), depths=(0.0, 50.0, 100.0), haystack=haystack)
    for s in generate_samples(spec, tok):
        total = s.prompt_tokens + s.max_tokens
        assert 0.99 * s.length <= total <= s.length, (s.task, s.length, total)


def test_ruler_lengths_within_one_percent(tok: Any) -> None:
    samples = generate_samples(TaskSpec("ruler", (1024, 4096)), tok)
    assert [s.task for s in samples] == [t for t in RULER_SUBTASKS for _ in range(2)]
    for s in samples:
        assert 0.99 * s.length <= s.prompt_tokens + s.max_tokens <= s.length, (s.task, s.length)


@pytest.mark.parametrize("haystack", ["repeat", "prose"])
def test_passkey_needle_at_the_requested_depth(tok: Any, haystack: str) -> None:
    depths = (0.0, 10.0, 25.0, 50.0, 75.0, 90.0, 100.0)
    for s in generate_samples(TaskSpec("passkey", (2048,), depths=depths, haystack=haystack), tok):
        text = tok.decode(s.prompt_ids)
        key = s.expected[0]
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        assert text.count(needle) == 1
        # Locate it independently: filler tokens before the needle / all filler tokens.
        start = text.index(PASSKEY_INTRO) + len(PASSKEY_INTRO) + 1
        end = text.rindex(PASSKEY_QUESTION)
        at = text.index(needle)
        before = _n(tok, text[start:at])
        filler = _n(tok, text[start:end]) - _n(tok, needle)
        assert s.depth is not None
        assert abs(100 * before / filler - s.depth) <= 3.0, (haystack, s.depth, 100 * before / filler)
        assert abs(s.needle_depths[0] - s.depth) <= 3.0
        assert text.endswith("<|im_start|>assistant\nThe pass key is")


def test_niah_needle_sits_on_a_sentence_boundary(tok: Any) -> None:
    for s in generate_samples(TaskSpec("niah", (1024,), depths=(0.0, 30.0, 60.0, 100.0)), tok):
        text = tok.decode(s.prompt_ids)
        m = re.search(
            r"(.)(.)One of the special magic numbers for [a-z]+-[a-z]+ is: (\d{7})\.(\s)", text, re.S
        )
        assert m is not None and m.group(3) == s.expected[0]
        if s.depth == 0.0:
            assert m.group(2) == "\n"  # right after the task's intro line
        else:
            assert m.group(1) in '.!?"\n' and m.group(2) in " \n"


def test_passkey_random_depths_spread(tok: Any) -> None:
    samples = generate_samples(TaskSpec("passkey", (1024,), samples=8), tok)
    depths = [s.needle_depths[0] for s in samples]
    assert min(depths) < 30 and max(depths) > 70
    assert all(s.depth is None for s in samples)


def test_ruler_answers_are_in_the_prompt(tok: Any) -> None:
    for s in generate_samples(TaskSpec("ruler", (2048,)), tok):
        text = tok.decode(s.prompt_ids)
        assert all(e in text for e in s.expected), s.task
        if s.task == "niah_multikey":
            assert len(re.findall(r"special magic numbers for ", text)) == 4
            assert len(s.expected) == 1
        if s.task in ("niah_multivalue", "niah_multiquery"):
            assert len(s.expected) == 4
        if s.task == "vt":
            assert len(s.expected) == 5 and all(re.fullmatch(r"[A-Z]{5}", e) for e in s.expected)
        if s.task == "cwe":
            body = text.rsplit("\nQuestion: What are the 10", 1)[0].rsplit("\n", 1)[1]
            counts = {w: len(re.findall(rf"\d+\. {w}(?= |$)", body)) for w in s.expected}
            assert set(counts.values()) == {6}  # below 4K each common word appears 6 times


# -- haystack and fitting ------------------------------------------------------------------------


def test_haystack_insert_keeps_order_and_spans(tok: Any) -> None:
    hay = Haystack("repeat", tok, 200)
    assert hay.text.startswith(FILLER)
    piece = hay.slice(0, 60)
    text, spans = piece.insert([(100.0, "Z."), (0.0, "A."), (0.0, "B.")])
    assert text.startswith("A. B. The grass is green.")
    assert [text[a:b] for a, b in spans] == ["Z.", "A.", "B."]
    assert len(prose_text().split()) > 5000


def test_fit_size_finds_the_largest_fit() -> None:
    calls: list[int] = []

    def count(n: int) -> int:
        calls.append(n)
        return 10 + 3 * n

    assert fit_size(count, 100, 1000) == 30
    assert len(calls) <= 8
    assert fit_size(lambda n: 10 + n, 100, 50) == 50  # capped by hi
    with pytest.raises(ConfigError, match="fixed text"):
        fit_size(lambda n: 200 + n, 100, 50)


def test_too_short_length_is_a_config_error(tok: Any) -> None:
    with pytest.raises(ConfigError, match="too short"):
        generate_samples(TaskSpec("passkey", (40,)), tok)


# -- scoring -------------------------------------------------------------------------------------


def test_passkey_scoring() -> None:
    assert first_int("The pass key is 68423.", ["68423"]) == 1.0
    assert first_int(" 68423", ["68423"]) == 1.0
    assert first_int("68424", ["68423"]) == 0.0
    assert first_int("It is 123, no wait, 68423", ["68423"]) == 0.0
    assert first_int("I do not know.", ["68423"]) == 0.0
    assert first_int("068423", ["68423"]) == 1.0  # integer equality, as int(match) == key


def test_recall_scoring() -> None:
    values = ["1234567", "7654321", "1111111", "2222222"]
    assert recall("1234567, 7654321, 1111111 and 2222222", values) == 1.0
    assert recall("They are 1234567 and 2222222.", values) == 0.5
    assert recall("none", values) == 0.0
    assert recall("qilqx wbqvk", ["QILQX", "WBQVK", "GUKTV"]) == pytest.approx(2 / 3)
    assert score("recall", "x 1234567", ["1234567"]) == 1.0
    with pytest.raises(ConfigError, match="unknown scorer"):
        score("rouge", "a", ["a"])


# -- options -------------------------------------------------------------------------------------


def test_method_specs() -> None:
    assert dict(parse_method("gpu").kwargs) == {"kv": "gpu"}
    a, b = parse_method("kv=head,head_group=1"), parse_method("head, head_group=1")
    assert a == b and a.label == "head,head_group=1" and dict(a.kwargs) == {"kv": "head", "head_group": 1}
    assert parse_methods(None)[0].label == "auto"
    with pytest.raises(
        ConfigError, match="unknown method 'magic'; choose one of auto, gpu, layer, head, hip"
    ):
        parse_method("magic")
    with pytest.raises(ConfigError, match="unknown key 'bits'; valid keys: kv, head_group"):
        parse_method("head,bits=4")
    with pytest.raises(ConfigError, match="not a valid value"):
        parse_method("head,head_group=two")
    with pytest.raises(ConfigError, match="not key=value"):
        parse_method("head,group")
    with pytest.raises(ConfigError, match="more than once"):
        parse_methods(["gpu", "kv=gpu"])


def test_lossy_methods() -> None:
    m = parse_method("quest,kv_budget=1k")
    assert (m.label, dict(m.kwargs), m.lossless) == (
        "quest,kv_budget=1024",
        {"attention": "quest", "kv_budget": 1024},
        False,
    )
    assert dict(parse_method("snapkv,kv_budget=2k,kv=head").kwargs) == {
        "evict": "snapkv",
        "kv_budget": 2048,
        "kv": "head",
    }
    with pytest.raises(ConfigError, match="cannot be combined"):  # refused before any model loads
        parse_method("snapkv,kv_budget=2k,kv_quant=int8")
    assert not parse_method("auto,kv_quant=int4").lossless
    assert parse_method("auto,attention=dense").lossless
    with pytest.raises(
        ConfigError, match=r"--method quest needs kv_budget; e\.g\. --method quest,kv_budget=1k"
    ):
        parse_method("quest")


def test_lengths_and_depths_parsing() -> None:
    assert parse_lengths("2k,4k,8k") == (2048, 4096, 8192)
    assert parse_lengths("3000, 1k") == (1024, 3000)
    assert parse_depths("0:100:25") == (0.0, 25.0, 50.0, 75.0, 100.0)
    assert parse_depths("0:100:10")[-1] == 100.0 and len(parse_depths("0:100:10")) == 11
    assert parse_depths("50,0") == (0.0, 50.0)
    for bad in ("2k,,4k", "two", "", "-1k"):
        with pytest.raises(ConfigError, match="--lengths"):
            parse_lengths(bad)
    for bad in ("0:120:10", "10:0:5", "0:100:0", "0:100", "a,b", "101"):
        with pytest.raises(ConfigError, match="--depths"):
            parse_depths(bad)


def test_task_spec_errors() -> None:
    with pytest.raises(ConfigError, match="unknown task 'lost'; choose one of passkey, niah, ruler"):
        TaskSpec("lost", (1024,))
    with pytest.raises(ConfigError, match="drop --depths"):
        TaskSpec("ruler", (1024,), depths=(50.0,))
    with pytest.raises(ConfigError, match="unknown ruler subtask"):
        TaskSpec("ruler", (1024,), subtasks=("qa",))
    with pytest.raises(ConfigError, match="--samples"):
        TaskSpec("passkey", (1024,), samples=0)


def test_lengths_past_the_model_are_refused() -> None:
    check_lengths((4096, 8192), 8192)
    with pytest.raises(
        ConfigError, match=r"16384 is longer .* 8192 tokens\. --max-model-len .* --method hip"
    ):
        check_lengths((8192, 16384), 8192)


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
