"""The server captures every decode bucket's graph at start, over the scratch page alone: no
sequence's page is written, and requests afterwards decode exactly as without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.engine.batch.graphs import DecodeRunner
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.serve.engine import ServeConfig, ServeEngine
from tests.hf_reference import make_hf_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder: Path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama-gqa", folder)
    return LLM(str(folder), device="cpu", dtype="fp32", kv="gpu")


def run(engine: ServeEngine, prompts: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        engine.submit(p, SamplingParams(max_tokens=6), lambda d, i=i: out[i].extend(d.token_ids))
    engine.run_until_idle()
    return out


def test_capture_all_touches_only_the_scratch_page(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU there are no graphs; the capture is faked, the forward it captures is real."""
    captured: list[int] = []

    def fake_capture(self: DecodeRunner, rows: int) -> tuple[Any, torch.Tensor]:
        tables = self.store.dec_tables[:rows]
        assert bool((tables == self.store.scratch).all()), "a capture reads a sequence's page"
        captured.append(rows)
        return None, self._forward(rows)  # the warm-up forward a capture runs, writes included

    cfg = ServeConfig(max_num_seqs=6, num_pages=64, static_decode=True, cuda_graphs=False)
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8], [11, 4, 6, 1, 9, 2, 10]]
    plain = ServeEngine(llm, cfg)
    reference = run(plain, prompts)
    assert plain.graphs_at_start == 0  # graphs off: nothing to capture
    monkeypatch.setattr(DecodeRunner, "_capture", fake_capture)
    engine = ServeEngine(llm, cfg)
    decoder = engine.decoder
    assert decoder is not None
    decoder.graphs = True
    pages_before = [t.clone() for t in engine.store.pages]
    assert decoder.capture_all() == len(decoder.buckets) and captured == list(decoder.buckets)
    assert decoder.capture_all() == 0  # captured once
    for old, new in zip(pages_before, engine.store.pages, strict=True):
        changed = {int(p) for p in (old != new).flatten(1).any(1).nonzero().flatten()}
        assert changed <= {engine.store.scratch}
    decoder.graphs, decoder._captured = False, {}
    assert run(engine, prompts) == reference
