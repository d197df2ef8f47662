"""Sliding-window attention (Mistral, Qwen2, Gemma-2's local layers): equal to Hugging Face
transformers past the window for every lossless placement, with each windowed slice holding only
its window. Gemma-2's own parts (soft-capping, presets, loading) are in tests/test_gemma2.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import ModelConfig
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import CapacityError, ConfigError
from kvtier.kv.store import TieredKVStore
from kvtier.loading.presets import PRESETS, preset_config
from kvtier.loading.weights import load_safetensors_folder
from kvtier.methods.choice import build_policy
from kvtier.planner.memory import window_tokens
from kvtier.planner.placement import KVPlan, plan_kv
from tests.hf_reference import (
    BLOCK,
    CHUNK,
    CONTEXT,
    PROMPT,
    hf_step_logits,
    make_hf_model,
    placement_plans,
    run_placement,
)

CPU = torch.device("cpu")
# windows of 8 and 6 bind in prefill and decode


@pytest.fixture(scope="module", params=["mistral-window", "qwen2-window", "gemma2"])
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder: Path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, folder)
    model, cfg = load_safetensors_folder(folder, CPU, torch.float32)
    return {"folder": folder, "hf": hf, "model": model, "cfg": cfg}


def test_every_placement_equals_transformers_past_the_window(windowed: dict[str, Any]) -> None:
    model, cfg = windowed["model"], windowed["cfg"]
    assert cfg.windowed_layers(CONTEXT) == cfg.sliding_layers and cfg.sliding_window < PROMPT
    plans = placement_plans(cfg)
    ref_logits, ref_tokens, _ = run_placement(model, cfg, plans["gpu"])
    hf = hf_step_logits(windowed["hf"], cfg, ref_tokens)
    assert torch.allclose(ref_logits, hf, rtol=1e-4, atol=1e-4)
    assert ref_tokens == hf[PROMPT - 1 : -1].argmax(-1).tolist()  # each decode step's greedy token
    for name, plan in plans.items():
        logits, tokens, store = run_placement(model, cfg, plan)
        assert tokens == ref_tokens, name
        if name == "head-blocks":  # the full layer's prefix in blocks, merged by log-sum-exp
            assert torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(logits, ref_logits), name
        store.close()


def test_windowed_slices_hold_only_their_window(windowed: dict[str, Any]) -> None:
    model, cfg = windowed["model"], windowed["cfg"]
    for policy in ("gpu", "head"):
        plan = placement_plans(cfg)[policy]
        window = cfg.sliding_window
        per_layer = cfg.num_kv_heads // plan.group_size
        assert plan.window_slices == len(cfg.sliding_layers) * per_layer
        assert plan.num_slices == (cfg.num_layers - len(cfg.sliding_layers)) * per_layer
        assert plan.window_tokens == window_tokens(window, CHUNK, CONTEXT, BLOCK) == 12  # rounded up to 4
        _, _, store = run_placement(model, cfg, plan)
        lay = store.layout
        for layer in cfg.sliding_layers:
            for g in range(lay.num_groups):
                sid = lay.slice_index(layer, g)
                assert store.resident[sid].shape[0] == plan.window_tokens
                assert window - 1 <= store.slice_length[sid] <= plan.window_tokens
        # The store allocates what the plan counted: resident slices, staging, windows.
        assert store.account.peak["gpu"] == plan.gpu_kv_bytes
        assert store.account.peak["host"] == plan.host_kv_bytes
        store.close()


@pytest.mark.parametrize("kv", ["gpu", "layer", "head", "auto"])
def test_greedy_tokens_equal_transformers_generate(windowed: dict[str, Any], kv: str) -> None:
    prompt = torch.randint(1, 211, (19,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = (
            windowed["hf"]
            .generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False, pad_token_id=0)[
                0, len(prompt) :
            ]
            .tolist()
        )
    llm = LLM(str(windowed["folder"]), device="cpu", kv=kv, chunk_size=CHUNK, block_size=BLOCK)
    out = llm.generate(prompt, SamplingParams(max_tokens=14, ignore_eos=True))[0]
    assert out.token_ids == ref
    if kv == "gpu":  # a list past the window (or soft-capped) runs one prompt at a time, not paged
        two = llm.generate([prompt, prompt[:5]], SamplingParams(max_tokens=14, ignore_eos=True))
        assert two[0].token_ids == ref
        assert (
            two[1].token_ids
            == llm.generate(prompt[:5], SamplingParams(max_tokens=14, ignore_eos=True))[0].token_ids
        )


def test_lossy_parts_refuse_a_binding_window(windowed: dict[str, Any]) -> None:
    cfg = windowed["cfg"]
    parts = build_policy(cfg, device=CPU, kv_quant="int8")
    plan = KVPlan("gpu", cfg.num_kv_heads, cfg.num_layers, CHUNK, 0, 0)

    def store(capacity: int) -> TieredKVStore:
        return TieredKVStore(
            cfg, plan, device=CPU, dtype=torch.float32, capacity=capacity, **parts.store_kwargs()
        )

    with pytest.raises(ConfigError, match="sliding windows"):
        store(CONTEXT)
    if not cfg.plain_scores:  # Gemma-2: soft-capped scores refuse the method at any length
        with pytest.raises(ConfigError, match="soft-capping"):
            store(cfg.sliding_window)
        return
    # Within the window the layers are plain causal: the method runs, and may not grow past it.
    short = store(cfg.sliding_window)
    short.begin_step(cfg.sliding_window)
    short.end_step()
    with pytest.raises(CapacityError, match="sliding window"):
        short.begin_step(1)


def test_mistral_v01_plans_a_million_tokens_in_its_window() -> None:
    cfg = preset_config("mistral-7b-v0.1")
    assert cfg.sliding_window == 4096 and cfg.sliding_layers == tuple(range(32))
    gib = 1 << 30
    plan = plan_kv(cfg, 1 << 20, gpu_budget=24 * gib)
    assert plan.num_slices == 0 and plan.host_kv_bytes == 0 and plan.window_slices == 32
    assert plan.window_tokens == 4096 - 1 + plan.chunk_size + 1  # rounded up to a 256 block
    assert plan.gpu_kv_bytes == 32 * plan.window_tokens * 2 * 8 * 128 * 2
    assert cfg.kv_bytes(1 << 20, 2) == 32 * 4096 * 2 * 8 * 128 * 2
    # Within the window nothing is windowed: the 32 layers are placed as a Llama's are.
    assert plan_kv(cfg, 4096, gpu_budget=24 * gib).num_slices == 32


def test_hf_configs_select_their_sliding_layers() -> None:
    base: dict[str, Any] = {
        "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 4,
        "num_attention_heads": 2, "sliding_window": 16,
    }  # fmt: skip
    qwen = ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "max_window_layers": 1})
    assert qwen.sliding_window is None and qwen.sliding_layers == ()  # use_sliding_window defaults off
    qwen = ModelConfig.from_hf_dict(
        {**base, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1}
    )
    assert qwen.sliding_layers == (1, 2, 3)
    typed = {**base, "model_type": "qwen2", "use_sliding_window": True}
    types = ["full_attention", "sliding_attention"] * 2
    assert ModelConfig.from_hf_dict({**typed, "layer_types": types}).sliding_layers == (1, 3)
    assert ModelConfig.from_hf_dict({**base, "model_type": "mistral"}).sliding_layers == (0, 1, 2, 3)
    assert (
        ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": None}).sliding_layers
        == ()
    )
    assert PRESETS["mistral-7b"].get("sliding_window") is None  # v0.3 shapes: no window
