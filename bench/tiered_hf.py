"""HF transformers beside `bench/tiered_store.py`'s policies, on the same weights: its layer-wise
offload (`DynamicCache(offloading=True)`) or its default cache on the GPU, prefilled in one
forward or, where that runs out of memory, in chunks."""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from bench.common import median, timed

DEV = torch.device("cuda")  # as bench/tiered_store.py's: it runs on CUDA only


def run_hf(model: Any, cfg: Any, contexts: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """HF transformers on the same weights: its own layer-wise offload (`DynamicCache(offloading=True)`)
    or, with `--hf-cache gpu`, its default cache on the GPU."""
    import transformers
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kvtier.loading.presets import PRESETS

    hf_cfg = LlamaConfig(**{k: v for k, v in PRESETS["llama-3-8b"].items() if k != "model_type"})
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(model.state_dict(), assign=True, strict=False)
    hf.model.rotary_emb = LlamaRotaryEmbedding(hf_cfg, device=DEV)
    hf.eval()
    rows = []
    for context in contexts:
        row: dict[str, Any] = {
            "policy": "hf-offloaded" if args.hf_cache == "offloaded" else "hf-gpu",
            "context": context,
            "transformers": transformers.__version__,
        }
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(0, cfg.vocab_size, (1, context), device=DEV)
        for mode, chunk in (("one forward", context), ("chunked", args.chunk_size or 8192)):
            cache = DynamicCache(config=hf_cfg, offloading=args.hf_cache == "offloaded")
            try:
                with torch.inference_mode():

                    def prefill() -> Any:
                        out = None
                        for s in range(0, context, chunk):
                            out = hf(
                                ids[:, s : s + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1
                            )
                        return out

                    dt, out = timed(prefill)
                    row["prefill_tok_s"], row["prefill_mode"] = context / dt, mode
                    token = out.logits[:, -1:].argmax(-1)
                    steps = []
                    for _ in range(args.decode_steps):
                        dt, out = timed(lambda: hf(token, past_key_values=cache, use_cache=True))
                        token = out.logits[:, -1:].argmax(-1)
                        steps.append(dt)
                    row["decode_s_per_token"] = median(steps[1:] if len(steps) > 2 else steps)
                    row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
                break
            except torch.OutOfMemoryError as e:
                row[f"oom_{mode}"] = str(e).splitlines()[0][:200]
            finally:
                cache = None
                gc.collect()
                torch.cuda.empty_cache()
        rows.append(row)
    return rows
