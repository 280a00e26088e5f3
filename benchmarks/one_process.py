"""Whether one gateway process carries an Atlas box: requests per CPU-second of one process under
MinerU's load, at the request rates of an 8-NPU box and at saturation.

One gateway process (`serve`) in front of two instant upstreams (benchmarks/small_requests/
upstream.py) is sent MinerU's requests as its client sends them: non-streamed, page by page, a
layout request on the page image and one request per block crop (benchmarks/routing/workload.py),
each body made unique so that nothing coalesces. A run holds a request rate (0: as fast as the
gateway answers, `--connections` at once) and reads the gateway's CPU from /proc around it.

    python -m benchmarks.one_process --rates 190,1110,0 --out benchmarks/results/one_process.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
import uvloop
from benchmarks.routing import fleet, suite
from benchmarks.routing.runs import git_commit, stop_on_sigterm
from benchmarks.routing.workload import Mix, StreamBuilder, describe
from benchmarks.small_requests import upstream

from mineru_gateway.testing import free_port, tree_cpu_seconds, wait_http_ok

CHAT = "/v1/chat/completions"
MARK = b"@@N@@"  # replaced in each body by the request's number


@dataclass(frozen=True)
class RunResult:
    rate: float  # asked; 0: unpaced
    requests: int
    errors: int
    duration_s: float
    requests_per_s: float
    gateway_cores: float
    cpu_per_request_us: float
    requests_per_cpu_s: float
    p50_ms: float
    p99_ms: float


def templates(pages: int, model: str, seed: int = 1) -> list[tuple[bytes, bytes]]:
    """Request bodies of `pages` MinerU pages, as MinerU's client sends them (not streamed),
    each split where its number goes."""
    builder = StreamBuilder(Mix(model=model), seed)
    out = []
    for _ in range(pages):
        for request in builder.page():
            body = orjson.loads(request.body)
            body.pop("stream_options", None)
            body["stream"] = False
            body["messages"][0]["content"] += MARK.decode()
            prefix, suffix = orjson.dumps(body).split(MARK)
            out.append((prefix, suffix))
    return out


class Driver:
    """`connections` keep-alive connections sending the bodies in turn, each request started
    no sooner than its slot at `rate` (0: at once)."""

    def __init__(self, port: int, bodies: list[tuple[bytes, bytes]], connections: int) -> None:
        self.port = port
        self.bodies = bodies
        self.connections = connections
        self.sent = 0
        self.latencies: list[float] = []
        self.errors = 0

    def _next(self) -> bytes:
        prefix, suffix = self.bodies[self.sent % len(self.bodies)]
        self.sent += 1
        body = prefix + str(self.sent).encode() + suffix
        head = (
            f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def run(self, rate: float, duration_s: float) -> None:
        start = time.monotonic()
        end = start + duration_s
        self.latencies, self.errors = [], 0
        slots = iter(range(1 << 62))

        async def connection() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            try:
                while True:
                    if rate > 0:
                        at = start + next(slots) / rate
                        if at >= end:
                            return
                        await asyncio.sleep(max(0.0, at - time.monotonic()))
                    elif time.monotonic() >= end:
                        return
                    began = time.monotonic()
                    writer.write(self._next())
                    status = await _response(reader)
                    self.latencies.append(time.monotonic() - began)
                    self.errors += status != 200
            finally:
                writer.close()

        await asyncio.gather(*(connection() for _ in range(self.connections)))


async def _response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return int(lines[0].split()[1])


def measure(
    driver: Driver, gateway_pid: int, rate: float, duration_s: float, warmup_s: float
) -> RunResult:
    uvloop.run(driver.run(rate, warmup_s))
    cpu0, wall0 = tree_cpu_seconds(gateway_pid), time.monotonic()
    uvloop.run(driver.run(rate, duration_s))
    cpu, wall = tree_cpu_seconds(gateway_pid) - cpu0, time.monotonic() - wall0
    done = len(driver.latencies)
    ordered = sorted(driver.latencies) or [0.0]
    return RunResult(
        rate=rate,
        requests=done,
        errors=driver.errors,
        duration_s=wall,
        requests_per_s=done / wall,
        gateway_cores=cpu / wall,
        cpu_per_request_us=cpu / max(1, done) * 1e6,
        requests_per_cpu_s=done / cpu if cpu > 0 else 0.0,
        p50_ms=statistics.median(ordered) * 1000,
        p99_ms=ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="190,1110,0", help="requests/s per run; 0: unpaced")
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pages", type=int, default=100, help="distinct pages sent in turn")
    parser.add_argument("--out", type=Path, default=suite.RESULTS / "one_process.json")
    args = parser.parse_args()
    stop_on_sigterm()
    rates = [float(rate) for rate in args.rates.split(",")]
    bodies = templates(args.pages, fleet.MODEL)
    with tempfile.TemporaryDirectory(prefix="one-process-") as logs:
        procs = fleet.Processes(Path(logs))
        try:
            urls = [url for url, _ in upstream.start(procs, fleet.MODEL)]
            port = free_port()
            argv = [sys.executable, "-m", "mineru_gateway", "serve", "--port", str(port)]
            gateway = procs.spawn(
                "gateway", [*argv, "--workers", ",".join(urls), "--log-level", "warning"]
            )
            wait_http_ok(f"http://127.0.0.1:{port}/ready", fleet.READY_TIMEOUT_S, gateway)
            driver = Driver(port, bodies, args.connections)
            runs = [
                measure(driver, gateway.pid, rate, args.duration, args.warmup)
                for _ in range(args.rounds)
                for rate in rates
            ]
        finally:
            procs.stop_all()
    report: dict[str, Any] = {
        "command": "python -m benchmarks.one_process " + " ".join(sys.argv[1:]),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git_commit(),
        "mix": describe(Mix(model=fleet.MODEL)),
        "machine": {"cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()},
        "runs": [asdict(run) for run in runs],
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    for run in runs:
        print(json.dumps(asdict(run)))


ATLAS_RATES = (190.0, 1110.0)  # an 8-NPU box's MinerU requests per second (docs/architecture.md)


def markdown(report: dict[str, Any]) -> str:
    """The report: per asked rate, the rounds' medians, and the headroom at the box's rates."""
    by_rate: dict[float, list[dict[str, Any]]] = {}
    for run in report["runs"]:
        by_rate.setdefault(run["rate"], []).append(run)
    mix = report["mix"]
    lines = [
        "# One gateway process against an Atlas box's MinerU load",
        "",
        f"`{report['command']}` ({report['at']}, commit {report['commit']}).",
        "",
        f"One `mineru-gateway serve` process, two instant upstreams; MinerU's requests as its "
        f"client sends them (not streamed; {mix['requests_per_page']:.1f} requests per page, "
        f"mean body {mix['mean_body_bytes'] / 1024:.1f} KiB: a layout request on the page image, "
        "then one per block crop), each body unique. CPU is the gateway's process from /proc; "
        "medians of the rounds. The driver (Python, 64 keep-alive connections), the upstreams "
        "and the gateway share this machine's "
        f"{report['machine']['cpus']} CPUs with other jobs (load average at the end "
        f"{report['machine']['load_average_at_end'][0]:.1f}): latencies include waiting for a "
        "CPU; the unpaced run is as much as the driver could send, not the gateway's limit.",
        "",
        "| asked rate | requests/s | gateway cores | CPU per request | requests per CPU-second "
        "| p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rate, runs in sorted(by_rate.items(), key=lambda item: item[0] or float("inf")):
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        asked = f"{rate:,.0f}/s" if rate else "unpaced (64 connections)"
        lines.append(
            f"| {asked} | {median['requests_per_s']:,.0f} | {median['gateway_cores']:.2f} "
            f"| {median['cpu_per_request_us']:.0f} us | {median['requests_per_cpu_s']:,.0f} "
            f"| {median['p50_ms']:.1f} | {median['p99_ms']:.1f} "
            f"| {sum(run['errors'] for run in runs)} |"
        )
    saturated = by_rate.get(0.0)
    if saturated:
        per_cpu = statistics.median(run["requests_per_cpu_s"] for run in saturated)
        low, high = ATLAS_RATES
        lines += [
            "",
            f"Unpaced, one process answers {per_cpu:,.0f} requests per CPU-second: one core "
            f"carries {per_cpu / high:.1f}x an 8-NPU box's highest MinerU rate ({high:,.0f}/s) "
            f"and {per_cpu / low:.1f}x its lowest ({low:,.0f}/s).",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
