"""The unit lane's guard (tests/support/offline.py) refuses what an offline machine lacks."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.support.offline import GUARD, Unreachable

pytestmark = pytest.mark.unit


def test_a_unit_test_runs_watched() -> None:
    assert GUARD.active


@pytest.mark.parametrize(
    ("family", "host"), [(socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")]
)
def test_a_connection_beyond_loopback_is_refused_and_recorded(family: int, host: str) -> None:
    with GUARD.watching() as refused, socket.socket(family) as sock, pytest.raises(Unreachable):
        sock.connect((host, 9))
    assert refused == [f"a connection to {host}"]


def test_a_name_lookup_beyond_loopback_is_refused() -> None:
    with GUARD.watching(), pytest.raises(Unreachable):
        socket.getaddrinfo("pypi.org", 443)


@pytest.mark.parametrize(
    "argv",
    [
        ["redis-server", "--version"],
        ["/usr/bin/promtool", "check", "rules"],
        [sys.executable, "-m", "pip", "install", "anything"],
    ],
)
def test_a_server_program_or_an_install_is_refused(argv: list[str]) -> None:
    with GUARD.watching() as refused, pytest.raises(Unreachable):
        subprocess.run(argv, check=False)
    assert refused and refused[0].startswith("running ")


def test_loopback_and_this_python_are_allowed() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()):
            pass
    socket.getaddrinfo("localhost", 80)
    assert subprocess.run([sys.executable, "-c", "pass"], check=False).returncode == 0
