"""Options shared by the subcommands, and the option types that check values at parse time.

An option type raises ConfigError (not argparse's own errors), so a bad value becomes the CLI's
one line `kvtier: error: ...` with exit code 2, before any model is loaded.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.errors import CapacityError, ConfigError
from kvtier.methods import FAMILIES, OPTIONS, REGISTRY, choices
from kvtier.planner.cpu_split import parse_mode
from kvtier.planner.memory import EXPERT_PLACES
from kvtier.planner.placement import POLICIES
from kvtier.units import (
    COUNT_LIMIT,
    format_bytes,
    parse_count,
    parse_finite_float,
    parse_int,
    parse_seed,
    parse_size,
)


def int_type(flag: str, lo: int = 1, hi: int = COUNT_LIMIT - 1) -> Callable[[str], int]:
    """An integer option within [lo, hi]: positive and below 2**31 unless told otherwise."""
    return lambda text: parse_int(text, flag, lo, hi)


def float_type(
    flag: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> Callable[[str], float]:
    """A finite float option (no nan, no inf) within the interval from lo to hi."""
    return lambda text: parse_finite_float(text, flag, lo, hi, lo_open=lo_open, hi_open=hi_open)


EXACT_LOSSLESS = {"auto": None, "on": True, "off": False}  # --exact-lossless -> LLM(exact_lossless=)


def cpu_attention_type(text: str) -> str | int:
    """`--cpu-attention`: auto, off or a number of slices."""
    return parse_mode(text)


def seed_type(flag: str = "--seed") -> Callable[[str], int]:
    """A seed option: 0 <= seed < 2**64, the same rule wherever --seed exists."""
    return lambda text: parse_seed(text, flag)


def count_type(flag: str) -> Callable[[str], int]:
    """A positive token count: 4096, 128K, 1M (binary K and M)."""
    return lambda text: parse_count(text, flag)


def size_type(flag: str, *, positive: bool = True) -> Callable[[str], int]:
    """Bytes from '24GiB', '24 GB' or '24g'; positive unless `positive=False` (0 allowed)."""

    def parse(text: str) -> int:
        value = parse_size(text, flag)
        if positive and value <= 0:
            raise ConfigError(f"{flag} must be at least 1 byte, got {text!r}")
        return value

    return parse


def text_type(flag: str, *, allow_empty: bool = True) -> Callable[[str], str]:
    """A text option that must be valid UTF-8 (and not blank unless `allow_empty`)."""

    def parse(text: str) -> str:
        check_utf8_text(text, flag)
        if not allow_empty and not text.strip():
            raise ConfigError(f"{flag} must not be empty")
        return text

    return parse


def check_utf8_text(text: str, source: str) -> None:
    """Reject text holding lone surrogates: on POSIX, Python passes argv bytes that are not
    UTF-8 as surrogate escapes, which a tokenizer or an HTTP library cannot encode."""
    bad = next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)
    if bad is None:
        return
    try:
        raw = text.encode("utf-8", "surrogateescape")
        raw.decode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{source} is not valid UTF-8 (a lone surrogate at character {bad})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(not_utf8_message(source, e)) from None


def decode_utf8(data: bytes, source: str) -> str:
    """`data` as UTF-8 text, or a ConfigError naming `source`, the bad byte and its offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(not_utf8_message(source, e)) from None


def not_utf8_message(source: str, e: UnicodeDecodeError) -> str:
    return f"{source} is not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})"


def output_path_type(flag: str) -> Callable[[str], str]:
    """A file the command will write: checked now, so a long run cannot fail at its very end."""
    return lambda text: check_output_path(text, flag)


