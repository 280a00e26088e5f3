"""The small-request benchmark's pure parts: wrk's script and output, nginx's configuration, the
summary against vllm-router, py-spy's stacks and the Markdown (benchmarks/small_requests)."""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from benchmarks.routing.fleet import Processes
from benchmarks.small_requests import (
    CHAT,
    RESULT_MARK,
    Run,
    chat_body,
    markdown,
    nginx_config,
    noise_png,
    parse_wrk,
    summarize,
    top_frames,
    upstream,
    wrk_script,
)
from benchmarks.small_requests.__main__ import (
    Bench,
    gateway_argv,
    groups,
    parse_args,
    request_body,
    rotated,
)
from benchmarks.small_requests.upstream import answers, stream_parts
from PIL import Image

from mineru_gateway.images import data_url_start, image_size
from mineru_gateway.testing import free_port, wait_http_ok

FIXTURES = Path(__file__).parent / "fixtures" / "small_requests"


def make_run(proxy: str, rps: float, cpu_s: float, round_: int = 0) -> Run:
    requests = int(rps * 8)
    return Run(proxy, round_, requests, 8.0, rps, 1.0, 4.0, 0, cpu_s, 0.5, cpu_user_s=cpu_s * 0.75)


def test_parse_wrk_reads_the_done_hook_line() -> None:
    result = parse_wrk((FIXTURES / "wrk_output.txt").read_text())
    assert result.requests == 102464
    assert result.duration_s == pytest.approx(8.0005)
    assert result.requests_per_s == pytest.approx(102464 / 8.0005)
    assert (result.p50_ms, result.p99_ms) == (4.76, 9.72)
    assert result.errors == 3


def test_parse_wrk_without_the_hook_line_fails() -> None:
    with pytest.raises(ValueError, match="no result line"):
        parse_wrk("Requests/sec: 100\n")


def test_wrk_script_posts_the_body_numbered_and_reports_with_the_mark() -> None:
    body = chat_body("m")
    script = wrk_script(body)
    assert 'wrk.method = "POST"' in script
    prefix, suffix = body.decode().split("Benchmark.")
    assert f"[==[{prefix}Benchmark.]==]" in script
    assert f"[==[{suffix}]==]" in script
    assert "prefix .. count .. suffix" in script  # no two requests the same body
    assert RESULT_MARK in script
    assert json.loads(body)["model"] == "m"
    numbered = json.loads(f"{prefix}Benchmark.17{suffix}")  # what wrk sends is JSON
    assert numbered["messages"][0]["content"].startswith("Benchmark.17\n")


def test_a_page_image_body_carries_a_png_the_gateway_reads_of_about_the_size_asked() -> None:
    body = json.loads(chat_body("m", image_kb=300))
    [image, text] = body["messages"][0]["content"]
    assert text == {"type": "text", "text": "Benchmark.\nText Recognition:"}
    url = image["image_url"]["url"]
    start = data_url_start(url)
    assert start is not None
    assert image_size(url, start) == (554, 554)  # 554 x 554 greyscale bytes: 300 KB
    png = base64.b64decode(url[start:])
    assert 300 * 1024 < len(png) < 310 * 1024
    assert png == noise_png(300)  # seeded: every run sends the same bytes
    with Image.open(io.BytesIO(png)) as decoded:  # a real decoder reads all of it
        decoded.load()
        assert (decoded.size, decoded.mode) == ((554, 554), "L")
    assert "image_url" not in chat_body("m").decode()


def test_wrk_script_refuses_a_body_that_ends_the_long_string() -> None:
    with pytest.raises(ValueError):
        wrk_script(b'{"a":"]==] Benchmark."}')
    with pytest.raises(ValueError, match="number"):
        wrk_script(b'{"a":"b"}')


