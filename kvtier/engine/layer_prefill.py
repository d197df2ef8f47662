"""A prompt's prefill run layer by layer: every chunk through layer 0, then every chunk through
layer 1, and so on, so a streamed slice's KV stays on the GPU for all of its layer's chunks
(`kvtier.kv.layer_pass`) and only the chunks' hidden states move between layers.

The residual stream of the chunks waits between layers in pinned host memory on CUDA (8 KB a
token for Llama-3-8B: 4 GiB at 512K, a piece a chunk, where its KV would send ~1.1 TB over the
prefill chunk by chunk); a chunk's next input is copied in on a stream of its own while the one before it
computes, and each output copied out on another. Off CUDA it is one tensor in memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtier.engine.host_pin import REGISTERED, REGISTERED_HUGE, hidden_pin
from kvtier.kv.host_register import RegisteredPool
from kvtier.kv.store import TieredKVStore
from kvtier.model.llama import CausalLM


class _Hidden:
    """The chunks' residual stream between layers, a [e - s, hidden] piece a chunk [s, e) on the
    host (pinned on CUDA), read into `device` one step ahead on a copy stream and written back on
    another.

    A piece is allocated when its chunk first writes (layer 0), not the whole stream at once:
    PyTorch's pinned allocator rounds a request up to a power of two and pins it before returning,
    so one [512K, 4096] bf16 buffer (4.3 GB) pinned 8 GB with the GPU idle (layer 0 of `fast` at
    512K took 7.3 s against ~1.2 s for each later layer: bench/results/
    hip_cli_speed_512k_fast_order_ab.json); a 16K chunk's piece is 128 MiB. Nor every piece
    before the first launch: a pinned allocation may synchronize with the device, so that pinned
    4.3 GB with the GPU idle too (layer 0 6.81 s at 8511455, some of it perhaps Triton compiles a
    64K warm-up left, against 4.06 s a piece at a time: hip_cli_speed_512k_fast_landmarks_layer.json,
    hip_cli_speed_512k_fast_landmarks_triton.json).

    A written chunk's device rows stay referenced until the next write, when the current stream
    waits for their copy (long done: a chunk's compute lies between) before the caching allocator
    may hand their block out again. Not `record_stream`: with the host chunks ahead of the GPU,
    blocks held for copies not yet run made the allocator call `cudaMalloc` again and again and,
    at a --gpu-memory cap, free its cache and retry (1,228 mallocs and 210 retries at 512K with
    record_stream; 69 and none held so, with layers 4-31 at 0.89-0.91 s against 0.91-0.96)."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        pin = hidden_pin() if self.cuda else "alloc"  # `kvtier.engine.host_pin`
        self.pool: RegisteredPool | None = {"register": REGISTERED, "huge": REGISTERED_HUGE}.get(pin)
        self.device, self.width, self.dtype = device, width, dtype
        self.pieces: dict[int, torch.Tensor] = {}  # chunk start -> its rows [e - s, hidden]
        self._in = torch.cuda.Stream(device) if self.cuda else None
        self._out = torch.cuda.Stream(device) if self.cuda else None
        self._written: dict[int, torch.cuda.Event] = {}  # chunk start -> its rows written back
        self._ahead: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}  # start -> (input, ready)
        self._held: tuple[torch.Tensor, torch.cuda.Event] | None = None  # the last rows written, their copy

    def prefetch(self, s: int, e: int) -> None:
        """Start reading chunk [s, e)'s rows (written before) into the device, once their last
        write-back is done."""
        if s in self._ahead:
            return
        rows = self.pieces[s]
        assert rows.shape[0] == e - s, "a chunk's rows are read as they were written"
        if self._in is None:
            self._ahead[s] = (rows, None)
            return
        # NOTE: allocated on the current stream, which reads it: memory allocated on the copy
        # stream stays in that stream's pool of the caching allocator, out of reach of the
        # compute stream's allocations under a tight --gpu-memory
        x = torch.empty(e - s, self.width, dtype=self.dtype, device=self.device)
        self._in.wait_stream(torch.cuda.current_stream(self.device))  # x's block's last users
        with torch.cuda.stream(self._in):
            if s in self._written:
                self._in.wait_event(self._written[s])
            x.copy_(rows, non_blocking=True)
            self._ahead[s] = (x, self._in.record_event())

    def read(self, s: int, e: int) -> torch.Tensor:
        """Rows [s, e) on the device, for the current stream."""
        self.prefetch(s, e)
        x, ready = self._ahead.pop(s)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return x

    def write(self, s: int, x: torch.Tensor) -> None:
        """Rows [s, s + len(x)) from the device, after the current stream's work so far."""
        rows = self.pieces.get(s)
        if rows is None:
            shape = (x.shape[0], self.width)
            if self.pool is not None:
                rows = self.pool.take(shape, self.dtype)
            else:
                rows = torch.empty(shape, dtype=self.dtype, pin_memory=self.cuda)
            self.pieces[s] = rows
        assert rows.shape[0] == x.shape[0], "a chunk's rows are written whole"
        if self._out is None:
            rows.copy_(x)
            return
        current = torch.cuda.current_stream(self.device)
        self._out.wait_stream(current)
        with torch.cuda.stream(self._out):
            rows.copy_(x, non_blocking=True)
            self._written[s] = self._out.record_event()
        self.release()
        self._held = (x, self._written[s])

    def release(self) -> None:
        """Let the last written rows' block go once their copy is done (in stream order)."""
        if self._held is not None:
            torch.cuda.current_stream(self.device).wait_event(self._held[1])
            self._held = None

    def close(self) -> None:
        """After the pass: registered pieces go back to their pool once the device is done with
        them (a sync; the pinned allocator's own pieces need none)."""
        self.release()
        if self.pool is not None and self.pieces:
            torch.cuda.synchronize(self.device)
            self.pool.give(self.pieces.values())
        self.pieces.clear()


