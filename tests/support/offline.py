"""The unit lane's guard: a test marked `unit` reaches nothing but this machine's loopback.

`make test-unit` runs the tests marked `unit` (CONTRIBUTING.md): the pure modules and the HTTP
protocol, with nothing a fresh offline machine lacks. While such a test runs, an audit hook
(`sys.addaudithook`, process-wide, so servers a test runs in threads are covered too) refuses
a connection or a name lookup beyond loopback, and the start of a program the lane must not
need (redis-server, Prometheus, pip, vLLM, Docker; the npu-smi stub is a fake, and runs). A
refusal is raised where the call was made and recorded, so the test fails at teardown even
where the code under test caught the error.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
PROGRAMS = frozenset({
    "redis-server", "redis-cli", "promtool", "prometheus", "docker", "docker-compose",
    "pip", "pip3", "uv", "vllm",
})  # fmt: skip


class Unreachable(RuntimeError):
    """Not an OSError: network code that tolerates a refused connection must not swallow it."""


class Guard:
    def __init__(self) -> None:
        self.active = False
        self.refused: list[str] = []

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active:
            return
        reason = None
        if event == "socket.connect":
            reason = remote_address(args[1])
        elif event == "socket.getaddrinfo":
            reason = remote_name(args[0])
        elif event in ("subprocess.Popen", "os.posix_spawn", "os.exec"):
            reason = forbidden_program(args[0], args[1])
        if reason is not None:
            self.refused.append(reason)
            raise Unreachable(f"the unit lane is offline: {reason}")

    @contextmanager
    def watching(self) -> Iterator[list[str]]:
        """Refuses until the block ends; yields what it refused. Blocks nest."""
        outer = self.active, self.refused
        self.active, self.refused = True, []
        try:
            yield self.refused
        finally:
            self.active, self.refused = outer


def remote_address(address: object) -> str | None:
    if not isinstance(address, tuple):
        return None  # a Unix socket's path
    return remote_name(address[0])


def remote_name(host: object) -> str | None:
    if host is None:
        return None
    name = host.decode() if isinstance(host, bytes) else str(host)
    if name in LOCAL_NAMES:
        return None
    try:
        if ipaddress.ip_address(name.split("%")[0]).is_loopback:
            return None
    except ValueError:
        pass
    return f"a connection to {name}"


def forbidden_program(executable: object, argv: object) -> str | None:
    words = [os.fsdecode(word) for word in argv] if isinstance(argv, list | tuple) else []
    if executable is not None:
        words.insert(0, os.fsdecode(str(executable)))
    names = {os.path.basename(word) for word in words[:3]}
    if names & PROGRAMS or ("-m" in words[:3] and "pip" in words[:4]):
        return f"running {' '.join(words[:4])}"
    return None


GUARD = Guard()
sys.addaudithook(GUARD.hook)