def test_nginx_config_has_both_upstreams_keepalive_and_local_paths(tmp_path: Path) -> None:
    text = nginx_config(8080, ["http://127.0.0.1:1", "http://127.0.0.1:2"], tmp_path, False)
    assert "server 127.0.0.1:1;" in text and "server 127.0.0.1:2;" in text
    assert "keepalive 128;" in text and 'proxy_set_header Connection "";' in text
    assert "listen 127.0.0.1:8080;" in text and "daemon off;" in text
    assert f"proxy_temp_path {tmp_path / 'proxy'};" in text
    # Page images are taken (nginx refuses bodies over 1 MB by default) and held in memory.
    assert "client_max_body_size 64m;" in text and "client_body_buffer_size 64m;" in text
    assert "user root;" not in text
    assert text.count("{") == text.count("}")
    assert nginx_config(8080, [], tmp_path, True).startswith("user root;\n")


def test_run_derives_cpu_per_request() -> None:
    run = make_run("gateway", 1000.0, 4.0)
    assert run.cpu_us_per_request == pytest.approx(500.0)
    assert run.requests_per_cpu_s == pytest.approx(2000.0)
    assert run.user_us_per_request == pytest.approx(375.0)
    assert run.as_dict()["user_us_per_request"] == pytest.approx(375.0)
    assert math.isnan(Run("x", 0, 0, 8.0, 0.0, 0.0, 0.0, 0, 0.0, 0.0).requests_per_cpu_s)


def test_summarize_takes_medians_and_ratios_to_vllm_router() -> None:
    runs = [
        make_run("gateway", 1000.0, 4.0, 0),
        make_run("vllm-router", 8000.0, 8.0, 0),
        make_run("gateway", 1200.0, 4.0, 1),
        make_run("vllm-router", 8000.0, 8.0, 1),
    ]
    gateway, router = summarize(runs)
    assert gateway["proxy"] == "gateway" and gateway["runs"] == 2
    assert gateway["requests_per_s"] == pytest.approx(1100.0)
    assert gateway["requests_per_cpu_s"] == pytest.approx((2000 + 2400) / 2)
    assert gateway["requests_per_cpu_s_vs_ref"] == pytest.approx(2200 / 8000)
    assert gateway["cpu_per_request_vs_ref"] == pytest.approx(
        ((500 + 1e6 / 2400) / 2) / 125, rel=1e-6
    )
    assert router["requests_per_s_vs_ref"] == pytest.approx(1.0)
    assert gateway["cpu_cores"] == pytest.approx(0.5)
    assert gateway["user_us_per_request"] == pytest.approx(((500 + 1e6 / 2400) / 2) * 0.75)
    assert gateway["kernel_us_per_request"] == pytest.approx(((500 + 1e6 / 2400) / 2) * 0.25)


def test_summarize_without_the_reference_has_no_ratios() -> None:
    (row,) = summarize([make_run("nginx", 30000.0, 6.0)])
    assert row["requests_per_s_vs_ref"] is None


def test_top_frames_by_self_and_total_time() -> None:
    top = top_frames((FIXTURES / "profile_raw.txt").read_text())
    self_time = dict(top["self"])
    total = dict(top["total"])
    assert self_time["data_received (uvicorn/protocols/http/httptools_impl.py)"] == 0.5
    assert self_time["(event loop: uvloop's own C code)"] == 0.1
    assert total["__call__ (mineru_gateway/api/relay.py)"] == 0.4
    assert total["post (mineru_gateway/workers/upstream.py)"] == 0.3
    assert not any("runners.py" in f or f.startswith("process") for f, _ in top["total"])
    assert top_frames("") == {"self": [], "total": []}


def results(summary: list[dict[str, Any]], command: str, **settings: Any) -> dict[str, Any]:
    """A results document as `__main__` writes it, with `settings` on top of the usual."""
    usual = {"threads": 1, "connections": 64, "duration_s": 8.0, "warmup_s": 2.0}
    return {
        "command": command,
        "when": "2026-01-01T00:00:00Z",
        "machine": {"cpus": 2},
        "git_commit": "abc",
        "settings": usual | {"body_bytes": 120, "rounds": 2} | settings,
        "summary": summary,
        "versions": {"nginx": "1.22.1"},
    }


