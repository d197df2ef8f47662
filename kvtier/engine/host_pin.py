"""How the layer-order prefill pins its hidden-state pieces (`kvtier.engine.layer_prefill`): the
environment's `KVTIER_HIDDEN_PIN`.

"alloc" (the default): PyTorch's pinned allocator, `cudaHostAlloc`, 1.59 GB/s on an H100 host
(bench/results/pin_rate.json), so layer 0 of a 512K prefill pins 4.3 GB in ~2.7 s beside
~0.95 s of compute. "register": pageable memory whose pages torch's threads fault in (a fill),
then `cudaHostRegister`, as PyTorch's `pinned_use_cuda_host_register` does (7.25 GB/s with 8
threads there). Only for these pieces, which the GPU reads by copies: set for the whole
allocator, registered memory made the host tier's in-place reads by kernels slower (the last
token's step 4.40 s against 0.80, hip_cli_speed_512k_fast_landmarks_all_layer_register16.json).
Off until a 512K run on one start compares the two.
"""

from __future__ import annotations

import os

import torch

from kvtier.errors import ConfigError

HIDDEN_PIN = ("alloc", "register")


def hidden_pin() -> str:
    """`KVTIER_HIDDEN_PIN`: "alloc" (unset, the default) or "register"."""
    raw = os.environ.get("KVTIER_HIDDEN_PIN", "").strip().lower() or "alloc"
    if raw not in HIDDEN_PIN:
        raise ConfigError(f"KVTIER_HIDDEN_PIN={raw!r}: use alloc (the default) or register")
    return raw


def registered_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of `shape` pinned by `cudaHostRegister` after a fill faulted its pages in on
    torch's threads; `unregister` it once no copy reads it any more (before it is freed)."""
    t = torch.zeros(shape, dtype=dtype)
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes failed: cudaError {rc}")
    return t


def unregister(t: torch.Tensor) -> None:
    """Undo `registered_empty` (its copies done: the caller synchronized)."""
    rc = int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))
    if rc != 0:
        raise RuntimeError(f"cudaHostUnregister failed: cudaError {rc}")
