"""An `LLM`'s model on its device: this process's CUDA memory capped at `gpu_memory`, the model
loaded (whole, with a MoE's routed experts on the host when they must be, or a rank's part), and
its projections fused."""

from __future__ import annotations

import contextlib

import torch

from kvtier.engine.config import EngineConfig
from kvtier.loading import LoadedModel, load_model
from kvtier.loading.resolve import read_model_config
from kvtier.model.fuse import fuse_projections_
from kvtier.model.llama import CausalLM
from kvtier.parallel.group import RankGroup
from kvtier.parallel.load import load_rank_model
from kvtier.planner.memory import place_experts


def load_llm_model(
    model: str | None,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    parallel: RankGroup | None,
    pipeline: bool,
) -> LoadedModel:
    """`model` (`kvtier.loading.load_model`'s spec) on `device` in `dtype`, once this process's
    CUDA memory is capped at `config.gpu_memory`: whole in one process, else this rank's part
    (a pipeline stage's layers when `pipeline`, else a tensor-parallel shard), agreed by every
    rank (one that fails to load fails them all)."""
    if device.type == "cuda" and config.gpu_memory is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, config.gpu_memory / total)
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    if parallel is None:
        return load_model(
            model, device, dtype, config.seed, experts_on_host=experts_on_host(model, config, device, dtype)
        )
    with parallel.agree("loading the model"):
        return load_rank_model(model, parallel, device, dtype, config.seed, pipeline=pipeline)


def experts_on_host(
    model: str | None, config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether a MoE model's routed experts go to host memory (`place_experts`: with "auto",
    when the weights would leave too little of --gpu-memory on a GPU)."""
    if config.experts == "gpu":
        return False  # NOTE: no config read for the default of most models
    itemsize = dtype.itemsize
    cfg = place_experts(
        read_model_config(model),
        config.gpu_memory,
        itemsize,
        config.experts,
        on_gpu=device.type == "cuda",
    )
    return cfg.moe is not None and cfg.moe.experts_on_host


def fuse_llm_model(model: CausalLM, device: torch.device) -> None:
    """Fuse the loaded `model`'s q/k/v and gate/up projections into one matmul each
    (`kvtier.model.fuse`), as far as memory allows; mutates the model."""
    # NOTE: after sharding (a rank fuses its own heads). Fusing a block briefly holds its
    # weights twice; a model that fills the budget leaves the blocks past an OOM unfused.
    with contextlib.suppress(torch.OutOfMemoryError):
        fuse_projections_(model)
    if device.type == "cuda":
        # NOTE: the separate weights' segments are free now; hand them back before the
        # planner and the memory cap see this process's reserved bytes.
        torch.cuda.empty_cache()