def test_markdown_has_the_table_and_the_profile() -> None:
    runs = [make_run("gateway", 1000.0, 4.0), make_run("vllm-router", 8000.0, 8.0)]
    document = results(summarize(runs), "python -m benchmarks.small_requests")
    document["notes"] = ["a note"]
    top = {"self": [("f (a.py:1)", 0.25)], "total": [("g (b.py:2)", 0.75)]}
    document["profile"] = {"command": "py-spy record", "top": top}
    text = markdown(document)
    row = "| gateway | 1,000 | 1.00 | 4.00 | 0.50 | 500 us | 375 / 125 us | 2,000 | 0.12x | 0.25x |"
    assert row + " 0 |" in text
    assert "| 25.0% | `f (a.py:1)` |" in text and "| 75.0% | `g (b.py:2)` |" in text
    assert "- a note" in text
    assert "two raw-asyncio upstreams answering at once" in text
    document["settings"]["upstreams"] = 8
    assert "8 raw-asyncio upstreams answering at once" in markdown(document)


def test_upstream_answers_name_the_model_sent() -> None:
    table = answers("opendatalab/x")
    chat = table[b"POST", b"/v1/chat/completions"]
    assert chat.startswith(b"HTTP/1.1 200 OK\r\n")
    head, body = chat.split(b"\r\n\r\n", 1)
    assert f"content-length: {len(body)}".encode() in head
    assert json.loads(body)["model"] == "opendatalab/x"
    models = table[b"GET", b"/v1/models"].split(b"\r\n\r\n", 1)[1]
    assert json.loads(models)["data"][0]["id"] == "opendatalab/x"


