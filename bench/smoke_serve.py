"""`kvtier serve --gpu-memory 24GiB` as a user drives it: the `openai` client and raw HTTP.

Completions, chat, streaming, 16 concurrent requests (and whether they equal the same requests
one by one), requests naming methods beside a batch (equal to each alone), a streaming and a
non-streaming client that leave early, `/metrics`, SIGTERM with a request in flight, and the
server process's peak GPU memory from `nvidia-smi`.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from bench.smoke_checks import Check, Smoke, last_line, prose

CAP = "24GiB"
CAP_BYTES = 24 * 2**30
KEY = "smoke-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GpuPeak:
    """The largest GPU memory `nvidia-smi` shows for one process, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_mib, self._stop = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.splitlines():
                pid, _, mib = line.partition(",")
                if pid.strip() == str(self.pid) and mib.strip().isdigit():
                    self.peak_mib = max(self.peak_mib, int(mib))
            time.sleep(0.2)

    def stop(self) -> float:
        self._stop.set()
        self.thread.join(timeout=5)
        return round(self.peak_mib * 2**20 / 1e9, 2)


@contextmanager
def server(
    smoke: Smoke, label: str, model: list[str]
) -> Iterator[tuple[str, subprocess.Popen[str], GpuPeak]]:
    port = free_port()
    # NOTE: --exact-lossless off: the short prompts' HiP request would run lossless in the batch
    # on CUDA; the generate part checks that, this part HiP's served path over lent pages.
    args = [
        "serve",
        *model,
        "--gpu-memory",
        CAP,
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--exact-lossless",
        "off",
    ]
    log = open(smoke.workdir / f"serve_{label}.log", "w")  # noqa: SIM115 - closed below
    t0 = time.perf_counter()
    proc = subprocess.Popen([*smoke.kvtier, *args], stdout=log, stderr=subprocess.STDOUT, text=True)
    peak = GpuPeak(proc.pid)
    url = f"http://127.0.0.1:{port}"
    import httpx

    up = False
    while time.perf_counter() - t0 < 300 and proc.poll() is None:
        try:
            up = httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            up = False
        if up:
            break
        time.sleep(0.5)
    smoke.add(
        Check(
            label,
            "serve starts",
            ["kvtier", *args],
            up,
            round(time.perf_counter() - t0, 1),
            proc.poll(),
            detail="" if up else _tail(smoke.workdir / f"serve_{label}.log"),
        )
    )
    try:
        yield url, proc, peak
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _tail(path: Path) -> str:
    return last_line(path.read_text(errors="replace"))


def step(smoke: Smoke, label: str, name: str, fn: Callable[[], str]) -> bool:
    """Run one server step; an exception fails it with its message."""
    if not smoke.wanted(name):
        return True
    t0 = time.perf_counter()
    try:
        detail, ok = fn(), True
    except Exception as e:
        detail, ok = f"{type(e).__name__}: {str(e)[:600]}", False
    smoke.add(Check(label, name, [], ok, round(time.perf_counter() - t0, 2), detail=detail))
    return ok


def running(url: str) -> int:
    import httpx

    text = httpx.get(url + "/metrics", timeout=5).text
    m = re.search(r"^kvtier:num_requests_running\{[^}]*\} ([0-9.e+]+)", text, re.M)
    return int(float(m.group(1))) if m else -1


def wait_idle(url: str, limit: float) -> float:
    t0 = time.perf_counter()
    while running(url) != 0:
        if time.perf_counter() - t0 > limit:
            raise TimeoutError(f"still running after {limit:.0f} s")
        time.sleep(0.05)
    return time.perf_counter() - t0


