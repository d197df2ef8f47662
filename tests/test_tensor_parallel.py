"""Tensor parallelism without processes: the per-rank config the planner plans, the transform's
cuts, `kvtier plan --tensor-parallel` and the errors raised before any rank starts.
(`test_tensor_parallel_gloo.py` runs the ranks.)"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.cli.main import main
from kvtier.errors import ConfigError
from kvtier.loading.presets import preset_config
from kvtier.loading.weights import load_safetensors_folder
from kvtier.parallel.tensor import RowParallelLinear, shard_
from kvtier.planner.hardware import hardware_preset
from kvtier.planner.memory import weight_bytes
from kvtier.planner.placement import plan_kv
from kvtier.planner.sharding import check_tensor_parallel, rank_config, tensor_parallel_sizes
from tests.hf_reference import make_hf_model

GiB = 1024**3


def test_rank_config_of_llama_3_70b_over_4_ranks() -> None:
    cfg = preset_config("llama-3-70b")
    rank = rank_config(cfg, 4)
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size) == (16, 2, 7168)
    assert (rank.hidden_size, rank.num_layers, rank.vocab_size, rank.head_dim) == (8192, 80, 128256, 128)
    # 4 ranks hold every split weight once and the replicated ones (embeddings, LM head, norms) 4 times.
    replicated = 2 * cfg.vocab_size * cfg.hidden_size + (2 * cfg.num_layers + 1) * cfg.hidden_size
    assert 4 * rank.num_parameters() - 3 * replicated == cfg.num_parameters()
    assert weight_bytes(rank, 2) == 38_430_851_072  # 2 B x (80 x 213,925,888 + 2 x 128256 x 8192 + 8192)
    assert rank.kv_bytes_per_token(2) * 4 == cfg.kv_bytes_per_token(2)
    assert rank_config(cfg, 1) is cfg


def test_sizes_that_do_not_split_the_kv_heads_are_refused_with_the_ones_that_do() -> None:
    cfg = preset_config("llama-3-70b")
    assert tensor_parallel_sizes(cfg) == [1, 2, 4, 8]
    divide = r"--tensor-parallel 3 must divide the model's 8 KV heads.*use one of 1, 2, 4, 8"
    with pytest.raises(ConfigError, match=divide):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ConfigError, match="3 KV heads"):
        rank_config(preset_config("smollm2-135m"), 2)
    with pytest.raises(ConfigError, match="at least 1"):
        check_tensor_parallel(cfg, 0)


class _NoCommunication:
    """A RankGroup stand-in for cutting weights without processes (forward is never run)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("qwen2")
    make_hf_model("qwen2-bias", path)  # 3 layers, 4 query heads, 2 KV heads (d=16), q/k/v biases
    return path


def test_shard_keeps_each_ranks_heads_and_mlp_channels(folder: Path) -> None:
    whole, cfg = load_safetensors_folder(folder, torch.device("cpu"), torch.float32)
    for rank in (0, 1):
        model, _ = load_safetensors_folder(folder, torch.device("cpu"), torch.float32)
        shard_(model, _NoCommunication(rank, 2))  # type: ignore[arg-type]
        assert model.config == rank_config(cfg, 2)
        for full, part in zip(whole.model.layers, model.model.layers, strict=True):
            a, b = full.self_attn, part.self_attn
            q, kv, i = 2 * 16, 1 * 16, cfg.intermediate_size // 2  # rows of this rank's heads / channels
            assert torch.equal(b.q_proj.weight, a.q_proj.weight[rank * q : (rank + 1) * q])
            assert torch.equal(b.q_proj.bias, a.q_proj.bias[rank * q : (rank + 1) * q])
            assert torch.equal(b.k_proj.weight, a.k_proj.weight[rank * kv : (rank + 1) * kv])
            assert torch.equal(b.v_proj.bias, a.v_proj.bias[rank * kv : (rank + 1) * kv])
            assert isinstance(b.o_proj, RowParallelLinear)
            assert torch.equal(b.o_proj.weight, a.o_proj.weight[:, rank * q : (rank + 1) * q])
            assert (b.num_heads, b.num_kv_heads) == (2, 1)
            up, down = part.mlp.up_proj.weight, part.mlp.down_proj.weight
            assert torch.equal(up, full.mlp.up_proj.weight[rank * i : (rank + 1) * i])
            assert torch.equal(down, full.mlp.down_proj.weight[:, rank * i : (rank + 1) * i])
            assert torch.equal(part.input_layernorm.weight, full.input_layernorm.weight)
        assert torch.equal(model.model.embed_tokens.weight, whole.model.embed_tokens.weight)
        assert torch.equal(model.lm_head.weight, whole.lm_head.weight)
        # The state dict keeps Hugging Face's names, at the rank's shapes.
        assert set(model.state_dict()) == set(whole.state_dict())


