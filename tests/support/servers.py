"""Real servers for tests: an ASGI app on uvicorn or on the gateway's own server in a thread,
or a CLI command in a subprocess.

Both listen on 127.0.0.1 with a port chosen by the OS, so tests never collide.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any

import httpx
import uvicorn
import uvloop

from mineru_gateway.api.connection import Timeouts
from mineru_gateway.entry.server import Server
from mineru_gateway.testing import free_port, wait_until

# free_port and wait_until live in mineru_gateway.testing; tests/api/test_relay.py imports
# them from here.
__all__ = [
    "CliProcess",
    "GatewayServerThread",
    "ServerThread",
    "free_port",
    "serve",
    "serve_gateway",
    "wait_for_series",
    "wait_until",
]


class ServerThread:
    """Runs `app` on a real uvicorn server (uvloop, httptools) in a daemon thread."""

    def __init__(self, app: Any, **config: Any) -> None:
        config = {
            "log_level": "warning",
            "lifespan": "on",
            "loop": "uvloop",
            "http": "httptools",
        } | config
        self.config = uvicorn.Config(app, host="127.0.0.1", port=0, **config)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=self.config.get_loop_factory()) as runner:
            runner.run(self.server.serve())

    def start(self, timeout: float = 20.0) -> str:
        self.thread.start()
        wait_until(self._started, timeout, "server start", poll=0.01)
        return self.url

    def _started(self) -> bool:
        if not self.server.started and not self.thread.is_alive():
            raise RuntimeError("server did not start")
        return self.server.started

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class GatewayServerThread(ServerThread):
    """Runs `app` on the gateway's own server (entry/server.py, uvloop) in a daemon thread, as
    `serve` runs it but for signals, which only reach the main thread. Started, found and
    stopped as ServerThread's uvicorn server is: the gateway's server keeps the same flags."""

    def __init__(
        self,
        app: Any,
        timeouts: Timeouts | None = None,
        graceful_timeout_s: float | None = None,
    ) -> None:
        self.server = Server(  # type: ignore[assignment]
            app, "127.0.0.1", 0, timeouts=timeouts, graceful_timeout_s=graceful_timeout_s
        )
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(self.server.serve())


@contextmanager
def serve_gateway(app: Any, **options: Any) -> Iterator[str]:
    """`with serve_gateway(app) as url:` the gateway's own server for the block's duration."""
    server = GatewayServerThread(app, **options)
    try:
        yield server.start()
    finally:
        server.stop()


def wait_for_series(url: str, name: str, timeout: float = 15.0) -> str:
    """The first /metrics body of the server at `url` that has a `name` sample."""

    def body_with_series() -> str | None:
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
        return text if f"\n{name}{{" in text else None

    return wait_until(body_with_series, timeout, f"a {name} series at {url}/metrics")


@contextmanager
def serve(app: Any, **config: Any) -> Iterator[str]:
    """`with serve(app) as url:` a real server for the block's duration."""
    server = ServerThread(app, **config)
    try:
        yield server.start()
    finally:
        server.stop()


class CliProcess:
    """`mineru-gateway ARGS...` (or any argv) in its own process group."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: IO[bytes] | None = None

    @classmethod
    def mineru_gateway(cls, *args: str, env: dict[str, str] | None = None) -> CliProcess:
        return cls([sys.executable, "-m", "mineru_gateway", *args], env=env)

    def start(self, log_path: str | None = None) -> subprocess.Popen[bytes]:
        self.log = open(log_path, "wb") if log_path else None  # noqa: SIM115
        out = self.log if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self.proc

    def close_log(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    def stop(self, timeout: float = 15.0) -> int | None:
        try:
            return self._stop(timeout)
        finally:
            self.close_log()

    def _stop(self, timeout: float) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(timeout=timeout)
