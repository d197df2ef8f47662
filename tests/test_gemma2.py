"""Gemma-2's own parts: soft-capped, scaled scores in key blocks, the presets' shapes, the plan at
1M tokens, and the paged batch's refusal. Its equality with HF transformers for every lossless
placement is tested with the other sliding-window models (tests/test_sliding_window.py) and in
tests/test_model_vs_hf.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.attention import dense
from kvtier.attention.dense import attend, attend_prefix_lse, attend_self_lse, merge_into
from kvtier.attention.spec import LayerAttention
from kvtier.cli.main import main
from kvtier.config import ModelConfig
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.loading.presets import PRESETS, preset_config
from kvtier.loading.weights import load_safetensors_folder, random_model
from kvtier.planner.placement import KVPlan, plan_kv
from tests.hf_reference import make_hf_model

CPU = torch.device("cpu")
SPEC = LayerAttention(window=5, softcap=0.3, scale=0.2)


def _naive(q: torch.Tensor, kv: torch.Tensor, spec: LayerAttention) -> torch.Tensor:
    """transformers' eager attention, written out: q [T, H_q, D] over kv [S, 2, H_kv, D]."""
    t, hq, _ = q.shape
    s, _, hkv, _ = kv.shape
    k = kv[:, 0].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [H_q, S, D]
    v = kv[:, 1].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * (spec.scale or q.shape[-1] ** -0.5)  # [H_q, T, S]
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    i = torch.arange(t)[:, None] + s - t
    j = torch.arange(s)[None, :]
    keep = (j <= i) & ((j > i - spec.window) if spec.window is not None else True)
    probs = torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1)
    return (probs @ v).transpose(0, 1)  # [T, H_q, D]


@pytest.mark.parametrize("t", [1, 4, 9])
@pytest.mark.parametrize("spec", [SPEC, LayerAttention(softcap=0.3), LayerAttention(window=5)])
def test_scored_attention_equals_eager_in_any_block_size(
    t: int, spec: LayerAttention, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(t, 6, 8, generator=gen)
    kv = torch.randn(17, 2, 2, 8, generator=gen)
    ref = _naive(q, kv, spec)
    assert torch.allclose(attend(q, kv, spec), ref, atol=1e-6)
    monkeypatch.setattr(dense, "SCORE_ELEMENTS", 7)  # one key per block: 17 merges
    assert torch.allclose(attend(q, kv, spec), ref, atol=1e-6)


def test_prefix_blocks_merge_to_the_whole_with_soft_capping() -> None:
    gen = torch.Generator().manual_seed(1)
    q, kv = torch.randn(4, 6, 8, generator=gen), torch.randn(21, 2, 2, 8, generator=gen)
    spec = LayerAttention(softcap=0.3, scale=0.2)
    acc = None
    for a in range(0, 17, 6):  # the prefix in blocks, as the store streams a long slice
        acc = merge_into(acc, attend_prefix_lse(q, kv[a : min(a + 6, 17)], spec))
    out = merge_into(acc, attend_self_lse(q, kv[17:, 0], kv[17:, 1], spec))[0]
    assert torch.allclose(out, _naive(q, kv, spec), atol=1e-6)


@pytest.mark.parametrize("name", ["gemma-2-2b", "gemma-2-9b", "gemma-2-27b"])
def test_presets_have_the_published_shapes(name: str) -> None:
    import transformers

    hf_dict = {k: v for k, v in PRESETS[name].items() if k != "model_type"}
    hf_cfg = transformers.Gemma2Config(**hf_dict)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    cfg = preset_config(name)
    assert cfg.num_parameters() == sum(p.numel() for p in skeleton.parameters())  # tied: once
    # transformers' own dict (layer_types, hidden_activation) reads back as the preset does.
    assert ModelConfig.from_hf_dict(hf_cfg.to_dict()) == cfg
    assert cfg.sliding_layers == tuple(range(0, cfg.num_layers, 2)) and cfg.sliding_window == 4096
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.hidden_act) == (50.0, 30.0, "gelu_pytorch_tanh")
    assert cfg.attn_scale == (None if name != "gemma-2-27b" else 144**-0.5)