def test_rounds_rotate_the_order_of_proxies() -> None:
    names = ["a", "b", "c"]
    assert [rotated(names, r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_together_pairs_the_gateway_with_each_candidate() -> None:
    args = argparse.Namespace(together=True, proxies=["gateway", "gateway@a", "gateway@b"])
    assert groups(args, 1) == [["gateway", "gateway@b"], ["gateway", "gateway@a"]]
    args.together = False
    assert groups(args, 0) == [["gateway"], ["gateway@a"], ["gateway@b"]]


def test_a_candidate_arg_reaches_that_candidates_serve_command_only(tmp_path: Path) -> None:
    args = parse_args(
        [
            *("--candidate", "info=/tmp/a", "--candidate", "plain=/tmp/b"),
            *("--candidate-arg=info=--log-level=info", "--gateway-arg=--max-retries=1"),
        ]
    )
    bench = Bench(args, Processes(tmp_path))
    bench.upstreams = ["http://127.0.0.1:1"]
    info, env, _ = bench._command("gateway@info", 8000)
    plain, _, _ = bench._command("gateway@plain", 8000)
    gateway, _, _ = bench._command("gateway", 8000)
    assert info[-2:] == ["--max-retries=1", "--log-level=info"]  # after the default: it wins
    assert "--log-level=info" not in plain + gateway
    assert "--max-retries=1" in plain and "--max-retries=1" in gateway
    assert env["PYTHONPATH"].startswith("/tmp/a/src")
    with pytest.raises(SystemExit):
        parse_args(["--candidate-arg=nobody=--log-level=info"])


@pytest.mark.parametrize("mode", ["raw", "asgi", "link"])
def test_a_floor_relay_answers_what_the_upstream_answers(mode: str, tmp_path: Path) -> None:
    """The floors (benchmarks/small_requests/floors.py) measure relaying alone: they must relay."""
    procs = Processes(tmp_path)
    try:
        [(upstream_url, _)] = upstream.start(procs, "tiny", count=1)
        port = free_port()
        floor_url = f"http://127.0.0.1:{port}"
        floor_args = ["--mode", mode, "--port", str(port), "--upstreams", upstream_url]
        argv = [sys.executable, "-m", "benchmarks.small_requests.floors", *floor_args]
        floor = procs.spawn("floor", argv)
        wait_http_ok(floor_url + "/health", 20, floor)
        body = chat_body("tiny")
        direct = httpx.post(upstream_url + CHAT, content=body)
        with httpx.Client() as client:  # one kept-alive connection for both
            relayed = [client.post(floor_url + CHAT, content=body) for _ in range(2)]
        assert direct.status_code == 200 and direct.json()["model"] == "tiny"
        assert [(r.status_code, r.content) for r in relayed] == [(200, direct.content)] * 2
    finally:
        procs.stop_all()


def test_a_streamed_answer_is_the_recorded_vllm_stream_with_as_many_token_events_as_asked() -> None:
    head, token, tail = stream_parts("opendatalab/x")
    assert b"transfer-encoding: chunked\r\n" in head and head.endswith(b"\r\n\r\n")
    assert b"content-type: text/event-stream" in head
    size, event = token.split(b"\r\n", 1)
    assert int(size, 16) == len(event) - 2 and event.endswith(b"\n\n\r\n")
    payload = json.loads(event.removeprefix(b"data: ").rstrip())
    assert payload["model"] == "opendatalab/x" and payload["choices"][0]["delta"]["content"]
    assert b'"usage":' in tail and tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


@pytest.mark.parametrize("gap_ms", [0.0, 20.0])
def test_a_streaming_upstream_streams_every_chat_answer_through_the_gateway(
    gap_ms: float, tmp_path: Path
) -> None:
    """`--stream-events`: the upstreams stream (all at once, or an event every gap), and the
    gateway relays every event of them, as it relays vLLM's."""
    procs = Processes(tmp_path)
    events = 5
    try:
        extra = ["--events", str(events), "--gap-ms", f"{gap_ms:g}"]
        [(upstream_url, _)] = upstream.start(procs, "tiny", count=1, extra=extra)
        port = free_port()
        gateway = procs.spawn("gateway", gateway_argv(port, [upstream_url], []))
        wait_http_ok(f"http://127.0.0.1:{port}/ready", 30, gateway)
        args = argparse.Namespace(model="tiny", stream_events=events, image_kb=0)
        body = request_body(args)
        assert json.loads(body)["stream"] is True and json.loads(body)["max_tokens"] == events
        started = time.perf_counter()
        with httpx.stream("POST", f"http://127.0.0.1:{port}{CHAT}", content=body) as answer:
            lines = [line for line in answer.iter_lines() if line]
        took = time.perf_counter() - started
        assert answer.status_code == 200
        deltas = [line for line in lines if '"content":"' in line]
        assert len(deltas) == events
        assert '"usage":' in lines[-2] and lines[-1] == "data: [DONE]"
        assert took >= (events - 1) * gap_ms / 1000
        # The upstream is still a plain one for everything else (health, models, load reads).
        assert httpx.get(upstream_url + "/v1/models").json()["data"][0]["id"] == "tiny"
    finally:
        procs.stop_all()


def test_nginx_passes_streams_on_unbuffered_only_when_streaming(tmp_path: Path) -> None:
    assert "proxy_buffering" not in nginx_config(8080, [], tmp_path, False)
    assert "      proxy_buffering off;\n" in nginx_config(8080, [], tmp_path, False, True)


def test_streamed_runs_report_the_cpu_per_token_event() -> None:
    runs = [make_run("gateway", 1000.0, 4.0), make_run("vllm-router", 1000.0, 2.0)]
    gateway, router = summarize(runs, events_per_request=64)
    assert gateway["cpu_us_per_event"] == pytest.approx(500 / 64)
    assert router["cpu_us_per_event"] == pytest.approx(250 / 64)
    assert summarize(runs)[0]["cpu_us_per_event"] is None
    command = "python -m benchmarks.small_requests --stream-events 64"
    text = markdown(results([gateway, router], command, stream_events=64, event_gap_ms=2.0))
    assert text.startswith("# Streamed requests: what a proxy costs per request and per token")
    assert "streaming each answer as 64 token events" in text and "every 2 ms" in text
    assert "| CPU per token event |" in text
    assert (
        "| gateway | 1,000 | 1.00 | 4.00 | 0.50 | 500 us | 375 / 125 us | 7.8 us | 2,000 |" in text
    )
