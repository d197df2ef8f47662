"""GPU hardware numbers for the roofline: peak compute, HBM bandwidth, host link bandwidth.

Presets are datasheet numbers except the H200's, which were measured on the machine kvtier is
tested on (research/headinfer.md §3.4), and the H100's host and GEMM numbers (the H200's: see
its entry). Every number can be overridden (`kvtier plan --tflops
--hbm-bw --pcie-bw`), and the engine may pass a `Hardware` it calibrated at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    import torch

GiB = 1024**3
# Measured on the H200 machine at constant shapes (bench/host_overhead.py: host_overhead.json);
# the layer figure is the prefill one (decode: 0.6 ms).
H200_SLICE_OVERHEAD_S = 215e-6
H200_PREFILL_SLICE_OVERHEAD_S = 435e-6
H200_LAYER_OVERHEAD_S = 850e-6
# The H200 machine's host: 16 cores read host memory at ~102 GB/s (a threaded fp32 sum; issue
# 23). Its CPU attention rates were measured there (bench/results/cpu_attention_h200.json,
# 2026-12-02, the native kernel on 15 threads, bf16, one KV head a slice): 68.6 GB/s of KV
# alone; with pinned H2D copies running, 60.7 GB/s beside the copies' 49.9 (110.6 combined).
# In decode the link keeps ~55 GB/s and the CPU gets ~49 (cpu_attention_sweep_128k.json and
# _512k.json, fitted by kvtier.planner.cpu_split's simulation), so the combined rate the planner
# uses is 104 GB/s.
H200_HOST_READ_BW = 102e9
H200_CPU_ATTENTION_BW = 68.6e9
H200_HOST_COMBINED_BW = 104e9
# A packed (quantized) load's unpack kernel: 256 unpacks of one-KV-head int4 slices at 512K
# (268 MB of bf16 each) ran 37.0 ms, 1.86e12 B/s of unpacked KV, on the H2D stream between the
# loads' copies (a traced decode step on an H100 of the same host kind, 2026-12-05:
# bench/results/int4_512k_g1_trace.json). Not measured on the H200 (HBM 1.25x the H100's).
H200_UNPACK_BW = 1.86e12
# The native kernel's rates over packed rows on the H200's host, 15 threads (packed bytes a
# second; bench/results/cpu_attention_rows_h200_wide.json, 2026-12-05): what `kvtier plan --gpu
# h200` splits a quantized cache at. A run on the machine measures its own (`hardware_for`).
H200_CPU_PACKED_BW = (("kivi4", 22.5e9), ("kivi8", 28.9e9), ("fp8", 19.0e9))


@dataclass(frozen=True)
class Hardware:
    """One GPU and its host link. Rates are per second, in FLOP and bytes."""

    name: str
    flops: float  # dense bf16 FLOP/s
    hbm_bw: float  # device memory bandwidth, B/s
    pcie_bw: float  # pinned host<->device bandwidth, one direction, B/s
    memory_bytes: int  # device memory, B
    # Host (CPU) time to issue work, which the GPU waits on when it has less to do:
    # one streamed slice in a decode step (its copy, kernel launches, event waits, write-back),
    slice_overhead_s: float = 30e-6
    # one slice step of a prefill chunk (more kernels: prefix and chunk attention, merge),
    prefill_slice_overhead_s: float = 30e-6
    # and one layer's other kernels (norms, projections, RoPE, MLP) in one step.
    layer_overhead_s: float = 0.0
    # The host CPU, for decode attention over host-resident slices (kvtier.planner.cpu_split):
    # KV bytes per second its attention kernel reads (0: unknown, so no slice is given to it),
    cpu_attention_bw: float = 0.0
    # its own host-memory read rate (a threaded fp32 sum; 0: unknown),
    host_read_bw: float = 0.0
    # the rate of DMA and CPU attention reading host memory at once (0: not measured),
    host_combined_bw: float = 0.0
    # and its attention kernel's rate over packed rows: (row format, packed bytes per second) for
    # each format measured ("kivi4", "fp8", ...: `kvtier.attention.row_formats.native_row_format`;
    # none: a quantized cache gets CPU slices only when told a number).
    cpu_packed_bw: tuple[tuple[str, float], ...] = ()
    # The GPU's unpacking of packed rows into full-precision KV, in bytes of that KV a second:
    # a quantized cache's loads run it on the H2D stream, where the link waits for it (0: not
    # modelled).
    unpack_bw: float = 0.0

    def __post_init__(self) -> None:
        for field_name in ("flops", "hbm_bw", "pcie_bw", "memory_bytes"):
            if getattr(self, field_name) <= 0:
                raise ConfigError(f"hardware {self.name}: {field_name} must be positive")
        if min(self.slice_overhead_s, self.prefill_slice_overhead_s, self.layer_overhead_s) < 0:
            raise ConfigError(f"hardware {self.name}: host overheads must not be negative")
        if min(self.cpu_attention_bw, self.host_read_bw, self.host_combined_bw, self.unpack_bw) < 0 or any(
            rate < 0 for _, rate in self.cpu_packed_bw
        ):
            raise ConfigError(f"hardware {self.name}: CPU and unpack rates must not be negative")

    def cpu_packed_rate(self, fmt: str | None) -> float:
        """The CPU attention kernel's packed bytes per second over rows of format `fmt` (0: not
        measured, or None: rows the kernel does not read in place)."""
        return next((rate for f, rate in self.cpu_packed_bw if f == fmt), 0.0)

    def over_packed(self, fmt: str | None) -> Hardware:
        """These numbers with the CPU attending packed rows of format `fmt`: its attention rate
        is `cpu_packed_rate(fmt)` (what a quantized cache's CPU split runs at)."""
        return replace(self, cpu_attention_bw=self.cpu_packed_rate(fmt))

    @property
    def pcie_ridge(self) -> float:
        """FLOP per PCIe byte above which offloaded work is compute-bound."""
        return self.flops / self.pcie_bw

    @property
    def hbm_ridge(self) -> float:
        """FLOP per HBM byte above which on-device work is compute-bound."""
        return self.flops / self.hbm_bw


# Measured: 790 TFLOP/s bf16 GEMM, 4.2 TB/s device copy, 55 GB/s pinned H2D (PCIe Gen5 x16).
_H200 = Hardware(
    "h200",
    flops=790e12,
    hbm_bw=4.2e12,
    pcie_bw=55e9,
    memory_bytes=141 * 10**9,
    slice_overhead_s=H200_SLICE_OVERHEAD_S,
    prefill_slice_overhead_s=H200_PREFILL_SLICE_OVERHEAD_S,
    layer_overhead_s=H200_LAYER_OVERHEAD_S,
    cpu_attention_bw=H200_CPU_ATTENTION_BW,
    host_read_bw=H200_HOST_READ_BW,
    host_combined_bw=H200_HOST_COMBINED_BW,
    unpack_bw=H200_UNPACK_BW,
    cpu_packed_bw=H200_CPU_PACKED_BW,
)

HARDWARE: dict[str, Hardware] = {
    "rtx4090": Hardware("rtx4090", flops=165e12, hbm_bw=1.0e12, pcie_bw=25e9, memory_bytes=24 * GiB),
    "l40s": Hardware("l40s", flops=362e12, hbm_bw=0.864e12, pcie_bw=25e9, memory_bytes=48 * GiB),
    "a100-80g": Hardware("a100-80g", flops=312e12, hbm_bw=2.0e12, pcie_bw=25e9, memory_bytes=80 * GiB),
    # The H100 the device tool lends (2026-12-05) sits in the same kind of host as its H200: the
    # same PCIe Gen5 link (53.4-54.5 GB/s pinned H2D), launch cost (6.9-10.8 us against the
    # H200's 6.2-13.1) and host reads (88-109 GB/s, once 37 on a start that read 108 minutes
    # before; `machine` in serve_gpu_24gib_mixed_hip*.json, serve_methods_fit_24gib.json,
    # gpu_checks.json). So it takes the H200's host numbers; its GPU is the same GH100 die (the
    # H200's measured GEMM rate) with HBM3 at the datasheet's 3.35 TB/s (not measured).
    "h100-sxm": replace(_H200, name="h100-sxm", hbm_bw=3.35e12, memory_bytes=80 * GiB),
    "h200": _H200,
}

DEFAULT_HARDWARE = HARDWARE["rtx4090"]  # the paper's card


def hardware_preset(
    name: str,
    *,
    tflops: float | None = None,
    hbm_bw: float | None = None,
    pcie_bw: float | None = None,
    cpu_attention_bw: float | None = None,
) -> Hardware:
    """A preset by name, with optional overrides (TFLOP/s, B/s, B/s, B/s). Unknown names list the presets."""
    key = name.lower().replace("_", "-")
    if key not in HARDWARE:
        raise ConfigError(f"unknown GPU {name!r}; known GPUs: {', '.join(HARDWARE)}")
    hw = HARDWARE[key]
    if tflops is not None:
        hw = replace(hw, flops=tflops * 1e12)
    if hbm_bw is not None:
        hw = replace(hw, hbm_bw=hbm_bw)
    if pcie_bw is not None:
        hw = replace(hw, pcie_bw=pcie_bw)
    if cpu_attention_bw is not None:
        hw = replace(hw, cpu_attention_bw=cpu_attention_bw)
    return hw


def detect_hardware(device: torch.device) -> Hardware:
    """The preset matching the CUDA device's name (the paper's RTX 4090 when none matches)."""
    import torch

    if device.type != "cuda":
        return DEFAULT_HARDWARE
    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "a100", "l40s", "4090"):
        if key in name:
            return next(hw for k, hw in HARDWARE.items() if key in k)
    return DEFAULT_HARDWARE


def host_memory_available() -> int | None:
    """Bytes of host memory available now (Linux MemAvailable, plus the pinned blocks PyTorch
    caches for reuse: a served request's store leaves its pinned memory there for the next
    one), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 + cached_pinned_bytes()
    except OSError:
        return None
    return None


def cached_pinned_bytes() -> int:
    """Pinned host bytes PyTorch's pinned allocator holds but no tensor uses (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    stats = torch.cuda.host_memory_stats()
    return max(0, int(stats.get("allocated_bytes.current", 0)) - int(stats.get("active_bytes.current", 0)))
