"""Byte formulas for one sequence: weights, KV slices and prefill activations.

Three activation models live here:

* `activation_bytes` — what kvtier's runner holds at its peak while it runs one prefill chunk.
  The planner and the engine use this one (the engine reports it next to the measured peak).
* `hf_activation_bytes` — what transformers' own forward (`LlamaModel` and its kin) holds for
  one chunk over a `kvtier.hf.TieredCache`: more [T, h] tensors alive at once, fp32 norms.
  The planner uses it for `kvtier.hf` (`PlanInputs.activations="hf"`).
* `paper_activation_bytes` — HeadInfer's estimate, chunk x (D + 2 I) elements, which is what the
  paper's Table 10 uses (64 GiB unchunked at 1M, 0.625 GiB for a 10K chunk, Llama-3-8B). It
  leaves out q/k/v, the attention output and the third MLP temporary, so it undercounts.

NOTE: the paper's "GB" is GiB (2^30 B): 1M tokens x 128 KiB = 128 GiB of KV, and 8.03e9 bf16
parameters = 14.96 GiB, within 1% of its "15.08". Only the 2^30 reading matches every cell.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from kvtier.attention.dense import ATTN_BACKEND, SCORE_ELEMENTS
from kvtier.config import ModelConfig
from kvtier.errors import ConfigError

GiB = 1024**3

# CUDA context, cuBLAS workspaces and allocator fragmentation: memory the process uses that no
# tensor accounts for. Subtracted from --gpu-memory before weights, activations and KV.
GPU_RESERVE_BYTES = GiB // 2

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

ACTIVATIONS = ("runner", "hf")  # whose forward runs the prefill chunks: kvtier's, transformers'
EXPERT_PLACES = ("auto", "gpu", "host")  # where a MoE model's routed experts live (`--experts`)


class Phases(NamedTuple):
    """Bytes alive at the peak of each phase of one layer's forward, and the logits after them."""

    norm: int
    attention: int
    mlp: int
    logits: int

    @property
    def peak(self) -> int:
        return max(self.norm, self.attention, self.mlp) + self.logits


def weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Parameter bytes on the GPU in the model dtype (tied embeddings counted once). With the
    routed experts on the host (`MoEConfig.experts_on_host`) those are left out and one MoE
    layer's worth of them is counted instead: the copies a prefill chunk that routes to every
    expert holds while the layer runs."""
    on_gpu = cfg.num_parameters() * dtype_bytes
    if cfg.moe is None or not cfg.moe.experts_on_host:
        return on_gpu
    return on_gpu - host_weight_bytes(cfg, dtype_bytes) + expert_layer_bytes(cfg, dtype_bytes)


def expert_layer_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """The routed experts of one MoE layer (gate, up and down of each), in bytes."""
    moe = cfg.moe
    if moe is None:
        return 0
    return moe.num_experts * 3 * cfg.hidden_size * moe.intermediate_size * dtype_bytes


def host_weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Parameter bytes kept in host memory: the routed experts of every MoE layer when
    `experts_on_host`, else 0."""
    moe = cfg.moe
    if moe is None or not moe.experts_on_host:
        return 0
    return (cfg.num_layers - min(moe.first_dense, cfg.num_layers)) * expert_layer_bytes(cfg, dtype_bytes)