def test_a_rank_reads_its_blocks_from_the_checkpoint_as_shard_cuts_them(folder: Path) -> None:
    """`load_folder_shard` (slices read from the safetensors file, nothing whole in memory) gives
    the parameters of the whole model cut by `shard_`, bit for bit."""
    from kvtier.parallel.load import load_folder_shard

    for rank in (0, 1):
        group: Any = _NoCommunication(rank, 2)
        cut, whole = load_safetensors_folder(folder, torch.device("cpu"), torch.float32)
        shard_(cut, group)
        read, cfg = load_folder_shard(folder, torch.device("cpu"), torch.float32, group=group)
        assert read.config == cut.config == cfg == rank_config(whole, 2)
        expected = dict(cut.named_parameters())
        got = dict(read.named_parameters())
        assert set(got) == set(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        assert isinstance(read.model.layers[0].mlp.down_proj, RowParallelLinear)


def test_split_dim_names_the_cuts_shard_makes() -> None:
    from kvtier.model.llama import CausalLM
    from kvtier.parallel.tensor import split_dim

    cfg = preset_config("qwen2-7b")  # q/k/v biases: cut with their rows
    with torch.device("meta"):
        whole = dict(CausalLM(cfg).named_parameters())
        model = CausalLM(cfg)
    shard_(model, _NoCommunication(1, 4))  # type: ignore[arg-type]
    for name, p in model.named_parameters():
        shape, dim = list(whole[name].shape), split_dim(name)
        if dim is not None:
            shape[dim] //= 4
        assert list(p.shape) == shape, name
    assert split_dim("model.layers.0.self_attn.o_proj.bias") is None  # added after the all-reduce


def test_shard_cuts_a_model_on_the_meta_device() -> None:
    from kvtier.model.llama import CausalLM

    with torch.device("meta"):
        model = CausalLM(preset_config("llama-3-70b"))
    shard_(model, _NoCommunication(3, 4))  # type: ignore[arg-type]
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.weight.shape == (16 * 128, 8192)
    assert layer.self_attn.k_proj.weight.shape == (2 * 128, 8192)
    assert layer.self_attn.o_proj.weight.shape == (8192, 16 * 128)
    assert layer.mlp.down_proj.weight.shape == (8192, 7168)
    assert sum(p.numel() for p in model.parameters()) == model.config.num_parameters()


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["plan", *argv, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_plan_prints_one_ranks_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvtier plan --tensor-parallel 4` plans the rank config on one GPU and 1/4 of the host."""
    args = ("--model", "llama-3-70b", "--context", "1M", "--gpu-memory", "80GiB", "--gpu", "h200")
    doc = _plan_json(capsys, *args, "--tensor-parallel", "4")
    expected = plan_kv(
        rank_config(preset_config("llama-3-70b"), 4),
        1 << 20,
        gpu_budget=80 * GiB,
        host_budget=128 * GiB,
        hardware=hardware_preset("h200"),
    )
    rec = doc["recommended"]
    assert (rec["group_size"], rec["resident_slices"], rec["num_slices"], rec["chunk_size"]) == (
        expected.group_size,
        expected.resident_slices,
        expected.num_slices,
        expected.chunk_size,
    )
    assert rec["num_slices"] == 80 * 2 // expected.group_size  # 2 KV heads per rank
    assert 0 < rec["resident_slices"] < rec["num_slices"]  # 1M tokens do not fit one rank's GPU
    tp = doc["tensor_parallel"]
    assert (tp["ranks"], tp["kv_heads_per_rank"], tp["query_heads_per_rank"]) == (4, 2, 16)
    assert tp["pcie_gb_per_decode_token_all_ranks"] == 4 * expected.pcie_bytes_per_decode_token / 1e9
    assert doc["methods"]["auto"]["weights_gb"] == round(38_430_851_072 / 1e9, 4)
    assert main(["plan", *args]) == 2  # one GPU: the whole model's 141 GB of weights do not fit
    assert "weights 141.11 GB" in capsys.readouterr().err


def test_plan_and_generate_refuse_a_size_that_does_not_split_the_model(
    capsys: pytest.CaptureFixture[str], folder: Path
) -> None:
    assert main(["plan", "--model", "llama-3-70b", "--tensor-parallel", "3"]) == 2
    assert "must divide the model's 8 KV heads" in capsys.readouterr().err
    # Checked on the config before any process starts (the folder's model has 2 KV heads).
    code = main(["generate", "--model", str(folder), "--prompt", "x", "--tensor-parallel", "4"])
    assert code == 2
    assert "--tensor-parallel 4 must divide the model's 2 KV heads" in capsys.readouterr().err


def test_generate_passes_tensor_parallel_to_the_llm() -> None:
    from kvtier.cli.main import build_parser
    from kvtier.cli.options import llm_kwargs

    args = build_parser().parse_args(["generate", "--prompt", "x", "--tensor-parallel", "2"])
    assert llm_kwargs(args)["tensor_parallel"] == 2
    assert llm_kwargs(build_parser().parse_args(["generate", "--prompt", "x"]))["tensor_parallel"] is None
    assert llm_kwargs(build_parser().parse_args(["serve"]))["tensor_parallel"] is None  # no such flag


def test_llm_refuses_what_tensor_parallelism_does_not_run(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.engine.llm import LLM

    with pytest.raises(ConfigError, match="lossless placements"):
        LLM(str(folder), device="cpu", tensor_parallel=2, kv_quant="int8")
    with pytest.raises(ConfigError, match="must divide the model's 2 KV heads"):
        LLM(str(folder), device="cpu", tensor_parallel=4)
    with pytest.raises(ConfigError, match="between 1 and the model's 3 layers"):
        LLM(str(folder), device="cpu", pipeline_parallel=4)
    with pytest.raises(ConfigError, match="cannot be combined yet"):
        LLM(str(folder), device="cpu", tensor_parallel=2, pipeline_parallel=2)
    # Under torchrun (its environment), the asked size must be the number of processes.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="--tensor-parallel 1 disagrees with the 2 processes"):
        LLM(str(folder), device="cpu", tensor_parallel=1)


def test_plan_of_a_rank_is_the_plan_of_its_config() -> None:
    """The engine's planning inputs under N ranks: the rank config, one GPU, 1/N of the host."""
    from kvtier.planner.sharding import rank_host_budget

    assert rank_host_budget(512 * GiB, 4) == 128 * GiB
    assert rank_host_budget(None, 4) is None
    cfg = rank_config(preset_config("llama-3-8b"), 2)
    plan = plan_kv(cfg, 512 * 1024, gpu_budget=24 * 10**9, hardware=hardware_preset("h200"))
    assert asdict(plan)["num_slices"] == 32 * 4 // plan.group_size


def test_pipeline_stages_take_contiguous_layers_the_first_ones_one_more() -> None:
    from kvtier.planner.sharding import check_pipeline_parallel, stage_config, stage_layers

    assert [stage_layers(80, 3, r) for r in range(3)] == [range(0, 27), range(27, 54), range(54, 80)]
    assert [len(stage_layers(3, 2, r)) for r in range(2)] == [2, 1]
    cfg = preset_config("llama-3-70b")
    assert stage_config(cfg, 3, 2).num_layers == 26
    with pytest.raises(ConfigError, match="between 1 and the model's 80 layers"):
        check_pipeline_parallel(cfg, 81)


def test_stage_keeps_its_layers_and_hooks_the_boundaries() -> None:
    from kvtier.model.llama import CausalLM
    from kvtier.parallel.pipeline import local_name, stage_

    with torch.device("meta"):
        model = CausalLM(preset_config("llama-3-70b"))
    stage_(model, _NoCommunication(1, 3))  # type: ignore[arg-type]
    layers = model.model.layers
    assert len(layers) == model.config.num_layers == 27
    assert sum(p.numel() for p in model.parameters()) == model.config.num_parameters()
    # A middle stage receives its input and sends its output; the others only one of the two.
    assert (len(layers[0]._forward_pre_hooks), len(layers[-1]._forward_hooks)) == (1, 1)
    up = "model.layers.{}.mlp.up_proj.weight"
    assert local_name(up.format(30), range(27, 54)) == up.format(3)
    assert local_name(up.format(3), range(27, 54)) is None
    assert local_name("lm_head.weight", range(27, 54)) == "lm_head.weight"


def test_a_stage_reads_its_layers_from_the_checkpoint(folder: Path) -> None:
    from kvtier.parallel.load import load_folder_rank
    from kvtier.parallel.pipeline import stage_

    for rank in (0, 1):
        group: Any = _NoCommunication(rank, 2)
        cut, _ = load_safetensors_folder(folder, torch.device("cpu"), torch.float32)
        stage_(cut, group)
        read, cfg = load_folder_rank(folder, torch.device("cpu"), torch.float32, group=group, pipeline=True)
        assert cfg == cut.config and cfg.num_layers == (2, 1)[rank]
        expected, got = dict(cut.named_parameters()), dict(read.named_parameters())
        assert set(got) == set(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_plan_prints_the_first_pipeline_stage(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.planner.sharding import stage_config

    args = ("--model", "llama-3-70b", "--context", "1M", "--gpu-memory", "80GiB", "--gpu", "h200")
    doc = _plan_json(capsys, *args, "--pipeline-parallel", "3")
    expected = plan_kv(
        stage_config(preset_config("llama-3-70b"), 3, 0),
        1 << 20,
        gpu_budget=80 * GiB,
        host_budget=512 * GiB // 3,
        hardware=hardware_preset("h200"),
    )
    rec = doc["recommended"]
    assert (rec["resident_slices"], rec["num_slices"]) == (expected.resident_slices, expected.num_slices)
    assert doc["pipeline_parallel"]["layers_per_stage"] == [27, 27, 26]
    assert main(["plan", *args, "--pipeline-parallel", "2", "--tensor-parallel", "2"]) == 2
    assert "cannot be combined" in capsys.readouterr().err


def test_a_stage_keeps_its_per_layer_switches() -> None:
    from kvtier.planner.sharding import stage_config, stage_layers

    gemma = preset_config("gemma-2-2b")  # 26 layers, sliding-window attention on the even ones
    assert gemma.sliding_layers == tuple(range(0, 26, 2))
    stage = stage_config(gemma, 3, 1)  # layers 9..17: sliding on 10, 12, 14, 16
    assert stage_layers(26, 3, 1) == range(9, 18)
    assert stage.sliding_layers == (1, 3, 5, 7)
    deepseek = preset_config("deepseek-v2-lite")  # its first layer keeps a dense MLP
    assert deepseek.moe is not None and deepseek.moe.first_dense == 1
    firsts = [stage_config(deepseek, 3, r).moe for r in range(3)]
    assert [m.first_dense for m in firsts if m is not None] == [1, 0, 0]
    with pytest.raises(ConfigError, match=r"latent attention.*use --pipeline-parallel"):
        rank_config(deepseek, 2)
