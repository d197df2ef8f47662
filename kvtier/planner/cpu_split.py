"""Which streamed slices a decode step attends on the CPU instead of copying them over PCIe.

Offloaded decode reads every streamed slice once per token. The KV already lives in host
memory, so the CPU can attend some slices in place (`kvtier.attention.cpu_decode`) while the
link carries the others; the partial results merge exactly by log-sum-exp. Three rates decide
the split: the link (`pcie_bw`), the CPU's attention kernel (`cpu_attention_bw`, KV bytes it
reads per second) and the GPU (HBM, and the host's per-slice issue time). The step is
simulated layer by layer, because a layer's query is known only when the layer runs:

```
 layer l:   q_l ─┬─ CPU: attend l's CPU slices (all at once, cpu_bw) ──────────┐
                 └─ GPU: attend l's streamed slices as their loads land ────────┴─ merge ─> layer l+1
 link:      loads of streamed slices back to back, each into a free staging buffer (2)
```

The plan takes the CPU-slice count with the least simulated step time, and 0 unless some count
is faster than the link alone: a slow CPU (two cores) gets nothing it cannot finish in time.

Contention: DMA and the CPU read the same memory. The link keeps its rate and the CPU gets what
is left of the combined rate: with a measured one (`host_combined_bw`) that, without one the
CPU's own measured read rate (`host_read_bw`: DMA and the CPU together read no faster than the
CPU alone), else `CONTENTION_FACTOR` of their sum. On the H200 the decode sweeps fit this: the
link ran at 53.4 GB/s beside a lightly loaded CPU, the CPU at ~49 GB/s beside the link
(bench/results/cpu_attention_sweep_512k.json). The rates hold for the whole step whenever any
slice is on the CPU (conservative).

Loads are issued the way `kvtier.kv.staging.StagingRing` issues them: taking a buffer issues the
load `staging_buffers - 1` slices ahead, so while the host waits for a layer's CPU results only
those loads are queued. More buffers keep the link busy through the wait; `more_buffers` trades a
resident slice for one. Against the H200 sweeps (128K and 512K, 0-44 CPU slices) the simulation
is within 5% on average (`tests/test_cpu_split.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.planner.hardware import Hardware
from kvtier.planner.memory import weight_bytes

CONTENTION_FACTOR = 0.75  # combined rate / (link + CPU) assumed when neither rate was measured
MODES = ("auto", "off")


def parse_mode(text: str | int) -> str | int:
    """`--cpu-attention`: "auto", "off" or a number of slices (ConfigError otherwise)."""
    if isinstance(text, int) or text.isdigit():
        return int(text)
    if text in MODES:
        return text
    raise ConfigError(f"--cpu-attention {text!r}: use auto, off or a number of slices")


@dataclass(frozen=True)
class SplitRates:
    """The rates a split runs at, B/s, with any contention applied."""

    pcie_bw: float  # link, while the CPU attends
    cpu_bw: float  # CPU attention, while the link copies
    contention: str  # how the combined rate was found: "measured", "host read rate", "factor"


def split_rates(hw: Hardware) -> SplitRates | None:
    """The link and CPU rates while both run (None when the CPU rate is unknown): the link keeps
    its rate, the CPU gets the rest of the combined one."""
    p, c = hw.pcie_bw, hw.cpu_attention_bw
    if c <= 0:
        return None
    if hw.host_combined_bw > 0:
        limit, how = hw.host_combined_bw, "measured"
    elif hw.host_read_bw > 0:
        limit, how = hw.host_read_bw, "host read rate"
    else:
        limit, how = CONTENTION_FACTOR * (p + c), "factor"
    link = min(p, limit)
    return SplitRates(link, max(min(c, limit - link), 0.0), how)


def spread(n_total: int, n_chosen: int) -> list[bool]:
    """NOTE: the rule of `kvtier.kv.layout.spread` (which slices the store keeps resident); the
    planner may not import `kvtier.kv`, and a test checks that the two agree."""
    return [(i + 1) * n_chosen // n_total > i * n_chosen // n_total for i in range(n_total)]


def cpu_slice_flags(num_layers: int, num_groups: int, resident: list[bool], count: int) -> list[bool]:
    """Which slices (layer-major) are attended on the CPU: `count` of the streamed ones, spread
    evenly over the layers (each layer's CPU work then overlaps its own loads), the last
    streamed groups of a layer first. The store picks its CPU slices with this function."""
    streamed = [
        [s for s in range(li * num_groups, (li + 1) * num_groups) if not resident[s]]
        for li in range(num_layers)
    ]
    total = sum(len(x) for x in streamed)
    if not 0 <= count <= total:
        raise ConfigError(f"{count} CPU-attended slices asked, but only {total} slices are streamed")
    flags = [False] * len(resident)
    quota = [(li + 1) * count // num_layers - li * count // num_layers for li in range(num_layers)]
    carry = 0
    for li in range(num_layers):
        want = quota[li] + carry
        take = streamed[li][len(streamed[li]) - min(want, len(streamed[li])) :]
        for s in take:
            flags[s] = True
        carry = want - len(take)
    for li in reversed(range(num_layers)):  # what the last layers could not take
        for s in reversed(streamed[li]):
            if carry and not flags[s]:
                flags[s] = True
                carry -= 1
    return flags


@dataclass(frozen=True)
class SliceShape:
    """What the simulation needs of a plan (a `KVPlan` has all of it)."""

    num_layers: int
    num_groups: int
    resident_slices: int
    context: int
    slice_token_bytes: int
    blocks_per_slice: int
    staging_buffers: int
    # Bytes of a token the link and the CPU read: a packed slice's rows, per token (0: the
    # full-precision slice_token_bytes, which the GPU attends either way).
    read_token_bytes: float = 0.0


def decode_step_s(
    cfg: ModelConfig, shape: SliceShape, hw: Hardware, dtype_bytes: int, cpu_slices: int
) -> float:
    """Simulated seconds of one decode step with `cpu_slices` streamed slices on the CPU."""
    n = shape.num_layers * shape.num_groups
    resident = spread(n, shape.resident_slices)
    on_cpu = cpu_slice_flags(shape.num_layers, shape.num_groups, resident, cpu_slices)
    rates = split_rates(hw) if cpu_slices else None
    if cpu_slices and rates is None:
        raise ConfigError("CPU attention needs the CPU's attention rate (Hardware.cpu_attention_bw)")
    pcie = rates.pcie_bw if rates is not None else hw.pcie_bw
    cpu = rates.cpu_bw if rates is not None else 0.0
    slice_bytes = shape.context * shape.slice_token_bytes
    read_bytes = shape.context * (shape.read_token_bytes or shape.slice_token_bytes)
    blocks = max(shape.blocks_per_slice, 1)
    load_s = read_bytes / blocks / pcie
    # A packed load is unpacked on the H2D stream, the link idle meanwhile; a slice packed on
    # the device loads through the ring too: its rows copied on the device, then unpacked.
    packed = shape.read_token_bytes > 0
    unpack_s = slice_bytes / blocks / hw.unpack_bw if packed and hw.unpack_bw > 0 else 0.0
    device_load_s = read_bytes / blocks / hw.hbm_bw + unpack_s
    attn_s = slice_bytes / blocks / hw.hbm_bw + hw.slice_overhead_s  # one staged block (or resident slice)
    layer_s = weight_bytes(cfg, dtype_bytes) / cfg.num_layers / hw.hbm_bw + hw.layer_overhead_s
    nbuf = max(shape.staging_buffers, 1)
    ahead = max(nbuf - 1, 1)  # loads the ring keeps issued beyond the one in use
    link = gpu = host = 0.0
    done: list[float] = []  # when each load's attention finished (its buffer is free again)
    taken: list[float] = []  # host time at which each load's buffer was taken
    for li in range(shape.num_layers):
        gpu += layer_s  # norms and projections up to this layer's query
        start = gpu
        sids = range(li * shape.num_groups, (li + 1) * shape.num_groups)
        cpu_bytes = sum(read_bytes for s in sids if on_cpu[s])
        cpu_done = max(start, host) + cpu_bytes / cpu if cpu_bytes else start
        for s in sids:
            if on_cpu[s]:
                continue
            if resident[s] and not packed:
                gpu = max(gpu, start) + slice_bytes / hw.hbm_bw + hw.slice_overhead_s
                continue
            for _ in range(blocks):
                j = len(done)
                free = done[j - nbuf] if j >= nbuf else 0.0
                issued = taken[j - ahead] if j >= ahead else 0.0  # when the host issued load j
                link = max(link, free, issued) + (device_load_s if resident[s] else load_s + unpack_s)
                gpu = max(gpu, link) + attn_s
                done.append(gpu)
                taken.append(host)
        if cpu_bytes:
            # The host waits for the CPU's results, then merges them: loads beyond those already
            # issued wait for it.
            host = max(host, cpu_done)
            gpu = max(gpu, cpu_done) + sum(on_cpu[s] for s in sids) * hw.slice_overhead_s
    return gpu


def choose_cpu_slices(
    cfg: ModelConfig, shape: SliceShape, hw: Hardware, dtype_bytes: int, mode: str | int
) -> int:
    """The CPU-attended slice count for `mode`: "off" 0, a number N min(N, streamed slices),
    "auto" the count with the least simulated step time (0 when the CPU rate is unknown or no
    count beats the link alone)."""
    streamed = shape.num_layers * shape.num_groups - shape.resident_slices
    if isinstance(mode, int):
        if mode < 0:
            raise ConfigError(f"--cpu-attention {mode}: give auto, off or a number of slices >= 0")
        return min(mode, max(streamed, 0))
    if mode not in MODES:
        raise ConfigError(f"--cpu-attention {mode!r}: use auto, off or a number of slices")
    if mode == "off" or streamed <= 0 or split_rates(hw) is None:
        return 0
    # NOTE: a coarse pass over at most ~32 counts, then every count around the best one: the
    # step time falls and then rises with the count, up to the rounding of slices to layers.
    step = max(1, streamed // 32)
    times = {0: decode_step_s(cfg, shape, hw, dtype_bytes, 0)}

    def time_of(k: int) -> float:
        if k not in times:
            times[k] = decode_step_s(cfg, shape, hw, dtype_bytes, k)
        return times[k]

    coarse = min(range(0, streamed + 1, step), key=lambda k: (time_of(k), k))
    fine = range(max(0, coarse - step + 1), min(streamed, coarse + step - 1) + 1)
    return min(fine, key=lambda k: (time_of(k), k))