def expert_copy_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """Bytes of routed experts a step of `tokens` tokens copies in over the host link with the
    experts on the host (0 otherwise): per MoE layer at most tokens x experts_per_token experts,
    and every expert once more than half may be chosen (`kvtier.model.moe.MoE`)."""
    moe = cfg.moe
    if moe is None or not moe.experts_on_host:
        return 0
    chosen = min(moe.num_experts, tokens * moe.experts_per_token)
    per_layer = moe.num_experts if 2 * chosen > moe.num_experts else chosen
    layers = cfg.num_layers - min(moe.first_dense, cfg.num_layers)
    return layers * per_layer * (expert_layer_bytes(cfg, dtype_bytes) // moe.num_experts)


def place_experts(
    cfg: ModelConfig, gpu_budget: int | None, dtype_bytes: int, experts: str = "auto", on_gpu: bool = True
) -> ModelConfig:
    """`cfg` with its routed experts placed: "gpu", "host", or "auto" (the host when the weights
    alone leave less than a quarter of `gpu_budget`, after the reserve, for KV and activations;
    the device otherwise, always without a budget, and always when the model does not run on a
    GPU, `on_gpu` False: host and device memory are one there). Not a MoE model: `cfg` unchanged."""
    if experts not in EXPERT_PLACES:
        raise ConfigError(f"--experts {experts!r}: use one of {', '.join(EXPERT_PLACES)}")
    if cfg.moe is None:
        return cfg
    host = experts == "host"
    if experts == "auto" and gpu_budget is not None and on_gpu:
        gpu = replace(cfg, moe=replace(cfg.moe, experts_on_host=False))
        host = weight_bytes(gpu, dtype_bytes) > 0.75 * (gpu_budget - GPU_RESERVE_BYTES)
    return replace(cfg, moe=replace(cfg.moe, experts_on_host=host))


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
    """Peak activation bytes of the runner for one prefill chunk of `chunk` tokens
    (`runner_phases`: the largest phase plus the logits)."""
    return runner_phases(cfg, chunk, dtype_bytes, mlp_chunk, group_size=group_size, context=context).peak


def runner_phases(
    cfg: ModelConfig,
    chunk: int,
    dtype_bytes: int,
    mlp_chunk: int | None = None,
    *,
    group_size: int | None = None,
    context: int | None = None,
) -> Phases:
    """Activation bytes of the runner in each phase of one prefill chunk of `chunk` tokens.

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
    return Phases(norm, attention, mlp, logits)


def hf_activation_bytes(
    cfg: ModelConfig,
    chunk: int,
    dtype_bytes: int,
    *,
    group_size: int | None = None,
    context: int | None = None,
) -> int:
    """Peak activation bytes of transformers' forward for one prefill chunk over a
    `kvtier.hf.TieredCache` (`hf_phases`: the largest phase plus the logits)."""
    return hf_phases(cfg, chunk, dtype_bytes, group_size=group_size, context=context).peak


def hf_phases(
    cfg: ModelConfig,
    chunk: int,
    dtype_bytes: int,
    *,
    group_size: int | None = None,
    context: int | None = None,
) -> Phases:
    """Activation bytes in each phase of transformers' forward (`LlamaModel` and the Mistral and
    Qwen models built like it) for one chunk of `chunk` tokens over a `TieredCache`.

    Attention runs inside the store (`kvtier.hf.attention`), so its kernels and their
    temporaries are the runner's; around them HF's model code keeps more alive (T = chunk):

    * `LlamaModel.forward` holds `inputs_embeds` [T,h] for the whole forward, and its loop holds
      each layer's input [T,h] while the layer runs; both are in every phase below.
    * RoPE tables: HF's cos and sin [T,d], the store's own [T,d] pair (`begin_step`), and the
      int64 position ids [T] (8 bytes a token).
    * norm (after attention): the residual [T,h], `LlamaRMSNorm`'s fp32 copy of it and its fp32
      normalised result [T,h], and the fp32 variance [T,1] with its rsqrt.
    * attention: the runner's attention phase (whose residual is the layer input) with
      inputs_embeds and the tables beside it. HF's RoPE keeps the unrotated q and three q-sized
      temporaries, as the runner's count.
    * MLP: the residual and the normed input [T,h] and gate-activation, up and their product
      [T,I] (`LlamaMLP` runs the whole chunk: no sub-chunks).

    Measured on the CPU (bf16) per phase: `tests/test_hf_memory.py`. The logits are the runner's:
    HF computes them for the last position only (`logits_to_keep=1`, which `generate` and
    `prefill_in_chunks` pass).
    """
    T, h, inter, b = chunk, cfg.hidden_size, cfg.intermediate_size, dtype_bytes
    runner = runner_phases(cfg, T, b, group_size=group_size, context=context)
    embeds = T * h * b
    tables = 4 * T * cfg.head_dim * b + 8 * T
    held = embeds + T * h * b + tables  # inputs_embeds, the layer's input, RoPE tables
    norm = held + T * h * (b + 2 * 4) + 2 * T * 4
    attention = runner.attention + embeds + tables
    mlp = held + 2 * T * h * b + 3 * T * inter * b
    return Phases(norm, attention, mlp, runner.logits)


def paper_activation_bytes(cfg: ModelConfig, chunk: int, dtype_bytes: int) -> int:
    """HeadInfer's estimate: chunk x (hidden + 2 x intermediate) elements (paper Table 10)."""
    return chunk * (cfg.hidden_size + 2 * cfg.intermediate_size) * dtype_bytes


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple
