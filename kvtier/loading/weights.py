"""Building a `CausalLM` from a preset, a Hugging Face folder or a GGUF file.

Models are built on the meta device and materialized straight on the target device in the
target dtype; safetensors shards are memory-mapped and read tensor by tensor, so peak host
memory stays near one tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from kvtier.config import ModelConfig
from kvtier.errors import ModelLoadError
from kvtier.model.llama import CausalLM


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_empty(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """An uninitialized model with storage on `device` in `dtype` (no host round trip)."""
    with _default_dtype(dtype), torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    return model.eval()


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A model of real shapes with random weights (for benchmarks and tests)."""
    model = build_empty(cfg, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    identity = 0.0 if cfg.family == "gemma2" else 1.0  # Gemma's norms scale by (1 + weight)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(identity)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def load_safetensors_folder(
    folder: Path, device: torch.device, dtype: torch.dtype
) -> tuple[CausalLM, ModelConfig]:
    """Load config.json and every *.safetensors shard of a Hugging Face model folder."""
    folder = Path(folder)
    cfg = ModelConfig.from_json(folder / "config.json")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has a config.json but no *.safetensors weights")
    model = build_empty(cfg, device, dtype)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    dev = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device=dev) as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not a dict
                    if name not in params:
                        continue  # e.g. rotary inv_freq buffers, or lm_head when tied
                    tensor = shard.get_tensor(name)
                    if tensor.shape != params[name].shape:
                        raise ModelLoadError(
                            f"{f.name}: {name} has shape {tuple(tensor.shape)}, "
                            f"the config implies {tuple(params[name].shape)}"
                        )
                    with torch.no_grad():
                        params[name].copy_(tensor)
                    seen.add(name)
        except (OSError, RuntimeError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"cannot read {f}: {e}") from None
    check_all_loaded(folder, cfg, params, seen)
    return model, cfg


def read_generation_eos(folder: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, if the folder has one."""
    path = Path(folder) / "generation_config.json"
    if not path.exists():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def check_all_loaded(folder: Path, cfg: ModelConfig, params: Mapping[str, object], seen: set[str]) -> None:
    """Raise ModelLoadError if a parameter of the model got no weights from the checkpoint (a
    tied LM head needs none)."""
    missing = sorted(set(params) - seen - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if missing:
        raise ModelLoadError(
            f"{folder}: {len(missing)} weights missing from the safetensors files, e.g. {missing[:3]}"
        )
