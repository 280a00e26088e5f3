"""What the gateway costs: the same streaming load sent straight to simulated workers and through
the gateway, in the same run, at several concurrencies.

Direct mode is an ideal zero-cost balancer: stream i always goes to worker i % N, so every worker
carries exactly the same load. Through the gateway, the gateway routes. Two other relays run as
references: `bare-proxy` (the routing benchmark's emulation of vLLM's DP balancer: a raw ASGI app,
an aiohttp client, no metrics, logs or retries; the floor for a Python relay) and `naive-httpx`
(FastAPI + httpx + StreamingResponse); mode `vllm-router` adds the Rust peer (PyPI
`vllm-router`, round robin; `make vllm-router` installs it). Reported per concurrency:
throughput (output tokens/s and requests/s), TTFT p50/p99 and the ratios against direct, plus
each relay's CPU time per relayed SSE event and per request (from /proc) and the gateway's CPU
against the bare proxy's.

    python -m benchmarks.gateway_overhead --out benchmarks/results/gateway_overhead.json

`--baseline-src DIR` adds the mode `gateway-baseline`: the gateway of another checkout (say a
`git worktree` of the commit before a change), run from DIR/src, with the same workers, load and
rounds, so that a change's cost per event is measured against its parent in the same run.
`--idle S` first measures what each proxy costs with no traffic over the same S seconds (the
gateway's polling of the workers' /metrics and /health).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from benchmarks.routing.fleet import ROUTERS, RouterSettings, find_vllm_router

from mineru_gateway.testing import free_port, tree_cpu_seconds, wait_http_ok

CHAT = "/v1/chat/completions"
PROXIES = (
    "gateway",
    "gateway-baseline",
    "bare-proxy",
    "naive-httpx",
    "vllm-router",
)
READY_TIMEOUT_S = 60.0


@dataclass
class Sample:
    sent: float
    first_token: float | None = None
    done: float | None = None
    events: int = 0


@dataclass
class RunResult:
    mode: str
    concurrency: int
    duration_s: float
    requests: int
    events: int
    requests_per_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    errors: int
    relayed_events: int = 0
    relayed_requests: int = 0
    gateway_cpu_s: float | None = None
    gateway_wall_s: float | None = None  # how long its CPU was read over (the whole run)
    gateway_cpu_us_per_event: float | None = None
    gateway_cpu_us_per_request: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Window:
    """The measured interval; tokens are counted when they arrive inside it. What the proxy
    relayed over the whole run (warm-up and the tail of requests still open at `stop` too) is
    counted apart: its CPU is read over the whole run, and is divided by that."""

    start: float
    stop: float
    events: int = 0
    relayed_events: int = 0
    relayed_requests: int = 0


async def one_stream(
    session: aiohttp.ClientSession, url: str, body: bytes, sample: Sample, window: Window
) -> None:
    headers = {"Content-Type": "application/json"}
    async with session.post(url, data=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"status {response.status}")
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                break
            if (
                sample.first_token is None
                and b'"content":"' in line
                and b'"content":""' not in line
            ):
                sample.first_token = time.perf_counter()
            sample.events += 1
            window.relayed_events += 1
            if window.start <= time.perf_counter() <= window.stop:
                window.events += 1
    sample.done = time.perf_counter()
    window.relayed_requests += 1


async def closed_loop(
    targets: list[str], concurrency: int, body: bytes, warmup_s: float, duration_s: float
) -> tuple[list[Sample], int, Window]:
    """`concurrency` streams, each sending its next request as soon as its last one ended."""
    samples: list[Sample] = []
    errors = 0
    start = time.perf_counter()
    window = Window(start + warmup_s, start + warmup_s + duration_s)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)

    async def stream_loop(index: int) -> None:
        nonlocal errors
        url = targets[index % len(targets)] + CHAT
        while time.perf_counter() < window.stop:
            sample = Sample(sent=time.perf_counter())
            try:
                await one_stream(session, url, body, sample, window)
            except (aiohttp.ClientError, RuntimeError):
                errors += 1
                await asyncio.sleep(0.05)
                continue
            if window.start <= sample.sent <= window.stop:
                samples.append(sample)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(stream_loop(i) for i in range(concurrency)))
    return samples, errors, window


def summarise(
    mode: str, concurrency: int, samples: list[Sample], errors: int, window: Window
) -> RunResult:
    ttfts = [(s.first_token - s.sent) * 1000 for s in samples if s.first_token]
    e2es = [(s.done - s.sent) * 1000 for s in samples if s.done]
    seconds = window.stop - window.start
    completed = [s for s in samples if s.done and s.done <= window.stop]
    return RunResult(
        mode=mode,
        concurrency=concurrency,
        duration_s=seconds,
        requests=len(completed),
        events=window.events,
        requests_per_s=len(completed) / seconds,
        tokens_per_s=window.events / seconds,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        e2e_p50_ms=percentile(e2es, 50),
        errors=errors,
        relayed_events=window.relayed_events,
        relayed_requests=window.relayed_requests,
    )


class Fleet:
    """Simulated workers and a gateway, as separate processes (as users run them)."""

    def __init__(
        self,
        workers: int,
        sim_args: list[str],
        gateway_args: list[str],
        baseline_src: Path | None = None,
        vllm_router: str = "",
    ) -> None:
        self.baseline_src = baseline_src
        self.vllm_router = vllm_router
        self.router_url = ""
        self.router_pid = 0
        self.baseline_url = ""
        self.baseline_pid = 0
        self.worker_urls: list[str] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self.sim_args = sim_args
        self.gateway_args = gateway_args
        self.count = workers
        self.gateway_url = ""
        self.gateway_pid = 0
        self.naive_url = ""
        self.naive_pid = 0
        self.bare_url = ""
        self.bare_pid = 0

    def _spawn(
        self, args: list[str], script: str | None = None, src: Path | None = None
    ) -> subprocess.Popen[bytes]:
        argv = [sys.executable, *(["-m", "mineru_gateway"] if script is None else [script]), *args]
        env = None if src is None else {**os.environ, "PYTHONPATH": str(src / "src")}
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=src
        )
        self.processes.append(proc)
        return proc

    def start(self) -> None:
        for _ in range(self.count):
            port = free_port()
            self._spawn(["sim", "--port", str(port), *self.sim_args])
            self.worker_urls.append(f"http://127.0.0.1:{port}")
        for url in self.worker_urls:
            wait_http_ok(url + "/health", READY_TIMEOUT_S)
        port = free_port()
        workers = ",".join(self.worker_urls)
        args = ["serve", "--port", str(port), "--workers", workers, *self.gateway_args]
        self.gateway_pid = self._spawn(args).pid
        self.gateway_url = f"http://127.0.0.1:{port}"
        wait_http_ok(self.gateway_url + "/ready", READY_TIMEOUT_S)
        if self.baseline_src is not None:
            port = free_port()
            args = ["serve", "--port", str(port), "--workers", workers, *self.gateway_args]
            self.baseline_pid = self._spawn(args, src=self.baseline_src).pid
            self.baseline_url = f"http://127.0.0.1:{port}"
            wait_http_ok(self.baseline_url + "/ready", READY_TIMEOUT_S)
        port = free_port()
        naive = str(Path(__file__).with_name("naive_relay.py"))
        self.naive_pid = self._spawn(["--port", str(port), "--workers", workers], naive).pid
        self.naive_url = f"http://127.0.0.1:{port}"
        wait_http_ok(self.naive_url + "/ready", READY_TIMEOUT_S)
        port = free_port()
        bare = str(Path(__file__).parent / "routing" / "dp_balancer.py")
        self.bare_pid = self._spawn(["--port", str(port), "--workers", workers], bare).pid
        self.bare_url = f"http://127.0.0.1:{port}"
        wait_http_ok(self.bare_url + "/ready", READY_TIMEOUT_S)
        if self.vllm_router:
            port = free_port()
            settings = RouterSettings(vllm_router_bin=self.vllm_router)
            argv = ROUTERS["vllm_router_rr"].argv(port, self.worker_urls, settings)
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.processes.append(proc)
            self.router_pid = proc.pid
            self.router_url = f"http://127.0.0.1:{port}"
            wait_http_ok(self.router_url + "/health", READY_TIMEOUT_S)

    def pid_of(self, mode: str) -> int:
        """The process (tree) of a proxy mode; the gateway's for `gateway`."""
        return {
            "naive-httpx": self.naive_pid,
            "bare-proxy": self.bare_pid,
            "gateway-baseline": self.baseline_pid,
            "vllm-router": self.router_pid,
        }.get(mode, self.gateway_pid)

    def stop(self) -> None:
        for proc in self.processes:
            proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def measure(args: argparse.Namespace, fleet: Fleet) -> list[RunResult]:
    body = json.dumps(
        {
            "model": args.model,
            "messages": [{"role": "user", "content": "Benchmark.\nText Recognition:"}],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
    ).encode()
    results = []
    # Modes alternate within each round, so that a neighbour's load on this shared machine
    # falls on all of them alike; `compare` takes the median of the rounds.
    rounds = [
        (c, mode) for c in args.concurrency for _ in range(args.rounds) for mode in args.modes
    ]
    for concurrency, mode in rounds:
        targets = {
            "direct": fleet.worker_urls,
            "gateway": [fleet.gateway_url],
            "gateway-baseline": [fleet.baseline_url],
            "naive-httpx": [fleet.naive_url],
            "bare-proxy": [fleet.bare_url],
            "vllm-router": [fleet.router_url],
        }[mode]
        proxy_pid = fleet.pid_of(mode)
        cpu_before, started = tree_cpu_seconds(proxy_pid), time.monotonic()
        samples, errors, window = await closed_loop(
            targets, concurrency, body, args.warmup, args.duration
        )
        cpu = tree_cpu_seconds(proxy_pid) - cpu_before
        wall = time.monotonic() - started
        result = summarise(mode, concurrency, samples, errors, window)
        if mode != "direct":
            result.gateway_cpu_s, result.gateway_wall_s = cpu, wall
            result.gateway_cpu_us_per_event = cpu / max(1, result.relayed_events) * 1e6
            result.gateway_cpu_us_per_request = cpu / max(1, result.relayed_requests) * 1e6
        results.append(result)
        print(format_row(result), flush=True)
        await asyncio.sleep(1.0)  # let workers drain between runs
    return results


def format_row(r: RunResult) -> str:
    cpu = f"{r.gateway_cpu_us_per_event:.0f} us/event" if r.gateway_cpu_us_per_event else "-"
    return (
        f"{r.mode:11s} c={r.concurrency:<4d} {r.requests_per_s:7.1f} req/s "
        f"{r.tokens_per_s:8.0f} tok/s  TTFT p50 {r.ttft_p50_ms:7.1f} ms p99 "
        f"{r.ttft_p99_ms:7.1f} ms  errors {r.errors}  gateway cpu {cpu}"
    )


def ratio(value: float, baseline: float) -> float | None:
    return value / baseline if baseline > 0 else None


def median_run(runs: list[RunResult]) -> RunResult:
    """The run with the median throughput of its mode and concurrency."""
    return sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]


