"""kvtier's own model runner against Hugging Face transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.kv.store import TieredKVStore
from kvtier.loading.weights import load_safetensors_folder
from kvtier.planner.placement import plan_kv
from tests.hf_reference import FAMILIES, make_hf_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, object]:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, folder)
    return request.param, folder, hf


def _all_logits(folder: Path, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    model, cfg = load_safetensors_folder(folder, CPU, torch.float32)
    plan = plan_kv(cfg, ids.shape[0], policy="gpu", gpu_budget=None, dtype_bytes=4, chunk_size=chunk)
    store = TieredKVStore(cfg, plan, device=CPU, dtype=torch.float32, capacity=ids.shape[0])
    outs = []
    for s in range(0, ids.shape[0], chunk):
        part = ids[s : s + chunk]
        store.begin_step(part.shape[0])
        outs.append(model(part, store, logits_at=torch.arange(part.shape[0])))
        store.end_step()
    return torch.cat(outs)


def test_logits_match_transformers(family: tuple[str, Path, object]) -> None:
    _, folder, hf = family
    ids = torch.randint(0, 211, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]  # type: ignore[operator]
    ours = _all_logits(folder, ids, chunk=37)
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-5, rel
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_shot(family: tuple[str, Path, object]) -> None:
    _, folder, _ = family
    ids = torch.randint(0, 211, (50,), generator=torch.Generator().manual_seed(2))
    one = _all_logits(folder, ids, chunk=50)
    for chunk in (7, 16, 49):  # sizes that do not divide the prompt
        chunked = _all_logits(folder, ids, chunk=chunk)
        assert torch.allclose(chunked, one, rtol=1e-5, atol=1e-5), chunk


def test_greedy_tokens_match_transformers(family: tuple[str, Path, object]) -> None:
    _, folder, hf = family
    prompt = torch.randint(1, 211, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf.generate(  # type: ignore[attr-defined]
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    llm = LLM(str(folder), device="cpu", chunk_size=8)
    out = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == ref
