"""Options shared by the subcommands that load a model and run it."""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.engine.config import KV_POLICIES
from kvtier.engine.methods import ATTENTION_METHODS
from kvtier.policies.evict import EVICT
from kvtier.policies.quant import KV_QUANT
from kvtier.sparse import HIP_PRESETS
from kvtier.units import parse_count


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
        choices=KV_POLICIES,
        help="KV placement: auto (planner decides), gpu, layer (layer-wise offload), head (head-wise)",
    )
    p.add_argument("--gpu-memory", default=None, help="GPU budget, e.g. 24GiB (default: the whole GPU)")
    p.add_argument("--head-group", type=int, default=None, help="KV heads per streamed group (--kv head)")
    p.add_argument(
        "--chunk-size",
        type=lambda s: parse_count(s, "--chunk-size"),
        default=None,
        help="prefill chunk in tokens (default: chosen by the planner)",
    )
    p.add_argument(
        "--max-model-len",
        type=lambda s: parse_count(s, "--max-model-len"),
        default=None,
        help="allow contexts past the model's trained length (quality may drop)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for random-weight presets and sampling")


def add_method_options(p: argparse.ArgumentParser) -> None:
    """The opt-in lossy methods. Without them kvtier is lossless."""
    g = p.add_argument_group("lossy methods (opt-in; default: lossless dense attention, full KV)")
    g.add_argument(
        "--attention",
        default="dense",
        choices=ATTENTION_METHODS,
        help="dense (default); hip = InfiniteHiP-style sparse attention with context "
        "extension; quest = query-aware page selection (needs --kv-budget)",
    )
    g.add_argument(
        "--hip-preset",
        default="default",
        choices=sorted(HIP_PRESETS),
        help="HiP budgets and decode refresh intervals",
    )
    g.add_argument("--kv-quant", default=None, choices=KV_QUANT, help="quantize stored KV")
    g.add_argument("--evict", default=None, choices=EVICT, help="evict KV tokens (needs --kv-budget)")
    g.add_argument(
        "--kv-budget",
        type=lambda s: parse_count(s, "--kv-budget"),
        default=None,
        help="tokens kept (or read) per KV head by --evict / --attention quest / --head-sparsity",
    )
    g.add_argument(
        "--head-sparsity",
        type=float,
        default=None,
        help="fraction of KV heads that become streaming heads (sinks + recent tokens)",
    )


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
        **{
            k: getattr(args, k)
            for k in ("attention", "hip_preset", "kv_quant", "evict", "kv_budget", "head_sparsity")
            if hasattr(args, k)
        },
    }
