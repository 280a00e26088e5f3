"""Usage in MinerU's units: counters by tenant, model and task, and GET /v1/usage, after a
MinerU-like mix (layout pages, then text and table blocks, each with its image) sent through a
real gateway to the simulator."""

from __future__ import annotations

import base64
import struct
from contextlib import ExitStack
from typing import Any
from urllib.parse import parse_qsl

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.conftest import StartGateway, StartSim
from tests.support.servers import serve

MODEL = "mineru"
CHAT = "/v1/chat/completions"
ADMIN = "adm-usage"
TENANTS = {"docs": {"keys": ["sk-docs"]}, "forms": {"keys": ["sk-forms"]}}


def png_data_url(width: int, height: int) -> str:
    ihdr = struct.pack(">II5B", width, height, 8, 2, 0, 0, 0)
    image = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + b"\0" * 4000
    return "data:image/png;base64," + base64.b64encode(image).decode()


def mineru_request(task: str, width: int, height: int, **extra: Any) -> dict[str, Any]:
    """A request as mineru-vl-utils sends it: one image, then the task's prompt."""
    content = [
        {"type": "image_url", "image_url": {"url": png_data_url(width, height)}},
        {"type": "text", "text": f"\n{task}:"},
    ]
    messages = [{"role": "user", "content": content}]
    return {"model": MODEL, "messages": messages, "temperature": 0.0, **extra}


def send_mix(gateway: str, key: str, pages: int) -> None:
    """`pages` pages: each a layout pass, two text blocks and a table (one of them streamed)."""
    auth = {"authorization": f"Bearer {key}"}
    for page in range(pages):
        stream = {"stream": True, "stream_options": {"include_usage": True}} if page else {}
        sent = [
            mineru_request("Layout Detection", 1036, 1036, **stream),
            mineru_request("Text Recognition", 600, 80),
            mineru_request("Text Recognition", 500, 60),
            mineru_request("Table Recognition", 800, 400),
        ]
        for body in sent:
            answer = httpx.post(gateway + CHAT, json=body, headers=auth, timeout=30)
            assert answer.status_code == 200, answer.text


def usage(gateway: str, query: str = "", key: str = ADMIN) -> httpx.Response:
    return httpx.get(f"{gateway}/v1/usage{query}", headers={"authorization": f"Bearer {key}"})


def rows_by(answer: httpx.Response) -> dict[tuple[str, str], dict[str, Any]]:
    assert answer.status_code == 200, answer.text
    return {(row["tenant"], row["task"]): row for row in answer.json()["tenants"]}


@pytest.fixture
def gateway(start_sim: StartSim, start_gateway: StartGateway) -> str:
    worker = start_sim(model_name=MODEL)
    return start_gateway([worker], tenants=orjson.dumps(TENANTS).decode(), admin_keys=[ADMIN])


def test_usage_counts_pages_images_tokens_and_worker_time_by_tenant_and_task(
    gateway: str,
) -> None:
    send_mix(gateway, "sk-docs", pages=2)
    send_mix(gateway, "sk-forms", pages=1)

    answer = usage(gateway)
    rows = rows_by(answer)
    assert answer.json()["since"].endswith("Z")
    assert set(rows) == {(t, task) for t in TENANTS for task in ("layout", "text", "table")}
    layout, text = rows[("docs", "layout")], rows[("docs", "text")]
    assert (layout["requests"], layout["pages"], layout["images"]) == (2, 2, 2)
    assert (text["requests"], text["pages"], text["images"]) == (4, 0, 4)
    assert rows[("forms", "table")]["requests"] == 1
    assert all(row["model"] == MODEL for row in rows.values())
    for row in rows.values():
        assert row["prompt_tokens"] > 0 and row["completion_tokens"] > 0
        assert row["npu_seconds"] > 0
    # A layout page's image is ~1369 prompt tokens; a small text block's a few dozen.
    assert layout["prompt_tokens"] / layout["requests"] > text["prompt_tokens"] / text["requests"]

    families = {
        (sample.name, sample.labels.get("tenant"), sample.labels.get("task")): sample.value
        for family in text_string_to_metric_families(httpx.get(gateway + "/metrics").text)
        for sample in family.samples
        if sample.name.startswith("mineru_gateway_usage_")
    }
    assert families[("mineru_gateway_usage_pages_total", "docs", "layout")] == 2.0
    assert families[("mineru_gateway_usage_images_total", "docs", "text")] == 4.0
    assert families[("mineru_gateway_usage_requests_total", "forms", "table")] == 1.0
    assert families[("mineru_gateway_usage_npu_seconds_total", "docs", "layout")] == pytest.approx(
        layout["npu_seconds"], abs=1e-5
    )


