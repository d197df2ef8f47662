"""Building blocks of the decoder: RMSNorm (Llama's, and Gemma's (1 + w) one), the gated MLP
(SwiGLU or GeGLU), and the switch to the fused kernels.

On CUDA with 16-bit activations the elementwise work runs in the Triton kernels of
`kvtier.model.fused` (see `use_fused`); everywhere else, and with KVTIER_FUSED=0, it runs as the
torch code below, which is what the CPU tests compare with Hugging Face transformers.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F
from torch import nn

_FUSED_DTYPES = (torch.float16, torch.bfloat16)


def use_fused(*tensors: torch.Tensor) -> bool:
    """Whether the fused Triton kernels take these tensors: all on CUDA in one 16-bit dtype,
    triton importable, and not forced off by KVTIER_FUSED=0. Shape and stride conditions are
    the caller's."""
    dtype = tensors[0].dtype
    if dtype not in _FUSED_DTYPES or not all(t.is_cuda and t.dtype == dtype for t in tensors):
        return False
    return os.environ.get("KVTIER_FUSED", "1") != "0" and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in float32, result in the input dtype (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        if use_fused(x, self.weight) and x.is_contiguous():
            from kvtier.model import fused

            return fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm: returns (x + delta, norm(x + delta)), x/delta [T, dim]."""
        if use_fused(x, delta, self.weight) and x.is_contiguous() and delta.is_contiguous():
            from kvtier.model import fused

            return fused.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32, rounded to the input dtype once
    (as HF's Gemma2RMSNorm; the weight is stored as an offset from 1, so zeros are the identity)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act silu (SwiGLU) or tanh-approximated gelu
    (GeGLU, Gemma's gelu_pytorch_tanh), run in sub-chunks of tokens.

    `max_tokens` bounds the [t, intermediate] temporaries: a long prefill chunk is split so that
    the MLP's activation memory stays proportional to `max_tokens`, not to the chunk.
    """

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # gate and up as one matmul, after `fuse()`

    def fuse(self) -> None:
        """Run gate and up as one matmul (`gate_up_proj`, weight [2I, hidden]); gate_proj and
        up_proj become views of its halves (no extra memory). Mutates."""
        self.gate_up_proj = fuse_linears_(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, max_tokens: int | None = None) -> torch.Tensor:
        # x: [T, hidden]
        if max_tokens is None or x.shape[0] <= max_tokens:
            return self.down_proj(self._gated(x))
        out = torch.empty_like(x)
        for s in range(0, x.shape[0], max_tokens):
            out[s : s + max_tokens] = self.down_proj(self._gated(x[s : s + max_tokens]))
        return out

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x) -> [t, intermediate]."""
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [t, I] each, rows 2I apart
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return gate_act(gate, up, self.act)


def gate_act(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up, [t, I]: silu (fused on CUDA) or tanh-approximated gelu."""
    if act != "silu":
        return F.gelu(gate, approximate="tanh") * up
    if use_fused(gate, up):
        from kvtier.model import fused

        # NOTE: gate, up and the product are alive together, the three [t, I] buffers the
        # planner's activation_bytes counts; the torch path below peaks at the same three.
        return fused.silu_mul(gate, up)
    return F.silu(gate) * up


def gated_mlp(x: torch.Tensor, w: torch.Tensor, act: str, max_tokens: int | None = None) -> torch.Tensor:
    """`GatedMLP` over weights packed as w [3, I * hidden] (gate [I, h], up [I, h] and down
    [h, I], each flattened), e.g. an expert copied in from host memory; x [T, hidden]."""
    h = x.shape[-1]
    i = w.shape[1] // h
    gate, up, down = w[0].view(i, h), w[1].view(i, h), w[2].view(h, i)
    step = max_tokens or max(x.shape[0], 1)
    if x.shape[0] <= step:
        return F.linear(gate_act(F.linear(x, gate), F.linear(x, up), act), down)
    out = torch.empty_like(x)
    for s in range(0, x.shape[0], step):
        xs = x[s : s + step]
        out[s : s + step] = F.linear(gate_act(F.linear(xs, gate), F.linear(xs, up), act), down)
    return out


def fuse_linears_(*parts: nn.Linear) -> nn.Linear:
    """One Linear whose output is `parts`' outputs side by side (weights, and biases if any,
    concatenated along the output dim); each part's weight and bias become views of its rows,
    so the parts still compute the same and hold no memory of their own. Mutates the parts."""
    weight = torch.cat([p.weight.data for p in parts])  # [sum of outs, in]
    has_bias = parts[0].bias is not None
    bias = torch.cat([p.bias.data for p in parts if p.bias is not None]) if has_bias else None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta", dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    start = 0
    for p in parts:
        end = start + p.weight.shape[0]
        p.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            p.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return fused
