"""Turning a `--model` value into a loaded model and (when it has one) a tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError, ModelLoadError
from kvtier.loading.presets import PRESETS, preset_config
from kvtier.loading.weights import (
    load_safetensors_folder,
    random_model,
    read_generation_eos,
    with_experts_on_host,
)
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
    from kvtier.loading.gguf import gguf_to_hf_folder

    kind, path = _classify(spec)
    if kind == "preset":
        return None
    return gguf_to_hf_folder(path) if kind == "gguf" else path


def read_model_config(spec: str | None) -> ModelConfig:
    """The ModelConfig `load_model(spec)` would load, without loading (or converting) weights.

    For a GGUF file: its cached conversion's config.json, else its metadata (`gguf_model_config`).
    """
    from kvtier.loading.gguf import gguf_model_config

    kind, path = _classify(spec)
    if kind == "preset":
        assert spec is not None
        return preset_config(spec)
    return gguf_model_config(path) if kind == "gguf" else ModelConfig.from_json(path / "config.json")


def _classify(spec: str | None) -> tuple[str, Path]:
    """("preset" | "gguf" | "folder", path) for a `--model` value; ModelLoadError when it is none."""
    if spec is None:
        from kvtier.loading.embedded import embedded_gguf_path

        return "gguf", embedded_gguf_path()
    if spec in PRESETS:
        return "preset", Path()
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        return "gguf", path
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is not a Hugging Face model folder: it has no config.json")
        return "folder", path
    raise ModelLoadError(
        f"model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}), "
        "a Hugging Face model folder nor a .gguf file"
    )


FolderLoader = Callable[[Path, torch.device, torch.dtype], tuple[CausalLM, ModelConfig]]


def load_model(
    spec: str | None,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    weights: FolderLoader = load_safetensors_folder,
    experts_on_host: bool = False,
) -> LoadedModel:
    """Load `spec`: None = the embedded SmolLM2, a preset name, an HF folder or a GGUF file.
    `weights` builds the model of a folder (another: e.g. one tensor-parallel rank's shard);
    `experts_on_host` keeps a MoE model's routed experts in host memory (`build_empty`)."""
    folder = resolve_folder(spec)
    if folder is None:
        assert spec is not None
        cfg = with_experts_on_host(preset_config(spec), experts_on_host)
        return LoadedModel(spec, random_model(cfg, device, dtype, seed), cfg, None, cfg.eos_token_ids)
    if experts_on_host:
        if weights is not load_safetensors_folder:
            raise ConfigError("experts in host memory need the default loader (not a parallel rank's)")
        model, cfg = load_safetensors_folder(folder, device, dtype, experts_on_host=True)
    else:
        model, cfg = weights(folder, device, dtype)
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
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {e}") from None
    _skip_ignored_cleanup(tokenizer)
    return tokenizer


_FORCE_BPE_CLEANUP = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


def _skip_ignored_cleanup(tokenizer: Any) -> None:
    """Turn `clean_up_tokenization_spaces` off where transformers ignores it anyway.

    NOTE: transformers 5 skips that clean-up for BPE tokenizers (it strips spaces before
    punctuation) unless `_FORCE_BPE_CLEANUP` is set, and logs "Ignoring
    clean_up_tokenization_spaces=True for BPE tokenizer ..." when a decode meets the flag on.
    Folders saved by older versions carry it on. Only where the skip exists (the force flag is an
    attribute) and applies (a BPE model, not forced) is it turned off: decoded text is unchanged.
    """
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return
    if not hasattr(tokenizer, _FORCE_BPE_CLEANUP) or getattr(tokenizer, _FORCE_BPE_CLEANUP):
        return
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        tokenizer.clean_up_tokenization_spaces = False
