"""The tensor-parallel transform: a built `CausalLM` becomes one rank's shard, in place.

The model file stays pure (gpt-fast's way): this module cuts the weights and swaps two linears
per layer, and the decoder runs unchanged. Rank r of N keeps (heads, KV heads and MLP channels
each in N contiguous blocks, block r):

    q_proj, k_proj, v_proj  rows of its query / KV heads (and their bias)  column-parallel
    gate_proj, up_proj      rows of its MLP channels                      column-parallel
    o_proj, down_proj       columns of those; the partial sums are         row-parallel
                            all-reduced, then the (whole) bias is added
    embeddings, norms, lm_head, q/k norms (per head_dim)                  whole on every rank

Query head j reads KV head j // q_per_kv, so rank r's query heads read exactly rank r's KV
heads: attention (and the KV cache) needs no communication. Two all-reduces of [T, hidden]
per layer are the only traffic. The Llama family's blocks and Gemma-2's (whose extra norms are
whole on every rank) are cut alike; DeepSeek-V2's latent attention has no KV heads to split and
is refused (`kvtier.planner.sharding.check_tensor_parallel`), as pipeline stages run it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.config import ModelConfig
from kvtier.loading.weights import random_model
from kvtier.model.layers import GatedMLP
from kvtier.model.llama import CausalLM
from kvtier.model.self_attention import SelfAttention
from kvtier.parallel.group import RankGroup
from kvtier.planner.sharding import rank_config

# The linears cut over the ranks, and the weight dim they are cut along (HF names).
SPLIT_DIMS = {
    **dict.fromkeys(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), 0),  # column-parallel
    **dict.fromkeys(("o_proj", "down_proj"), 1),  # row-parallel
}


def split_dim(name: str) -> int | None:
    """The dim along which parameter `name` ("model.layers.3.self_attn.q_proj.weight") is cut
    into N blocks, block r on rank r; None: whole on every rank. `shard_` makes these cuts; a
    loader reading a checkpoint slice by slice makes the same ones from it."""
    module, _, kind = name.rpartition(".")
    dim = SPLIT_DIMS.get(module.rpartition(".")[2])
    if dim == 1 and kind == "bias":
        return None  # NOTE: a row-parallel bias is added once, after the sum
    return dim


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over the ranks: each rank multiplies its
    slice of the input by its columns of the weight, one all-reduce sums the partial outputs,
    and the bias (whole, on every rank) is added once, after the sum.

    An `nn.Linear` (same parameter names, so state dicts keep Hugging Face's) with this forward."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: RankGroup) -> None:
        nn.Module.__init__(self)  # NOTE: not nn.Linear's, which would allocate a weight
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in / N]
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(bias, requires_grad=False)  # [out], whole
        self.group = group
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / N] -> [T, out]
        y = self.group.all_reduce_(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (this rank's), out_features={self.out_features}"


def _block(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Block `rank` of `size` equal blocks of `t` along `dim`, as a tensor of its own (so the
    whole tensor's storage is freed when the caller drops it)."""
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n).clone()


def _narrow_rows_(linear: nn.Linear, rank: int, size: int) -> None:
    """Keep block `rank` of the output rows of `linear` (column parallel), in place."""
    linear.weight = nn.Parameter(_block(linear.weight.data, 0, rank, size), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_block(linear.bias.data, 0, rank, size), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _row_parallel(linear: nn.Linear, group: RankGroup, cut: bool) -> RowParallelLinear:
    """`linear` as a RowParallelLinear over its input columns (cut to block `rank` when `cut`;
    else it already has this rank's columns)."""
    weight = linear.weight.data
    if cut:
        weight = _block(weight, 1, group.rank, group.size)
    bias = None if linear.bias is None else linear.bias.data
    return RowParallelLinear(weight, bias, group)


def _parallelize_(model: CausalLM, cfg: ModelConfig, group: RankGroup, cut: bool) -> CausalLM:
    """Make `model` rank `group.rank`'s shard of a model of config `cfg` (cutting the column-
    and row-parallel weights when `cut`; else they already have the rank's shapes)."""
    rank, size = group.rank, group.size
    local = rank_config(cfg, size)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp  # the Llama family's and Gemma-2's blocks
        assert isinstance(attn, SelfAttention) and isinstance(mlp, GatedMLP), "checked by rank_config"
        if cut:
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                _narrow_rows_(linear, rank, size)
        attn.o_proj = _row_parallel(attn.o_proj, group, cut)
        mlp.down_proj = _row_parallel(mlp.down_proj, group, cut)
        # NOTE: SelfAttention reshapes q/k/v by these counts, so they must be the rank's.
        attn.num_heads, attn.num_kv_heads = local.num_heads, local.num_kv_heads
    model.config = local
    return model


def shard_(model: CausalLM, group: RankGroup) -> CausalLM:
    """Cut a whole `model` (any device, meta included) to rank `group.rank`'s shard, in place;
    its `config` becomes the rank's (`kvtier.planner.sharding.rank_config`). Returns `model`.

    Every rank must hold the same whole model: the replicated parts are used as they are."""
    return _parallelize_(model, model.config, group, cut=True)


def random_rank_model(
    cfg: ModelConfig, group: RankGroup, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> CausalLM:
    """Rank `group.rank`'s shard of a random-weight model of `cfg`, built at the rank's shapes:
    the whole model is never materialized (a 70B preset on 80 GB GPUs).

    NOTE: every rank draws the same numbers (same seed, same shapes, same order), so the
    replicated embeddings, norms and LM head agree across ranks, as they must. The weights are
    not the cut of `random_model(cfg)`'s: a random preset under N ranks is another random model
    of the same shapes."""
    model = random_model(rank_config(cfg, group.size), device, dtype, seed)
    return _parallelize_(model, cfg, group, cut=False)
