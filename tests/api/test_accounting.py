"""What a finished exchange leaves behind, from hand-made records: metrics, cost, the access log."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import structlog
from prometheus_client.core import Metric
from structlog.testing import LogCapture, capture_logs

from mineru_gateway.api.accounting import (
    CLIENT_CLOSED,
    Accounting,
    ExchangeRecord,
    learn_cost,
    log_exchange,
)
from mineru_gateway.cost import CostInputs, CostModel
from mineru_gateway.metrics import Counter, GatewayMetrics, Histogram
from mineru_gateway.prompts import PromptEstimate, PromptKind

pytestmark = pytest.mark.unit

WORKER = "http://127.0.0.1:30001"
COST = CostInputs(
    "m", PromptEstimate(1400, PromptKind.LAYOUT, True), max_tokens=None, ignore_eos=False
)

# A streamed answer: received at 10 s, first chunk at 10.25 s, last byte at 11.5 s.
STREAMED = ExchangeRecord(
    request_id="r1",
    endpoint="chat",
    outcome="ok",
    received=10.0,
    ended=11.5,
    model="m",
    stream=True,
    cost=COST,
    worker=WORKER,
    attempts=1,
    status=200,
    streaming=True,
    first_chunk=10.25,
    finished=11.5,
    completion_tokens=120,
    prompt_tokens=1400,
)


def samples(metric: Counter | Histogram) -> dict[tuple[str, tuple[str, ...]], float]:
    """(sample name, label values) -> value, as /metrics would export them."""
    family: Metric = metric.collect()
    return {(s.name, tuple(s.labels.values())): s.value for s in family.samples}


# -- Accounting.record_metrics ------------------------------------------------------------------


def test_a_streamed_answer_counts_its_request_latencies_and_tokens() -> None:
    metrics = GatewayMetrics()
    accounting = Accounting(metrics, CostModel())
    accounting.record_metrics(STREAMED)
    assert samples(metrics.requests) == {
        ("mineru_gateway_requests_total", ("chat", "m", WORKER, "200", "ok")): 1.0
    }
    ttft = samples(metrics.ttft)
    assert ttft[("mineru_gateway_time_to_first_token_seconds_sum", ("m", WORKER))] == 0.25
    assert ttft[("mineru_gateway_time_to_first_token_seconds_count", ("m", WORKER))] == 1
    e2e = samples(metrics.e2e)
    assert e2e[("mineru_gateway_e2e_request_latency_seconds_sum", ("m", WORKER))] == 1.5
    assert samples(metrics.prompt_tokens) == {
        ("mineru_gateway_prompt_tokens_total", ("m", WORKER)): 1400.0
    }
    assert samples(metrics.completion_tokens) == {
        ("mineru_gateway_completion_tokens_total", ("m", WORKER)): 120.0
    }


def test_a_failed_exchange_counts_as_a_request_only() -> None:
    failed = replace(
        STREAMED, outcome="upstream_timeout", status=504, streaming=False, first_chunk=None,
        completion_tokens=0, prompt_tokens=None,
    )  # fmt: skip
    metrics = GatewayMetrics()
    accounting = Accounting(metrics, CostModel())
    accounting.record_metrics(failed)
    assert samples(metrics.requests) == {
        ("mineru_gateway_requests_total", ("chat", "m", WORKER, "504", "upstream_timeout")): 1.0
    }
    assert samples(metrics.e2e) == samples(metrics.ttft) == {}  # an error is no latency figure
    assert samples(metrics.prompt_tokens) == samples(metrics.completion_tokens) == {}


def test_a_client_that_left_before_any_status_is_counted_as_499_without_a_worker() -> None:
    gone = ExchangeRecord("r2", "completions", "client_disconnected", received=1.0, ended=1.2)
    metrics = GatewayMetrics()
    accounting = Accounting(metrics, CostModel())
    accounting.record_metrics(gone)
    labels = ("completions", "", "", str(CLIENT_CLOSED), "client_disconnected")
    assert samples(metrics.requests) == {("mineru_gateway_requests_total", labels): 1.0}


def test_an_unknown_model_stays_out_of_the_labels() -> None:
    unknown = replace(STREAMED, model="no-such-model", outcome="model_not_found", status=404)
    metrics = GatewayMetrics()
    accounting = Accounting(metrics, CostModel())
    accounting.record_metrics(unknown)
    [(_, labels)] = samples(metrics.requests)
    assert labels == ("chat", "", WORKER, "404", "model_not_found")


def test_a_streamed_error_event_after_headers_keeps_its_ttft_but_no_e2e() -> None:
    cut = replace(STREAMED, outcome="upstream_error", finished=11.0)  # status 200 was sent
    metrics = GatewayMetrics()
    accounting = Accounting(metrics, CostModel())
    accounting.record_metrics(cut)
    assert ("mineru_gateway_time_to_first_token_seconds_count", ("m", WORKER)) in samples(
        metrics.ttft
    )
    assert samples(metrics.e2e) == {}


def test_a_tenants_exchanges_count_in_its_series_and_each_kind_in_its_own() -> None:
    metrics = GatewayMetrics()
    accounting = Accounting(metrics, CostModel())
    mine = replace(STREAMED, tenant="team", queued_s=0.25)
    accounting.record_metrics(mine)
    accounting.record_metrics(replace(mine, completion_tokens=30, prompt_tokens=None))
    refused = ExchangeRecord("r3", "chat", "tenant_queue_full", 1.0, 1.1, tenant="team", status=429)
    accounting.record_metrics(refused)
    assert samples(metrics.requests) == {
        ("mineru_gateway_requests_total", ("chat", "m", WORKER, "200", "ok")): 2.0,
        ("mineru_gateway_requests_total", ("chat", "", "", "429", "tenant_queue_full")): 1.0,
    }
    assert samples(metrics.tenant_requests) == {
        ("mineru_gateway_tenant_requests_total", ("team", "200")): 2.0,
        ("mineru_gateway_tenant_requests_total", ("team", "429")): 1.0,
    }
    assert samples(metrics.rejections) == {
        ("mineru_gateway_rejections_total", ("team", "tenant_queue_full")): 1.0
    }
    waits = samples(metrics.queue_wait)  # only what went to a worker waited for one
    assert waits[("mineru_gateway_queue_wait_seconds_count", ("team",))] == 2
    assert waits[("mineru_gateway_queue_wait_seconds_sum", ("team",))] == 0.5
    assert samples(metrics.tenant_tokens) == {
        ("mineru_gateway_tenant_tokens_total", ("team", "prompt")): 1400.0,
        ("mineru_gateway_tenant_tokens_total", ("team", "completion")): 150.0,
    }
    assert samples(metrics.prompt_tokens) == {
        ("mineru_gateway_prompt_tokens_total", ("m", WORKER)): 1400.0
    }
    e2e = samples(metrics.e2e)
    assert e2e[("mineru_gateway_e2e_request_latency_seconds_count", ("m", WORKER))] == 2


def test_a_series_appears_at_its_first_count_not_at_its_kinds_first_exchange() -> None:
    metrics = GatewayMetrics()
    accounting = Accounting(metrics, CostModel())
    bare = replace(STREAMED, streaming=False, first_chunk=None, prompt_tokens=None)
    accounting.record_metrics(replace(bare, completion_tokens=0))
    assert samples(metrics.prompt_tokens) == samples(metrics.completion_tokens) == {}
    assert samples(metrics.ttft) == samples(metrics.tenant_tokens) == {}
    accounting.record_metrics(replace(bare, completion_tokens=5, prompt_tokens=9))  # same kind
    assert samples(metrics.prompt_tokens) == {
        ("mineru_gateway_prompt_tokens_total", ("m", WORKER)): 9.0
    }
    assert samples(metrics.completion_tokens) == {
        ("mineru_gateway_completion_tokens_total", ("m", WORKER)): 5.0
    }
    assert accounting.kinds == 1


# -- learn_cost --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "learns"),
    [
        ({}, True),
        ({"outcome": "upstream_error"}, False),  # cut short: not the answer's real length
        ({"status": 400}, False),  # the worker refused it
        ({"cost": None}, False),  # not parsed: nothing to learn for
    ],
)
def test_only_complete_answers_teach_the_cost_model(
    change: dict[str, object], learns: bool
) -> None:
    model = CostModel(default_decode_tokens=256)
    learn_cost(model, replace(STREAMED, **change))  # type: ignore[arg-type]
    assert model.expected_decode(COST) == (120 if learns else 256)
    assert model.classes() == (1 if learns else 0)


# -- log_exchange ------------------------------------------------------------------------------


def test_the_access_log_has_one_line_per_exchange_with_its_times_in_ms() -> None:
    with capture_logs() as logs:
        log_exchange(STREAMED)
    [line] = logs
    assert line["event"] == "request" and line["log_level"] == "info"
    assert {k: line[k] for k in ("request_id", "model", "stream", "worker", "attempts")} == {
        "request_id": "r1",
        "model": "m",
        "stream": True,
        "worker": WORKER,
        "attempts": 1,
    }
    assert (line["status"], line["outcome"]) == (200, "ok")
    assert (line["latency_ms"], line["ttft_ms"]) == (1500.0, 250.0)


def test_the_access_log_of_an_exchange_without_answer_has_no_ttft() -> None:
    gone = ExchangeRecord("r2", "chat", "client_disconnected", received=1.0, ended=1.0123456)
    with capture_logs() as logs:
        log_exchange(gone)
    [line] = logs
    assert (line["status"], line["worker"], line["ttft_ms"]) == (None, None, None)
    assert line["latency_ms"] == 12.35


def test_the_access_log_follows_the_log_level() -> None:
    capture = LogCapture()
    try:
        for level, lines in ((logging.WARNING, 0), (logging.INFO, 1)):
            structlog.configure(
                processors=[capture],
                wrapper_class=structlog.make_filtering_bound_logger(level),
                cache_logger_on_first_use=False,
            )
            capture.entries.clear()
            log_exchange(STREAMED)
            assert len(capture.entries) == lines, logging.getLevelName(level)
    finally:
        structlog.reset_defaults()


def test_account_does_all_three() -> None:
    metrics, model = GatewayMetrics(), CostModel()
    with capture_logs() as logs:
        Accounting(metrics, model).account(STREAMED)
    assert [line["request_id"] for line in logs] == ["r1"]
    assert sum(samples(metrics.requests).values()) == 1
    assert model.classes() == 1


@pytest.mark.parametrize(
    ("document", "counts", "fields"),
    [
        (None, None, {}),
        ("scan-7.pdf", None, {"document": "scan-7.pdf"}),  # no flow kept for it (folded)
        (
            "scan-7.pdf",
            (4, 2, 9),
            {
                "document": "scan-7.pdf",
                "document_queued": 4,
                "document_running": 2,
                "document_done": 9,
            },
        ),
    ],
)
def test_the_access_log_names_the_document_and_its_requests_waiting_and_done(
    document: str | None, counts: tuple[int, int, int] | None, fields: dict[str, object]
) -> None:
    with capture_logs() as logs:
        log_exchange(replace(STREAMED, document=document, document_counts=counts))
    [line] = logs
    assert {k: v for k, v in line.items() if k.startswith("document")} == fields
