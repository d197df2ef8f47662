"""Running the app with uvicorn: in the foreground (the CLI) or in a thread (tests, benchmarks).

Shutdown (SIGTERM / SIGINT, or `ServerThread.stop`) does not wait for in-flight generations:

    1. `app.state.begin_shutdown()` (the engine aborts every request; clients get an "abort"
       chunk or a 503 at the engine's next step) - before uvicorn waits for open connections
    2. uvicorn closes the listeners and waits for the connections, at most GRACEFUL_SECONDS,
       then cancels the handlers still running
    3. the app's lifespan shutdown stops the engine thread

A second SIGTERM or SIGINT during 1-3 exits at once (uvicorn's `force_exit`; plain uvicorn
forces only on a second SIGINT).
"""

from __future__ import annotations

import gc
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from kvtier.errors import ConfigError

GRACEFUL_SECONDS = 5  # open connections may finish this long after the requests were aborted


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _Server(uvicorn.Server):
    """uvicorn's server, which aborts in-flight requests as shutdown begins (see the module)."""

    def __init__(self, config: uvicorn.Config, begin_shutdown: Callable[[], None] | None) -> None:
        super().__init__(config)
        self.begin_shutdown = begin_shutdown

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig in (signal.SIGINT, signal.SIGTERM):
            self._captured_signals.append(sig)
            self.force_exit = True  # the second signal: stop waiting for anything
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.begin_shutdown is not None:
            self.begin_shutdown()
        await super().shutdown(sockets)


def _server(app: FastAPI, host: str, port: int, log_level: str) -> _Server:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SECONDS,
    )
    return _Server(config, getattr(app.state, "begin_shutdown", None))


def freeze_heap() -> None:
    """Collect once, then move every object alive now (the libraries the server imported, the
    model's modules, the engine) to the interpreter's permanent generation (`gc.freeze`), so a
    full collection walks only what requests created since. A full collection stops every
    Python thread, the engine loop's too: over the heap of `kvtier serve` with the embedded model
    it took ~0.2 s on the development CPU, a batch step's worth many times over."""
    gc.collect()
    gc.freeze()


def serve_forever(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve `app` in the foreground until SIGTERM / SIGINT (what `kvtier serve` runs), its
    start-up heap frozen first (`freeze_heap`).

    Raises ConfigError if the server could not start (e.g. the port is taken; uvicorn logs why).
    """
    server = _server(app, host, port, log_level)
    freeze_heap()
    server.run()
    if not server.started:
        raise ConfigError(f"the server did not start on {host}:{port} (see the log above)")


class ServerThread:
    """uvicorn serving `app` on host:port in a daemon thread; `stop()` shuts it down cleanly."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host, self.port = host, port or free_port(host)
        self.server = _server(app, self.host, self.port, "warning")
        self.thread = threading.Thread(target=self.server.run, name="kvtier-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down as on SIGTERM (in-flight requests are aborted) and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout=timeout)
