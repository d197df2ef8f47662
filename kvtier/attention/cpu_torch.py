"""The torch backend of CPU decode attention: one task on PyTorch's CPU flash kernel (one Python
pool task each), and the merge of the tasks' partial results by log-sum-exp. Used when no C++
compiler is found, or for fp16, codecs and shapes the native kernel does not take.
"""

from __future__ import annotations

import torch

from kvtier.attention.cpu_tasks import Task
from kvtier.attention.row_formats import RowCodec


def merge(out: torch.Tensor, lse: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tasks' partial results out [P, G, r, D], lse [P, G, r] (float32) merged -> (out
    [H_q, D], lse [H_q]), H_q = heads = G x r. The torch backend's merge. NOTE: PyTorch's sum
    over P may split differently with its intra-op thread count; the native backend merges in
    task order instead (`kvtier_merge`)."""
    w = torch.softmax(lse, dim=0)  # [P, G, r]
    merged = (out * w[..., None]).sum(0)  # [G, r, D]
    return merged.reshape(heads, -1), torch.logsumexp(lse, dim=0).reshape(heads)


def run_torch_task(
    q: torch.Tensor,
    ext: torch.Tensor,
    t: Task,
    out: torch.Tensor,
    lse: torch.Tensor,
    ready: torch.cuda.Event | None,
    codec: RowCodec | None = None,
) -> None:
    """One task on PyTorch's CPU flash kernel: every KV head over t.tokens tokens of `ext`
    (with `codec`: over t.tokens packed rows, unpacked into float32 first) -> out [G, r, D],
    lse [G, r]."""
    if ready is not None:
        ready.synchronize()  # NOTE: before q is read: it may still be in flight from the GPU
    g, r, d = out.shape
    with torch.inference_mode():
        if codec is None:
            kv = ext[t.start : t.start + t.tokens]  # [n, 2, G, D]
        else:
            kv = codec.unpack(ext[t.start : t.start + t.tokens], g, d, torch.float32)
        qs = q.reshape(g, r, d).to(kv.dtype)[None]  # [1, G, r, D]
        k = kv[:, 0].transpose(0, 1).unsqueeze(0)  # [1, G, n, D]
        v = kv[:, 1].transpose(0, 1).unsqueeze(0)
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, k, v)
        out.copy_(res[0][0])
        lse.copy_(res[1][0])