def test_gemma_2_9b_plans_a_million_tokens_in_24_gib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = preset_config("gemma-2-9b")
    gib = 1 << 30
    plan = plan_kv(cfg, 1 << 20, gpu_budget=24 * gib, host_budget=512 * gib)
    groups = cfg.num_kv_heads // plan.group_size
    # The 21 local layers keep window + chunk on the GPU; the 21 global ones are placed.
    assert plan.window_slices == 21 * groups and plan.num_slices == 21 * groups
    assert plan.window_tokens == 4096 + plan.chunk_size  # 4095 + chunk, rounded to a block
    assert plan.host_kv_bytes == plan.streamed_slices * (1 << 20) * plan.slice_token_bytes
    assert plan.gpu_kv_bytes == (
        plan.resident_slices * (1 << 20) * plan.slice_token_bytes
        + 2 * plan.staging_tokens * plan.slice_token_bytes
        + plan.window_slices * plan.window_tokens * plan.slice_token_bytes
    )
    code = main(["plan", "--model", "gemma-2-9b", "--context", "1M", "--gpu-memory", "24GiB", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["recommended"]["window_slices"] == plan.window_slices
    assert doc["methods"]["auto"]["total_gpu_gb"] + doc["gpu_reserve_gb"] <= 24 * gib / 1e9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("gemma2")
    return folder, make_hf_model("gemma2", folder)


def test_a_soft_capped_model_batches_over_stores_of_its_own(tiny: tuple[Path, Any]) -> None:
    """The paged kernels have no soft-capping, so the batch gives every Gemma-2 request a store of
    its own in the same forward (`LLM.generate([...])` and the server alike), with the tokens of
    each prompt alone."""
    from kvtier.serve.engine import ServeEngine

    llm = LLM(str(tiny[0]), device="cpu")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 200, (n,), generator=gen).tolist() for n in (9, 23, 14)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    batched = llm.generate(prompts, params)
    assert [o.token_ids for o in batched] == alone
    assert all("own store" in o.stats.plan["method"] for o in batched)
    engine = ServeEngine(llm)
    assert not engine.paged and engine.needs_offload(prompts[0], params)
    got: list[list[int]] = [[], [], []]
    for i, p in enumerate(prompts):
        engine.submit(p, params, lambda d, i=i: got[i].extend(d.token_ids))
    engine.run_until_idle()
    assert got == alone and engine.own_store_requests == 3 and engine.offloaded == 0


def test_random_weights_start_from_identity_norms() -> None:
    small = {
        "num_hidden_layers": 2,
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "head_dim": 8,
    }
    cfg = ModelConfig.from_hf_dict({**PRESETS["gemma-2-2b"], **small})
    model = random_model(cfg, CPU, torch.float32)
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert len(norms) == 2 * 4 + 1 and all(bool((p == 0).all()) for p in norms)  # (1 + 0) scales by 1


def test_local_layers_hold_the_window_and_global_layers_everything(tiny: tuple[Path, Any]) -> None:
    model, cfg = load_safetensors_folder(tiny[0], CPU, torch.float32)
    plan = KVPlan("head", 1, 0, 4, 2, 40)
    store = TieredKVStore(
        cfg, plan, device=CPU, dtype=torch.float32, capacity=40, options=StoreOptions(block_size=4)
    )
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    for s in range(0, 40, 4):
        store.begin_step(4)
        model(ids[s : s + 4], store)
        store.end_step()
    lay = store.layout
    token = lay.token_bytes
    for layer in (0, 2):  # local: the window's 7 earlier tokens plus one 4-token step, 12 at most
        for g in range(lay.num_groups):
            sid = lay.slice_index(layer, g)
            assert store.resident[sid].shape[0] == 12 and 7 <= store.slice_length[sid] <= 12
    assert store.stored_bytes()["host"] == 40 * token * lay.num_groups  # global layer 1: every token
    assert set(store.hosts) == {lay.slice_index(1, g) for g in range(lay.num_groups)}
    store.close()


def test_synthetic_fill_gives_windowed_slices_their_window(tiny: tuple[Path, Any]) -> None:
    from kvtier.kv.synthetic import fill_synthetic

    model, cfg = load_safetensors_folder(tiny[0], CPU, torch.float32)
    plan = KVPlan("layer", cfg.num_kv_heads, 0, 4, 2, 64)
    store = TieredKVStore(
        cfg, plan, device=CPU, dtype=torch.float32, capacity=64, options=StoreOptions(block_size=4)
    )
    fill_synthetic(store, 50)
    lay = store.layout
    assert [store.slice_length[lay.slice_index(i, 0)] for i in range(3)] == [7, 50, 7]
    store.begin_step(1)  # a decode step at position 50 over the synthetic KV
    assert model(torch.tensor([3]), store).isfinite().all()
    store.end_step()
    store.close()
