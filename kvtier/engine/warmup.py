"""The GPU libraries' first-use costs, paid while a request's store is set up: the environment's
`KVTIER_WARMUP`.

Every 512K run through the CLI spent ~1.6 s more on its first prefill step than on its second
(lossless auto: 2.58 s against 0.94 for its first two 5K chunks; HiP by layer: layer 0 2.6 s
against ~1.0 for layers 1-3, hip_cli_speed_512k_auto_base_f.json and
hip_cli_speed_512k_fast_landmarks_layer_combined.json, H100), before which the setup pins the
host tier for ~30 s with the GPU idle. The extra is a process's first call into each library
the layers use (cuBLAS, cuDNN's attention, Triton's fused norms), not anything a step repeats.

"thread" (the default): `start` runs layer 0 twice over a few dummy tokens (a first chunk, then
one after a prefix: both of `attend`'s causal paths) on a thread of its own, beside the store's
setup, and `join` waits for it before the prefill. Libraries keep what a first call loads for
the whole process (and PyTorch's cuBLAS and cuDNN handles go back to a shared pool when the
thread ends), so the prefill's first step no longer pays it: on an H100, lossless auto's first
4K chunk of a 64K prompt took 2.07 s under the profiler without it, 1.14 s of that in cuDNN's
first attention calls, and 0.17 s with it (first_prefill_step_trace_64k_auto{,_warm}.json); HiP
by layer's layer 0 at 512K 1.63 s against 2.19 on the same start
(hip_cli_speed_512k_fast_landmarks_layer_combined_stage0{_warm_pin8,}.json). The thread ended
as the pinning did (25.2 and 30.1 s of setup with it, pinning from 8 threads; 28.5 without, one
thread: no cost seen). Once per device and process. "off": nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import torch

from kvtier.attention.dense import attend, attend_prefix_lse, attend_self_lse, merge_into
from kvtier.errors import ConfigError
from kvtier.model.llama import CausalLM

WARMUP = ("off", "thread")
WARM_TOKENS = 256  # tokens of each dummy step: enough for every kernel the chunks use to load
_WARMED: set[int] = set()  # CUDA device indices this process has warmed


def warmup_mode() -> str:
    """`KVTIER_WARMUP`: "thread" (unset, the default) or "off"."""
    raw = os.environ.get("KVTIER_WARMUP", "").strip().lower() or "thread"
    if raw not in WARMUP:
        raise ConfigError(f"KVTIER_WARMUP={raw!r}: use thread (the default) or off")
    return raw


class _ScratchAttention:
    """Dense causal attention of one layer over the tokens it has been given (no RoPE: only
    which kernels run matters, not the values), the model's `Attention` interface, two ways:
    `attend` (a resident slice's kernel: cuDNN's on Hopper) and its parts with log-sum-exp
    merged (a streamed slice's: the flash kernel's)."""

    def __init__(self) -> None:
        self.kv: torch.Tensor | None = None  # [S, 2, H_kv, D]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        part = attend_self_lse(q, k, v)  # ([T, H_q, D] float32, [T, H_q])
        if self.kv is not None:
            part = merge_into(attend_prefix_lse(q, self.kv), part)
        step = torch.stack((k, v), dim=1)  # [T, 2, H_kv, D]
        self.kv = step if self.kv is None else torch.cat((self.kv, step))
        return attend(q, self.kv) + part[0].to(q.dtype)  # [T, H_q, D]


def warm_layer(model: CausalLM, device: torch.device, tokens: int = WARM_TOKENS) -> None:
    """Run layer 0 of `model` on `device` over two steps of `tokens` dummy tokens, then the LM
    head on the last. Reads the weights only; the model is unchanged."""
    with torch.inference_mode():
        x = model.embed(torch.zeros(tokens, dtype=torch.long, device=device))  # [T, hidden]
        attention = _ScratchAttention()
        for _ in range(2):
            h = model.model.layers[0](x, 0, attention, None)
        model.logits(h)
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def warms(model: CausalLM, device: torch.device) -> bool:
    """Whether `start` would warm `model` on `device`: CUDA, not yet warmed, KVTIER_WARMUP on,
    and a family whose layer 0 takes dense attention of plain heads (not latent ones)."""
    cfg = model.config
    return (
        device.type == "cuda"
        and (device.index or 0) not in _WARMED
        and warmup_mode() == "thread"
        and cfg.mla is None
        and cfg.family != "gemma2"
    )


class KernelWarmup:
    """`warm_layer` on a thread of its own, beside other host work (see the module docstring)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._seconds: float | None = None
        self._error: str | None = None

    def start(self, model: CausalLM, device: torch.device, ranked: bool = False) -> KernelWarmup:
        """Start warming `model` on `device` if `warms` says so; returns self. `ranked`: the
        model is one of several ranks' parts, which is never warmed (a pipeline stage may lack
        layer 0, a tensor-parallel layer's forward would enter collectives on one rank alone)."""
        if ranked or not warms(model, device):
            return self
        _WARMED.add(device.index or 0)

        def run() -> None:
            t0 = time.perf_counter()
            try:
                on = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
                with on:
                    warm_layer(model, device)
            except Exception as e:  # a warm-up that fails costs nothing but its note
                self._error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            self._seconds = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name="kvtier-warmup", daemon=True)
        self._thread.start()
        return self

    def join(self) -> dict[str, float | str]:
        """Wait for the warm-up; what it did, for the stats: {"seconds"} (and "error" when it
        failed), {} when none ran."""
        if self._thread is None:
            return {}
        self._thread.join()
        self._thread = None
        out: dict[str, float | str] = {"seconds": round(self._seconds or 0.0, 4)}
        if self._error is not None:
            out["error"] = self._error
        return out