def check_output_path(text: str, flag: str) -> str:
    """`text` if a file can be written there: not a folder, in an existing writable folder, and
    writable itself if it exists. Raises ConfigError saying which of these fails."""
    check_utf8_text(text, flag)
    if not text.strip():
        raise ConfigError(f"{flag} needs a file name")
    path = Path(text).expanduser()
    if path.is_dir():
        raise ConfigError(f"{flag} {text} is a folder; give a file name inside it")
    parent = path.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise ConfigError(f"{flag} {text}: the folder {parent} {what}; create it or pick another path")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {text} exists and is not writable; pick another path")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {text}: the folder {parent} is not writable; pick another path")
    return text


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype and the KV placement options."""
    p.add_argument(
        "--model",
        default=None,
        help="preset name, HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32")
    p.add_argument(
        "--kv",
        default="auto",
        choices=POLICIES,
        help="KV placement: auto (planner decides), gpu, layer (layer-wise offload), head (head-wise)",
    )
    p.add_argument(
        "--gpu-memory",
        type=size_type("--gpu-memory"),
        default=None,
        help="GPU budget, e.g. 24GiB (default: the whole GPU)",
    )
    p.add_argument(
        "--head-group",
        type=int_type("--head-group"),
        default=None,
        help="KV heads per streamed group (--kv head)",
    )
    p.add_argument(
        "--chunk-size",
        type=count_type("--chunk-size"),
        default=None,
        help="prefill chunk in tokens (default: chosen by the planner)",
    )
    p.add_argument(
        "--cpu-attention",
        type=cpu_attention_type,
        default="off",
        help="streamed KV slices a decode step attends on the CPU instead of copying them: off "
        "(default), auto (as many as this machine's CPU finishes in time, measured), or a number",
    )
    p.add_argument(
        "--experts",
        choices=EXPERT_PLACES,
        default="auto",
        help="a mixture-of-experts model's routed experts: in GPU memory, or in host memory with "
        "each step copying in the experts it chose; auto (default): host memory when the weights "
        "would leave under a quarter of --gpu-memory",
    )
    p.add_argument(
        "--max-model-len",
        type=count_type("--max-model-len"),
        default=None,
        help="allow contexts past the model's trained length (quality may drop)",
    )
    p.add_argument(
        "--seed",
        type=seed_type(),
        default=0,
        help="seed for random-weight presets and sampling (0 <= seed < 2**64)",
    )


def add_parallel_option(p: argparse.ArgumentParser) -> None:
    """--tensor-parallel N / --pipeline-parallel N (`generate`): the model over N ranks."""
    p.add_argument(
        "--tensor-parallel",
        type=int_type("--tensor-parallel"),
        default=None,
        metavar="N",
        help="split the model over N GPUs by KV heads: each rank holds its heads' weights and KV in "
        "its own GPU and host tiers, streamed over its own link; --gpu-memory is per GPU. Started "
        "here, or by `torchrun --nproc-per-node N -m kvtier generate` (default: torchrun's N, else 1)",
    )
    p.add_argument(
        "--pipeline-parallel",
        type=int_type("--pipeline-parallel"),
        default=None,
        metavar="N",
        help="split the model into N stages of contiguous layers instead, one per GPU, each with its "
        "layers' KV in its own tiers; the stages run one after the other (more memory, not more "
        "bandwidth). Started here or by torchrun, as --tensor-parallel",
    )


def _method_help(family: str) -> str:
    names = [n for n in choices(family) if n in REGISTRY]
    listed = "; ".join(f"{n}: {REGISTRY[n].help}" for n in names)
    return f"{FAMILIES[family].help}. {listed}" if listed else FAMILIES[family].help


def _parsed(key: str) -> Callable[[str], Any]:
    """An option's parser as an argparse type (the registry's parsers raise ConfigError)."""
    return OPTIONS[key].parse


def add_method_options(p: argparse.ArgumentParser) -> None:
    """The opt-in lossy methods, from the registry (`kvtier.methods`): one option per family
    (`--attention`, `--kv-quant`, `--evict`, `--head-sparsity`) with the registered methods as its
    choices, and one per method option (`--kv-budget`, `--hip-preset`, ...). Without them kvtier
    is lossless."""
    g = p.add_argument_group("lossy methods (opt-in; default: lossless dense attention, full KV)")
    for family in FAMILIES.values():
        if family.key in OPTIONS:  # selected by a value (--head-sparsity R), not by a name
            opt = OPTIONS[family.key]
            g.add_argument(opt.flag, type=_parsed(opt.key), default=None, help=_method_help(family.key))
            continue
        g.add_argument(
            family.flag,
            default=family.none,
            choices=choices(family.key),
            help=_method_help(family.key),
        )
    for key, opt in OPTIONS.items():
        if key not in FAMILIES:
            g.add_argument(opt.flag, type=_parsed(key), default=None, help=opt.help)
    add_exact_lossless_option(g)


def add_exact_lossless_option(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--exact-lossless`: `LLM(exact_lossless=)` (generate's method options; serve's requests
    name their methods in the body)."""
    p.add_argument(
        "--exact-lossless",
        choices=tuple(EXACT_LOSSLESS),
        default="auto",
        help="a request whose method drops nothing at its length (HiP under 3,328 tokens of prompt "
        "plus output with its fast and lean presets, eviction or Quest within --kv-budget) runs "
        "lossless, on the faster paths, and says so: auto (default: on CUDA), on, off (the "
        "method's own path at every length)",
    )


