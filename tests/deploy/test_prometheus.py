"""deploy/prometheus/ and deploy/grafana/ against a real Prometheus (Debian's `prometheus`).

One stack for the module: 4 simulated vLLM workers, the gateway in front of them, the NPU exporter
over a stub npu-smi, all on 127.0.0.1, and Prometheus scraping them every second with a copy of
deploy/prometheus/prometheus.yml (targets rewritten, intervals 1 s) and the real rule files. Load
runs for LOAD_S seconds (streamed and not, chat and completions, 1 in 10 for an unknown model);
at 60% of it one worker stops, so failures (retries, an ejection, a worker down) have data too.

Then every query of every dashboard panel must return data, once with the template variables at
"All" (`.*`) and once with real values taken from the variables' own `label_values` queries;
`$__rate_interval` is RATE_INTERVAL, which holds several 1 s scrapes. Every rule of the rule
files must be loaded, evaluate without error, and (recording rules) record something.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from benchmarks.dashboard_snapshot import (
    Prometheus,
    iter_panels,
    panel_queries,
    snapshot,
    substitute,
    variable_defaults,
)
from benchmarks.observability_demo import Phase, PrometheusServer, local_prometheus_config, run_load

from mineru_gateway.api.app import create_app
from mineru_gateway.config import GatewaySettings
from mineru_gateway.sim import SimConfig, create_sim_app
from mineru_gateway.sim.config import DEFAULT_MODEL_NAME
from mineru_gateway.telemetry import create_exporter_app
from mineru_gateway.testing import wait_http_ok, wait_until
from tests.deploy.support import (
    DASHBOARDS,
    PROMETHEUS_YML,
    RULE_FILES,
    promtool,
    recorded_names,
    rules_found,
    tool,
)
from tests.support.npu_smi_stub import install_npu_smi
from tests.support.servers import ServerThread, serve

LOAD_S = 12.0
BURST = 40  # concurrent requests after the load: more than the workers and the queue hold
BURST_BATCH = 1  # with the minimum headroom of 2, three requests per worker
BURST_QUEUE = 4
CONCURRENCY = 8
STOP_WORKER_AT = 0.6
CACHE_BYTES = 4096  # a few answers: distinct ones evict older ones (the cache's panels)
RATE_INTERVAL = "1m"
_LABEL_VALUES = re.compile(r"^label_values\((.+), (\w+)\)$")
_REGEX_SPECIAL = re.compile(r"([\\.+*?()\[\]{}|^$])")

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Stack:
    prometheus: Prometheus
    gateway: str
    workers: list[str]
    stopped: str
    exporter: str
    load_statuses: dict[int, int]

    def real_values(self) -> dict[str, str]:
        """A value each dashboard variable can take, whose series all have data."""
        return {
            "model": DEFAULT_MODEL_NAME,
            "worker": self.workers[0],
            "instance": self.exporter.removeprefix("http://"),
            "npu": "0",
            "tenant": "default",
        }


async def send_burst(gateway: str, count: int) -> dict[int, int]:
    """`count` concurrent requests at once; their statuses, counted."""
    body = {"messages": [{"role": "user", "content": "\nText Recognition:"}], "max_tokens": 32}
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        sends = [client.post("/v1/chat/completions", json=body) for _ in range(count)]
        responses = await asyncio.gather(*sends)
    statuses: dict[int, int] = {}
    for response in responses:
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
    return statuses


async def exercise_cache(gateway: str) -> None:
    """Greedy requests, so the cache's panels have data: identical ones at once (one generation,
    the rest coalesced), the same again one by one (hits), then distinct ones past the memory
    cache's bound (evictions)."""

    def body(text: str) -> dict[str, Any]:
        message = {"role": "user", "content": f"{text}\nText Recognition:"}
        return {"messages": [message], "max_tokens": 2048, "temperature": 0}  # ends with stop

    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        same = [client.post("/v1/chat/completions", json=body("same")) for _ in range(5)]
        answers = list(await asyncio.gather(*same))
        for index in range(12):
            answers.append(await client.post("/v1/chat/completions", json=body("same")))
            answers.append(await client.post("/v1/chat/completions", json=body(f"page {index}")))
    labels = {response.headers.get("x-cache") for response in answers}
    assert {"miss", "hit"} <= labels, labels


def targets_up(prometheus: Prometheus, expected: int) -> bool:
    active = prometheus.get("/api/v1/targets", {"state": "active"})["activeTargets"]
    return len(active) == expected and all(t["health"] == "up" for t in active)


