"""The gateway's /metrics: names, values after real traffic, and promtool's verdict."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mineru_gateway.metrics import Counter, Histogram
from tests.conftest import StartGateway, StartSim
from tests.support.npu_smi_stub import install_npu_smi
from tests.support.servers import wait_for_series

CHAT = "/v1/chat/completions"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(text: str, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(
        value
        for (sample, sample_labels), value in samples(text).items()
        if sample == name and wanted <= sample_labels
    )


def test_metrics_after_real_traffic(start_sim: StartSim, start_gateway: StartGateway) -> None:
    worker = start_sim(model_name="m", time_scale=1.0)  # one chunk per token: real pace
    gateway = start_gateway([worker])
    message = [{"role": "user", "content": "\nText Recognition:"}]
    completion_tokens = 0
    for _ in range(3):
        body = {"model": "m", "messages": message, "max_tokens": 7, "ignore_eos": True}
        stream = body | {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", gateway + CHAT, json=stream) as response:
            events = [line for line in response.iter_lines() if line]
        completion_tokens += orjson.loads(events[-2][6:])["usage"]["completion_tokens"]
    for _ in range(2):
        answer = httpx.post(gateway + CHAT, json={"model": "m", "messages": message}).json()
        completion_tokens += answer["usage"]["completion_tokens"]
    # a stream without usage: its tokens are counted from the stream itself
    plain = {"model": "m", "messages": message, "max_tokens": 4, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", gateway + CHAT, json=plain) as response:
        response.read()
    completion_tokens += 4
    assert (
        httpx.post(gateway + CHAT, json={"model": "bogus", "messages": message}).status_code == 404
    )
    assert httpx.post(gateway + CHAT, content=b"{").status_code == 400

    text = httpx.get(gateway + "/metrics").text
    ok = {"endpoint": "chat", "model": "m", "worker": worker, "status": "200", "outcome": "ok"}
    assert total(text, "mineru_gateway_requests_total", **ok) == 6
    assert total(text, "mineru_gateway_requests_total", outcome="model_not_found", model="") == 1
    assert total(text, "mineru_gateway_requests_total", outcome="invalid_request") == 1
    assert "bogus" not in text  # clients cannot mint label values
    assert total(text, "mineru_gateway_time_to_first_token_seconds_count", worker=worker) == 4
    assert total(text, "mineru_gateway_e2e_request_latency_seconds_count", worker=worker) == 6
    # every gap between relayed chunks: one per token after the first at most (a loaded machine
    # may read two events in one chunk), and at least one per stream
    gaps = total(text, "mineru_gateway_inter_token_latency_seconds_count")
    assert 4 <= gaps <= 3 * 6 + 3
    assert total(text, "mineru_gateway_completion_tokens_total", worker=worker) == completion_tokens
    assert total(text, "mineru_gateway_prompt_tokens_total", worker=worker) > 0
    assert total(text, "mineru_gateway_routing_decisions_total", policy="queue") == 6
    assert total(text, "mineru_gateway_worker_healthy", worker=worker) == 1
    assert total(text, "mineru_gateway_requests_in_flight", worker=worker) == 0
    assert total(text, "mineru_gateway_info", policy="queue") == 1
    assert total(text, "mineru_gateway_time_to_upstream_seconds_count", model="m") == 6
    names = {family.name for family in text_string_to_metric_families(text)}
    assert all(name.startswith("mineru_gateway_") for name in names), names

    check = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_histogram_exports_cumulative_buckets() -> None:
    histogram = Histogram("h_seconds", "doc", ("a",), (0.1, 1.0))
    series = histogram.series("x")
    # A value on a bound is in that bound's bucket (Prometheus's le: less or equal).
    for value in (0.05, 0.1, 0.5, 0.5, 1.0, 5.0):
        series.observe(value)
    family = histogram.collect()
    by_bound = {s.labels.get("le"): s.value for s in family.samples if s.name == "h_seconds_bucket"}
    assert by_bound == {"0.1": 2, "1.0": 5, "+Inf": 6}
    count = [s.value for s in family.samples if s.name == "h_seconds_count"]
    assert count == [6]


def test_counter_adds_per_label_set() -> None:
    counter = Counter("c", "doc", ("a",))
    counter.inc("x")
    counter.inc("x", amount=2)
    counter.inc("y")
    values = {s.labels["a"]: s.value for s in counter.collect().samples}
    assert values == {"x": 3, "y": 1}


def test_npu_telemetry_in_the_gateway_metrics(
    tmp_path: Path, start_sim: StartSim, start_gateway: StartGateway
) -> None:
    stub = install_npu_smi(tmp_path / "bin")
    worker = start_sim(model_name="m")
    gateway = start_gateway(
        [worker], npu_smi=str(stub.path), npu_smi_interval_s=0.1, npu_devices=f"0={worker}"
    )
    text = wait_for_series(gateway, "npu_chip_info_power")
    assert total(text, "mineru_gateway_npu_healthy", npu="0", worker=worker) == 1
    assert total(text, "npu_chip_info_hbm_total_memory", id="0") > 0
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_npu_telemetry_is_off_by_default(start_sim: StartSim, start_gateway: StartGateway) -> None:
    gateway = start_gateway([start_sim(model_name="m")])
    text = httpx.get(gateway + "/metrics").text
    assert "npu_chip_info_" not in text and "mineru_gateway_npu_" not in text


def test_past_the_per_worker_limit_request_series_fold_into_one_and_gauges_stay() -> None:
    from mineru_gateway.metrics import GatewayCollector, GatewayMetrics, WorkerGauges

    per_worker = [True]
    metrics = GatewayMetrics()
    metrics.worker_labels.per_worker = lambda: per_worker[0]
    metrics.requests.inc("chat", "m", "http://w0:1", "200", "ok")
    metrics.e2e.series("m", "http://w0:1").observe(0.5)
    per_worker[0] = False  # the fleet grew past the limit
    for n in range(1, 200):
        metrics.requests.inc("chat", "m", f"http://w{n}:1", "200", "ok")
        metrics.e2e.series("m", f"http://w{n}:1").observe(0.5)
        metrics.ejections.inc(f"http://w{n}:1", "status_5xx")
    gauges = [WorkerGauges(f"http://w{n}:1", True, 1, 0.0, 1.0, 0.1, 0.2) for n in range(200)]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(metrics, lambda: gauges, "queue"))
    text = generate_latest(registry).decode()
    assert total(text, "mineru_gateway_requests_total", worker="") == 199
    assert total(text, "mineru_gateway_requests_total", worker="http://w0:1") == 1
    assert total(text, "mineru_gateway_e2e_request_latency_seconds_count", worker="") == 199
    assert total(text, "mineru_gateway_worker_ejections_total") == 199  # per worker, always
    assert total(text, "mineru_gateway_worker_healthy") == 200
    folded = [line for line in text.splitlines() if 'worker="http://w5:1"' in line]
    assert folded and all("worker_" in line or "in_flight" in line for line in folded)


def test_a_costly_exposition_is_served_again_while_young_and_a_cheap_one_never() -> None:
    from mineru_gateway.metrics import ExpositionCache

    cache = ExpositionCache()
    cache.put(b"cheap", 100.0, 0.001)
    assert cache.get(100.0) is None
    cache.put(b"costly", 100.0, 0.05)
    assert cache.get(100.4) == b"costly"
    assert cache.get(100.6) is None
    cache.put(b"huge", 200.0, 5.0)
    assert cache.get(200.9) == b"huge" and cache.get(201.1) is None
