"""The pipeline-parallel transform: a built `CausalLM` becomes one stage, a contiguous run of its
layers (`kvtier.planner.sharding.stage_layers`), in place.

    stage 0: embed -> layers 0..a  --send-->  stage 1: (recv) layers a+1..b  --send--> ... last stage
    every stage: final norm + LM head on its output; the last stage's logits are the model's

Stage r keeps only its layers, renumbered from 0 (so its `TieredKVStore` has its layers'
slices, on its own GPU and host tiers). Two forward hooks, no change to the model's code: the
first kept layer's input is replaced by the hidden states received from stage r-1, the last
kept layer's output is sent to stage r+1. Embeddings, final norm and LM head stay on every stage
(the embedding's output is overwritten on stages past 0, the other stages' logits are unused):
the last stage's sampled token is broadcast (`RankGroup.synced(src=size-1)`).

One sequence's stages run one after the other, so decode does not stream the stages' KV in
parallel: pipeline parallelism here buys GPU memory (each stage holds 1/N of the layers and
their KV) over a weak interconnect (one [T, hidden] tensor per stage boundary), not bandwidth.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvtier.config import ModelConfig
from kvtier.loading.weights import random_model
from kvtier.model.llama import CausalLM
from kvtier.parallel.group import RankGroup
from kvtier.planner.sharding import stage_config, stage_layers


def _parallelize_(model: CausalLM, cfg: ModelConfig, group: RankGroup, cut: bool) -> CausalLM:
    """Make `model` stage `group.rank` of a model of config `cfg` (dropping the other stages'
    layers when `cut`; else it holds the stage's layers already)."""
    rank, size = group.rank, group.size
    if cut:
        kept = stage_layers(cfg.num_layers, size, rank)
        model.model.layers = nn.ModuleList(model.model.layers[i] for i in kept)
    layers = model.model.layers
    if rank > 0:

        def receive(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = torch.empty_like(args[0])  # [T, hidden]: every stage runs the same tokens
            dist.recv(x, src=rank - 1)
            return (x, *args[1:])

        layers[0].register_forward_pre_hook(receive)
    if rank < size - 1:

        def send(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            dist.send(out.contiguous(), dst=rank + 1)  # [T, hidden]

        layers[-1].register_forward_hook(send)
    model.config = stage_config(cfg, size, rank)
    return model


def stage_(model: CausalLM, group: RankGroup) -> CausalLM:
    """Cut a whole `model` (any device, meta included) to stage `group.rank`, in place; its
    `config` becomes the stage's. Returns `model`."""
    return _parallelize_(model, model.config, group, cut=True)


def random_stage_model(
    cfg: ModelConfig, group: RankGroup, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> CausalLM:
    """Stage `group.rank` of a random-weight model of `cfg`, built with the stage's layers only.

    NOTE: every stage draws its embeddings first with the same seed, so they agree; the layers
    differ from `random_model(cfg)`'s (another random model of the same shapes)."""
    model = random_model(stage_config(cfg, group.size, group.rank), device, dtype, seed)
    return _parallelize_(model, cfg, group, cut=False)


def local_name(name: str, layers: range) -> str | None:
    """The stage's parameter name for checkpoint name `name` ("model.layers.12.mlp.up_proj.weight"
    -> "model.layers.2.mlp.up_proj.weight" on a stage of layers 10..19); None: another stage's."""
    prefix = "model.layers."
    if not name.startswith(prefix):
        return name
    index, _, rest = name[len(prefix) :].partition(".")
    g = int(index)
    return f"{prefix}{g - layers.start}.{rest}" if g in layers else None
