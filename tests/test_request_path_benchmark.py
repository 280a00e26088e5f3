"""The request-path benchmark (benchmarks/request_path.py): a real run of the gateway's app
in-process against the instant upstreams answers every request, and the per-request figures are
the difference of two runs."""

from __future__ import annotations

import pytest
from benchmarks.request_path import (
    REPO,
    RESULT_MARK,
    markdown,
    measure,
    parse_child,
    per_request,
    upstreams,
)


def test_a_run_answers_every_request_through_the_gateway() -> None:
    with upstreams() as urls:
        figures = measure(REPO, urls, 16, instructions=False)
    short, long = figures["runs"]  # no callgrind runs without `instructions`
    assert (short["requests"], long["requests"]) == (160, 480)
    assert short["answered"] == 160 and long["answered"] == 480
    assert figures["cpu_us_long_run"] > 0


def test_the_floor_relays_every_request_through_the_gateways_client() -> None:
    with upstreams() as urls:
        floor = measure(REPO, urls, 16, instructions=False, extra=["--floor"])
    assert [(run["requests"], run["answered"]) for run in floor["runs"]] == [(160, 160), (480, 480)]


def test_page_image_requests_are_answered_too() -> None:
    with upstreams() as urls:
        figures = measure(REPO, urls, 16, instructions=False, extra=["--image-kb", "64"])
    assert [run["answered"] for run in figures["runs"]] == [160, 480]
    assert all(64_000 < run["body_bytes"] < 100_000 for run in figures["runs"])  # base64: 4/3


def test_streamed_requests_are_answered_to_their_last_event() -> None:
    # Answered: a 200 whose chunked body ends with [DONE] and the last chunk.
    with upstreams(2, events=8, gap_ms=5) as urls:
        extra = ["--stream", "--warmup", "16"]
        figures = measure(REPO, urls, 16, instructions=False, extra=extra)
    answered = [(run["requests"], run["answered"]) for run in figures["runs"]]
    assert answered == [(160, 160), (480, 480)]


def test_figures_per_request_are_what_the_longer_run_added() -> None:
    short = {"requests": 100, "cpu_s": 1.0, "instructions": 5_000_000}
    long = {"requests": 300, "cpu_s": 1.4, "instructions": 9_000_000}
    assert per_request(short, long) == pytest.approx({"cpu_us": 2000.0, "instructions": 20_000.0})
    assert per_request({"requests": 1, "cpu_s": 0.0}, {"requests": 2, "cpu_s": 1e-6}) == (
        pytest.approx({"cpu_us": 1.0})
    )


def test_the_childs_result_and_callgrinds_count_are_read() -> None:
    stdout = f'noise\n{RESULT_MARK}{{"requests": 16, "cpu_s": 0.5, "answered": 16}}\n'
    assert parse_child(stdout, None) == {"requests": 16, "cpu_s": 0.5, "answered": 16}
    counted = parse_child(stdout, "==1== Events    : Ir\n==1== Collected : 123456\n")
    assert counted["instructions"] == 123456


def test_the_table_compares_instructions_against_the_first_gateway() -> None:
    table = markdown(
        {
            "command": "python -m benchmarks.request_path --instructions",
            "date": "2026-12-03T00:00:00Z",
            "commit": "abc",
            "body_bytes": 410_381,
            "gateways": {
                "gateway": {"instructions": 400_000.0, "cpu_us": 100.0},
                "gateway@before": {"instructions": 500_000.0, "cpu_us": 130.0},
            },
        }
    )
    assert "410,381-byte bodies" in table
    assert "| gateway | 400,000 | 1.00x | 100 us |" in table
    assert "| gateway@before | 500,000 | 1.25x | 130 us |" in table