def scraped_and_evaluated_after(prometheus: Prometheus, moment: float) -> bool:
    """Every target scraped, and every rule group evaluated, after `moment` (Unix time)."""
    targets = prometheus.get("/api/v1/targets", {"state": "active"})["activeTargets"]
    groups = prometheus.get("/api/v1/rules")["groups"]
    times = [t["lastScrape"] for t in targets] + [g["lastEvaluation"] for g in groups]
    return all(datetime.fromisoformat(t).timestamp() > moment for t in times)


def pending_alerts(prometheus: Prometheus, worker: str) -> set[str]:
    alerts = prometheus.get("/api/v1/alerts")["alerts"]
    return {a["labels"]["alertname"] for a in alerts if a["labels"].get("worker") == worker}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("observability")
    npu_smi = install_npu_smi(directory / "npu-smi")
    with ExitStack() as servers:
        sims = [ServerThread(create_sim_app(SimConfig(seed=i))) for i in range(4)]
        workers = [sim.start() for sim in sims]
        for sim in sims:
            servers.callback(sim.stop)
        # Health probes only at start: the stopped worker is then found by the refused
        # connections of requests routed to it (a retry and an ejection), never by a probe.
        # A small batch and tenant queue, so that the burst after the load queues requests and
        # sheds some (429): the tenants dashboard's panels then have data too.
        settings = GatewaySettings(
            workers=workers,
            port=0,
            health_interval_s=60,
            log_level="warning",
            batch_limit=BURST_BATCH,
            tenant_max_queued=BURST_QUEUE,
            cache="memory",
            cache_max_bytes=CACHE_BYTES,
        )
        gateway = servers.enter_context(serve(create_app(settings)))
        devices = dict(enumerate(workers))
        exporter_app = create_exporter_app(
            npu_smi_path=str(npu_smi.path), interval_s=1.0, device_workers=devices
        )
        exporter = servers.enter_context(serve(exporter_app))
        wait_http_ok(f"{gateway}/ready", timeout=10)
        config = local_prometheus_config(
            PROMETHEUS_YML.read_text(),
            gateway=gateway.removeprefix("http://"),
            workers=[url.removeprefix("http://") for url in workers],
            npu_exporter=exporter.removeprefix("http://"),
            interval_s=1,
        )
        server = PrometheusServer(config, directory, binary=tool("prometheus"))
        prometheus = Prometheus(servers.enter_context(server.running()))
        wait_until(lambda: targets_up(prometheus, 6), 60, "every target scraped")
        result = asyncio.run(
            run_load(
                gateway,
                DEFAULT_MODEL_NAME,
                [Phase(LOAD_S, CONCURRENCY)],
                at_fraction=(STOP_WORKER_AT, sims[-1].stop),
            )
        )
        burst = asyncio.run(send_burst(gateway, BURST))
        assert burst.get(429, 0) > 0 and burst.get(200, 0) > BURST_QUEUE, burst
        asyncio.run(exercise_cache(gateway))
        load_ended = time.time()
        wanted = {"MineruWorkerUnhealthy", "MineruWorkerMetricsDown"}
        wait_until(lambda: pending_alerts(prometheus, workers[-1]) >= wanted, 15, "alerts")
        # Two more scrapes and rule evaluations after the load's last requests (1 s intervals).
        settled = partial(scraped_and_evaluated_after, prometheus, load_ended + 1.0)
        wait_until(settled, 15, "scrapes and rule evaluations after the load")
        yield Stack(prometheus, gateway, workers, workers[-1], exporter, dict(result.statuses))