def method_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The method options a parsed command line gave (unset ones left to `MethodChoice`)."""
    keys = [*FAMILIES, *OPTIONS]
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for `kvtier.LLM` from parsed model options."""
    return {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "kv": args.kv,
        "gpu_memory": args.gpu_memory,
        "head_group": args.head_group,
        "chunk_size": args.chunk_size,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "cpu_attention": args.cpu_attention,
        "experts": args.experts,
        "exact_lossless": EXACT_LOSSLESS[getattr(args, "exact_lossless", "auto")],
        "prefill_order": getattr(args, "prefill_order", "chunk"),
        "tensor_parallel": getattr(args, "tensor_parallel", None),
        "pipeline_parallel": getattr(args, "pipeline_parallel", None),
        **method_kwargs(args),
    }


def check_before_loading(args: argparse.Namespace) -> None:
    """Fail before the model loads on what the planner would reject once it has: a --gpu-memory
    too small for the weights, a --head-group that does not divide the model's KV heads.

    Runs the planner for a one-token context on the model's config alone (no weights read; a GGUF
    file's metadata or cached config). Any longer context needs at least as much, so this never
    rejects a run the engine would take. Without either option there is nothing to check.
    Over several ranks (--tensor-parallel, --pipeline-parallel, or torchrun's ranks) the check is
    of one rank's part (`kvtier.planner.sharding`: a shard, or the first and largest stage), and a
    size that cannot split the model fails.
    """
    from kvtier.config import ModelConfig
    from kvtier.loading.resolve import read_model_config
    from kvtier.parallel.group import launched_world_size
    from kvtier.planner.sharding import rank_config, stage_config

    pipeline = (getattr(args, "pipeline_parallel", None) or 1) > 1
    asked = args.pipeline_parallel if pipeline else getattr(args, "tensor_parallel", None)
    ranks = asked or launched_world_size() or 1

    def of_rank(cfg: ModelConfig) -> ModelConfig:
        return stage_config(cfg, ranks, 0) if pipeline else rank_config(cfg, ranks)

    if ranks > 1:
        of_rank(read_model_config(args.model))  # ConfigError before any process starts
    if args.gpu_memory is None and args.head_group is None:
        return

    from kvtier.engine.config import EngineConfig
    from kvtier.methods import MethodChoice, PlanInputs, plan_for
    from kvtier.planner.hardware import detect_hardware
    from kvtier.planner.memory import place_experts, weight_bytes

    config = EngineConfig.with_sizes(
        args.gpu_memory,
        device=args.device,
        dtype=args.dtype,
        chunk_size=args.chunk_size,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    itemsize = dtype.itemsize
    cfg = place_experts(
        of_rank(read_model_config(args.model)),
        config.gpu_memory,
        itemsize,
        args.experts,
        on_gpu=device.type == "cuda",
    )
    weights = weight_bytes(cfg, itemsize)
    if config.gpu_memory is not None and weights > config.gpu_memory:
        raise CapacityError(
            f"--gpu-memory {format_bytes(config.gpu_memory)} is smaller than the model's weights alone "
            f"({format_bytes(weights)} in {str(dtype).removeprefix('torch.')}"
            f"{f', one rank of {ranks}' if ranks > 1 else ''}); use a larger --gpu-memory"
        )
    method = MethodChoice(kv=args.kv, head_group=args.head_group)
    inputs = PlanInputs(
        cfg,
        1,
        hardware=detect_hardware(device),
        dtype_bytes=itemsize,
        gpu_budget=config.gpu_memory,
        kv=method.kv,
        head_group=method.head_group,
        chunk_size=config.chunk_size,
        block_size=config.block_size,
    )
    plan_for(inputs)
