"""Loading one rank's part of a `--model` (a tensor-parallel shard or a pipeline stage), without
the whole model in memory.

A preset is built at the rank's shapes (`random_rank_model`, `random_stage_model`). A Hugging
Face folder (a GGUF file: its conversion) is built on the meta device, cut by the transform
(`shard_`, `stage_`), materialized on the rank's device and filled from the safetensors files
tensor by tensor through `safe_open(...).get_slice`: a rank reads only its blocks of the split
weights (its layers, for a stage), and host memory peaks near one tensor's block.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from kvtier.config import ModelConfig
from kvtier.errors import ModelLoadError
from kvtier.loading import LoadedModel, load_model
from kvtier.loading.presets import preset_config
from kvtier.loading.resolve import resolve_folder
from kvtier.loading.weights import build_empty, check_all_loaded
from kvtier.model.llama import CausalLM
from kvtier.parallel.group import RankGroup
from kvtier.parallel.pipeline import local_name, random_stage_model, stage_
from kvtier.parallel.tensor import random_rank_model, shard_, split_dim
from kvtier.planner.sharding import stage_layers


def load_rank_model(
    spec: str | None,
    group: RankGroup,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    pipeline: bool = False,
) -> LoadedModel:
    """Rank `group.rank`'s shard of `spec` (its pipeline stage when `pipeline`) on `device`; its
    `config` is the rank's. A GGUF file is converted by rank 0 alone, before the other ranks read
    the conversion."""
    with group.agree("converting the model"):
        if group.is_rank0:
            resolve_folder(spec)
    if resolve_folder(spec) is None:  # NOTE: after rank 0's, a cached conversion
        assert spec is not None
        cfg = preset_config(spec)
        build = random_stage_model if pipeline else random_rank_model
        model = build(cfg, group, device, dtype, seed)
        return LoadedModel(spec, model, model.config, None, cfg.eos_token_ids)
    weights = partial(load_folder_rank, group=group, pipeline=pipeline)
    return load_model(spec, device, dtype, seed, weights=weights)


def load_folder_shard(
    folder: Path, device: torch.device, dtype: torch.dtype, *, group: RankGroup
) -> tuple[CausalLM, ModelConfig]:
    """Rank `group.rank`'s tensor-parallel shard of the safetensors folder `folder`."""
    return load_folder_rank(folder, device, dtype, group=group, pipeline=False)


def load_folder_rank(
    folder: Path, device: torch.device, dtype: torch.dtype, *, group: RankGroup, pipeline: bool
) -> tuple[CausalLM, ModelConfig]:
    """Rank `group.rank`'s part of the safetensors folder `folder` (its tensor-parallel shard, or
    its stage when `pipeline`), and its config (the rank's)."""
    cfg = ModelConfig.from_json(folder / "config.json")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has a config.json but no *.safetensors weights")
    model = build_empty(cfg, torch.device("meta"), dtype)
    model = stage_(model, group) if pipeline else shard_(model, group)
    model.to_empty(device=device)
    model.tie_weights()
    params = dict(model.named_parameters())
    layers = stage_layers(cfg.num_layers, group.size, group.rank) if pipeline else range(cfg.num_layers)
    seen: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not a dict
                    local = local_name(name, layers)
                    if local in params:
                        blocks = None if pipeline else group
                        _copy_block(params[local], shard.get_slice(name), name, f, blocks)
                        seen.add(local)
        except (OSError, RuntimeError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"cannot read {f}: {e}") from None
    check_all_loaded(folder, cfg, params, seen)
    return model, model.config


def _copy_block(param: torch.Tensor, sliced: object, name: str, f: Path, group: RankGroup | None) -> None:
    """Copy checkpoint tensor `name` (a safetensors slice) into `param`: whole, or this rank's
    block of it when `group` (tensor parallelism) splits it."""
    shape = list(sliced.get_shape())  # type: ignore[attr-defined]
    dim = None if group is None else split_dim(name)
    whole = list(param.shape)
    if dim is not None and group is not None:
        whole[dim] *= group.size
    if shape != whole:
        raise ModelLoadError(f"{f.name}: {name} has shape {tuple(shape)}, the config implies {tuple(whole)}")
    if dim is None or group is None:
        block = sliced[:]  # type: ignore[index]
    else:
        n = param.shape[dim]
        cut = slice(group.rank * n, (group.rank + 1) * n)
        block = sliced[cut] if dim == 0 else sliced[:, cut]  # type: ignore[index]
    with torch.no_grad():
        param.copy_(block)
