"""`GET /v1/usage`: what each tenant used, in MinerU's units, for operators (docs/usage.md).

Without a range it answers from the gateway's own counters (accounting.UsageMeter) since it
started. With `?start=&end=` it asks the Prometheus that scrapes the gateway
(`usage_prometheus_url`) for the counters' increase over that range, with the gateway's own
client (workers/upstream.py).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any
from urllib.parse import urlencode

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from mineru_gateway.api.auth import bearer_match
from mineru_gateway.api.context import GatewayContext, gateway_context
from mineru_gateway.errors import InvalidRequest, PermissionDenied, UpstreamError
from mineru_gateway.workers.upstream import UpstreamClient

PATH = "/v1/usage"
KEY = ("tenant", "model", "task")
# Each figure of a row and the counter it comes from; tokens' counter has a `kind` label too.
FIGURES: dict[str, tuple[str, str | None]] = {
    "requests": ("mineru_gateway_usage_requests_total", None),
    "pages": ("mineru_gateway_usage_pages_total", None),
    "images": ("mineru_gateway_usage_images_total", None),
    "prompt_tokens": ("mineru_gateway_usage_tokens_total", "prompt"),
    "completion_tokens": ("mineru_gateway_usage_tokens_total", "completion"),
    "npu_seconds": ("mineru_gateway_usage_npu_seconds_total", None),
}
PROMETHEUS_TIMEOUT_S = 10.0
FORM = {"content-type": "application/x-www-form-urlencoded"}


def add_usage_route(app: FastAPI) -> None:
    app.add_api_route(PATH, usage, methods=["GET"])


async def usage(request: Request) -> Response:
    """Usage per tenant, model and MinerU task: since the gateway started, or over
    `?start=&end=` (RFC 3339 or Unix seconds) from Prometheus. Needs an admin key."""
    context = gateway_context(request.scope)
    _require_admin(context, request)
    start, end = request.query_params.get("start"), request.query_params.get("end")
    if start is not None or end is not None:
        body = await _range(context, _instant(start, "start"), _instant(end, "end"))
    else:
        body = _own(context)
    return Response(orjson.dumps(body), media_type="application/json")


def _require_admin(context: GatewayContext, request: Request) -> None:
    """As the gateway's other admin endpoints: off without admin keys, else an admin key."""
    keys = context.settings.all_admin_keys
    if not keys:
        raise PermissionDenied(
            "usage is for operators: set MINERU_GATEWAY_ADMIN_KEYS to enable it",
            code="admin_disabled",
        )
    header = request.headers.get("authorization", "").encode()
    if bearer_match(header, ((key.encode(), True) for key in keys)) is not True:
        raise PermissionDenied("this needs an admin key (Authorization: Bearer <admin key>)")


def _own(context: GatewayContext) -> dict[str, Any]:
    meter = context.accounting.usage
    return {"tenants": meter.rows(), "since": _iso(meter.started)}


async def _range(context: GatewayContext, start: float, end: float) -> dict[str, Any]:
    base = context.settings.usage_prometheus_url
    if base is None:
        raise InvalidRequest(
            "usage over a time range reads Prometheus: set MINERU_GATEWAY_USAGE_PROMETHEUS_URL",
            param="start",
        )
    if end <= start:
        raise InvalidRequest("`end` must be after `start`", param="end")
    window = f"{max(1, round(end - start))}s"
    results = await asyncio.gather(
        *(
            _query(context.client, base, range_query(counter, kind, window), end)
            for counter, kind in FIGURES.values()
        )
    )
    rows: dict[tuple[str, ...], dict[str, Any]] = {}
    for figure, series in zip(FIGURES, results, strict=True):
        for labels, amount in series:
            key = tuple(labels.get(name, "") for name in KEY)
            row = rows.setdefault(key, _blank(key))
            row[figure] = round(amount, 6) if figure == "npu_seconds" else round(amount)
    listed = [rows[key] for key in sorted(rows)]
    return {"tenants": listed, "since": _iso(start), "until": _iso(end)}


def _blank(key: tuple[str, ...]) -> dict[str, Any]:
    return dict(zip(KEY, key, strict=True)) | dict.fromkeys(FIGURES, 0)


def range_query(counter: str, kind: str | None, window: str) -> str:
    selector = f'{counter}{{kind="{kind}"}}' if kind else counter
    return f"sum by (tenant, model, task) (increase({selector}[{window}]))"


async def _query(
    client: UpstreamClient, base: str, query: str, at: float
) -> list[tuple[dict[str, str], float]]:
    """One instant query, POSTed as a form (Prometheus' HTTP API takes both): one URL for
    every query, so the client's table of URLs does not grow with them."""
    form = urlencode({"query": query, "time": f"{at:.3f}"}).encode()
    try:
        async with asyncio.timeout(PROMETHEUS_TIMEOUT_S):
            answer = await client.post(base.rstrip("/") + "/api/v1/query", form, FORM)
            try:
                body = await answer.read()
            finally:
                answer.close()
        if answer.status != 200:
            raise UpstreamError(f"status {answer.status}")
        result = orjson.loads(body)["data"]["result"]
        return [(item["metric"], float(item["value"][1])) for item in result]
    except (TimeoutError, UpstreamError, KeyError, TypeError, ValueError) as error:
        raise UpstreamError(
            f"Prometheus at {base} did not answer the usage query: {error!r}",
            code="usage_source_unavailable",
        ) from None


def _instant(text: str | None, name: str) -> float:
    """RFC 3339 or Unix seconds; `end` defaults to now."""
    if text is None:
        if name == "end":
            return dt.datetime.now(dt.UTC).timestamp()
        raise InvalidRequest("`start` is needed with `end`", param="start")
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(
            f"`{name}` must be RFC 3339 (2026-01-31T12:00:00Z) or Unix seconds", param=name
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


def _iso(moment: float) -> str:
    return dt.datetime.fromtimestamp(moment, dt.UTC).isoformat().replace("+00:00", "Z")
