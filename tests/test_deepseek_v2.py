"""DeepSeek-V2's latent attention (MLA) and MoE against Hugging Face transformers (tiny random
configs, fp32, CPU) for every lossless placement, and the latent cache's bytes: one entry of
kv_lora_rank + qk_rope_head_dim values per token and layer, as the store measures them.
tests/test_model_vs_hf.py also runs both tiny families (with and without the q LoRA and
group-limited routing) through its logits, chunked-prefill and greedy checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.cli.main import main
from kvtier.config import ModelConfig
from kvtier.engine.batch.core import BatchEngine
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import CapacityError, ConfigError
from kvtier.kv.store import TieredKVStore
from kvtier.loading.presets import PRESETS, preset_config
from kvtier.loading.weights import load_safetensors_folder
from kvtier.methods.choice import build_policy
from kvtier.model.moe import MoE
from kvtier.model.rope import inverse_frequencies
from kvtier.planner.memory import expert_copy_bytes, host_weight_bytes, place_experts, weight_bytes
from kvtier.planner.placement import KVPlan, plan_kv
from tests.hf_reference import PROMPT, hf_step_logits, make_hf_model, placement_plans, run_placement

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lite(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder: Path = tmp_path_factory.mktemp("deepseek-v2-lite")
    hf = make_hf_model("deepseek-v2-lite", folder)
    model, cfg = load_safetensors_folder(folder, CPU, torch.float32)
    return {"folder": folder, "hf": hf, "model": model, "cfg": cfg}


def test_every_placement_equals_transformers(lite: dict[str, Any]) -> None:
    model, cfg = lite["model"], lite["cfg"]
    assert cfg.mla is not None and (cfg.num_kv_heads, cfg.head_dim) == (1, cfg.mla.entry // 2)
    plans = placement_plans(cfg)
    ref_logits, ref_tokens, _ = run_placement(model, cfg, plans["gpu"])
    hf = hf_step_logits(lite["hf"], cfg, ref_tokens)
    assert torch.allclose(ref_logits, hf, rtol=1e-4, atol=1e-4)
    assert ref_tokens == hf[PROMPT - 1 : -1].argmax(-1).tolist()
    for name, plan in plans.items():
        logits, tokens, store = run_placement(model, cfg, plan)
        assert tokens == ref_tokens, name
        if name == "head-blocks":  # the latent streamed in sequence blocks, merged by log-sum-exp
            assert torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(logits, ref_logits), name
        store.close()


@pytest.mark.parametrize("kv", ["gpu", "layer", "head", "auto"])
def test_greedy_tokens_equal_transformers_generate(lite: dict[str, Any], kv: str) -> None:
    prompt = torch.randint(1, 211, (19,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = (
            lite["hf"]
            .generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)[
                0, len(prompt) :
            ]
            .tolist()
        )
    llm = LLM(str(lite["folder"]), device="cpu", kv=kv, chunk_size=6, block_size=4)
    assert llm.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids == ref
    if kv == "gpu":  # a list batches over stores of their own: the paged kernels have no latent attention
        two = llm.generate([prompt, prompt], SamplingParams(max_tokens=10, ignore_eos=True))
        assert [o.token_ids for o in two] == [ref, ref]
        assert all("own store" in o.stats.plan["method"] for o in two)
        assert not BatchEngine(llm).paged


def test_the_store_keeps_576_values_per_token_and_layer() -> None:
    cfg = preset_config("deepseek-v2-lite")
    assert cfg.mla is not None and cfg.mla.entry == 576
    plan = KVPlan("gpu", 1, cfg.num_layers, 8, 0, 0)
    store = TieredKVStore(cfg, plan, device=CPU, dtype=torch.bfloat16, capacity=16)
    gen = torch.Generator().manual_seed(0)
    store.begin_step(8)
    for layer in range(cfg.num_layers):  # a step of the attention calls LatentAttention makes
        q = torch.randn(8, 16, 576, generator=gen).bfloat16()
        k, v = torch.randn(2, 8, 1, 288, generator=gen).bfloat16()
        assert store(layer, q, k, v).shape == (8, 16, 512)  # the latent per head
    store.end_step()
    assert store.stored_bytes()["gpu"] == 8 * cfg.num_layers * 576 * 2  # bf16
    assert plan_kv(cfg, 1 << 20, gpu_budget=None).slice_token_bytes == 576 * 2
    assert cfg.kv_bytes(1 << 20, 2) == (1 << 20) * 27 * 576 * 2
    store.close()


def test_preset_has_the_published_shapes() -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.DeepseekV2Config(
        **{k: v for k, v in PRESETS["deepseek-v2-lite"].items() if k != "model_type"}
    )
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    cfg = preset_config("deepseek-v2-lite")
    assert cfg.num_parameters() == sum(p.numel() for p in skeleton.parameters()) == 15_706_484_224
    assert ModelConfig.from_hf_dict(hf_cfg.to_dict()) == cfg
    # YaRN x40 on the 64 RoPE dimensions: transformers' frequencies and factors, exactly.
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    assert torch.equal(inverse_frequencies(cfg.rope, 64), inv) and cfg.rope.attention_factor == factor
    assert cfg.attn_scale == pytest.approx(
        192**-0.5 * (0.1 * 0.707 * torch.tensor(40.0).log().item() + 1) ** 2
    )


def test_experts_in_host_memory_give_the_same_tokens(
    lite: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = torch.randint(1, 211, (19,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    kw: dict[str, Any] = {"device": "cpu", "kv": "gpu", "chunk_size": 6, "block_size": 4}
    ref = LLM(str(lite["folder"]), **kw).generate(prompt, params)
    copies: list[int] = []  # experts a step copied in: all 4 of a layer at once, or one at a time
    real = MoE._copy_in

    def spy(self: MoE, used: list[int], device: torch.device) -> dict[int, torch.Tensor] | None:
        copies.append(4 if 2 * len(used) > 4 else len(used))
        return real(self, used, device)

    monkeypatch.setattr(MoE, "_copy_in", spy)
    llm = LLM(str(lite["folder"]), **kw, experts="host")
    cfg = llm.model_config
    assert cfg.moe is not None and cfg.moe.experts_on_host
    moes = [m for m in llm.model.modules() if isinstance(m, MoE)]
    assert len(moes) == cfg.num_layers - cfg.moe.first_dense
    for m in moes:  # every expert weight is a view of its layer's host rows, which hold the checkpoint
        assert m.host_experts is not None and m.host_experts.shape == (4, 3, 32 * cfg.hidden_size)
        base = m.host_experts.untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == base for p in m.experts.parameters())
    out = llm.generate(prompt, params)
    assert out[0].token_ids == ref[0].token_ids
    assert 4 in copies and any(
        c < 4 for c in copies
    )  # prefill chunks copy whole layers, decode single experts


def test_experts_go_to_the_host_when_the_weights_crowd_the_budget() -> None:
    cfg = preset_config("deepseek-v2-lite")
    assert cfg.moe is not None and not cfg.moe.experts_on_host
    placed = place_experts(cfg, 24 << 30, 2)
    assert placed.moe is not None and placed.moe.experts_on_host
    experts = 26 * 64 * 3 * 2048 * 1408 * 2
    assert host_weight_bytes(placed, 2) == experts
    assert weight_bytes(placed, 2) == weight_bytes(cfg, 2) - experts + experts // 26  # one layer's copies
    # one decode token copies its 6 experts in each of the 26 MoE layers; a long chunk every expert
    assert expert_copy_bytes(placed, 1, 2) == 26 * 6 * 3 * 2048 * 1408 * 2
    assert expert_copy_bytes(placed, 4096, 2) == experts and expert_copy_bytes(cfg, 1, 2) == 0
    for budget, where in ((80 << 30, False), (None, False)):
        got = place_experts(cfg, budget, 2)
        assert got.moe is not None and got.moe.experts_on_host is where
    cpu = place_experts(cfg, 24 << 30, 2, on_gpu=False)  # one memory: nothing to move
    assert cpu.moe is not None and not cpu.moe.experts_on_host
    forced = place_experts(cfg, None, 2, "host")
    assert forced.moe is not None and forced.moe.experts_on_host
    assert place_experts(preset_config("llama-3-8b"), 1 << 30, 2) == preset_config("llama-3-8b")
    with pytest.raises(ConfigError, match="--experts"):
        place_experts(cfg, None, 2, "disk")


def test_plan_rows(capsys: pytest.CaptureFixture[str]) -> None:
    # The weights alone (15.7B parameters, 31.4 GB in bf16) exceed a 24 GiB GPU: with the routed
    # experts in host memory 3.7 GB stay, and 1M tokens fit.
    args = ["plan", "--model", "deepseek-v2-lite", "--context", "1M", "--gpu-memory", "24GiB"]
    assert main([*args, "--experts", "gpu"]) == 2
    assert "weights 31.41 GB" in capsys.readouterr().err
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "routed experts in host memory: 28.79 GB" in out and "recommended: policy auto" in out
    assert (
        main(["plan", "--model", "deepseek-v2-lite", "--context", "1M", "--gpu-memory", "48GiB", "--json"])
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    rec = doc["recommended"]
    assert rec["num_slices"] == 27 and rec["group_size"] == 1  # one latent "head" per layer
    assert doc["methods"]["standard"]["kv_total_gb"] == round((1 << 20) * 27 * 1152 / 1e9, 4)


def test_lossy_parts_refuse_latent_attention(lite: dict[str, Any]) -> None:
    cfg = lite["cfg"]
    plan = KVPlan("gpu", 1, cfg.num_layers, 4, 0, 0)
    for spec in ({"kv_quant": "int8"}, {"evict": "window", "kv_budget": 8}):
        parts = build_policy(cfg, device=CPU, **spec)
        with pytest.raises(ConfigError, match="latent attention"):
            TieredKVStore(cfg, plan, device=CPU, dtype=torch.float32, capacity=32, **parts.store_kwargs())
    with pytest.raises(CapacityError):  # and the planner keeps the 24 GiB refusal for real shapes
        plan_kv(preset_config("deepseek-v2-lite"), 1024, gpu_budget=24 << 30)
