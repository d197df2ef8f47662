"""Every opt-in method is reachable from `LLM` (and so the CLI), and bad combinations fail early."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier import LLM, SamplingParams
from kvtier.cli.main import main
from kvtier.errors import ConfigError
from tests.hf_reference import make_hf_model

PROMPT = list(range(3, 60))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama-gqa", folder)
    return folder


def tokens(folder: Path, **kw: Any) -> tuple[list[int], str]:
    llm = LLM(str(folder), device="cpu", chunk_size=16, **kw)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))[0]
    return out.token_ids, out.stats.plan["method"]


def test_methods_run_and_budgets_covering_the_context_are_lossless(tiny: Path) -> None:
    ref, desc = tokens(tiny)
    assert desc == "lossless"
    # HiP's default budgets (32K tokens) cover this context, so it equals dense attention.
    assert tokens(tiny, attention="hip") == (ref, "hip default")
    # Every method also runs over head-wise offload (HiP through its GPU block cache, the codec
    # through the packed host tier, evicted slices resident next to streamed ones).
    assert tokens(tiny, attention="hip", kv="head") == (ref, "hip default")
    assert tokens(tiny, kv_quant="int8", kv="head") == tokens(tiny, kv_quant="int8", kv="gpu")
    assert tokens(tiny, evict="window", kv_budget=40, kv="head") == tokens(tiny, evict="window", kv_budget=40)
    assert (
        tokens(tiny, attention="quest", kv_budget=16, kv="head")[0]
        == tokens(tiny, attention="quest", kv_budget=16)[0]
    )
    assert tokens(tiny, attention="quest", kv_budget=4096)[0] == ref
    assert len(tokens(tiny, evict="window", kv_budget=40)[0]) == 6
    with pytest.raises(ConfigError, match="not below the context"):
        tokens(tiny, evict="window", kv_budget=4096)
    assert tokens(tiny, kv_quant="int8")[1] == "kv-quant int8"
    assert len(tokens(tiny, evict="streaming", kv_budget=24)[0]) == 6


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"attention": "hip", "kv_quant": "int4"}, "cannot be combined"),
        ({"attention": "sparse"}, "unknown --attention"),
        ({"evict": "h2o"}, "--kv-budget"),
        ({"kv_quant": "int3"}, "unknown --kv-quant"),
        ({"head_sparsity": 1.5}, r"\[0, 1\]"),
    ],
)
def test_bad_method_options(tiny: Path, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LLM(str(tiny), device="cpu", **kw)


def test_cli_flags_reach_the_engine(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tiny), "--prompt", "x", "--evict", "h2o"]) == 2
    assert "--kv-budget" in capsys.readouterr().err
