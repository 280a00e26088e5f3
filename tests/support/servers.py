"""Real servers for tests: an ASGI app on uvicorn in a thread, or a CLI command in a subprocess.

Both listen on 127.0.0.1 with a port chosen by the OS, so tests never collide.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, TypeVar

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self.url

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextmanager
def serve(app: Any, **config: Any) -> Iterator[str]:
    """`with serve(app) as url:` a real server for the block's duration."""
    server = ServerThread(app, **config)
    try:
        yield server.start()
    finally:
        server.stop()


T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], timeout: float = 5.0, what: str = "condition", poll: float = 0.05
) -> T:
    """Polls `condition` until it returns something truthy, and returns that."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(poll)
    return found


def wait_http_ok(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Polls `url` until it answers 200; fails early if `proc` exits."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
        try:
            response = httpx.get(url, timeout=2.0)
            if response.status_code == 200:
                return
            last = response.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout} s (last: {last!r})")


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
