"""kvtier.eval's parsers and scorers on the CPU: method specs, lengths and depths, task specs,
lengths past the model, and scoring. No tokenizer, no model."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.eval.grid import parse_depths, parse_lengths
from kvtier.eval.runner import check_lengths
from kvtier.eval.scoring import first_int, recall, score
from kvtier.eval.specs import parse_method, parse_methods
from kvtier.eval.tasks import TaskSpec

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
