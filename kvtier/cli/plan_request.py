"""What `kvtier plan` plans: the model `--model` names (a preset, a folder, a config.json or a
.gguf file) and the `PlanRequest` the options make of it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvtier.cli.plan_parallel import rank_of
from kvtier.config import ModelConfig
from kvtier.errors import ModelLoadError
from kvtier.loading.gguf import gguf_model_config, is_gguf_file
from kvtier.loading.presets import PRESETS, preset_config
from kvtier.planner.hardware import hardware_preset
from kvtier.planner.memory import DTYPE_BYTES, host_weight_bytes, place_experts
from kvtier.planner.report import PlanRequest
from kvtier.planner.sharding import rank_host_budget


def resolve_model(spec: str) -> ModelConfig:
    """A preset name, a folder holding config.json, a config.json path or a .gguf file (its
    metadata: no weights are read or converted)."""
    if spec in PRESETS:
        return preset_config(spec)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelConfig.from_json(path / "config.json")
    if path.is_file():
        if is_gguf_file(path):
            return gguf_model_config(path)
        return _config_json_file(path)
    raise ModelLoadError(
        f"--model {spec!r} is neither a preset, a folder with config.json, a config.json file nor "
        f"a .gguf file; known presets: {', '.join(sorted(PRESETS))}"
    )


def _config_json_file(path: Path) -> ModelConfig:
    """The config.json at `path`; any other file is a ModelLoadError saying what plan reads."""
    not_config = f"--model {path} is not a config.json (not UTF-8 JSON) nor a .gguf file"
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ModelLoadError(f"cannot read --model {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ModelLoadError(not_config) from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{not_config}: {e}") from None
    if not isinstance(d, dict):
        raise ModelLoadError(f"--model {path} holds JSON but not an object; is it a config.json?")
    return ModelConfig.from_hf_dict(d)


def build_request(args: argparse.Namespace) -> PlanRequest:
    """Parse and check the options (ConfigError / ModelLoadError on bad input)."""
    whole = resolve_model(args.model)
    cfg, ranks, label = rank_of(args, whole)
    hw = hardware_preset(
        args.gpu,
        tflops=args.tflops,
        hbm_bw=args.hbm_bw,
        pcie_bw=args.pcie_bw,
        cpu_attention_bw=args.cpu_attention_bw,
    )
    gpu = hw.memory_bytes if args.gpu_memory is None else args.gpu_memory
    cfg = place_experts(cfg, gpu, DTYPE_BYTES[args.dtype], args.experts)
    host = rank_host_budget(args.host_memory, ranks)
    assert host is not None
    host -= host_weight_bytes(cfg, DTYPE_BYTES[args.dtype])  # the experts' host memory, if there
    return PlanRequest(
        cfg=cfg,
        model=args.model if ranks == 1 else f"{args.model} ({label})",
        context=args.context,
        gpu_budget=gpu,
        host_budget=host,
        disk_budget=args.disk,
        dtype_bytes=DTYPE_BYTES[args.dtype],
        hardware=hw,
        chunk_size=args.chunk_size,
        group_size=args.group_size,
        policy=args.policy,
        block_size=args.block_size,
        activation_model=args.activations,
        cpu_attention=args.cpu_attention if ranks == 1 else "off",  # NOTE: one CPU, N ranks: not modelled
    )
