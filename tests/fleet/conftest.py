"""The real `redis-server` fixture (tests/support/redis_server.py), and a counting worker."""

from collections.abc import Callable
from contextlib import ExitStack

import pytest

from mineru_gateway.testing import CountingWorker
from tests.support.redis_server import redis_server
from tests.support.servers import serve

__all__ = ["counting_worker", "redis_server"]

CountingWorkers = Callable[[float], tuple[CountingWorker, str]]


@pytest.fixture
def counting_worker(servers: ExitStack) -> CountingWorkers:
    """Starts a worker that holds each completion `hold_s`: it, and its URL."""

    def start(hold_s: float) -> tuple[CountingWorker, str]:
        counts = CountingWorker(hold_s=hold_s)
        return counts, servers.enter_context(serve(counts))

    return start