def test_usage_is_for_admin_keys_only(gateway: str, start_gateway: StartGateway) -> None:
    refused = usage(gateway, key="sk-docs")
    assert refused.status_code == 403
    assert refused.json()["error"]["type"] == "permission_error"
    off = start_gateway(["http://127.0.0.1:9"], api_keys=["k"])
    assert usage(off, key="k").json()["error"]["code"] == "admin_disabled"


def test_refused_requests_use_nothing(gateway: str) -> None:
    bad = httpx.post(
        gateway + CHAT,
        json={"model": MODEL, "messages": []},
        headers={"authorization": "Bearer sk-docs"},
    )
    assert bad.status_code == 400
    assert usage(gateway).json()["tenants"] == []


class FakePrometheus:
    """Prometheus' HTTP query API as far as /v1/usage reads it: answers each usage counter's
    query with one series, and keeps the queries."""

    def __init__(self) -> None:
        self.queries: list[dict[str, str]] = []

    def app(self) -> Starlette:
        async def query(request: Request) -> JSONResponse:
            form = dict(parse_qsl((await request.body()).decode()))  # POST: a form
            params = dict(request.query_params) | form
            self.queries.append(params)
            text = params["query"]
            amount = {"pages": "7", "npu_seconds": "12.5"}.get(
                next((name for name in ("pages", "npu_seconds") if name in text), ""), "3"
            )
            series = {"tenant": "docs", "model": MODEL, "task": "layout"}
            result = [{"metric": series, "value": [1767229200, amount]}]
            return JSONResponse(
                {"status": "success", "data": {"resultType": "vector", "result": result}}
            )

        return Starlette(routes=[Route("/api/v1/query", query, methods=["GET", "POST"])])


def test_usage_over_a_time_range_asks_prometheus_for_each_counters_increase(
    start_gateway: StartGateway, servers: ExitStack
) -> None:
    prometheus = FakePrometheus()
    url = servers.enter_context(serve(prometheus.app()))
    gateway = start_gateway(["http://127.0.0.1:9"], admin_keys=[ADMIN], usage_prometheus_url=url)
    answer = usage(gateway, "?start=2026-01-01T00:00:00Z&end=2026-01-01T01:00:00Z")
    [row] = answer.json()["tenants"]
    assert (row["tenant"], row["task"], row["pages"], row["requests"]) == ("docs", "layout", 7, 3)
    assert row["npu_seconds"] == 12.5
    assert answer.json()["since"] == "2026-01-01T00:00:00Z"
    assert answer.json()["until"] == "2026-01-01T01:00:00Z"
    queries = {query["query"] for query in prometheus.queries}
    assert (
        "sum by (tenant, model, task) (increase(mineru_gateway_usage_pages_total[3600s]))"
        in queries
    )
    assert (
        'sum by (tenant, model, task) (increase(mineru_gateway_usage_tokens_total{kind="prompt"}'
        "[3600s]))" in queries
    )
    assert {query["time"] for query in prometheus.queries} == {"1767229200.000"}


def test_a_time_range_needs_prometheus(gateway: str) -> None:
    answer = usage(gateway, "?start=0&end=60")
    assert answer.status_code == 400
    assert "USAGE_PROMETHEUS_URL" in answer.json()["error"]["message"]
