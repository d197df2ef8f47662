"""`StepProbe`: each decode step's H2D bytes and the collector's pauses in a request's stats."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.engine.step_probe import StepProbe
from kvtier.kv.tiers import TierAccount


def test_probe_counts_bytes_and_collections_by_step() -> None:
    account = TierAccount()
    probe = StepProbe(account, torch.device("cpu"))
    try:
        account.h2d_bytes += 100
        probe.step()
        gc.collect()  # a full collection in the second step
        account.h2d_bytes += 7
        probe.step()
        probe.step()
    finally:
        probe.close()
    assert probe.step_h2d_bytes == [100, 7, 0]
    summary = probe.gc_summary()
    assert summary["collections"][2] >= 1 and summary["pause_s"] > 0
    assert all(p["step"] in (0, 1, 2) and p["s"] >= 1e-3 for p in summary["long_pauses"])
    assert probe.allocator == {}  # no CUDA allocator on the CPU
    gc.collect()  # after close the probe hears nothing
    assert probe.gc_summary()["collections"] == summary["collections"]


NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]


@pytest.mark.parametrize("device", DEVICES)
def test_offloaded_request_reports_its_steps_bytes(tiny: Path, device: str) -> None:
    """Head-wise offload streams the host slices each decode step: the per-step bytes are what
    the request's decode moved in all, one entry a step; on CUDA the allocator's counts too."""
    llm = LLM(str(tiny), device=device, kv="head", head_group=1, chunk_size=8)
    out = llm.generate(list(range(1, 40)), SamplingParams(max_tokens=5, ignore_eos=True))[0]
    stats = out.stats
    assert len(stats.decode_step_h2d_bytes) == len(stats.decode_step_times_s) == 4
    assert sum(stats.decode_step_h2d_bytes) == stats.decode_h2d_bytes > 0
    assert min(stats.decode_step_h2d_bytes) > 0
    assert set(stats.to_dict()["decode_gc"]) == {"collections", "pause_s", "long_pauses"}
    if device == "cpu":
        assert stats.decode_allocator == {}
    else:
        assert set(stats.decode_allocator) == {"cuda_mallocs", "alloc_retries"}
        assert min(stats.decode_allocator.values()) >= 0
    assert not any(getattr(cb, "__self__", None).__class__ is StepProbe for cb in gc.callbacks)
