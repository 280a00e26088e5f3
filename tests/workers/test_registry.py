"""The registry's view of workers: what routing gets to see."""

from __future__ import annotations

import pytest

from mineru_gateway.cost import Cost
from mineru_gateway.routing import RoundRobin
from mineru_gateway.workers.registry import WorkerRegistry
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient


def registry_of(*urls: str, pace_weighting: bool = True) -> WorkerRegistry:
    return WorkerRegistry(
        list(urls),
        UpstreamClient(Timeouts(1, 1, 1)),
        RoundRobin(),
        health_interval_s=60,
        health_timeout_s=1,
        pace_weighting=pace_weighting,
    )


def test_a_lease_releases_its_prefill_at_the_first_byte_and_the_rest_at_the_end() -> None:
    registry = registry_of("http://a:1")
    worker = registry.workers[0]
    page, block = Cost(prefill=1.4, hold=1.0), Cost(prefill=0.1, hold=1.0)
    with registry.lease(worker, block):
        with registry.lease(worker, page) as lease:
            assert (worker.in_flight, worker.own_cost) == (2, pytest.approx(3.5))
            lease.prefilled()
            lease.prefilled()  # idempotent: released once
            assert worker.own_cost == pytest.approx(2.1)
        assert (worker.in_flight, worker.own_cost) == (1, pytest.approx(1.1))
    assert (worker.in_flight, worker.own_cost) == (0, 0.0)


def test_a_lease_ended_before_its_first_byte_releases_everything() -> None:
    registry = registry_of("http://a:1")
    worker = registry.workers[0]
    with registry.lease(worker, Cost(prefill=0.5, hold=1.0)):
        with pytest.raises(RuntimeError), registry.lease(worker, Cost(prefill=1.4, hold=1.0)):
            raise RuntimeError("the worker dropped the connection")
        assert (worker.in_flight, worker.own_cost) == (1, pytest.approx(1.5))


@pytest.mark.parametrize(("pace_weighting", "expected"), [(True, {0.5, 1.5}), (False, {1.0})])
def test_pace_weighting_scales_workers_by_reported_latency(
    pace_weighting: bool, expected: set[float]
) -> None:
    registry = registry_of("http://a:1", "http://b:1", pace_weighting=pace_weighting)
    for worker, itl in zip(registry.workers, (0.01, 0.03), strict=True):
        worker.healthy, worker.itl_s = True, itl
    assert {view.slowness for view in registry.views()} == expected
