"""An `LLM`'s ranks: the split its options ask for (`tensor_parallel` shards by KV heads, or
`pipeline_parallel` stages of layers), checked on the model's config and the LLM's method and
device before any process starts, then its rank group joined (`kvtier.parallel.spawn`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtier.engine.config import EngineConfig
from kvtier.errors import ConfigError
from kvtier.loading.resolve import read_model_config
from kvtier.methods import MethodChoice
from kvtier.parallel.group import RankGroup, launched_world_size
from kvtier.parallel.spawn import Workers, start_ranks
from kvtier.planner.sharding import check_pipeline_parallel, check_tensor_parallel


def start_llm_ranks(
    factory: Callable[..., Any],
    options: dict[str, Any],
    method: MethodChoice,
    config: EngineConfig,
    device: torch.device,
) -> tuple[RankGroup | None, Workers | None, bool]:
    """An LLM's rank group (None: one process), the workers it started (rank 0 outside
    torchrun: ranks 1..N-1, each running `factory(**options)`, `options` being the LLM's
    arguments), and whether the ranks are pipeline stages (else tensor-parallel shards). The
    split is checked on the model's config before any process starts."""
    tp, pp = options["tensor_parallel"] or 1, options["pipeline_parallel"] or 1
    if tp > 1 and pp > 1:
        raise ConfigError("--tensor-parallel and --pipeline-parallel cannot be combined yet; choose one")
    pipeline = pp > 1
    size = options["pipeline_parallel"] if pipeline else options["tensor_parallel"]
    launched = launched_world_size() or 1
    if size in (None, 1) and launched == 1:
        return None, None, pipeline
    check = check_pipeline_parallel if pipeline else check_tensor_parallel
    check(read_model_config(options["model"]), size or launched)
    if not method.lossless:
        raise ConfigError(
            "tensor and pipeline parallelism run the lossless placements (--kv gpu, layer, head, "
            "auto) only for now; drop the lossy method options"
        )
    if config.device not in ("auto", "cuda", "cpu"):
        raise ConfigError(
            f"--device {config.device!r}: with several ranks, rank r runs on cuda:r of its "
            "machine; pass --device cuda (or auto, or cpu)"
        )
    group, workers = start_ranks(size, device.type, factory, options)
    return group, workers, pipeline
