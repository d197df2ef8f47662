"""Whether HiP replays its decode steps as CUDA graphs (`kvtier.sparse.decode_graph`): the
environment's `KVTIER_HIP_GRAPHS` and where its default ("auto") applies."""

from __future__ import annotations

import os

from kvtier.errors import ConfigError

GRAPH_SETTINGS = {"": "auto", "auto": "auto", "0": "off", "off": "off", "1": "on", "on": "on"}


def graphs_setting() -> str:
    """`KVTIER_HIP_GRAPHS` as "auto" (unset, the default), "off" ("0") or "on" ("1")."""
    raw = os.environ.get("KVTIER_HIP_GRAPHS", "")
    setting = GRAPH_SETTINGS.get(raw.strip().lower())
    if setting is None:
        raise ConfigError(f"KVTIER_HIP_GRAPHS={raw!r}: use 1 (on), 0 (off) or auto (the default)")
    return setting


def graphs_wanted(setting: str, cuda: bool, allowed: bool) -> bool:
    """Whether a HiP kernel replays its decode steps as CUDA graphs: "on" always (on CPU tensors
    the bodies run eagerly), "off" never, "auto" on CUDA where `allowed`: not where its decode
    memory is placed in a region it was lent (`HipKernel.place_caches`: a server's pages; the
    graphs' shared pool, their temporaries of a few MB, would lie outside it) or its caller
    keeps them off (`ReplaysGraphs`). Measured on an H100 through `kvtier generate` under
    24 GiB: 512K 24.4 -> 31.1 tok/s on one machine start, bitwise the same outputs
    (bench/results/hip_cli_speed_512k_graphs_{0,1}.json, gpu_checks_7972508.json)."""
    return setting == "on" or (setting == "auto" and cuda and allowed)
