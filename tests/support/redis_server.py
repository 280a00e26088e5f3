"""A real `redis-server` (Debian's package, `make system-deps`) on a free port, per test
(the `redis_server` fixture: tests/cache and tests/fleet import it in their conftest)."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator

import pytest

from mineru_gateway.testing import free_port, wait_until


class RedisServer:
    """`redis-server --port N --save '' --appendonly no`, started and stopped by the test."""

    def __init__(self, *options: str) -> None:
        self.port = free_port()  # kept across stop() and start(): the same Redis comes back
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.options = options  # more of redis-server's own (`--requirepass`, say)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: `make system-deps`")
        argv = [binary, "--port", str(self.port), "--save", "", "--appendonly", "no"]
        argv += self.options
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._answers, 10.0, "redis-server start", poll=0.02)

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
