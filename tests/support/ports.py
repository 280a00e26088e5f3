"""Ports for servers that restart: consecutive, and below the kernel's ephemeral range.

A port the OS hands out for `bind(0)` comes from the ephemeral range, where it may become the local
end of any outgoing connection once its server is gone; a restarted worker then cannot bind it
again. Worker ports below the range (as in production: 30001+) do not have that problem.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int = 1) -> int:
    """The first of `count` consecutive free ports below the ephemeral range."""
    high = _ephemeral_low() - count
    for _ in range(500):
        base = random.randrange(10000, high)
        if all(_bindable(port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports below {high}")
