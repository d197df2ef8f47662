"""A request's stats time each prefill step (`GenerationStats.prefill_step_s`): where a long
prompt's prefill goes, read without a host sync between steps; and they carry what its attention
kernel counted (`GenerationStats.kernel`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.engine.runner import StepClock
from tests.hf_reference import make_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama-gqa", folder)
    return folder


@pytest.mark.parametrize("attention", [None, "hip"])
def test_every_prefill_step_is_timed(tiny: Path, attention: str | None) -> None:
    """57 prompt tokens in chunks of 16: four steps (HiP: the last token alone, a fifth), each
    timed, together no longer than the prefill (each step is rounded to 4 decimals, so up to
    0.5e-4 s a step over)."""
    kw = {} if attention is None else {"attention": attention}
    llm = LLM(str(tiny), device="cpu", chunk_size=16, **kw)  # type: ignore[arg-type]
    stats = llm.generate(list(range(3, 60)), SamplingParams(max_tokens=3, ignore_eos=True))[0].stats
    assert len(stats.prefill_step_s) == (5 if attention else 4)
    assert all(s >= 0 for s in stats.prefill_step_s)
    rounding = 0.5e-4 * len(stats.prefill_step_s)
    assert 0 < sum(stats.prefill_step_s) <= stats.prefill_s + rounding
    assert stats.to_dict()["prefill_step_s"] == stats.prefill_step_s
    assert 0 < stats.setup_s < 60  # the store built before the prefill's clock starts


def test_the_clock_times_consecutive_steps() -> None:
    """Marks before the first step and after each give one duration a step, in order."""
    clock = StepClock(torch.device("cpu"))
    assert clock.seconds() == []
    clock.mark()
    for n in (1, 2):
        torch.ones(n).sum()
        clock.mark()
    assert len(clock.seconds()) == 2


@pytest.mark.parametrize("graphs", ["0", "1"])
def test_a_request_reports_what_its_kernel_counted(
    tiny: Path, graphs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HiP's stats carry its counters (stage reruns per stage, the block caches' hit rate, and
    with KVTIER_HIP_GRAPHS the decode graphs': none replay on the CPU); dense attention's none."""
    monkeypatch.setenv("KVTIER_HIP_GRAPHS", graphs)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    hip = LLM(str(tiny), device="cpu", chunk_size=16, attention="hip").generate(list(range(3, 60)), params)
    counted = hip[0].stats.kernel
    stages = counted["decode_recomputes"]
    assert isinstance(stages, list) and len(stages) == 3 and min(stages) > 0
    assert counted["cache_hit_rate"] == 1.0
    assert ("decode_graphs" in counted) == (graphs == "1")
    if graphs == "1":
        assert counted["decode_graphs"] == {"captures": 0, "replays": 0, "steps": {}}
    assert hip[0].stats.to_dict()["kernel"] == counted
    dense = LLM(str(tiny), device="cpu", chunk_size=16).generate(list(range(3, 60)), params)
    assert dense[0].stats.kernel == {}
