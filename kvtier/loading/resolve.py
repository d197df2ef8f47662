"""Turning a `--model` value into a loaded model and (when it has one) a tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.config import ModelConfig
from kvtier.errors import ModelLoadError
from kvtier.loading.presets import PRESETS, preset_config
from kvtier.loading.weights import load_safetensors_folder, random_model, read_generation_eos
from kvtier.model.llama import CausalLM


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it."""

    name: str
    model: CausalLM
    config: ModelConfig
    tokenizer: Any | None  # a transformers tokenizer, None for random-weight presets
    eos_token_ids: tuple[int, ...]


def resolve_folder(spec: str | None) -> Path | None:
    """The HF folder a spec points at (converting GGUF files once), or None for a preset."""
    if spec is None:
        from kvtier.loading.embedded import embedded_gguf_path
        from kvtier.loading.gguf import gguf_to_hf_folder

        return gguf_to_hf_folder(embedded_gguf_path())
    if spec in PRESETS:
        return None
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        from kvtier.loading.gguf import gguf_to_hf_folder

        return gguf_to_hf_folder(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is not a Hugging Face model folder: it has no config.json")
        return path
    raise ModelLoadError(
        f"model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}), "
        "a Hugging Face model folder nor a .gguf file"
    )


def load_model(spec: str | None, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """Load `spec`: None = the embedded SmolLM2, a preset name, an HF folder or a GGUF file."""
    folder = resolve_folder(spec)
    if folder is None:
        assert spec is not None
        cfg = preset_config(spec)
        return LoadedModel(spec, random_model(cfg, device, dtype, seed), cfg, None, cfg.eos_token_ids)
    model, cfg = load_safetensors_folder(folder, device, dtype)
    tokenizer = _load_tokenizer(folder)
    eos = set(cfg.eos_token_ids) | set(read_generation_eos(folder))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    name = spec if spec is not None else "SmolLM2-135M-Instruct (embedded)"
    return LoadedModel(name, model, cfg, tokenizer, tuple(sorted(eos)))


def _load_tokenizer(folder: Path) -> Any | None:
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {e}") from None
