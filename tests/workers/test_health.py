"""Passive health: what an attempt's outcome does to a worker (probes: test_registry.py)."""

from __future__ import annotations

import pytest

from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.workers.health import SUCCESS, Health, HealthPolicy, Outcome
from mineru_gateway.workers.membership import Membership
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient

pytestmark = pytest.mark.unit


def health_of(*urls: str, eject_after: int = 3) -> tuple[Health, Membership]:
    membership = Membership(urls)
    for worker in membership.workers:
        worker.healthy = True
    policy = HealthPolicy(eject_after=eject_after)
    client = UpstreamClient(Timeouts(1, 1, 1))
    return Health(membership, client, policy, GatewayMetrics()), membership


def test_failures_in_a_row_eject_a_worker_and_a_success_starts_the_count_again() -> None:
    health, membership = health_of("http://a:1", eject_after=2)
    worker = membership.workers[0]
    dropped = Outcome.failed("upstream_disconnect", "dropped")
    health.report(worker, dropped)
    health.report(worker, SUCCESS)
    health.report(worker, dropped)
    assert worker.healthy, "two failures, not two in a row"
    health.report(worker, dropped)
    assert not worker.healthy and worker.last_error == "dropped"


def test_a_refused_connection_ejects_at_once() -> None:
    health, membership = health_of("http://a:1")
    worker = membership.workers[0]
    health.report(worker, Outcome.failed("connect_error", "refused", eject_now=True))
    assert not worker.healthy


def test_a_probes_finding_is_heard_only_when_it_changes_something() -> None:
    health, membership = health_of("http://a:1")
    heard: list[int] = []
    membership.on_change(lambda: heard.append(1))
    worker = membership.workers[0]
    health.set_health(worker, True, None)
    assert heard == []
    health.set_health(worker, False, "503")
    assert worker.last_error == "503"
    health.set_health(worker, True, None)
    assert len(heard) == 2
    assert worker.last_error is None  # healthy again: the old error is past
