"""Building a `CausalLM` from a preset, a Hugging Face folder or a GGUF file.

Models are built on the meta device and materialized straight on the target device in the
target dtype; safetensors shards are memory-mapped and read tensor by tensor, so peak host
memory stays near one tensor.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from kvtier.config import ModelConfig
from kvtier.errors import ModelLoadError
from kvtier.loading.staged import load_mode, read_shard_staged
from kvtier.model.llama import CausalLM
from kvtier.model.moe import MoE

LOAD_BAR_FROM = 1 << 30  # checkpoint bytes from which loading shows a progress bar (on a terminal)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_empty(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """An uninitialized model with storage on `device` in `dtype` (no host round trip). With
    `MoEConfig.experts_on_host` the routed experts get host memory instead: one tensor
    [E, 3, I * hidden] per MoE layer, views of one allocation, pinned when `device` is CUDA."""
    with _default_dtype(dtype), torch.device("meta"):
        model = CausalLM(cfg)
    moes = [m for m in model.modules() if isinstance(m, MoE)] if cfg.moe and cfg.moe.experts_on_host else []
    held = [m.experts for m in moes]
    for m in moes:
        m.experts = nn.ModuleList()  # kept off the device while the rest is materialized
    model.to_empty(device=device)
    if moes:
        assert cfg.moe is not None
        shape = (len(moes), cfg.moe.num_experts, 3, cfg.moe.intermediate_size * cfg.hidden_size)
        slabs = torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
        for m, experts, slab in zip(moes, held, slabs, strict=True):
            m.attach_host_experts(experts, slab)
    model.tie_weights()
    return model.eval()


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A model of real shapes with random weights (for benchmarks and tests). On CUDA, experts in
    host memory are drawn on the device an expert at a time, after the other parameters, and
    copied out (so not the numbers an all-device model of that seed gets; on the CPU they are)."""
    model = build_empty(cfg, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    identity = 0.0 if cfg.family == "gemma2" else 1.0  # Gemma's norms scale by (1 + weight)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.device.type != device.type:
                continue  # a host expert: below
            if name.endswith("norm.weight"):
                p.fill_(identity)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for m in model.modules():
            if isinstance(m, MoE) and m.host_experts is not None and device.type != "cpu":
                for row in m.host_experts:  # [3, I * h] per expert
                    row.copy_(torch.empty_like(row, device=device).normal_(0.0, 0.02, generator=gen))
    return model


def load_safetensors_folder(
    folder: Path, device: torch.device, dtype: torch.dtype, experts_on_host: bool = False
) -> tuple[CausalLM, ModelConfig]:
    """Load config.json and every *.safetensors shard of a Hugging Face model folder
    (`experts_on_host`: a MoE model's routed experts into host memory, `build_empty`)."""
    folder = Path(folder)
    cfg = with_experts_on_host(ModelConfig.from_json(folder / "config.json"), experts_on_host)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has a config.json but no *.safetensors weights")
    model = build_empty(cfg, device, dtype)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    dev = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    total = sum(f.stat().st_size for f in files)
    staged = load_mode() == "staged"  # KVTIER_LOAD (`kvtier.loading.staged`)
    # NOTE: disable=None: shown on a terminal only (an 8B model's 16 GB take many seconds)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading weights",
              file=sys.stderr, disable=None if total >= LOAD_BAR_FROM else True) as bar:  # fmt: skip
        for f in files:
            before = bar.n
            if staged:
                seen |= read_shard_staged(f, params, bar.update)
            else:
                seen |= _read_shard(f, params, dev, bar.update)
            bar.update(f.stat().st_size - (bar.n - before))  # its header and the tensors skipped
    check_all_loaded(folder, cfg, params, seen)
    return model, cfg


def _read_shard(
    f: Path, params: Mapping[str, nn.Parameter], dev: str, advance: Callable[[int], object]
) -> set[str]:
    """Copy shard `f`'s tensors into `params` (read on device `dev`), `advance(bytes)` after each
    read; the names copied. ModelLoadError for a shape the config does not imply or a file that
    cannot be read."""
    seen: set[str] = set()
    try:
        with safe_open(str(f), framework="pt", device=dev) as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a dict
                if name not in params:
                    continue  # e.g. rotary inv_freq buffers, or lm_head when tied
                tensor = shard.get_tensor(name)
                advance(tensor.numel() * tensor.element_size())
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
    return seen


def with_experts_on_host(cfg: ModelConfig, on_host: bool) -> ModelConfig:
    """`cfg` with its routed experts in host memory when `on_host` (a MoE model only)."""
    if cfg.moe is None or cfg.moe.experts_on_host == on_host:
        return cfg
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, experts_on_host=on_host))


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
