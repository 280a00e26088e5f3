"""The registry's view of workers: what routing gets to see."""

from __future__ import annotations

import pytest

from mineru_gateway.routing import RoundRobin
from mineru_gateway.workers.registry import WorkerRegistry
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient


@pytest.mark.parametrize(("pace_weighting", "expected"), [(True, {0.5, 1.5}), (False, {1.0})])
def test_pace_weighting_scales_workers_by_reported_latency(
    pace_weighting: bool, expected: set[float]
) -> None:
    registry = WorkerRegistry(
        ["http://a:1", "http://b:1"],
        UpstreamClient(Timeouts(1, 1, 1)),
        RoundRobin(),
        health_interval_s=60,
        health_timeout_s=1,
        pace_weighting=pace_weighting,
    )
    for worker, itl in zip(registry.workers, (0.01, 0.03), strict=True):
        worker.healthy, worker.itl_s = True, itl
    assert {view.slowness for view in registry.views()} == expected
