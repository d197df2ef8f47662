"""Roofline of offloaded prefill and decode: FLOPs, bytes moved, and the time each bounds.

A step is compute-bound over a link when FLOPs / bytes-over-that-link >= peak FLOP/s / link B/s
(the ridge). Offloaded KV crosses PCIe every time attention reads it, so:

* prefill chunk of T tokens after a prefix of P tokens: the prefix's KV goes host->device and the
  chunk's new KV goes device->host; FLOPs are the chunk's linear layers plus attention of T
  queries against P + T keys (causal). For long prefixes the intensity tends to T x Hq/Hkv
  (Llama-3-8B, 1K chunk: ~4100 FLOP/B; the paper's App. C number), so the chunk size sets it.
* decode of one token: ~Hq/Hkv FLOP per KV byte (1 for MHA, 4 for Llama-3-8B), always bound
  by the bytes it reads (HBM or PCIe).
* the host: Python issues every layer's kernels and every attention slice step; when a chunk's
  GPU work is shorter than that, the GPU waits. `default_chunk_size` keeps chunks above it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.config import ModelConfig
from kvtier.planner.hardware import Hardware
from kvtier.planner.memory import expert_copy_bytes, round_up, weight_bytes

MIN_CHUNK = 2048
MAX_CHUNK = 16384
CHUNK_MULTIPLE = 1024
HOST_MARGIN = 1.5  # GPU time per chunk / host issue time per chunk, at least


def linear_flops_per_token(cfg: ModelConfig) -> int:
    """2 x the parameters of the attention projections and MLPs (no embedding, no lm_head; of
    a mixture of experts, the ones a token runs through)."""
    emb = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return 2 * (cfg.num_parameters(active=True) - emb)


def attention_flops(cfg: ModelConfig, queries: int, prefix: int) -> int:
    """QK^T and PV FLOPs of `queries` new tokens, causal, after `prefix` cached tokens (a
    windowed layer's query attends at most its window)."""
    keys = queries * prefix + queries * (queries + 1) // 2  # sum over queries of keys attended
    windowed = len(cfg.windowed_layers(prefix + queries))
    window_keys = min(keys, queries * (cfg.sliding_window or 0))
    per_key = 2 * cfg.num_heads * (cfg.score_dim + cfg.value_dim)  # q.k and p.v, every head
    return per_key * ((cfg.num_layers - windowed) * keys + windowed * window_keys)


def prefill_chunk_flops(cfg: ModelConfig, chunk: int, prefix: int) -> int:
    """All FLOPs of one prefill chunk; logits only for its last token."""
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size
    return chunk * linear_flops_per_token(cfg) + attention_flops(cfg, chunk, prefix) + lm_head


def prefill_chunk_pcie_bytes(
    cfg: ModelConfig, chunk: int, prefix: int, dtype_bytes: int, streamed_fraction: float = 1.0
) -> float:
    """Bytes over PCIe for one chunk: prefix KV in (H2D) + the chunk's new KV out (D2H), of the
    layers that keep every token (windowed layers stay on the GPU)."""
    per_layer = cfg.kv_bytes_per_token(dtype_bytes) // cfg.num_layers
    return streamed_fraction * (prefix + chunk) * cfg.full_layers(prefix + chunk) * per_layer


def prefill_intensity(cfg: ModelConfig, chunk: int, context: int, dtype_bytes: int) -> float:
    """FLOP per PCIe byte of the fully offloaded chunk that ends at `context` (the hardest one)."""
    chunk = min(chunk, context)
    prefix = context - chunk
    pcie = prefill_chunk_pcie_bytes(cfg, chunk, prefix, dtype_bytes)
    return prefill_chunk_flops(cfg, chunk, prefix) / pcie if pcie else math.inf  # inf: every layer windowed


def decode_intensity(cfg: ModelConfig, context: int, dtype_bytes: int) -> float:
    """FLOP per byte read (weights + all KV) of one decoded token; ~Hq/Hkv at long context."""
    read = weight_bytes(cfg, dtype_bytes) + cfg.kv_bytes(context, dtype_bytes)
    return decode_flops(cfg, context) / read


def min_compute_bound_chunk(cfg: ModelConfig, context: int, hw: Hardware, dtype_bytes: int) -> int:
    """Smallest chunk whose offloaded prefill at `context` is compute-bound on PCIe and HBM.

    NOTE: with P = context - T the chunk's PCIe bytes are context x KV/token whatever T is, and its
    FLOPs grow with T, so intensity is monotonic in T and a binary search is exact.
    """
    w = weight_bytes(cfg, dtype_bytes)

    def compute_bound(t: int) -> bool:
        flops = prefill_chunk_flops(cfg, t, context - t)
        pcie = prefill_chunk_pcie_bytes(cfg, t, context - t, dtype_bytes)
        return flops / hw.flops >= max(pcie / hw.pcie_bw, w / hw.hbm_bw)

    lo, hi = 1, context
    while lo < hi:
        mid = (lo + hi) // 2
        if compute_bound(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def host_issue_s(cfg: ModelConfig, hw: Hardware, pieces: int | None = None) -> float:
    """Host time to issue one prefill chunk: every layer's kernels plus `pieces` attention slice
    steps (default one per layer; head-wise offload issues num_layers x num_kv_heads)."""
    pieces = cfg.num_layers if pieces is None else pieces
    return cfg.num_layers * hw.layer_overhead_s + pieces * hw.prefill_slice_overhead_s


def min_host_hidden_chunk(cfg: ModelConfig, hw: Hardware, pieces: int | None = None) -> int:
    """Smallest chunk whose linear-layer FLOPs alone keep the GPU busy `HOST_MARGIN` times as long
    as the host takes to issue the chunk's kernels. Below it the GPU idles between launches: on
    the H200, head-wise offload of Llama-3-8B at 2K-token chunks ran 0.65x of the `gpu` policy."""
    return math.ceil(HOST_MARGIN * host_issue_s(cfg, hw, pieces) * hw.flops / linear_flops_per_token(cfg))


def default_chunk_size(
    cfg: ModelConfig, context: int, hw: Hardware, dtype_bytes: int, pieces: int | None = None
) -> int:
    """Roofline chunk: the smallest one that is compute-bound (over PCIe and HBM) and hides the
    host's issue time of `pieces` slice steps, rounded up to 1024, in [2048, 16384], <= context."""
    t = max(min_compute_bound_chunk(cfg, context, hw, dtype_bytes), min_host_hidden_chunk(cfg, hw, pieces))
    return min(max(round_up(t, CHUNK_MULTIPLE), MIN_CHUNK), MAX_CHUNK, context)


def decode_flops(cfg: ModelConfig, context: int) -> int:
    """FLOPs of decoding one token against `context` cached tokens."""
    return (
        linear_flops_per_token(cfg) + attention_flops(cfg, 1, context) + 2 * cfg.vocab_size * cfg.hidden_size
    )


@dataclass(frozen=True)
class StepTime:
    """Roofline time of one step, seconds: the largest of the three bounds plus fixed overhead."""

    compute_s: float
    hbm_s: float
    pcie_s: float
    overhead_s: float
    cpu_s: float = 0.0  # host CPU attention of the slices it decodes (kvtier.planner.cpu_split)

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.hbm_s, self.pcie_s, self.cpu_s) + self.overhead_s

    @property
    def bound(self) -> str:
        """'compute', 'hbm', 'pcie' or 'cpu': which resource sets the time."""
        return max(
            ("compute", self.compute_s),
            ("hbm", self.hbm_s),
            ("pcie", self.pcie_s),
            ("cpu", self.cpu_s),
            key=lambda p: p[1],
        )[0]


def decode_time(
    cfg: ModelConfig,
    context: int,
    hw: Hardware,
    dtype_bytes: int,
    *,
    pcie_bytes: float,
    streamed_pieces: int,
    cpu_s: float = 0.0,
) -> StepTime:
    """Time to decode one token: all weights and KV are read from HBM; `pcie_bytes` of streamed
    KV cross the link; each of `streamed_pieces` streamed slices (or sequence blocks) costs
    `hw.slice_overhead_s`; `cpu_s`: the host CPU's attention, beside the link."""
    hbm = weight_bytes(cfg, dtype_bytes) + cfg.kv_bytes(context, dtype_bytes)
    return StepTime(
        compute_s=decode_flops(cfg, context) / hw.flops,
        hbm_s=hbm / hw.hbm_bw,
        pcie_s=(pcie_bytes + expert_copy_bytes(cfg, 1, dtype_bytes)) / hw.pcie_bw,
        overhead_s=streamed_pieces * hw.slice_overhead_s,
        cpu_s=cpu_s,
    )


def prefill_time(
    cfg: ModelConfig,
    context: int,
    chunk: int,
    hw: Hardware,
    dtype_bytes: int,
    streamed_fraction: float = 1.0,
    pieces: int | None = None,
) -> float:
    """Seconds to prefill `context` tokens in chunks; `streamed_fraction` of the KV is offloaded.
    Each chunk takes at least the host's time to issue its layers and `pieces` slice steps."""
    w = weight_bytes(cfg, dtype_bytes)
    host = host_issue_s(cfg, hw, pieces)
    total = 0.0
    for start in range(0, context, chunk):
        t = min(chunk, context - start)
        compute = prefill_chunk_flops(cfg, t, start) / hw.flops
        pcie = (
            prefill_chunk_pcie_bytes(cfg, t, start, dtype_bytes, streamed_fraction)
            + expert_copy_bytes(cfg, t, dtype_bytes)
        ) / hw.pcie_bw
        hbm = (w + cfg.kv_bytes(start + t, dtype_bytes)) / hw.hbm_bw
        total += max(compute, pcie, hbm, host)
    return total