@torch.inference_mode()
def prefill_by_layer(
    model: CausalLM,
    store: TieredKVStore,
    ids: torch.Tensor,
    spans: list[tuple[int, int]],
    chunk_size: int,
    *,
    progress: Callable[[int], object] | None = None,
    layer_done: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Run the prompt ids [N] (`spans`: consecutive chunks [start, end) from 0 to N, at least
    two) through the model as one store step taken layer by layer (`TieredKVStore.begin_step(n,
    by_layer=True)`: the caller checked `layer_pass_fits`). Returns the last token's logits
    [1, vocab]. `progress(tokens)`: after each (layer, chunk), whole tokens that sum to N over
    the pass (the pairs' tokens over the layer count, a progress bar's share; whole, so a bar's
    total is never passed by rounding); `layer_done()`: after each layer."""
    n = spans[-1][1]
    assert spans[0][0] == 0 and n == ids.shape[0], "the whole prompt, from its first token"
    layers = model.model.layers
    hidden = _Hidden(model.config.hidden_size, model.model.embed_tokens.weight.dtype, ids.device)
    store.begin_step(n, by_layer=True)  # NOTE: after `_Hidden`, whose setting may be refused
    out = torch.empty(0)
    passed = 0  # tokens through a layer so far, summed over layers
    order = [(i, s, e) for i in range(len(layers)) for s, e in spans]
    for k, (i, s, e) in enumerate(order):
        x = model.embed(ids[s:e]) if i == 0 else hidden.read(s, e)
        if k + 1 < len(order) and order[k + 1][0] > 0 and order[k + 1][1] != s:
            hidden.prefetch(*order[k + 1][1:])  # the next chunk's input, while this one computes
        store.pass_chunk(s, e)
        x = layers[i](x, i, store, chunk_size)
        if i + 1 < len(layers):
            hidden.write(s, x)
        elif e == n:
            out = model.logits(x)
        shown, passed = passed // len(layers), passed + e - s
        if progress is not None:
            progress(passed // len(layers) - shown)  # whole tokens: their sum is exactly n
        if layer_done is not None and e == n:
            layer_done()
    hidden.close()
    store.end_step()
    return out
