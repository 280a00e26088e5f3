"""The worker-side polling benchmark's reading and report (benchmarks/scrape_cost.py), on a
server in this process instead of vLLM."""

from __future__ import annotations

import os
from typing import Any

import pytest
from benchmarks.scrape_cost import gateway_read_cost, markdown, read_cost

from mineru_gateway.vllm_contract import FULL_PATH, LOAD_PATH
from tests.conftest import StartSim
from tests.support.servers import serve

BODY = b"vllm:num_requests_running 0\n" * 100


async def exposition(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    # Burns CPU in this process on every read, as rendering an exposition does.
    sum(range(20_000))
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": BODY})


def test_a_read_costs_the_servers_cpu_and_its_answer_size_is_kept() -> None:
    with serve(exposition) as url:
        cost = read_cost(url + "/metrics", os.getpid(), reads=200)
    assert cost["bytes"] == len(BODY)
    assert cost["server_cpu_ms_per_read"] > 0
    assert cost["wall_ms_per_read"] > 0


def test_the_report_says_what_the_polling_takes_of_a_core() -> None:
    document = {
        "command": "python -m benchmarks.scrape_cost --out x.json",
        "when": "2026-12-03T00:00:00Z",
        "machine": {"cpus": 2},
        "paths": {  # the last run before the filtered read
            "/health": {"server_cpu_ms_per_read": 0.5, "wall_ms_per_read": 1.0, "bytes": 0},
            "/metrics": {"server_cpu_ms_per_read": 8.0, "wall_ms_per_read": 10.0, "bytes": 50000},
        },
    }
    report = markdown(document)
    assert "| `/metrics` | 8.00 ms | 10.00 ms | 50,000 | - |" in report
    assert "`/metrics` reads take 4.0% of one core" in report  # 8 ms every 0.2 s
    document["paths"][LOAD_PATH] = {
        "server_cpu_ms_per_read": 1.0,
        "wall_ms_per_read": 1.5,
        "bytes": 800,
        "gateway_cpu_ms_per_read": 0.18,
    }
    report = markdown(document)
    row = "| `/metrics/?name[]=... (the gateway's load read)` | 1.00 ms | 1.50 ms | 800 | 0.18 ms |"
    assert row in report
    assert "load reads take 0.5% of one core" in report
    assert "(4.0% if they read the whole page" in report


def test_the_gateways_side_of_a_load_read_is_measured_on_the_path_asked(
    start_sim: StartSim,
) -> None:
    """A filtered read that fell back to the whole page would measure the wrong read: the
    benchmark refuses to report it."""
    assert gateway_read_cost(start_sim(), LOAD_PATH, reads=20) > 0
    assert gateway_read_cost(start_sim(), FULL_PATH, reads=20) > 0
    with pytest.raises(RuntimeError, match="gave no load reading"):
        gateway_read_cost(start_sim(api_server_count=2), LOAD_PATH, reads=5)
