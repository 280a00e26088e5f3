"""The backlog gauges autoscaling follows (fleet/backlog.py), from a real gateway: they rise
with a queue and fall as it drains; a real Prometheus evaluates the KEDA triggers' and the
prometheus-adapter rules' queries (deploy/k8s/autoscaling/) on them."""

from __future__ import annotations

import asyncio
import re
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import yaml
from benchmarks.dashboard_snapshot import Prometheus
from benchmarks.observability_demo import PrometheusServer

from mineru_gateway.testing import CountingWorker
from tests.conftest import StartGateway
from tests.deploy.support import ROOT, tool
from tests.support.servers import serve, wait_until

CHAT = "/v1/chat/completions"
BODY = {"model": "counting-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
AUTOSCALING = ROOT / "deploy" / "k8s" / "autoscaling"
# batch_limit 1 and the minimum headroom of 2, no reserve: three requests on the worker, the rest
# queue.
ROOM = 3

pytestmark = pytest.mark.timeout(120)


def gauges(gateway: str, model: str) -> tuple[float, float]:
    """(queue depth, backlog seconds) of `model`, as /metrics says."""
    text = httpx.get(gateway + "/metrics").text
    found = []
    for name in ("mineru_gateway_queue_depth", "mineru_gateway_backlog_seconds"):
        match = re.search(rf'^{name}\{{model="{model}"\}} (\S+)$', text, re.M)
        assert match is not None, f"no {name} for {model}"
        found.append(float(match.group(1)))
    return found[0], found[1]


async def send(gateway: str, count: int) -> list[int]:
    async with httpx.AsyncClient(timeout=60) as client:
        sends = [client.post(gateway + CHAT, json=BODY) for _ in range(count)]
        return [response.status_code for response in await asyncio.gather(*sends)]


async def test_the_backlog_rises_with_a_queue_and_falls_as_it_drains(
    servers: ExitStack, start_gateway: StartGateway
) -> None:
    counts = CountingWorker(hold_s=0.3)
    worker = servers.enter_context(serve(counts))
    gateway = start_gateway([worker], batch_limit=1, batch_reserve=0, max_queue_wait_s=60)
    assert gauges(gateway, counts.model) == (0.0, 0.0)  # the series exist before any queue
    load = asyncio.create_task(send(gateway, 6 * ROOM))
    samples = []
    while not load.done():
        samples.append(await asyncio.to_thread(gauges, gateway, counts.model))
        await asyncio.sleep(0.05)
    assert await load == [200] * 6 * ROOM
    depths = [depth for depth, _ in samples]
    backlogs = [backlog for _, backlog in samples]
    assert max(depths) >= 4 * ROOM
    peak = backlogs.index(max(backlogs))
    last_queued = max(i for i, depth in enumerate(depths) if depth > 0)
    assert backlogs[0] < backlogs[peak]  # it rose with the queue...
    assert 0 < backlogs[last_queued] < backlogs[peak]  # ...and fell as the queue drained
    assert gauges(gateway, counts.model) == (0.0, 0.0)


def keda_queries() -> dict[str, str]:
    scaled = yaml.safe_load((AUTOSCALING / "keda" / "keda-scaledobject.yaml").read_text())
    return {t["name"]: t["metadata"]["query"] for t in scaled["spec"]["triggers"]}


def adapter_queries() -> dict[str, str]:
    """The adapter's external rules with their templates filled as it fills them for an HPA
    metric without a selector."""
    values = yaml.safe_load((AUTOSCALING / "hpa" / "prometheus-adapter-rules.yaml").read_text())
    queries = {}
    for rule in values["rules"]["external"]:
        series = rule["seriesQuery"].strip("'")
        query = rule["metricsQuery"].replace("<<.Series>>", series)
        queries[rule["name"]["as"]] = query.replace("<<.LabelMatchers>>", "")
    return queries


def value_of(prometheus: Prometheus, query: str) -> float:
    result = prometheus.query(query)
    assert len(result) == 1, (query, result)
    return float(result[0]["value"][1])


async def test_prometheus_evaluates_the_autoscalers_queries(
    servers: ExitStack, start_gateway: StartGateway, tmp_path: Path
) -> None:
    counts = CountingWorker(hold_s=1.0)
    worker = servers.enter_context(serve(counts))
    gateway = start_gateway([worker], batch_limit=1, batch_reserve=0, max_queue_wait_s=60)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "mineru-gateway",
                "static_configs": [{"targets": [gateway.removeprefix("http://")]}],
            }
        ],
    }
    server = PrometheusServer(yaml.safe_dump(config), tmp_path, binary=tool("prometheus"))
    prometheus = Prometheus(servers.enter_context(server.running()))
    queries = keda_queries()
    adapter = adapter_queries()
    assert set(queries) == {"backlog", "busy"}
    assert set(adapter) == {"mineru_gateway_backlog_seconds", "mineru_gateway_requests_in_flight"}
    everything = [*queries.values(), *adapter.values()]
    idle = lambda: all(value_of(prometheus, q) == 0 for q in everything) or None  # noqa: E731
    await asyncio.to_thread(wait_until, idle, 30.0, "the queries answering 0 when idle")

    load = asyncio.create_task(send(gateway, 8 * ROOM))
    backlog = [queries["backlog"], adapter["mineru_gateway_backlog_seconds"]]
    busy = [queries["busy"], adapter["mineru_gateway_requests_in_flight"]]

    def scaling_up() -> bool | None:
        return (
            all(value_of(prometheus, q) > 0 for q in backlog)
            and all(value_of(prometheus, q) == ROOM for q in busy)
        ) or None

    started = time.monotonic()
    await asyncio.to_thread(wait_until, scaling_up, 20.0, "backlog and busy workers seen")
    assert time.monotonic() - started < 20.0
    assert await load == [200] * 8 * ROOM
    await asyncio.to_thread(wait_until, idle, 30.0, "the queries back to 0 once drained")
