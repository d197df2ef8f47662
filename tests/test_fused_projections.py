"""q/k/v and gate/up fused into one matmul each (`kvtier.model.fuse`): bitwise the same logits
on the CPU for every family that has them (biases, q/k norms, GeGLU, experts), no weight held
twice, and `LLM` fuses by default (`fuse_projections=False` keeps the separate matmuls)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.loading import load_model
from kvtier.model.fuse import fuse_projections_
from kvtier.model.layers import GatedMLP
from kvtier.model.self_attention import SelfAttention
from tests.hf_reference import make_hf_model, placement_plans, run_placement


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-bias", "qwen3-qknorm", "gemma2", "deepseek-v2"])
def test_fused_logits_equal_the_separate_matmuls(tmp_path: Path, family: str) -> None:
    make_hf_model(family, tmp_path)
    model = load_model(str(tmp_path), torch.device("cpu"), torch.float32, 0).model
    cfg = model.config
    plan = placement_plans(cfg)["head"]  # prefill chunks and decode steps, KV streamed
    before, tokens, _ = run_placement(model, cfg, plan)  # every position's logits
    weights = sum(p.numel() for p in model.parameters())
    fused = fuse_projections_(model)
    attn = [m for m in model.modules() if isinstance(m, SelfAttention)]
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    assert fused == len(attn) + len(mlps) > 0
    assert fuse_projections_(model) == 0  # fused once
    after, fused_tokens, _ = run_placement(model, cfg, plan)
    assert torch.equal(before, after) and tokens == fused_tokens
    for m in attn:  # the separate weights are views of the fused one: nothing is held twice
        assert m.qkv_proj is not None and m.q_proj.weight.data_ptr() == m.qkv_proj.weight.data_ptr()
    for m in mlps:
        assert m.gate_up_proj is not None
        assert (
            m.up_proj.weight.untyped_storage().data_ptr()
            == m.gate_up_proj.weight.untyped_storage().data_ptr()
        )
    new = sum(p.numel() for n, p in model.named_parameters() if "qkv_proj" in n or "gate_up_proj" in n)
    assert sum(p.numel() for p in model.parameters()) == weights + new  # views, counted again


def test_llm_fuses_unless_told_not_to(tmp_path: Path) -> None:
    make_hf_model("llama-gqa", tmp_path)
    fused = LLM(str(tmp_path), device="cpu", dtype="fp32")
    plain = LLM(str(tmp_path), device="cpu", dtype="fp32", fuse_projections=False)
    attn = fused.model.model.layers[0].self_attn
    assert isinstance(attn, SelfAttention) and attn.qkv_proj is not None
    assert plain.model.model.layers[0].self_attn.qkv_proj is None
    params = SamplingParams(max_tokens=6)
    a = fused.generate([5, 9, 13, 2, 7], params)[0].token_ids
    b = plain.generate([5, 9, 13, 2, 7], params)[0].token_ids
    assert a == b
