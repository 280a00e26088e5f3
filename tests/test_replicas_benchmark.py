"""The replicas benchmark's own parts (`benchmarks/replicas/`): the session that splits the load
between gateways, the gateways of each configuration, and the summary of a results document."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from benchmarks.replicas import summary
from benchmarks.replicas.bench import CONFIGURATIONS, SplitSession, parse_args
from benchmarks.routing.stats import RunResult


class Recorder:
    """Stands in for an aiohttp session: records the URLs it is asked for."""

    def __init__(self) -> None:
        self.posted: list[str] = []
        self.closed = False

    def post(self, url: str, **kwargs: Any) -> str:
        self.posted.append(url)
        return url

    async def close(self) -> None:
        self.closed = True


async def test_requests_to_the_first_gateway_alternate_and_the_rest_pass_through() -> None:
    recorder = Recorder()
    gateways = ["http://127.0.0.1:4000", "http://127.0.0.1:4001"]
    split = SplitSession(recorder, gateways)  # type: ignore[arg-type]
    for _ in range(3):
        split.post("http://127.0.0.1:4000/v1/chat/completions", data=b"{}")
    split.post("http://127.0.0.1:40001/v1/chat/completions")  # a worker whose port shares a prefix
    assert recorder.posted == [
        "http://127.0.0.1:4000/v1/chat/completions",
        "http://127.0.0.1:4001/v1/chat/completions",
        "http://127.0.0.1:4000/v1/chat/completions",
        "http://127.0.0.1:40001/v1/chat/completions",
    ]
    assert split.sent == [2, 1]
    await split.close()  # everything else is the wrapped session's
    assert recorder.closed


def run(router: str, fraction: float, p99: float | None, rate: float) -> dict[str, Any]:
    result = RunResult(
        scenario="a_identical",
        router=router,
        fraction=fraction,
        rate=rate,
        wait_for="first_token",
        measured=100,
        completed=100,
        errors=0,
        no_first_token=0,
        unfinished=0,
        ttft_ms={"p50": 50.0, "p90": 90.0, "p99": p99},
        ttft_p99_by_kind_ms={},
        e2e_ms={"p50": None, "p99": None},
        requests_per_s=rate,
        tokens_per_s=0.0,
        lag_ms={"p50": 0.0, "p99": 0.0, "max": 0.0},
        worker_requests=[25, 25, 25, 25],
        background_sent=0,
        cpu={},
        tail_s=0.0,
        capped=False,
        wall_s=10.0,
        extra={"requests_per_gateway": [50, 50]} if router == summary.TWO else {},
    )
    return asdict(result)


def document(two_p99_at_knee: float | None, other: str = summary.TWO) -> dict[str, Any]:
    runs = [
        run(summary.ONE, 0.85, 200.0, 90.0),
        run(summary.ONE, 1.0, 900.0, 108.0),
        run(other, 0.85, 210.0, 90.0),
        run(other, 1.0, two_p99_at_knee, 108.0),
    ]
    plan = {"slo_ms": 500.0, "fixed": [0.85, 1.0], "warmup_s": 40, "window_s": 8, "time_scale": 1}
    configurations = {name: asdict(CONFIGURATIONS[name]) for name in (summary.ONE, other)}
    settings = {"plan": plan, "worker_capacity_rps": 27.0, "configurations": configurations}
    return {"settings": settings, "runs": runs}


def test_the_summary_compares_two_gateways_with_one_per_scenario() -> None:
    result = summary.summarise(document(two_p99_at_knee=950.0))
    goodput = result["goodput"]["a_identical"]
    # Both cross the SLO between 0.85 K and 1 K; two gateways' higher p99 there, a bit sooner.
    assert 90.0 < goodput[summary.TWO]["rps"] < goodput[summary.ONE]["rps"] < 108.0
    assert [check["result"] for check in result["checks"]] == ["PASS", "PASS", "PASS"]
    assert result["fixed"][0][summary.TWO]["gateways"] == [50, 50]


def test_a_worse_second_gateway_fails_the_checks() -> None:
    result = summary.summarise(document(two_p99_at_knee=5000.0))
    verdicts = {check["check"]: check["result"] for check in result["checks"]}
    assert verdicts["a_identical at 1 K: two gateways: TTFT p99 <= 1.2x one gateway's"] == "FAIL"
    assert list(verdicts.values()).count("FAIL") == 2  # its goodput is lower too


def test_a_rate_where_neither_configuration_answered_in_time_is_not_a_pass() -> None:
    doc = document(two_p99_at_knee=None)  # censored: the tail outlasted the run
    assert summary.summarise(doc)["checks"][2]["result"] == "FAIL"  # against a measured 900 ms
    doc["runs"][1]["ttft_ms"]["p99"] = None  # one gateway censored at 1 K too
    assert summary.summarise(doc)["checks"][2]["result"] == "n/a"


def test_the_defaults_are_the_routing_suites_knee_and_both_scenarios() -> None:
    args = parse_args([])
    assert (args.fractions, args.scenarios, args.e2e) == ((0.85, 1.0), ["a", "c"], ())
    assert args.configurations == ["one_gateway", "two_gateways"]
    assert args.out.name == "replicas.json"
