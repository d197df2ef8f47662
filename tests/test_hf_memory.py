"""What transformers' forward over a `TieredCache` holds per layer, and the plan that leaves room
for it: HF's model code keeps inputs_embeds and each layer's input [T, h] alive and its norms
make fp32 copies, which kvtier's runner model (`activation_bytes`) does not count. On the H200
capped to 24 GiB, llama-3-8b shapes at 128K ran out of memory in HF's MLP under the runner's
plan (docs/hf.md)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from kvtier.hf import TieredCache, cache_keyword
from kvtier.loading.presets import preset_config
from kvtier.methods import PlanInputs, plan_for
from kvtier.planner.hardware import HARDWARE
from kvtier.planner.memory import (
    GPU_RESERVE_BYTES,
    Phases,
    activation_bytes,
    hf_activation_bytes,
    hf_phases,
    weight_bytes,
)
from kvtier.planner.placement import plan_kv
from tests.cpu_memory import phase_peaks

GiB = 1024**3
LLAMA3 = preset_config("llama-3-8b")
BENCH_128K = 131072 + 9  # bench/hf_cache.py's context: the prompt, 8 decode steps and one more


def test_hf_plan_at_128k_leaves_room_for_the_hf_forward() -> None:
    """llama-3-8b at 128K under 24 GiB (the H200 run): the runner's plan, which the HF path got
    before, has 40.6 MB left beside the runner's activations and 48.5 MB too little for HF's;
    planned for HF's forward it keeps one slice fewer resident and fits with 220 MB to spare."""
    budget, hw, T = 24 * GiB, HARDWARE["h200"], 5120
    # HF's per-layer working set for a 5120-token chunk (group of 4 KV heads), bytes.
    assert hf_phases(LLAMA3, T, 2, group_size=4, context=BENCH_128K) == Phases(
        norm=298_926_080, attention=403_742_720, mlp=613_457_920, logits=769_536
    )
    hf = hf_activation_bytes(LLAMA3, T, 2, group_size=4, context=BENCH_128K)
    runner = activation_bytes(LLAMA3, T, 2, group_size=4, context=BENCH_128K)
    # MLP phase: inputs_embeds, the layer input, residual, normed [T,h] and 3 x [T,I]; the
    # runner's model counts 2 x [T,h]. The rest: the RoPE tables [T,d] x 4 and position ids.
    assert hf - runner == 2 * T * 4096 * 2 + 4 * T * 128 * 2 + 8 * T == 89_169_920
    fixed = weight_bytes(LLAMA3, 2) + GPU_RESERVE_BYTES

    old = plan_kv(LLAMA3, BENCH_128K, gpu_budget=budget, hardware=hw)  # what the H200 run had
    assert (old.group_size, old.resident_slices, old.chunk_size, old.staging_buffers) == (4, 30, 5120, 2)
    assert budget - (fixed + runner + old.gpu_kv_bytes) == 40_641_024
    assert budget - (fixed + hf + old.gpu_kv_bytes) == -48_528_896

    inputs = PlanInputs(LLAMA3, BENCH_128K, hardware=hw, dtype_bytes=2, gpu_budget=budget, activations="hf")
    new = plan_for(inputs).plan
    assert new == plan_kv(LLAMA3, BENCH_128K, gpu_budget=budget, hardware=hw, activations="hf")
    assert (new.group_size, new.resident_slices, new.chunk_size, new.staging_buffers) == (4, 29, 5120, 2)
    assert old.gpu_kv_bytes - new.gpu_kv_bytes == new.capacity_tokens * new.slice_token_bytes
    assert budget - (fixed + hf + new.gpu_kv_bytes) == 220_430_848
    # At 32K everything stays resident either way (4.35 GB to spare).
    short = replace(inputs, context=32768 + 9)
    assert plan_for(short).plan == plan_for(replace(short, activations="runner")).plan


SHAPES = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 3,
    "vocab_size": 211,
}
PREFIX, CHUNK = 16, 256


@pytest.fixture(scope="module")
def bf16_llama() -> Any:
    """A tiny random Llama in bf16 (the GPU's dtype, so the norms make fp32 copies), with the
    MLP wider than the hidden size as Llama's is."""
    import transformers

    cfg = transformers.LlamaConfig(
        **SHAPES, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=0
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def test_tiered_cache_plans_for_hf_activations(bf16_llama: Any) -> None:
    assert TieredCache(bf16_llama, kv="gpu", context=64).plan_inputs().activations == "hf"


def test_hf_forward_holds_what_hf_phases_counts(bf16_llama: Any) -> None:
    """CPU allocator bytes alive inside HF's norm and MLP of a 256-token chunk after 16 cached
    tokens, exactly `hf_phases`' terms (bf16; the attention phase runs the CPU kernel, not the
    GPU's, and is not compared). Layer 0's input *is* inputs_embeds: one [T,h] less."""
    model = bf16_llama
    cache = TieredCache(model, kv="gpu", context=PREFIX + CHUNK + 8)
    cfg = cache.model_config
    key = cache_keyword(model)
    ids = torch.randint(1, 211, (1, PREFIX + CHUNK), generator=torch.Generator().manual_seed(3))
    watched = {}
    for i, layer in enumerate(model.model.layers):
        watched[f"norm.{i}"] = layer.post_attention_layernorm
        watched[f"mlp.{i}"] = layer.mlp
    watched["final_norm"] = model.model.norm
    with torch.inference_mode():
        model(input_ids=ids[:, :PREFIX], use_cache=True, logits_to_keep=1, **{key: cache})
        chunk = ids[:, PREFIX:]

        def forward() -> Any:
            return model(input_ids=chunk, use_cache=True, logits_to_keep=1, **{key: cache})

        got = phase_peaks(forward, watched)
    want = hf_phases(cfg, CHUNK, 2)
    th = CHUNK * cfg.hidden_size * 2
    for i in (1, 2):
        assert got[f"mlp.{i}"] == want.mlp == 2_230_272
        assert got[f"norm.{i}"] == want.norm == 1_052_672
    assert (got["mlp.0"], got["norm.0"]) == (want.mlp - th, want.norm - th)
    assert got["final_norm"] == want.norm - th  # inputs_embeds, the last layer's output, fp32 x 2