def test_config_rewritten_for_the_test_is_valid(tmp_path: Path) -> None:
    config = local_prometheus_config(
        PROMETHEUS_YML.read_text(),
        gateway="127.0.0.1:1",
        workers=["127.0.0.1:2", "127.0.0.1:3"],
        npu_exporter="127.0.0.1:4",
        interval_s=1,
    )
    (tmp_path / "prometheus.yml").write_text(config)
    result = promtool("check", "config", tmp_path / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "- worker-" not in config and "- 127.0.0.1:3\n" in config
    assert f"- {PROMETHEUS_YML.parent / 'rules' / 'alerts.yml'}\n" in config


def test_rewriting_a_changed_config_fails_loudly() -> None:
    changed = PROMETHEUS_YML.read_text().replace("gateway:9464", "gw:9464")
    with pytest.raises(ValueError, match="gateway:9464"):
        local_prometheus_config(
            changed, gateway="127.0.0.1:1", workers=[], npu_exporter=None, interval_s=1
        )


def test_the_load_had_successes_and_client_errors(stack: Stack) -> None:
    assert stack.load_statuses.get(200, 0) > 50
    assert stack.load_statuses.get(404, 0) > 0  # the unknown model


def test_every_target_but_the_stopped_worker_is_up(stack: Stack) -> None:
    active = stack.prometheus.get("/api/v1/targets", {"state": "active"})["activeTargets"]
    health = {(t["labels"]["job"], t["labels"]["instance"]): t["health"] for t in active}
    stopped = stack.stopped.removeprefix("http://")
    assert health.pop(("vllm", stopped)) == "down"
    assert sorted(job for job, _ in health) == ["mineru-gateway", "npu-exporter", *["vllm"] * 3]
    assert set(health.values()) == {"up"}


def test_the_real_rule_files_are_loaded_and_evaluate(stack: Stack) -> None:
    groups = stack.prometheus.get("/api/v1/rules")["groups"]
    by_file: dict[str, int] = {}
    for group in groups:
        by_file[group["file"]] = by_file.get(group["file"], 0) + len(group["rules"])
        for rule in group["rules"]:
            assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
    expected = {
        str(path): rules_found(promtool("check", "rules", path).stdout) for path in RULE_FILES
    }
    assert by_file == expected


def test_every_rule_expression_parses_and_runs(stack: Stack) -> None:
    rules = [r for g in stack.prometheus.get("/api/v1/rules")["groups"] for r in g["rules"]]
    assert len(rules) == sum(
        rules_found(promtool("check", "rules", path).stdout) for path in RULE_FILES
    )
    for rule in rules:
        stack.prometheus.query(rule["query"])  # raises PrometheusError if it does not parse


def test_every_recording_rule_records_data(stack: Stack) -> None:
    empty = [name for name in recorded_names() if not stack.prometheus.query(name)]
    assert empty == []


def test_alerts_for_the_stopped_worker_are_pending(stack: Stack) -> None:
    alerts = stack.prometheus.get("/api/v1/alerts")["alerts"]
    states = {
        a["labels"]["alertname"]: a["state"]
        for a in alerts
        if a["labels"].get("worker") == stack.stopped
    }
    # `for: 2m` has not passed: pending, not firing.
    assert states == {"MineruWorkerUnhealthy": "pending", "MineruWorkerMetricsDown": "pending"}


def load(path: Path) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(path.read_text())
    return dashboard


def empty_queries(stack: Stack, dashboard: dict[str, Any], values: dict[str, str]) -> list[str]:
    """`panel: expr` of every query that returns nothing (a bad query raises)."""
    empty = []
    for panel in iter_panels(dashboard):
        for target in panel_queries(panel):
            expr = substitute(target["expr"], values, RATE_INTERVAL)
            assert "$" not in expr, f"{panel['title']}: unknown variable in {expr}"
            if not stack.prometheus.query(expr):
                empty.append(f"{panel['title']}: {expr}")
    return empty


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda path: path.stem)
def test_every_panel_query_returns_data(stack: Stack, path: Path) -> None:
    dashboard = load(path)
    assert empty_queries(stack, dashboard, variable_defaults(dashboard)) == []


def label_values(stack: Stack, definition: str, chosen: dict[str, str]) -> list[str]:
    """Grafana's `label_values(selector, label)`, as a PromQL query."""
    match = _LABEL_VALUES.match(substitute(definition, chosen, RATE_INTERVAL))
    assert match, definition
    selector, label = match.groups()
    results = stack.prometheus.query(f"group by ({label}) ({selector})")
    return sorted(result["metric"].get(label, "") for result in results)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda path: path.stem)
def test_every_panel_query_returns_data_for_one_value_of_each_variable(
    stack: Stack, path: Path
) -> None:
    """Variables as a user picks them: from their own queries, regex-escaped as Grafana does."""
    dashboard = load(path)
    chosen: dict[str, str] = {}
    for variable in dashboard["templating"]["list"]:
        value = stack.real_values()[variable["name"]]
        assert value in label_values(stack, variable["definition"], chosen), variable["name"]
        chosen[variable["name"]] = _REGEX_SPECIAL.sub(r"\\\\\1", value)
    assert empty_queries(stack, dashboard, chosen) == []


def test_snapshot_renders_every_overview_panel(stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "overview.png"
    overview = next(path for path in DASHBOARDS if path.stem == "overview")
    panels = snapshot(stack.prometheus.url, overview, out, range_s=60, step_s=1)
    drawn = [p for p in panels if p.panel["type"] in ("timeseries", "stat")]
    assert drawn and all(p.series for p in drawn)
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 50_000
