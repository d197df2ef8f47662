"""The GPU libraries' first-use warm-up beside a request's setup (`kvtier.engine.warmup`): what it
runs leaves the model as it was, a failing one costs only its note, and a request's tokens do
not depend on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier.engine.warmup as warmup
from kvtier import LLM, SamplingParams
from kvtier.errors import ConfigError


def test_warm_layer_runs_both_attention_paths_and_leaves_the_weights(gqa: tuple[Any, Any]) -> None:
    model = gqa[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls: list[tuple[int, int]] = []
    real = warmup.attend

    def spy(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        calls.append((q.shape[0], kv.shape[0]))
        return real(q, kv)

    with pytest.MonkeyPatch().context() as mp:
        mp.setattr(warmup, "attend", spy)
        warmup.warm_layer(model, torch.device("cpu"), tokens=8)
    assert calls == [(8, 8), (8, 16)]  # a first chunk, then one after a prefix of 8
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_mode_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_WARMUP", raising=False)
    assert warmup.warmup_mode() == "thread"
    monkeypatch.setenv("KVTIER_WARMUP", " Off ")
    assert warmup.warmup_mode() == "off"
    monkeypatch.setenv("KVTIER_WARMUP", "yes")
    with pytest.raises(ConfigError, match="KVTIER_WARMUP='yes'"):
        warmup.warmup_mode()


def test_nothing_runs_on_the_cpu_or_when_off(gqa: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_WARMUP", "thread")
    assert not warmup.warms(gqa[0], torch.device("cpu"))
    monkeypatch.setenv("KVTIER_WARMUP", "off")
    assert not warmup.warms(gqa[0], torch.device("cuda", 0))
    assert warmup.KernelWarmup().start(gqa[0], torch.device("cpu")).join() == {}
    monkeypatch.setattr(warmup, "warms", lambda *_: True)
    assert warmup.KernelWarmup().start(gqa[0], torch.device("cpu"), ranked=True).join() == {}


def test_a_failing_warmup_is_noted_not_raised(gqa: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("no kernel image\nsecond line")

    monkeypatch.setattr(warmup, "warms", lambda *_: True)
    monkeypatch.setattr(warmup, "warm_layer", broken)
    done = warmup.KernelWarmup().start(gqa[0], torch.device("cpu")).join()
    assert done["error"] == "RuntimeError: no kernel image"
    assert isinstance(done["seconds"], float)


def test_a_request_warmed_beside_its_setup_makes_the_same_tokens(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(tiny), device="cpu", kv="head", head_group=1, chunk_size=8)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    plain = llm.generate([list(range(3, 30))], params)[0]
    assert plain.stats.warmup == {}
    monkeypatch.setattr(warmup, "warms", lambda *_: True)
    warmed = llm.generate([list(range(3, 30))], params)[0]
    assert warmed.token_ids == plain.token_ids
    assert set(warmed.stats.warmup) == {"seconds"}
    assert warmed.stats.warmup["seconds"] > 0


def test_the_server_warms_before_its_first_request_and_decodes_the_same(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.serve.engine import ServeConfig, ServeEngine

    llm = LLM(str(tiny), device="cpu", dtype="fp32", kv="gpu")
    cfg = ServeConfig(max_num_seqs=4, num_pages=64)

    def tokens(engine: ServeEngine) -> list[int]:
        out: list[int] = []
        engine.submit([5, 9, 13, 2, 7], SamplingParams(max_tokens=5), lambda d: out.extend(d.token_ids))
        engine.run_until_idle()
        return out

    plain = ServeEngine(llm, cfg)
    assert plain.warmup == {}  # on the CPU: nothing to warm
    reference = tokens(plain)
    monkeypatch.setattr(warmup, "warms", lambda *_: True)
    warmed = ServeEngine(llm, cfg)
    assert set(warmed.warmup) == {"seconds"}
    assert tokens(warmed) == reference
