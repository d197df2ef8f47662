"""How the layer-order prefill pins its hidden-state pieces (`kvtier.engine.layer_prefill`): the
environment's `KVTIER_HIDDEN_PIN`.

"alloc" (the default): PyTorch's pinned allocator, `cudaHostAlloc`, 1.59 GB/s on an H100 host
(bench/results/pin_rate.json), so layer 0 of a 512K prefill pins 4.3 GB in ~2.7 s beside
~0.95 s of compute. "register": pageable memory whose pages torch's threads fault in (a fill),
then `cudaHostRegister`, as PyTorch's `pinned_use_cuda_host_register` does (7.25 GB/s with 8
threads there). Only for these pieces, which the GPU reads by copies: set for the whole
allocator, registered memory made the host tier's in-place reads by kernels slower (the last
token's step 4.40 s against 0.80, hip_cli_speed_512k_fast_landmarks_all_layer_register16.json).
Off until a 512K run on one start compares the two. "huge": the same in transparent huge pages
(`kvtier.kv.host_register`), 17.19 GB/s against 8.47 for "register" on one H100 host
(bench/results/host_memory.json); untimed at 512K (`pending_h200.sh 184`).

Registered pieces are not unregistered after the pass, inside the prefill (unpinning PyTorch's
4.3 GB of cached pieces had put ~0.5-0.8 s into a graph capture): they go back to their pool,
which the next prefill by layer takes them from, as PyTorch's pinned allocator keeps its own
pieces cached (`kvtier.kv.graph_capture`), and are unregistered when the process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import os

from kvtier.errors import ConfigError
from kvtier.kv.host_register import RegisteredPool, registered_huge

HIDDEN_PIN = ("alloc", "register", "huge")


def hidden_pin() -> str:
    """`KVTIER_HIDDEN_PIN`: "alloc" (unset, the default), "register" or "huge" (registered in
    transparent huge pages: 17.19 GB/s against 8.47 for "register" on an H100 host,
    bench/results/host_memory.json; the pieces are only copied, never read in place)."""
    raw = os.environ.get("KVTIER_HIDDEN_PIN", "").strip().lower() or "alloc"
    if raw not in HIDDEN_PIN:
        raise ConfigError(f"KVTIER_HIDDEN_PIN={raw!r}: use alloc (the default), register or huge")
    return raw


REGISTERED = RegisteredPool()
REGISTERED_HUGE = RegisteredPool(registered_huge)


def _release_at_exit() -> None:
    """`REGISTERED.close()` (and the huge pool's) as the process ends; a CUDA runtime already
    shut down refuses the unregistering, and the process's end releases the pages then anyway."""
    for pool in (REGISTERED, REGISTERED_HUGE):
        with contextlib.suppress(RuntimeError):
            pool.close()


atexit.register(_release_at_exit)
