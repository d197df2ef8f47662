"""Loading one rank's shard of a `--model`: the loaded model, cut by `tensor.shard_`."""

from __future__ import annotations

import torch

from kvtier.loading import LoadedModel, load_model
from kvtier.loading.presets import preset_config
from kvtier.loading.resolve import resolve_folder
from kvtier.parallel.group import RankGroup
from kvtier.parallel.tensor import random_rank_model, shard_


def load_rank_model(
    spec: str | None, group: RankGroup, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> LoadedModel:
    """Rank `group.rank`'s shard of `spec` on `device`; its `config` is the rank's.

    A preset is built at the rank's shapes directly (`random_rank_model`). A folder or GGUF file
    is loaded whole into host memory, cut, and the shard moved to `device`: peak host memory is
    one whole model per rank while loading. A GGUF file is converted by rank 0 alone, before
    the other ranks read the conversion.
    """
    with group.agree("converting the model"):
        if group.is_rank0:
            resolve_folder(spec)
    folder = resolve_folder(spec)  # NOTE: after rank 0's, a cached conversion
    if folder is None:
        assert spec is not None
        cfg = preset_config(spec)
        model = random_rank_model(cfg, group, device, dtype, seed)
        return LoadedModel(spec, model, model.config, None, cfg.eos_token_ids)
    loaded = load_model(spec, torch.device("cpu"), dtype, seed)
    model = shard_(loaded.model, group).to(device)
    return LoadedModel(loaded.name, model, model.config, loaded.tokenizer, loaded.eos_token_ids)
