"""`serve --processes N` (issue 16): several gateway processes on one port, seen as one gateway.

The merge of the processes' expositions is pure code; the rest runs the real command against a
simulated worker on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mineru_gateway.api.app import create_app
from mineru_gateway.config import GatewaySettings
from mineru_gateway.entry.processes import run_processes
from mineru_gateway.siblings import Siblings, merge_expositions
from mineru_gateway.testing import free_port, wait_until
from tests.conftest import StartSim
from tests.support.servers import serve
from tests.support.workers import Script, scripted_worker

ADMIN = "admin-secret"
MODEL = "tiny"
CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def exposition(
    ok: int,
    fast: int,
    count: int,
    seconds: float,
    in_flight: int,
    w1_healthy: int,
    started: int,
    disconnected: int = 0,
) -> str:
    """One process's own /metrics, in the shape the gateway's collectors give it."""
    left = (
        f'mineru_gateway_requests_total{{outcome="client_disconnected"}} {disconnected}\n'
        if disconnected
        else ""
    )
    return f"""\
# HELP mineru_gateway_requests_total Requests finished.
# TYPE mineru_gateway_requests_total counter
mineru_gateway_requests_total{{outcome="ok"}} {ok}
{left}# HELP mineru_gateway_ttft_seconds TTFT.
# TYPE mineru_gateway_ttft_seconds histogram
mineru_gateway_ttft_seconds_bucket{{le="0.1"}} {fast}
mineru_gateway_ttft_seconds_bucket{{le="+Inf"}} {count}
mineru_gateway_ttft_seconds_count {count}
mineru_gateway_ttft_seconds_sum {seconds}
# HELP mineru_gateway_requests_in_flight In flight.
# TYPE mineru_gateway_requests_in_flight gauge
mineru_gateway_requests_in_flight{{worker="w0"}} {in_flight}
# HELP mineru_gateway_worker_healthy Healthy.
# TYPE mineru_gateway_worker_healthy gauge
mineru_gateway_worker_healthy{{worker="w0"}} 1
mineru_gateway_worker_healthy{{worker="w1"}} {w1_healthy}
# HELP mineru_gateway_start_time_seconds Start.
# TYPE mineru_gateway_start_time_seconds gauge
mineru_gateway_start_time_seconds {started}
"""


PROCESS_A = exposition(3, 2, 3, 0.5, 2, 0, 200, disconnected=1)
PROCESS_B = exposition(4, 1, 4, 2.0, 5, 1, 100)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_counters_and_histograms_add_up_across_processes() -> None:
    merged = samples(merge_expositions([PROCESS_A, PROCESS_B]).decode())
    assert merged[("mineru_gateway_requests_total", (("outcome", "ok"),))] == 7.0
    assert merged[("mineru_gateway_requests_total", (("outcome", "client_disconnected"),))] == 1
    assert merged[("mineru_gateway_ttft_seconds_bucket", (("le", "0.1"),))] == 3.0
    assert merged[("mineru_gateway_ttft_seconds_bucket", (("le", "+Inf"),))] == 7.0
    assert merged[("mineru_gateway_ttft_seconds_count", ())] == 7.0
    assert merged[("mineru_gateway_ttft_seconds_sum", ())] == 2.5
    assert merged[("mineru_gateway_processes", ())] == 2.0


def test_gauges_add_up_only_where_each_process_holds_its_own_share() -> None:
    merged = samples(merge_expositions([PROCESS_A, PROCESS_B]).decode())
    # Requests on a worker: each process has its own.
    assert merged[("mineru_gateway_requests_in_flight", (("worker", "w0"),))] == 7.0
    # A worker's health: every process sees the same worker; one gateway's view, not a count.
    assert merged[("mineru_gateway_worker_healthy", (("worker", "w0"),))] == 1.0
    assert merged[("mineru_gateway_worker_healthy", (("worker", "w1"),))] == 1.0
    assert merged[("mineru_gateway_start_time_seconds", ())] == 100.0


def test_one_process_merges_to_its_own_figures() -> None:
    merged = samples(merge_expositions([PROCESS_A]).decode())
    assert merged.pop(("mineru_gateway_processes", ())) == 1.0
    assert merged == samples(PROCESS_A)


async def test_a_process_asks_a_sibling_over_one_kept_connection(tmp_path: Path) -> None:
    """The readings are taken five times a second: a connection (and an HTTP session) for each
    cost every process more CPU than its own idle work. One is kept, and closed with the app."""
    siblings = Siblings(1, 2, tmp_path)
    accepted: list[asyncio.StreamReader] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(reader)
        while await reader.readuntil(b"\r\n\r\n"):  # GETs: a head, no body
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()

    server = await asyncio.start_unix_server(answer, path=str(siblings.socket_path(0)))
    try:
        for _ in range(20):
            assert await siblings.request(0, "GET", "/v1/internal/readings") == (200, b"{}")
        assert len(accepted) == 1
        await siblings.close()
        await asyncio.wait_for(accepted[0].read(), 5)  # the end of the stream: closed
        assert accepted[0].at_eof()
    finally:
        server.close()


@pytest.fixture
def sibling_pair(start_sim: StartSim, servers: ExitStack, tmp_path: Path) -> list[str]:
    """Two gateway apps that are each other's siblings, each on a port of its own (the
    shared port is the kernel's part; everything else is the gateway's)."""
    worker = start_sim(model_name=MODEL)
    settings = GatewaySettings(
        workers=[worker], port=0, health_interval_s=0.2, log_level="warning", admin_keys=[ADMIN]
    )
    return [
        servers.enter_context(serve(create_app(settings, siblings=Siblings(index, 2, tmp_path))))
        for index in range(2)
    ]


def requests_total(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "mineru_gateway_requests_total"
    )


def test_each_process_answers_metrics_for_the_whole_gateway(sibling_pair: list[str]) -> None:
    first, second = sibling_pair
    for _ in range(3):
        assert httpx.post(first + CHAT, json=BODY, timeout=30).status_code == 200
    for _ in range(5):
        assert httpx.post(second + CHAT, json=BODY, timeout=30).status_code == 200
    assert requests_total(first) == requests_total(second) == 8.0
    text = httpx.get(first + "/metrics").text
    assert "mineru_gateway_processes 2.0" in text
    # What a process tells a sibling is its own share only.
    assert httpx.get(second + "/v1/workers").json()["processes"] == 2


def test_metrics_leave_out_a_sibling_that_does_not_answer(
    start_sim: StartSim, servers: ExitStack, tmp_path: Path
) -> None:
    worker = start_sim(model_name=MODEL)
    settings = GatewaySettings(workers=[worker], port=0, health_interval_s=0.2)
    alone = servers.enter_context(serve(create_app(settings, siblings=Siblings(0, 2, tmp_path))))
    assert httpx.post(alone + CHAT, json=BODY, timeout=30).status_code == 200
    text = httpx.get(alone + "/metrics").text
    assert "mineru_gateway_processes 1.0" in text
    assert requests_total(alone) == 1.0


def test_an_operators_change_reaches_every_process(sibling_pair: list[str]) -> None:
    first, second = sibling_pair
    admin = {"authorization": f"Bearer {ADMIN}"}
    wait_until(lambda: all_healthy(first) and all_healthy(second), 10, "workers healthy")
    worker = httpx.get(first + "/v1/workers").json()["workers"][0]["url"]
    drained = httpx.post(first + "/v1/workers/drain", json={"url": worker}, headers=admin)
    assert drained.status_code == 200
    assert httpx.get(second + "/v1/workers").json()["workers"][0]["state"] != "healthy"
    refused = httpx.post(second + CHAT, json=BODY, timeout=30)
    assert refused.status_code == 503
    undrained = httpx.post(second + "/v1/workers/undrain", json={"url": worker}, headers=admin)
    assert undrained.status_code == 200
    wait_until(lambda: all_healthy(first), 10, "the worker healthy again in the other process")
    assert httpx.post(first + CHAT, json=BODY, timeout=30).status_code == 200


def test_a_change_a_sibling_refuses_is_reported(sibling_pair: list[str], tmp_path: Path) -> None:
    first, second = sibling_pair
    admin = {"authorization": f"Bearer {ADMIN}"}
    wait_until(lambda: all_healthy(first) and all_healthy(second), 10, "workers healthy")
    worker = httpx.get(first + "/v1/workers").json()["workers"][0]["url"]
    # Removed from the second process alone (over its sibling socket, so not passed on), the
    # worker is unknown there when the first passes its drain on.
    transport = httpx.HTTPTransport(uds=str(Siblings(1, 2, tmp_path).own_socket))
    with httpx.Client(transport=transport, base_url="http://sibling") as sibling:
        removed = sibling.request("DELETE", "/v1/workers", json={"url": worker}, headers=admin)
    assert removed.status_code == 200
    assert httpx.get(first + "/v1/workers").json()["workers"][0]["url"] == worker
    drained = httpx.post(first + "/v1/workers/drain", json={"url": worker}, headers=admin)
    assert drained.status_code == 500
    assert "1 of the gateway's other 1 processes" in drained.json()["error"]["message"]


def ready(url: str) -> bool:
    return httpx.get(url + "/ready").status_code == 200


def all_healthy(url: str) -> bool:
    workers = httpx.get(url + "/v1/workers").json()["workers"]
    return bool(workers) and all(worker["state"] == "healthy" for worker in workers)


def test_serve_with_processes_shares_the_port_restarts_a_dead_process_and_stops_on_sigterm(
    start_sim: StartSim, capfd: pytest.CaptureFixture[str]
) -> None:
    """`run_processes` as `serve --processes 2` runs it, in this (the main) thread, where it
    takes SIGTERM; the checks run beside it and end by sending that SIGTERM."""
    worker = start_sim(model_name=MODEL)
    port = free_port()
    settings = GatewaySettings(
        workers=[worker], port=port, processes=2, health_interval_s=0.2, log_format="json"
    )
    url = f"http://127.0.0.1:{port}"
    found: dict[str, object] = {}

    def check() -> None:
        try:
            wait_until(lambda: scraped_processes(url) == 2, 90, "two gateway processes")
            for _ in range(60):  # a new connection each: the kernel spreads them
                assert httpx.post(url + CHAT, json=BODY, timeout=30).status_code == 200
            found["total"] = requests_total(url)
            children = multiprocessing.active_children()
            found["children"] = len(children)
            os.kill(children[0].pid or 0, signal.SIGKILL)
            wait_until(
                lambda: (
                    children[0].pid not in [c.pid for c in multiprocessing.active_children()]
                    and len(multiprocessing.active_children()) == 2
                ),
                30,
                "a new process in place of the killed one",
            )
            wait_until(lambda: scraped_processes(url) == 2, 90, "both processes answering")
            found["after_restart"] = [
                httpx.post(url + CHAT, json=BODY, timeout=30).status_code for _ in range(10)
            ]
        except BaseException as error:  # reported by the test's main thread
            found["error"] = error
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    checker = threading.Thread(target=check)
    checker.start()
    assert run_processes(settings) == 0
    checker.join()
    if "error" in found:
        raise AssertionError(f"check failed: {found['error']!r}")
    assert found["total"] == 60.0
    assert found["children"] == 2
    assert found["after_restart"] == [200] * 10
    assert multiprocessing.active_children() == []
    logged = capfd.readouterr()
    served = {
        record["process"]
        for line in (logged.out + logged.err).splitlines()
        if line.startswith("{") and (record := orjson.loads(line)).get("event") == "request"
    }
    assert served == {0, 1}
    assert "gateway_process_died" in logged.out + logged.err


def scraped_processes(url: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "mineru_gateway_processes":
            return family.samples[0].value
    return 0.0


class CountingWorker:
    """A worker that says it runs 7 requests and has 3 waiting, and counts its /metrics reads."""

    def __init__(self) -> None:
        self.metrics_reads = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        if scope["path"] == "/metrics":
            self.metrics_reads += 1
            body = b"vllm:num_requests_running 7.0\nvllm:num_requests_waiting 3.0\n"
        elif scope["path"] == "/v1/models":
            body = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


def reported(url: str) -> dict[str, Any] | None:
    return httpx.get(url + "/v1/workers").json()["workers"][0]["reported"]


def test_one_process_reads_the_workers_metrics_for_all(servers: ExitStack, tmp_path: Path) -> None:
    """Each read costs a worker's API server CPU (benchmarks/results/scrape_cost.md):
    with several processes, only the first reads it, and the others route on its readings."""
    worker = CountingWorker()
    worker_url = servers.enter_context(serve(worker))
    settings = GatewaySettings(
        workers=[worker_url], port=0, health_interval_s=0.2, load_interval_s=0.1
    )
    second = servers.enter_context(serve(create_app(settings, siblings=Siblings(1, 2, tmp_path))))
    wait_until(lambda: all_healthy(second), 10, "the worker healthy in the second process")
    time.sleep(0.5)  # five of its load intervals, with no first process to take readings from
    assert worker.metrics_reads == 0 and reported(second) is None
    first = servers.enter_context(serve(create_app(settings, siblings=Siblings(0, 2, tmp_path))))
    wait_until(lambda: reported(second) is not None, 10, "the first process's readings")
    figures = reported(second)
    assert figures is not None and (figures["running"], figures["waiting"]) == (7.0, 3.0)
    assert reported(first) is not None and worker.metrics_reads > 0
    # Not over a client port: the readings are for the gateway's own processes.
    refused = httpx.get(first + "/v1/internal/readings")
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found"


def test_a_process_routes_around_requests_another_just_sent(
    servers: ExitStack, tmp_path: Path
) -> None:
    """The processes share their in-flight counts per worker (workers/group_load.py), so a
    request another process holds is in this one's routing before any reading shows it (load
    reads are a minute apart here). The first process, with worker b drained in it alone, holds
    two requests on a; the second, choosing between a and b, must send both of its to b."""
    scripts = {name: Script(mode="hang") for name in ("a", "b")}
    urls = {name: servers.enter_context(serve(scripted_worker(s))) for name, s in scripts.items()}
    settings = GatewaySettings(
        workers=list(urls.values()),
        port=0,
        health_interval_s=0.2,
        load_interval_s=60,
        admin_keys=[ADMIN],
    )
    first, second = (
        servers.enter_context(serve(create_app(settings, siblings=Siblings(index, 2, tmp_path))))
        for index in range(2)
    )
    wait_until(lambda: all_healthy(first) and all_healthy(second), 10, "workers healthy")
    admin = {"authorization": f"Bearer {ADMIN}"}
    transport = httpx.HTTPTransport(uds=str(Siblings(0, 2, tmp_path).own_socket))
    with httpx.Client(transport=transport, base_url="http://sibling") as sibling:  # not passed on
        drained = sibling.post("/v1/workers/drain", json={"url": urls["b"]}, headers=admin)
    assert drained.status_code == 200
    timed_out: list[str] = []

    def hold(gateway: str) -> None:  # the workers never answer: the client gives up after 3 s
        body = {**BODY, "model": "echo-model"}
        try:
            httpx.post(gateway + CHAT, json=body, timeout=httpx.Timeout(5, read=3))
        except httpx.ReadTimeout:
            timed_out.append(gateway)

    clients = [threading.Thread(target=hold, args=(first,)) for _ in range(2)]
    clients += [threading.Thread(target=hold, args=(second,)) for _ in range(2)]
    try:
        for client in clients[:2]:
            client.start()
        wait_until(lambda: len(scripts["a"].seen) == 2, 5, "the first process's two on a")
        for client in clients[2:]:
            client.start()
            time.sleep(0.2)  # one at a time: each sees the one before
        wait_until(lambda: len(scripts["b"].seen) == 2, 5, "the second process's two on b")
        assert len(scripts["a"].seen) == 2
    finally:
        for client in clients:
            client.join(10)
    assert len(timed_out) == 4


def test_a_tenants_in_flight_limit_holds_across_processes(
    servers: ExitStack, tmp_path: Path
) -> None:
    """A tenant's limits count every process's requests (workers/group_load.py, GroupTenants):
    with `max_in_flight` 1 and one request held through the first process, the tenant's request
    to the second waits in its queue (then 429 at the queue's time limit) and never reaches the
    worker; another tenant's goes straight on."""
    script = Script(mode="hang")
    worker = servers.enter_context(serve(scripted_worker(script)))
    settings = GatewaySettings(
        workers=[worker],
        port=0,
        health_interval_s=0.2,
        api_keys="capped,other",
        tenant_max_in_flight=1,
        max_queue_wait_s=1.0,
    )
    first, second = (
        servers.enter_context(serve(create_app(settings, siblings=Siblings(index, 2, tmp_path))))
        for index in range(2)
    )
    wait_until(lambda: ready(first) and ready(second), 10, "the worker healthy")
    body = {**BODY, "model": "echo-model"}

    def hold() -> None:  # the worker never answers: the client gives up after 4 s
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                first + CHAT,
                json=body,
                headers={"authorization": "Bearer capped"},
                timeout=httpx.Timeout(5, read=4),
            )

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        wait_until(lambda: len(script.seen) == 1, 5, "the first process's request on the worker")
        refused = httpx.post(
            second + CHAT, json=body, headers={"authorization": "Bearer capped"}, timeout=5
        )
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "queue_timeout"
        assert len(script.seen) == 1
        with pytest.raises(httpx.ReadTimeout):  # another tenant is not held back
            httpx.post(
                second + CHAT,
                json=body,
                headers={"authorization": "Bearer other"},
                timeout=httpx.Timeout(5, read=0.5),
            )
        assert len(script.seen) == 2
    finally:
        holder.join(10)


async def test_a_ring_reaches_the_process_and_rings_pile_up_into_one_look(tmp_path: Path) -> None:
    looks: list[int] = []
    first, second = (Siblings(index, 2, tmp_path).doorbell() for index in range(2))
    second.listen(lambda: looks.append(1))
    first.ring(0)  # nobody listens there: lost, and harmless
    for _ in range(3):
        first.ring(1)
    await asyncio.sleep(0.05)
    assert looks == [1]
    first.ring(1)
    await asyncio.sleep(0.05)
    assert looks == [1, 1]
    second.close()
    first.ring(1)  # a process that went away
    first.close()


def test_siblings_figures_as_json_merge_as_their_expositions_do() -> None:
    from prometheus_client.parser import text_string_to_metric_families as parse

    from mineru_gateway.siblings import families_of, merge_families

    as_data = [orjson.loads(orjson.dumps(families_of(parse(t)))) for t in (PROCESS_A, PROCESS_B)]
    assert merge_families(as_data) == merge_expositions([PROCESS_A, PROCESS_B])


def test_the_readers_findings_round_trip_and_each_worker_is_serialised_once() -> None:
    import time

    from mineru_gateway.siblings import Findings, findings_from_json
    from mineru_gateway.vllm_contract import VllmLoad
    from mineru_gateway.workers.worker import Scrape, Worker

    a, b = Worker("http://a:1", healthy=True, models={"m": {"id": "m"}}), Worker("http://b:1")
    b.last_error = "refused"
    a.scrape = Scrape(VllmLoad(1, 2, 0.5, 3.0, 4.0), time.monotonic(), 2)
    findings = Findings()
    first = findings.body([a, b])
    found = findings_from_json(first)
    assert found["http://a:1"].scrape == a.scrape and found["http://a:1"].models == a.models
    assert not found["http://b:1"].healthy and found["http://b:1"].error == "refused"
    parts = dict(findings._parts)
    assert findings.body([a, b]) == first
    assert all(findings._parts[url][4] is parts[url][4] for url in parts)  # not made again
    b.healthy = True
    findings.body([a, b])
    assert findings._parts["http://a:1"][4] is parts["http://a:1"][4]
    assert findings._parts["http://b:1"][4] is not parts["http://b:1"][4]