def serve_checks(smoke: Smoke, label: str, model: list[str]) -> None:
    import httpx
    import openai

    if not smoke.wanted("serve"):
        return
    with server(smoke, label, model) as (url, proc, peak):
        if proc.poll() is not None:
            return
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        prompts = [f"{prose(120, seed)} Question {seed}: which word came first?" for seed in range(16)]

        def complete(prompt: str) -> str:
            r = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0)
            return r.choices[0].text

        def completion() -> str:
            return repr(complete("The capital of France is")[:40])

        def chat() -> str:
            r = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=16
            )
            return repr((r.choices[0].message.content or "")[:40])

        def streaming() -> str:
            chunks = list(
                client.chat.completions.create(
                    model=name,
                    messages=[{"role": "user", "content": "Count to five."}],
                    max_tokens=16,
                    stream=True,
                )
            )
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert reasons, "no finish_reason in the stream"
            return f"{len(chunks)} chunks, finish {reasons[-1]}"

        def concurrent() -> str:
            alone = [complete(p) for p in prompts]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(16) as pool:
                together = list(pool.map(complete, prompts))
            dt = time.perf_counter() - t0
            differ = sum(a != b for a, b in zip(alone, together, strict=True))
            smoke.agreement[f"{label} serve batched vs alone"] = {"requests": 16, "differ": differ}
            return f"16 requests in {dt:.1f} s; {differ}/16 differ from one-by-one"

        def stream_disconnect() -> str:
            body = {
                "model": name,
                "prompt": prompts[0],
                "max_tokens": 2000,
                "stream": True,
                "ignore_eos": True,
            }
            with httpx.stream(
                "POST",
                url + "/v1/completions",
                json=body,
                timeout=60,
                headers={"Authorization": f"Bearer {KEY}"},
            ) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 3:
                        break
            return f"idle {wait_idle(url, 5):.2f} s after the client left"

        def plain_disconnect() -> str:
            body = {"model": name, "prompt": prompts[1], "max_tokens": 2000, "ignore_eos": True}
            with suppress(httpx.TimeoutException):
                httpx.post(
                    url + "/v1/completions",
                    json=body,
                    timeout=1.0,
                    headers={"Authorization": f"Bearer {KEY}"},
                )
            return f"idle {wait_idle(url, 5):.2f} s after the client left"

        def methods() -> str:
            """Requests naming a method (one whose store fits the GPU joins the batch's forward,
            one that streams runs tiered on its own CUDA stream) while 8 plain requests run:
            each equals the same request sent alone."""

            def with_method(prompt: str, method: str | None) -> str:
                extra = {"method": method} if method else None
                try:
                    r = client.completions.create(
                        model=name, prompt=prompt, max_tokens=16, temperature=0, extra_body=extra
                    )
                except Exception as e:  # name the method: the step's detail is all a run keeps
                    raise RuntimeError(f"method {method!r}: {type(e).__name__}: {e}") from e
                return r.choices[0].text

            # NOTE: since 2026-12-05 int8's packed rows, the evictors' slices, HiP's block caches
            # (of the slices it streams) and Quest's page bounds are lent pool pages
            specs = [
                "int8",
                "window,kv_budget=256",
                "snapkv,kv_budget=256",
                "head,head_group=1",
                "hip,hip_preset=fast,kv=head",
                "quest,kv_budget=64,kv=head",
            ]
            alone = [with_method(prompts[i], spec) for i, spec in enumerate(specs)]
            jobs = [(prompts[i], spec) for i, spec in enumerate(specs)] + [(p, None) for p in prompts[8:]]
            with ThreadPoolExecutor(len(jobs)) as pool:
                together = list(pool.map(lambda job: with_method(*job), jobs))
            differ = [spec for spec, a, b in zip(specs, alone, together, strict=False) if a != b]
            smoke.agreement[f"{label} serve methods beside a batch vs alone"] = {
                "methods": specs,
                "differ": differ,
            }
            text = httpx.get(url + "/metrics", timeout=5).text
            own = re.search(r"^kvtier:own_store_requests_total\{[^}]*\} ([0-9.e+]+)", text, re.M)
            owned = own.group(1) if own else "?"
            assert all(len(t) > 0 for t in together), "a request came back empty"
            # the server says how it placed each of them (`kvtier.serve.tiered` logs it)
            placed = (smoke.workdir / f"serve_{label}.log").read_text().count("kvtier serve: a ")
            assert placed >= len(specs), f"the server's log shows {placed} placed requests"
            if label != "embedded":
                # NOTE: random bf16 weights leave near-ties everywhere: a batch of another size
                # rounds the projections differently and flips greedy picks (see "16 concurrent",
                # where plain requests differ the same way), so only real weights assert equality.
                # The H200 run of 2026-12-01 saw int8 and window differ here, equal on the
                # embedded model.
                n = f"{len(differ)}/{len(specs)}"
                return f"{n} methods differ from alone (random weights); own-store requests: {owned}"
            assert not differ, f"{differ} differ from the same request alone"
            return f"{len(specs)} methods beside 8 plain requests equal alone; own-store requests: {owned}"

        def metrics() -> str:
            text = httpx.get(url + "/metrics", timeout=5).text
            assert "kvtier:generation_tokens_total" in text, "no kvtier:generation_tokens_total"
            # On a GPU: where the process's memory is (the allocator's peaks, the CUDA context).
            mem = dict(re.findall(r'^kvtier:gpu_memory_bytes\{[^}]*kind="(\w+)"\} ([0-9.e+]+)', text, re.M))
            shown = ", ".join(f"{k} {float(v) / 1e9:.2f} GB" for k, v in mem.items() if k != "allocated")
            # The latency histograms (vLLM's names): every request so far had a first token.
            lat = {
                m[0]: float(m[1])
                for m in re.findall(r"^kvtier:(\w+_seconds_(?:count|sum))\{[^}]*\} ([0-9.e+]+)", text, re.M)
            }
            ttft = lat.get("time_to_first_token_seconds_count", 0.0)
            assert ttft > 0, "no time_to_first_token_seconds observations"
            mean = lat["time_to_first_token_seconds_sum"] / ttft
            tpot = lat.get("time_per_output_token_seconds_sum", 0.0) / max(
                1.0, lat.get("time_per_output_token_seconds_count", 0.0)
            )
            latency = f"TTFT mean {mean:.3f} s over {int(ttft)}, TPOT mean {1e3 * tpot:.1f} ms"
            return "; ".join(x for x in (f"{len(text.splitlines())} lines", shown, latency) if x)

        for step_name, fn in [
            ("completions", completion),
            ("chat", chat),
            ("chat stream", streaming),
            ("16 concurrent", concurrent),
            ("methods per request", methods),
            ("stream client leaves", stream_disconnect),
            ("non-stream client leaves", plain_disconnect),
            ("/metrics", metrics),
        ]:
            step(smoke, label, f"serve {step_name}", fn)

        def sigterm() -> str:
            body = {"model": name, "prompt": prompts[2], "max_tokens": 4000, "ignore_eos": True}
            result: dict[str, Any] = {}

            def request() -> None:
                try:
                    r = httpx.post(
                        url + "/v1/completions",
                        json=body,
                        timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"},
                    )
                    result["status"] = r.status_code
                except httpx.HTTPError as e:
                    result["status"] = type(e).__name__

            t = threading.Thread(target=request)
            t.start()
            time.sleep(1.0)
            t0 = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)
            t.join(timeout=5)
            dt = time.perf_counter() - t0
            assert dt <= 10, f"exit took {dt:.1f} s"
            return f"exit {proc.returncode} after {dt:.2f} s; client got {result.get('status')}"

        step(smoke, label, "serve SIGTERM in flight", sigterm)
        gb = peak.stop()
        if shutil.which("nvidia-smi") is None:
            return  # no GPU here: nothing to measure
        ok = 0 < gb * 1e9 <= CAP_BYTES
        smoke.add(
            Check(
                label,
                "serve peak GPU (nvidia-smi)",
                [],
                ok,
                0.0,
                peak_gb=gb,
                detail=f"{gb} GB incl. CUDA context; cap {CAP_BYTES / 1e9:.2f} GB",
            )
        )
