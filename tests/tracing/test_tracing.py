"""Traces through the gateway: a real gateway in front of a scripted worker that records the
headers it receives, spans sent over OTLP/HTTP to a receiver built here (receiver.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
from structlog.testing import capture_logs

from mineru_gateway import tracing
from tests.conftest import StartGateway
from tests.support.servers import serve, wait_until
from tests.support.workers import DroppingWorker, Script
from tests.tracing.receiver import ReceivedSpan, Receiver, receiver_app

CHAT = "/v1/chat/completions"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
TRACESTATE = "vendor=opaque,other=1"
SERVER_KIND, CLIENT_KIND = 2, 3  # opentelemetry-proto's Span.SpanKind
BODY = {
    "model": "echo-model",
    "messages": [{"role": "user", "content": "\nText Recognition:"}],
    "temperature": 0.0,  # greedy: the request leads a coalesced generation (docs/cache.md)
}


@pytest.fixture
def receiver(servers: ExitStack, monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    """An OTLP receiver, and the standard OTEL_* variables pointing the gateway at it."""
    received = Receiver()
    url = servers.enter_context(serve(receiver_app(received)))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gateway-under-test")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # milliseconds
    yield received


def trace_of(receiver: Receiver, trace_id: str, names: set[str]) -> dict[str, ReceivedSpan]:
    """The spans of `trace_id`, by name, once every one of `names` arrived."""

    def complete() -> dict[str, ReceivedSpan] | None:
        spans = {span.name: span for span in receiver.in_trace(trace_id)}
        return spans if names <= set(spans) else None

    return wait_until(complete, 15.0, f"spans {sorted(names)} of trace {trace_id}")


def test_one_trace_from_the_client_through_the_gateway_to_the_worker(
    receiver: Receiver, scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker], tracing=True, log_level="info")
    headers = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    with capture_logs() as logs:
        assert httpx.post(gateway + CHAT, json=BODY, headers=headers).status_code == 200
    access = [entry for entry in logs if entry["event"] == "request"]
    assert [entry["trace_id"] for entry in access] == [CLIENT_TRACE]

    names = {f"POST {CHAT}", "admission", "queue wait", "upstream attempt", "relay"}
    spans = trace_of(receiver, CLIENT_TRACE, names)
    server, attempt = spans[f"POST {CHAT}"], spans["upstream attempt"]
    assert server.service == "gateway-under-test"
    assert (server.parent_id, server.kind) == (CLIENT_SPAN, SERVER_KIND)
    for child in ("admission", "queue wait", "upstream attempt"):
        assert spans[child].parent_id == server.span_id
    assert spans["relay"].parent_id == attempt.span_id
    assert attempt.kind == CLIENT_KIND
    assert attempt.attributes["mineru.worker"] == worker
    assert attempt.attributes["mineru.outcome"] == "ok"
    assert attempt.attributes["http.response.status_code"] == 200
    assert server.attributes["mineru.task"] == "text"
    assert server.attributes["http.response.status_code"] == 200
    # The worker's parent is the attempt span: a worker's own spans join the trace under it.
    seen = script.seen[-1]["headers"]
    assert seen["traceparent"] == f"00-{CLIENT_TRACE}-{attempt.span_id}-01"
    assert seen["tracestate"] == TRACESTATE


def test_each_attempt_is_a_span_with_its_worker_and_outcome(
    receiver: Receiver,
    scripted: tuple[Script, str],
    start_gateway: StartGateway,
    servers: ExitStack,
) -> None:
    script, worker = scripted
    dropping = DroppingWorker()
    servers.callback(dropping.stop)
    dead = dropping.start()
    gateway = start_gateway([dead, worker], tracing=True, routing_policy="round_robin")
    wait_until(lambda: httpx.get(gateway + "/ready").status_code == 200, 10.0, "ready")
    for _ in range(4):  # round robin: some request meets the dropping worker first
        headers = {"traceparent": TRACEPARENT}
        assert httpx.post(gateway + CHAT, json=BODY, headers=headers).status_code == 200
        if dropping.dropped:
            break
    assert dropping.dropped

    def both_outcomes() -> dict[str, ReceivedSpan] | None:
        attempts = {s.attributes["mineru.worker"]: s for s in receiver.named("upstream attempt")}
        return attempts if {dead, worker} <= set(attempts) else None

    attempts = wait_until(both_outcomes, 15.0, "an attempt span on each worker")
    assert attempts[dead].attributes["mineru.outcome"] == "upstream_disconnect"
    assert attempts[dead].status_code == 2  # STATUS_CODE_ERROR
    assert attempts[worker].attributes["mineru.outcome"] == "ok"
    # The retried attempt sent the worker its own span as parent, not the failed one's.
    parents = {seen["headers"]["traceparent"].split("-")[2] for seen in script.seen}
    assert attempts[worker].span_id in parents and attempts[dead].span_id not in parents


def test_with_tracing_off_the_clients_trace_context_reaches_the_worker_unchanged(
    receiver: Receiver, scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker])  # OTEL_EXPORTER_OTLP_ENDPOINT alone does not turn it on
    headers = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    assert httpx.post(gateway + CHAT, json=BODY, headers=headers).status_code == 200
    seen = script.seen[-1]["headers"]
    assert (seen["traceparent"], seen["tracestate"]) == (TRACEPARENT, TRACESTATE)
    assert not tracing.ENABLED
    assert httpx.post(gateway + CHAT, json=BODY).status_code == 200
    assert "traceparent" not in script.seen[-1]["headers"]  # none given, none invented
    assert receiver.posts == 0


def test_a_gateway_without_tracing_never_starts_the_sdk() -> None:
    """Off, tracing costs a module attribute check: neither the gateway's spans nor an exporter
    are imported (redis imports parts of the SDK for its own use, so that is not looked at)."""
    script = (
        "import sys\n"
        "from mineru_gateway.api.app import create_app\n"
        "from mineru_gateway.config import GatewaySettings\n"
        "create_app(GatewaySettings())\n"
        "print(sorted(m for m in sys.modules if m.startswith(\n"
        "    ('mineru_gateway.tracing.spans', 'opentelemetry.exporter', 'opentelemetry.proto'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def test_a_documents_id_and_its_requests_are_attributes_of_the_trace_and_the_access_log(
    receiver: Receiver, scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    _, worker = scripted
    gateway = start_gateway([worker], tracing=True, log_level="info")
    headers = {"traceparent": TRACEPARENT, "X-Document-Id": "annual-report.pdf"}
    with capture_logs() as logs:
        assert httpx.post(gateway + CHAT, json=BODY, headers=headers).status_code == 200
    [access] = [entry for entry in logs if entry["event"] == "request"]
    assert access["document"] == "annual-report.pdf"
    assert (access["document_queued"], access["document_running"]) == (0, 0)
    assert access["document_done"] == 1
    server = trace_of(receiver, CLIENT_TRACE, {f"POST {CHAT}"})[f"POST {CHAT}"]
    assert server.attributes["mineru.document.id"] == "annual-report.pdf"
    assert server.attributes["mineru.document.done"] == 1
    assert server.attributes["mineru.document.queued"] == 0
