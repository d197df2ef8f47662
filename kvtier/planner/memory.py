"""Byte formulas for one sequence: weights, KV slices and prefill activations.

Two activation models live here:

* `activation_bytes` — what kvtier's runner holds at its peak while it runs one prefill chunk.
  The planner and the engine use this one (the engine reports it next to the measured peak).
* `paper_activation_bytes` — HeadInfer's estimate, chunk x (D + 2 I) elements, which is what the
  paper's Table 10 uses (64 GiB unchunked at 1M, 0.625 GiB for a 10K chunk, Llama-3-8B). It
  leaves out q/k/v, the attention output and the third MLP temporary, so it undercounts.

NOTE: the paper's "GB" is GiB (2^30 B): 1M tokens x 128 KiB = 128 GiB of KV, and 8.03e9 bf16
parameters = 14.96 GiB, within 1% of its "15.08". Only the 2^30 reading matches every cell.
"""

from __future__ import annotations

from kvtier.attention.dense import ATTN_BACKEND, SCORE_ELEMENTS
from kvtier.config import ModelConfig

GiB = 1024**3

# CUDA context, cuBLAS workspaces and allocator fragmentation: memory the process uses that no
# tensor accounts for. Subtracted from --gpu-memory before weights, activations and KV.
GPU_RESERVE_BYTES = GiB // 2

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """All parameters on the GPU in the model dtype (tied embeddings counted once)."""
    return cfg.num_parameters() * dtype_bytes


def kv_token_bytes(cfg: ModelConfig, group_size: int, dtype_bytes: int) -> int:
    """K and V of one token in one (layer, group) slice: 2 x group_size x head_dim x dtype."""
    return 2 * group_size * cfg.head_dim * dtype_bytes


def window_tokens(window: int, chunk: int, context: int, block_size: int) -> int:
    """Tokens the store's buffer of one windowed slice holds: the window's `window - 1` earlier
    tokens plus one step of up to `chunk` new ones, in whole blocks, at most the context's.

    NOTE: the store trims a windowed slice back to its last `window - 1` tokens only when the
    next step would not fit, so decode trims once every ~chunk tokens (one copy of the window)."""
    return round_up(min(context, window - 1 + chunk), block_size)


def window_kv_bytes(cfg: ModelConfig, chunk: int, context: int, dtype_bytes: int, block_size: int) -> int:
    """GPU bytes of every windowed layer's KV (always resident) at `context` tokens."""
    layers = cfg.windowed_layers(context)
    if not layers:
        return 0
    assert cfg.sliding_window is not None
    tokens = window_tokens(cfg.sliding_window, chunk, context, block_size)
    return len(layers) * tokens * kv_token_bytes(cfg, cfg.num_kv_heads, dtype_bytes)


def activation_bytes(
    cfg: ModelConfig,
    chunk: int,
    dtype_bytes: int,
    mlp_chunk: int | None = None,
    *,
    group_size: int | None = None,
    context: int | None = None,
) -> int:
    """Peak activation bytes of the runner for one prefill chunk of `chunk` tokens.

    The runner keeps a flattened residual stream [T, h] in the model dtype and frees each block's
    locals when the block returns, so the peak is the largest of three phases (T = chunk,
    t = min(mlp_chunk, T), Hq/Hkv = query/KV heads, d = head_dim, gq = query heads of one group):

    * norm:      residual [T,h] + output [T,h] + two fp32 temporaries [T,h]
    * attention: residual + normed [T,h] + q [T,Hq*d] + k, v [T,Hkv*d] + attention output
                 [T,Hq*d], plus the larger of: RoPE's three q-sized temporaries, or SDPA's
                 per-group output [T,gq*d] with its fp32 log-sum-exp [gq,T] and o_proj's [T,h]
                 output. SDPA is flash-style: no [T, prefix] score matrix, no GQA expansion.
                 (cuDNN's merged calls keep folded queries and fp32 merge buffers instead.)
    * MLP:       residual + normed [T,h] + (an output buffer [T,h] when split into sub-chunks)
                 + gate-activation, up and their product [t,I] each.

    Logits are only for the last position: [1, vocab] in the dtype and again in fp32.
    `group_size` (KV heads per group) defaults to all KV heads, the largest SDPA call.

    Layer kinds with their own attention temporaries, at a sequence of `context` tokens (default:
    the chunk): a binding sliding window adds its [r T, window + T] bool mask; soft-capped or
    scaled scores (Gemma-2, `kvtier.attention.dense.scored_attention`) replace SDPA's part by one
    block of at most SCORE_ELEMENTS scores (q.k in the dtype, four float32 temporaries and the
    probabilities in the dtype) and three float32 [T, gq, d] accumulators.
    """
    T = chunk
    t = min(mlp_chunk or T, T)
    g = group_size or cfg.num_kv_heads
    h, inter, d, b = cfg.hidden_size, cfg.intermediate_size, cfg.value_dim, dtype_bytes
    # NOTE: MLA's absorbed queries are as wide as the cached entry, its outputs as the latent.
    q_width, kv_width = cfg.num_heads * cfg.score_dim, cfg.num_kv_heads * cfg.head_dim
    gq = g * cfg.q_per_kv

    norm = T * h * (2 * b + 2 * 4)
    attn_base = T * (2 * h + 2 * q_width + 2 * kv_width) * b
    rope_tmp = 3 * T * q_width * b
    sdpa_tmp = T * gq * (d * b + 4) + T * h * b
    if ATTN_BACKEND != "flash":  # cuDNN: folded queries, a block's output, fp32 copy and result
        sdpa_tmp = T * gq * d * (2 * b + 8) + T * h * b
    keys = max(context or T, T)
    if cfg.windowed_layers(keys):
        w = cfg.sliding_window or 0
        sdpa_tmp += cfg.q_per_kv * T * min(keys, w + T)
    if cfg.attn_softcap is not None or cfg.attn_scale is not None:
        scores = min(max(SCORE_ELEMENTS, T * gq), T * gq * keys)
        sdpa_tmp = scores * (2 * b + 16) + 3 * T * gq * d * 4 + T * h * b
    attention = attn_base + max(rope_tmp, sdpa_tmp)
    mlp = T * (2 + (1 if t < T else 0)) * h * b + 3 * t * inter * b
    logits = cfg.vocab_size * (b + 4)
    return max(norm, attention, mlp) + logits


def paper_activation_bytes(cfg: ModelConfig, chunk: int, dtype_bytes: int) -> int:
    """HeadInfer's estimate: chunk x (hidden + 2 x intermediate) elements (paper Table 10)."""
    return chunk * (cfg.hidden_size + 2 * cfg.intermediate_size) * dtype_bytes


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple
