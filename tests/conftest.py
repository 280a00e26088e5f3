"""Fixtures that start real servers on 127.0.0.1: gateways, simulated and scripted workers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from mineru_gateway.api.app import create_app
from mineru_gateway.config import GatewaySettings
from tests.support.offline import GUARD
from tests.support.servers import serve, serve_gateway
from tests.support.workers import Script, scripted_worker

FIXTURES = Path(__file__).resolve().parent / "fixtures"


StartGateway = Callable[..., str]
StartSim = Callable[..., str]


@pytest.fixture
def servers() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


@pytest.fixture
def start_gateway(servers: ExitStack) -> StartGateway:
    """`start_gateway([worker urls], **settings)` -> the gateway's base URL."""

    def start(workers: list[str], **settings: Any) -> str:
        settings = {"port": 0, "health_interval_s": 0.2, "log_level": "warning"} | settings
        app = create_app(GatewaySettings(workers=workers, **settings))
        # The gateway's own server, as `serve` runs it (entry/server.py).
        return servers.enter_context(serve_gateway(app))

    return start


@pytest.fixture
def start_sim(servers: ExitStack) -> StartSim:
    """`start_sim(**SimConfig fields)` -> a simulated vLLM worker's base URL (100x real speed)."""

    def start(**config: Any) -> str:
        from mineru_gateway.sim import SimConfig, create_sim_app

        config = {"time_scale": 0.01} | config
        return servers.enter_context(serve(create_sim_app(SimConfig(**config))))

    return start


@pytest.fixture
def scripted(servers: ExitStack) -> tuple[Script, str]:
    script = Script()
    return script, servers.enter_context(serve(scripted_worker(script)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("unit") and item.get_closest_marker("vllm"):
            raise pytest.UsageError(f"{item.nodeid}: a unit test cannot need real vLLM")


@pytest.fixture(autouse=True)
def offline_when_unit(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests marked `unit` reach loopback only and start no server program (support/offline.py)."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    with GUARD.watching() as refused:
        yield
    assert not refused, f"the unit lane is offline, yet this test tried {refused}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A skipped test fails: a missing dependency is installed by the project's files, not
    passed over (CONTRIBUTING.md)."""
    report: pytest.TestReport = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped, which this suite counts as a failure: {report.longrepr}"
    return report
