"""Whether HiP replays its decode steps as CUDA graphs (`KVTIER_HIP_GRAPHS`): "auto", the
default, does on CUDA for a sequence run alone and not where its memory is placed in a region
(a server's lent pages) or the caller keeps them off (`LLM.make_store(graphs=False)`: the
server's requests); "1" and "0" stand everywhere; anything else is refused with what to use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import LLM
from kvtier.errors import ConfigError
from kvtier.sparse.graph_setting import graphs_setting, graphs_wanted
from tests.hf_reference import make_hf_model
from tests.hip_store import kernel_for, plan


@pytest.mark.parametrize(
    ("raw", "setting"),
    [(None, "auto"), ("", "auto"), ("auto", "auto"), ("0", "off"), ("1", "on"), (" ON ", "on")],
)
def test_the_setting_reads_the_environment(
    raw: str | None, setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if raw is None:
        monkeypatch.delenv("KVTIER_HIP_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("KVTIER_HIP_GRAPHS", raw)
    assert graphs_setting() == setting


def test_a_bad_setting_says_what_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_HIP_GRAPHS", "yes")
    with pytest.raises(ConfigError, match=r"KVTIER_HIP_GRAPHS='yes': use 1 \(on\), 0 \(off\) or auto"):
        graphs_setting()


def test_auto_is_on_cuda_where_allowed() -> None:
    table = {
        (setting, cuda, allowed): graphs_wanted(setting, cuda, allowed)
        for setting in ("auto", "on", "off")
        for cuda in (False, True)
        for allowed in (False, True)
    }
    assert [k for k, on in table.items() if on] == [
        ("auto", True, True),
        ("on", False, False),
        ("on", False, True),
        ("on", True, False),
        ("on", True, True),
    ]


def _kernel_graphs(monkeypatch: pytest.MonkeyPatch, setting: str, cuda: bool, gqa: Any) -> Any:
    """A HiP kernel for conftest's `gqa` model made as on a machine with (`cuda`) or without CUDA."""
    monkeypatch.setenv("KVTIER_HIP_GRAPHS", setting)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    return kernel_for(gqa[1])


@pytest.mark.parametrize("setting", ["auto", "1"])
def test_placed_memory_and_the_caller_turn_auto_off(
    setting: str, monkeypatch: pytest.MonkeyPatch, gqa: Any
) -> None:
    kernel = _kernel_graphs(monkeypatch, setting, True, gqa)
    assert kernel._graphs is not None
    kernel.allow_graphs(False)
    assert (kernel._graphs is not None) == (setting == "1")
    kernel.allow_graphs(True)
    assert kernel._graphs is not None
    kernel.place_caches(lambda shape, dtype: torch.empty(shape, dtype=dtype))
    assert (kernel._graphs is not None) == (setting == "1")
    kernel.allow_graphs(True)
    assert (kernel._graphs is not None) == (setting == "1"), "placed memory stays placed"


def test_auto_is_off_without_cuda(monkeypatch: pytest.MonkeyPatch, gqa: Any) -> None:
    assert _kernel_graphs(monkeypatch, "auto", False, gqa)._graphs is None


@pytest.mark.parametrize("graphs", [True, False])
def test_make_store_passes_the_callers_word(
    graphs: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the server does (`graphs=False`) and what `kvtier generate` does (the default)."""
    make_hf_model("llama-gqa", tmp_path)
    llm = LLM(str(tmp_path), device="cpu", attention="hip")
    monkeypatch.setenv("KVTIER_HIP_GRAPHS", "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _, parts = llm.make_store(plan("head"), 140, graphs=graphs)
    assert (parts.kernel._graphs is not None) == graphs  # type: ignore[union-attr]
