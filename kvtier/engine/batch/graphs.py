"""Decode-only batch steps from static buffers, replayed as CUDA graphs on the GPU.

A decode step of B sequences runs the same kernels every time; only the token ids, positions,
write slots, block tables and lengths change. `DecodeRunner` pads B up to a bucket (1, 2, 4, 8,
16, 24, 32, 48, 64, ... up to `max_num_seqs`), fills the store's static buffers
(`PagedKVStore.begin_decode`) and runs the forward. On CUDA each bucket's forward is captured
once as a CUDA graph (after a warm-up run that compiles the Triton kernels) and then replayed:
one launch for the whole model instead of ~40 per layer from Python, which is what bounded the
server's decode at a few hundred steps per second. On the CPU the same static path runs eagerly
(its tests check it against the single-sequence store).

    step:  ids, SeqSteps --begin_decode--> static buffers --replay--> logits [B_bucket, vocab]
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.kv.graph_capture import capture
from kvtier.kv.paged import PagedKVStore, SeqStep
from kvtier.model.llama import CausalLM


def buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes graphs are captured for: powers of two to 16, then steps of 8 then 16."""
    out, b = [], 1
    while b < min(16, max_batch):
        out.append(b)
        b *= 2
    while b < max_batch:
        out.append(b)
        b += 8 if b < 64 else 16
    return (*out, max_batch)


class DecodeRunner:
    """Runs decode-only batches of up to `store.max_batch` sequences through `model`.

    `graphs`: capture and replay CUDA graphs (default: on CUDA). The logits it returns are a
    view of the graph's output buffer, valid until the next `run`.
    """

    def __init__(self, model: CausalLM, store: PagedKVStore, graphs: bool | None = None) -> None:
        self.model, self.store = model, store
        dev = store.device
        self.graphs = dev.type == "cuda" if graphs is None else graphs
        self.buckets = buckets(store.max_batch)
        self.ids = store.dec_ids  # [B_max], filled by `store.begin_decode`
        self.rows = torch.arange(store.max_batch, device=dev)  # logits of every row
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None  # the graphs' shared memory pool (after the first capture)
        self.captures = self.replays = 0

    def bucket(self, n: int) -> int:
        """The smallest bucket holding `n` rows."""
        return next(b for b in self.buckets if b >= n)

    def run(self, ids: list[int] | torch.Tensor, steps: list[SeqStep]) -> torch.Tensor:
        """Logits [len(ids), vocab] (float32) of one decode step: token ids[i] of steps[i]. `ids`
        may be a tensor on the device (the tokens a step before sampled there: no host sync)."""
        n = len(ids)
        rows = self.bucket(n)
        if isinstance(ids, torch.Tensor):
            self.store.begin_decode(steps, rows)
            self.ids[:n].copy_(ids)  # NOTE: after begin_decode's copy, in the stream's order
        else:
            self.store.begin_decode(steps, rows, ids)
        if not self.graphs:
            return self._forward(rows)[:n]
        if rows not in self._captured:
            self._captured[rows] = self._capture(rows)
        graph, out = self._captured[rows]
        graph.replay()
        self.replays += 1
        return out[:n]

    def capture_all(self) -> int:
        """Capture every bucket's graph now, each over the store's scratch page alone, so that
        no request waits for a capture later (a server does this at start; lazily, each new
        batch size cost its first step a warm-up and a capture). Returns how many it captured."""
        if not self.graphs:
            return 0
        todo = [rows for rows in self.buckets if rows not in self._captured]
        for rows in todo:
            self.store.begin_decode([SeqStep((self.store.scratch,), 0, 1)], rows)  # ids 0
            self._captured[rows] = self._capture(rows)
        return len(todo)

    def _forward(self, rows: int) -> torch.Tensor:
        self.store.decode_prologue(rows)
        logits = self.model(self.ids[:rows], self.store, logits_at=self.rows[:rows])  # [rows, vocab]
        self.store.end_step()
        return logits

    def _capture(self, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (Triton compiles, cuBLAS picks kernels), then capture.

        The warm-up writes the step's own k/v into its own slots, the values the replay writes
        again, so it changes nothing the sequences read."""
        side = torch.cuda.Stream(self.store.device)
        side.wait_stream(torch.cuda.current_stream(self.store.device))
        with torch.cuda.stream(side):
            self._forward(rows)
        torch.cuda.current_stream(self.store.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        out = capture(graph, lambda: self._forward(rows), side, self._pool)  # the pinned cache kept
        self._pool = graph.pool()
        self.captures += 1
        return graph, out