def compare(
    results: list[RunResult], proxy: str = "gateway", idle: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """`proxy` against direct calls, per concurrency (median-throughput runs); its CPU also
    against the bare proxy's when that mode ran (the cheapest relay: what the gateway's routing,
    metrics and error handling cost on top). With `idle` (ms of CPU a second with no traffic,
    `idle_cost`), also its CPU per event net of that: what one more event costs, without the
    fixed cost of polling the workers, which a low event rate spreads over few events."""
    rows = []
    grouped: dict[tuple[str, int], list[RunResult]] = {}
    for result in results:
        grouped.setdefault((result.mode, result.concurrency), []).append(result)
    by_key = {key: median_run(runs) for key, runs in grouped.items()}
    for concurrency in sorted({r.concurrency for r in results}):
        direct, via = by_key.get(("direct", concurrency)), by_key.get((proxy, concurrency))
        if not direct or not via:
            continue
        # Total CPU per event over each mode's runs: steadier than one run's.
        bare_cpu = _cpu_per_event(grouped.get(("bare-proxy", concurrency), []))
        cpu_over_bare = _cpu_per_event(grouped[proxy, concurrency]) / bare_cpu if bare_cpu else None
        rows.append(
            {
                "proxy": proxy,
                "concurrency": concurrency,
                "throughput_ratio": ratio(via.tokens_per_s, direct.tokens_per_s),
                "requests_ratio": ratio(via.requests_per_s, direct.requests_per_s),
                "added_ttft_p50_ms": via.ttft_p50_ms - direct.ttft_p50_ms,
                "added_ttft_p99_ms": via.ttft_p99_ms - direct.ttft_p99_ms,
                "gateway_cpu_us_per_event": via.gateway_cpu_us_per_event,
                "gateway_cpu_us_per_request": via.gateway_cpu_us_per_request,
                "cpu_over_bare_proxy": cpu_over_bare,
                "gateway_cpu_us_per_event_net_of_idle": _net_cpu_per_event(
                    grouped[proxy, concurrency], (idle or {}).get(proxy)
                ),
            }
        )
    return rows


def _net_cpu_per_event(runs: list[RunResult], idle_ms_per_s: float | None) -> float | None:
    """Microseconds; None without an idle figure or a run's length."""
    if idle_ms_per_s is None or any(r.gateway_wall_s is None for r in runs):
        return None
    return _cpu_per_event(runs, idle_ms_per_s) * 1e6


def _cpu_per_event(runs: list[RunResult], idle_ms_per_s: float = 0.0) -> float:
    """Seconds of the runs' CPU per relayed event, less `idle_ms_per_s` over their length."""
    cpu = sum(
        (r.gateway_cpu_s or 0.0) - idle_ms_per_s / 1000 * (r.gateway_wall_s or 0.0) for r in runs
    )
    return cpu / max(1, sum(r.relayed_events for r in runs))


async def idle_cost(fleet: Fleet, modes: list[str], seconds: float) -> dict[str, float]:
    """CPU milliseconds a second each proxy spends with no traffic: what it costs to keep its
    view of the workers (the gateway reads their /metrics and /health; measured over the same
    seconds for all, before any load)."""
    proxies = [mode for mode in modes if mode != "direct"]
    before = {mode: tree_cpu_seconds(fleet.pid_of(mode)) for mode in proxies}
    await asyncio.sleep(seconds)
    return {
        mode: (tree_cpu_seconds(fleet.pid_of(mode)) - before[mode]) / seconds * 1e3
        for mode in proxies
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[32, 128, 256]
    )
    parser.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=["direct", "gateway", "bare-proxy", "naive-httpx"],
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="runs per mode, alternating")
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default="opendatalab/MinerU2.5-2509-1.2B")
    parser.add_argument("--time-scale", type=float, default=5.0)
    parser.add_argument("--gateway-log-level", default="info")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--idle", type=float, default=0.0, help="first measure each proxy idle for this many s"
    )
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="a checkout whose gateway runs as mode gateway-baseline (added to --modes)",
    )
    args = parser.parse_args(argv)
    if args.baseline_src is not None and "gateway-baseline" not in args.modes:
        args.modes.append("gateway-baseline")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sim_args = ["--time-scale", str(args.time_scale), "--model-name", args.model]
    gateway_args = ["--log-level", args.gateway_log_level]
    router = ""
    if "vllm-router" in args.modes:
        router = find_vllm_router()
        if not router:
            raise SystemExit("mode vllm-router needs the vllm-router binary: make vllm-router")
    fleet = Fleet(args.workers, sim_args, gateway_args, args.baseline_src, router)
    fleet.start()
    try:
        import uvloop

        idle = uvloop.run(idle_cost(fleet, args.modes, args.idle)) if args.idle else {}
        results = uvloop.run(measure(args, fleet))
    finally:
        fleet.stop()
    summary = [row for mode in PROXIES for row in compare(results, mode, idle)]
    for mode, cost in idle.items():
        print(f"{mode} idle: {cost:.1f} ms of CPU a second")
    for row in summary:
        over_bare = row["cpu_over_bare_proxy"]
        print(
            f"{row['proxy']} c={row['concurrency']}: "
            f"throughput vs direct {row['throughput_ratio']:.3f}, "
            f"added TTFT p50 {row['added_ttft_p50_ms']:+.1f} ms, "
            f"p99 {row['added_ttft_p99_ms']:+.1f} ms"
            + (f", CPU per event {over_bare:.2f}x the bare proxy's" if over_bare else "")
            + (
                f", {net:.1f} us/event net of idle"
                if (net := row["gateway_cpu_us_per_event_net_of_idle"])
                else ""
            )
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "runs": [asdict(r) for r in results],
            "summary": summary,
            "idle_cpu_ms_per_s": idle,
        }
        args.out.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
