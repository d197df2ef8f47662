"""Loading one rank's shard of a `--model`, without the whole model in memory.

A preset is built at the rank's shapes (`random_rank_model`). A Hugging Face folder (a GGUF
file: its conversion) is built on the meta device, cut by `shard_`, materialized on the rank's
device and filled from the safetensors files slice by slice (`safe_open(...).get_slice`): a rank
reads only its blocks of the split weights, and host memory peaks near one tensor's block.
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
from kvtier.loading.weights import build_empty
from kvtier.model.llama import CausalLM
from kvtier.parallel.group import RankGroup
from kvtier.parallel.tensor import random_rank_model, shard_, split_dim


def load_rank_model(
    spec: str | None, group: RankGroup, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> LoadedModel:
    """Rank `group.rank`'s shard of `spec` on `device`; its `config` is the rank's. A GGUF file is
    converted by rank 0 alone, before the other ranks read the conversion."""
    with group.agree("converting the model"):
        if group.is_rank0:
            resolve_folder(spec)
    if resolve_folder(spec) is None:  # NOTE: after rank 0's, a cached conversion
        assert spec is not None
        cfg = preset_config(spec)
        model = random_rank_model(cfg, group, device, dtype, seed)
        return LoadedModel(spec, model, model.config, None, cfg.eos_token_ids)
    return load_model(spec, device, dtype, seed, weights=partial(load_folder_shard, group=group))


def load_folder_shard(
    folder: Path, device: torch.device, dtype: torch.dtype, *, group: RankGroup
) -> tuple[CausalLM, ModelConfig]:
    """Rank `group.rank`'s shard of the safetensors folder `folder`, and its config (the rank's,
    `kvtier.planner.sharding.rank_config` of the folder's)."""
    cfg = ModelConfig.from_json(folder / "config.json")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has a config.json but no *.safetensors weights")
    model = shard_(build_empty(cfg, torch.device("meta"), dtype), group)
    model.to_empty(device=device)
    model.tie_weights()
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not a dict
                    if name in params:
                        _copy_block(params[name], shard.get_slice(name), name, f, group)
                        seen.add(name)
        except (OSError, RuntimeError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"cannot read {f}: {e}") from None
    if cfg.tie_word_embeddings:
        seen.add("lm_head.weight")
    missing = sorted(set(params) - seen)
    if missing:
        raise ModelLoadError(
            f"{folder}: {len(missing)} weights missing from the safetensors files, e.g. {missing[:3]}"
        )
    return model, model.config


def _copy_block(param: torch.Tensor, sliced: object, name: str, f: Path, group: RankGroup) -> None:
    """Copy this rank's block of checkpoint tensor `name` (a safetensors slice) into `param`."""
    shape = list(sliced.get_shape())  # type: ignore[attr-defined]
    dim = split_dim(name)
    whole = list(param.shape)
    if dim is not None:
        whole[dim] *= group.size
    if shape != whole:
        raise ModelLoadError(f"{f.name}: {name} has shape {tuple(shape)}, the config implies {tuple(whole)}")
    if dim is None:
        block = sliced[:]  # type: ignore[index]
    else:
        n = param.shape[dim]
        cut = slice(group.rank * n, (group.rank + 1) * n)
        block = sliced[cut] if dim == 0 else sliced[:, cut]  # type: ignore[index]
    with torch.no_grad():
        param.copy_(block)
