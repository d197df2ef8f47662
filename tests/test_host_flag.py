"""The stream's wait for CPU slices' results (`kvtier.kv.host_flag`): the choices that turn it
on, the decoder's signal after a layer's results (and after an error), and the store's protocol
with a flag whose `gpu_wait` blocks the host as a CUDA stream would block: the same tokens, one
ticket a CPU layer in order, and a CPU job's error raised at the step's end."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import kvtier.kv.cpu_attend as cpu_attend
import kvtier.kv.host_flag as host_flag
import kvtier.kv.mapped as mapped
from kvtier.attention.cpu_decode import CpuDecoder, PendingDecode
from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.kv.host_flag import HostFlag
from kvtier.kv.mapped import device_view, results_mode
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.loading.weights import load_safetensors_folder
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import KVPlan
from tests.hf_reference import drive, make_hf_model

CPU = torch.device("cpu")
PROMPT, DECODE, CHUNK = 45, 5, 11


class HostBlockingFlag:
    """A stand-in for `HostFlag` on the CPU: `gpu_wait` blocks the caller until the counter
    reaches the value, as the CUDA stream would block the work queued after it."""

    def __init__(self) -> None:
        self.value = 0
        self.waits: list[int] = []
        self.sets: list[int] = []
        self._changed = threading.Condition()

    def set(self, value: int) -> None:
        with self._changed:
            self.value = value
            self.sets.append(value)
            self._changed.notify_all()

    def gpu_wait(self, value: int) -> None:
        self.waits.append(value)
        with self._changed:
            assert self._changed.wait_for(lambda: self.value >= value, timeout=30), "never signalled"


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[CausalLM, ModelConfig]:
    folder: Path = tmp_path_factory.mktemp("gqa-flag")
    make_hf_model("llama-gqa", folder)  # 3 layers, 2 KV heads of 2 query heads, head dim 16
    return load_safetensors_folder(folder, CPU, torch.float32)


@pytest.fixture
def decoder(backend: str) -> CpuDecoder:
    """The decoder of `backend` (conftest) every store of the test shares."""
    return cpu_attend.shared_decoder()


def run(
    model: CausalLM, cfg: ModelConfig, flag: HostBlockingFlag | None, decode: int = DECODE
) -> tuple[list[int], TieredKVStore]:
    """Greedy tokens with two of the six slices on the CPU; with `flag`, the store's CPU layers
    hand off through it."""
    plan = KVPlan("head", 1, 1, CHUNK, 2, 60, num_slices=6, cpu_slices=2)
    store = TieredKVStore(cfg, plan, device=CPU, dtype=torch.float32, capacity=PROMPT + decode)
    assert store.cpu is not None and store.cpu.flag is None  # no CUDA: the host waits
    store.cpu.flag = flag  # type: ignore[assignment]
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3))
    _, tokens = drive(model, store, ids, CHUNK, decode)
    return tokens, store


def test_handoff_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert HostFlag.make(CPU) is None and HostFlag.make(CPU, "gpu") is None  # no stream to wait
    with pytest.raises(ValueError, match="use one of auto, gpu, host"):
        HostFlag.make(CPU, "stream")
    # On CUDA "auto" is the stream's wait, but where the driver's stream waits are missing (or
    # fail their self-test) it falls back to the host's; "gpu" asked for them and raises
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(host_flag, "_driver", lambda: None)
    assert HostFlag.make(cuda) is None and HostFlag.make(cuda, "host") is None
    with pytest.raises(RuntimeError, match="stream waits"):
        HostFlag.make(cuda, "gpu")
    monkeypatch.setenv("KVTIER_CPU_HANDOFF", "gpu")  # the variable speaks for "auto"
    with pytest.raises(RuntimeError, match="stream waits"):
        HostFlag.make(cuda)
    monkeypatch.setenv("KVTIER_CPU_HANDOFF", "host")
    assert HostFlag.make(cuda) is None
    with pytest.raises(ConfigError, match="cpu_handoff 'later'"):
        StoreOptions(cpu_handoff="later")


def test_signal_follows_the_results_and_errors(decoder: CpuDecoder) -> None:
    ext = torch.randn(64, 2, 1, 16)
    q = torch.randn(2, 16)
    into = (torch.zeros(2, 16), torch.zeros(2))
    pending = [decoder.start(q, [ext], 64, into=into)]
    seen: list[torch.Tensor] = []
    decoder.signal(pending, lambda: seen.append(into[0].clone())).result()
    ref = decoder.attend(q, [ext], 64)[0]
    assert len(seen) == 1 and torch.equal(seen[0], ref)  # done() saw the merged result
    failed: Future[None] = Future()
    failed.set_exception(RuntimeError("kernel rejected"))
    calls: list[int] = []
    broken = PendingDecode([failed], torch.zeros(1, 1, 2, 16), torch.zeros(1, 1, 2), 2, into=into)
    signal = decoder.signal([broken], lambda: calls.append(1))
    with pytest.raises(RuntimeError, match="kernel rejected"):
        signal.result()
    assert calls == [1]  # done() ran all the same: a waiting stream goes on


def test_a_stream_side_wait_gives_the_same_tokens(
    gqa_model: tuple[CausalLM, ModelConfig], decoder: CpuDecoder
) -> None:
    ref, store = run(*gqa_model, None)
    assert store.cpu is not None and store.cpu.wait_s > 0
    store.close()
    flag = HostBlockingFlag()
    tokens, store = run(*gqa_model, flag)
    assert tokens == ref
    assert store.cpu is not None
    layers = len(store.cpu.layers)
    # One ticket per CPU layer of each one-token step (the last prompt chunk and every decode
    # step), waited for in order, each set by its layer's signal once
    steps = DECODE + (PROMPT % CHUNK == 1)
    assert flag.waits == list(range(1, steps * layers + 1))
    assert sorted(flag.sets) == flag.waits
    assert not store.cpu._signals  # end_step collected them
    store.close()


def test_a_cpu_jobs_error_is_raised_at_the_steps_end(
    gqa_model: tuple[CausalLM, ModelConfig], decoder: CpuDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = HostBlockingFlag()
    _, store = run(*gqa_model, flag, decode=1)
    model = gqa_model[0]

    def failing(*args: object) -> PendingDecode:
        f: Future[None] = Future()
        f.set_exception(RuntimeError("native CPU attention (kernel 1) rejected G=1"))
        return PendingDecode([f], torch.zeros(1, 1, 2, 16), torch.zeros(1, 1, 2), 2, into=args[-1])  # type: ignore[arg-type]

    assert store.cpu is not None
    monkeypatch.setattr(store.cpu, "_start", failing)
    length = store.length
    store.begin_step(1)
    start = time.perf_counter()
    # raised at the next CPU layer (the host runs at most one ahead), else at the step's end;
    # the "stream" was released although the jobs failed
    with pytest.raises(RuntimeError, match="rejected G=1"):
        model(torch.tensor([1]), store)
        store.end_step()
    assert time.perf_counter() - start < 30
    assert store.length == length  # the failed step did not count
    assert not store.cpu._signals  # forgotten: the next step starts clean
    store.close()


def test_the_bench_watchdog_leaves_stacks_and_handoff_states(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(
        "import sys, time, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        "from bench.watchdog import arm\n"
        "from kvtier.kv.cpu_attend import CpuSlices\n"
        "from kvtier.kv.layout import KVLayout\n"
        "from kvtier.kv.streams import Streams\n"
        "arm(0.5)\n"
        "lay = KVLayout(2, 2, 16, 1, 1, 4, torch.float32)\n"
        "cpu = CpuSlices(lay, {}, 0, torch.device('cpu'), Streams(torch.device('cpu')))\n"
        "def stuck_here():\n"
        "    time.sleep(30)\n"
        "stuck_here()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert "== watchdog: still running after 0.5 s" in done.stderr
    assert "== handoff: ticket 0 flag None signals 0/0 done" in done.stderr
    assert "stuck_here" in done.stderr  # the main thread's stack


class NonBlockingFlag(HostBlockingFlag):
    """A stream that never waits: the host runs ahead as far as the store lets it."""

    def gpu_wait(self, value: int) -> None:
        self.waits.append(value)


def test_the_host_runs_at_most_one_cpu_layer_ahead(
    gqa_model: tuple[CausalLM, ModelConfig], decoder: CpuDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    pending_after: list[int] = []
    attend = cpu_attend.CpuSlices.attend_layer

    def checked(self: cpu_attend.CpuSlices, *args: object) -> torch.Tensor:
        out = attend(self, *args)  # type: ignore[arg-type]
        pending_after.append(len(self._signals))
        assert all(s.done() for s in self._signals[:-1])
        return out

    monkeypatch.setattr(cpu_attend.CpuSlices, "attend_layer", checked)
    _, store = run(*gqa_model, NonBlockingFlag(), decode=3)
    assert store.cpu is not None and len(store.cpu.layers) == 2
    # each layer's own signal only, and none once the step's last CPU layer is attended
    assert pending_after == [1, 0] * (3 + (PROMPT % CHUNK == 1))
    store.close()


def test_step_trace_tells_queued_small_copies_from_parallel_ones() -> None:
    from bench.step_trace import small_copy_queueing

    big = [(0.0, 1e-3), (1e-3, 2e-3)]  # two KV loads back to back, 1 ms each
    small = [(1.004e-3, 1.006e-3), (0.5e-3, 0.502e-3), (5e-3, 5.001e-3)]
    got = small_copy_queueing(small, big)
    # the first starts 4 us after a load ends, while the next load runs (counted both ways),
    # the second during a load (another engine), the third with no load near (neither)
    assert got == {"small_h2d_copies": 3, "small_h2d_right_after_big": 1, "small_h2d_during_big": 2}


def test_results_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(mapped, "driver_available", lambda: True)
    assert results_mode("auto", cuda) == "mapped" and results_mode("copy", cuda) == "copy"
    monkeypatch.setattr(mapped, "driver_available", lambda: False)  # no libcuda: copied
    assert results_mode("auto", cuda) == "copy" and results_mode("mapped", cuda) == "mapped"
    assert results_mode("mapped", CPU) == "copy"  # the merge already runs where the results are
    monkeypatch.setenv("KVTIER_CPU_RESULTS", "mapped")
    assert results_mode("auto", cuda) == "mapped" and results_mode("copy", cuda) == "copy"
    monkeypatch.setenv("KVTIER_CPU_RESULTS", "copy")
    monkeypatch.setattr(mapped, "driver_available", lambda: True)
    assert results_mode("auto", cuda) == "copy"
    monkeypatch.setenv("KVTIER_CPU_RESULTS", "zero-copy")
    with pytest.raises(ConfigError, match="CPU results 'zero-copy'"):
        results_mode("auto", cuda)
    with pytest.raises(ConfigError, match="cpu_results 'pinned'"):
        StoreOptions(cpu_results="pinned")
    with pytest.raises(ValueError, match="pinned, contiguous"):
        device_view(torch.zeros(4), cuda)


def test_mapped_results_give_the_same_tokens_with_one_view_a_buffer(
    gqa_model: tuple[CausalLM, ModelConfig], decoder: CpuDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merge reads each layer's results through a view made once per buffer (a stand-in
    view on the CPU: the buffer itself), and the tokens are the copy's."""
    ref, store = run(*gqa_model, None)
    store.close()
    made: list[int] = []

    def view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        made.append(host.data_ptr())
        return host

    monkeypatch.setattr(cpu_attend, "device_view", view)
    monkeypatch.setattr(cpu_attend, "results_mode", lambda choice, device: "mapped")
    tokens, store = run(*gqa_model, HostBlockingFlag())
    assert tokens == ref
    assert store.cpu is not None and store.cpu.results == "mapped"
    assert len(made) == len(set(made)) == len(store.cpu.layers)  # one view a layer, kept
    store.close()
