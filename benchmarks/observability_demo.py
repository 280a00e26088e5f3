"""The observability stack on one machine: 4 simulated workers behind the gateway, scraped by a real
Prometheus with deploy/prometheus/'s rules, under a few minutes of varying load; then a PNG of the
overview dashboard (docs/dashboard-overview.png in the README).

    python benchmarks/observability_demo.py --duration 180 --out docs/dashboard-overview.png

Needs `prometheus` on PATH (`make system-deps`). Workers and gateway run as `mineru-gateway up` on
free ports; Prometheus gets a copy of deploy/prometheus/prometheus.yml with those targets and a
shorter scrape interval (`--scrape-interval`), and loads the real rule files. Everything is stopped
at the end, also on Ctrl-C. `--keep` leaves it running for a look at Prometheus's own UI.

Also imported by tests/deploy/: `local_prometheus_config`, `PrometheusServer` and `run_load`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from mineru_gateway.testing import free_port, free_port_block, wait_http_ok

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"

# The compose targets in deploy/prometheus/prometheus.yml: replaced by local ones. The workers
# come from a file that `mineru-gateway compose` writes (one per NPU): replaced by a static list.
GATEWAY_TARGET = "gateway:9464"
WORKER_TARGETS_FILE = "    file_sd_configs:\n      - files:\n          - targets/workers.yml\n"
NPU_EXPORTER_TARGET = "npu-exporter:8083"
_INTERVAL = re.compile(r"^(\s*)(scrape_interval|scrape_timeout|evaluation_interval): \S+$", re.M)
_RULE_FILE = re.compile(r"^(\s*- )(rules/\S+)$", re.M)

# MinerU's prompts (docs/mineru-client.md), without page images: the simulator charges text tokens.
PROMPTS = ("\nLayout Detection:", "\nText Recognition:", "\nTable Recognition:", "\nFormula:")


# ---------------------------------------------------------------------------------------------
# Prometheus


def local_prometheus_config(
    text: str,
    *,
    gateway: str,
    workers: Sequence[str],
    npu_exporter: str | None,
    interval_s: float,
    rules_dir: Path = PROMETHEUS_DIR,
) -> str:
    """deploy/prometheus/prometheus.yml with local `host:port` targets, `interval_s` for scrapes and
    rule evaluation, and absolute rule file paths (so the real rule files are loaded).

    Raises `ValueError` if the file no longer has the targets this expects (so that a changed
    prometheus.yml fails tests loudly rather than scraping nothing). The workers' target file
    becomes a static list of `workers`. Without `npu_exporter` its target is left as it is.
    """
    interval = f"{interval_s:g}s"
    text, count = _INTERVAL.subn(lambda m: f"{m.group(1)}{m.group(2)}: {interval}", text)
    _expect(count, 3, "scrape_interval, scrape_timeout and evaluation_interval")
    text, count = _RULE_FILE.subn(lambda m: f"{m.group(1)}{rules_dir / m.group(2)}", text)
    _expect(count, 2, "rule files under rules/")
    static = "".join(f"          - {worker}\n" for worker in workers)
    replacements = [
        (f'"{GATEWAY_TARGET}"', f'"{gateway}"'),
        (WORKER_TARGETS_FILE, f"    static_configs:\n      - targets:\n{static}"),
    ]
    if npu_exporter is not None:
        replacements.append((f'"{NPU_EXPORTER_TARGET}"', f'"{npu_exporter}"'))
    for old, new in replacements:
        _expect(text.count(old), 1, repr(old))
        text = text.replace(old, new)
    return text


def _expect(found: int, wanted: int, what: str) -> None:
    if found != wanted:
        raise ValueError(f"prometheus.yml: expected {wanted} x {what}, found {found}")


@dataclass
class PrometheusServer:
    """`prometheus` on 127.0.0.1 with `config`, storing in `directory`; its own process group."""

    config: str
    directory: Path
    binary: str = "prometheus"
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        config = self.directory / "prometheus.yml"
        config.write_text(self.config)
        argv = [
            self.binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={self.directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with open(self.directory / "prometheus.log", "wb") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_http_ok(
            f"{self.url}/-/ready", timeout_s, self.process, self.directory / "prometheus.log"
        )
        return self.url

    def stop(self) -> None:
        _stop_group(self.process)

    @contextlib.contextmanager
    def running(self) -> Iterator[str]:
        try:
            yield self.start()
        finally:
            self.stop()


def _stop_group(process: subprocess.Popen[bytes] | None, timeout_s: float = 15.0) -> None:
    """SIGTERM to the process group we started, SIGKILL if it lingers."""
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout_s)


# ---------------------------------------------------------------------------------------------
# Load


@dataclass(frozen=True)
class Phase:
    """`concurrency` clients in closed loops for `seconds`."""

    seconds: float
    concurrency: int


@dataclass
class LoadResult:
    statuses: Counter[int] = field(default_factory=Counter)
    streamed: int = 0
    transport_errors: int = 0


async def run_load(
    gateway: str,
    model: str,
    phases: Sequence[Phase],
    *,
    unknown_model_every: int = 10,
    max_tokens: int = 48,
    at_fraction: tuple[float, Callable[[], object]] | None = None,
    seed: int = 0,
) -> LoadResult:
    """MinerU-like requests through the gateway, phase after phase: 2 in 3 streamed (with usage),
    1 in 8 to /v1/completions, 1 in `unknown_model_every` for a model that does not exist (404).

    `at_fraction=(0.6, callback)` calls `callback` in a thread once 60% of the time has passed
    (tests stop a worker there).
    """
    result = LoadResult()
    rng = random.Random(seed)
    total_s = sum(phase.seconds for phase in phases)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        hook = asyncio.create_task(_call_at(total_s, at_fraction))
        for phase in phases:
            deadline = time.monotonic() + phase.seconds
            clients = [
                _client(
                    session, gateway, model, deadline, rng, result, unknown_model_every, max_tokens
                )
                for _ in range(phase.concurrency)
            ]
            await asyncio.gather(*clients)
        await hook
    return result


async def _call_at(total_s: float, at_fraction: tuple[float, Callable[[], object]] | None) -> None:
    if at_fraction is not None:
        fraction, callback = at_fraction
        await asyncio.sleep(total_s * fraction)
        await asyncio.to_thread(callback)


async def _client(
    session: aiohttp.ClientSession,
    gateway: str,
    model: str,
    deadline: float,
    rng: random.Random,
    result: LoadResult,
    unknown_model_every: int,
    max_tokens: int,
) -> None:
    while time.monotonic() < deadline:
        number = sum(result.statuses.values()) + result.transport_errors
        name = model if number % unknown_model_every else "no-such-model"
        stream = rng.random() < 2 / 3
        prompt = rng.choice(PROMPTS)
        if rng.random() < 1 / 8:
            path = "/v1/completions"
            body: dict[str, object] = {"model": name, "prompt": prompt}
        else:
            path = "/v1/chat/completions"
            body = {"model": name, "messages": [{"role": "user", "content": prompt}]}
        body |= {"max_tokens": rng.randint(max_tokens // 4, max_tokens), "temperature": 0}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        try:
            async with session.post(f"{gateway}{path}", json=body) as response:
                async for _ in response.content.iter_any():
                    pass
                result.statuses[response.status] += 1
                result.streamed += stream and response.status == 200
        except aiohttp.ClientError:
            result.transport_errors += 1


# ---------------------------------------------------------------------------------------------
# The demo


@dataclass
class GatewayGroup:
    """`mineru-gateway up`: N simulated workers and the gateway, in their own process group."""

    workers: int
    time_scale: float
    directory: Path
    port: int = field(default_factory=free_port)
    worker_base_port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def worker_targets(self) -> list[str]:
        return [f"127.0.0.1:{self.worker_base_port + i}" for i in range(self.workers)]

    @contextlib.contextmanager
    def running(self) -> Iterator[str]:
        self.worker_base_port = self.worker_base_port or free_port_block(self.workers)
        argv = [
            sys.executable,
            "-m",
            "mineru_gateway",
            "up",
            f"--workers={self.workers}",
            f"--worker-base-port={self.worker_base_port}",
            f"--port={self.port}",
            f"--sim-arg=--time-scale={self.time_scale:g}",
            "--log-level=warning",
        ]
        log_path = self.directory / "gateway.log"
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_http_ok(f"{self.url}/ready", 60, self.process, log_path)
            yield self.url
        finally:
            _stop_group(self.process)


def _model(gateway: str) -> str:
    with urllib.request.urlopen(f"{gateway}/v1/models", timeout=5) as response:
        model: str = json.load(response)["data"][0]["id"]
        return model


def demo_phases(duration_s: float) -> list[Phase]:
    """A quiet start, a ramp to a busy plateau, and a cool-down."""
    shares = ((0.15, 2), (0.2, 8), (0.35, 24), (0.15, 12), (0.15, 3))
    return [Phase(duration_s * share, concurrency) for share, concurrency in shares]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180, help="seconds of load (180)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard-overview.png")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARDS / "overview.json")
    parser.add_argument("--scrape-interval", type=float, default=2.0, help="seconds (2)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="simulator time scale (1)")
    parser.add_argument("--keep", action="store_true", help="keep running until Ctrl-C")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Ctrl-C and SIGTERM both unwind the `with` blocks, which stop what was started (also when
    # started in the background, where a shell leaves SIGINT ignored).
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="mineru-observability-") as temp:
        directory = Path(temp)
        group = GatewayGroup(4, args.time_scale, directory)
        with group.running() as gateway:
            config = local_prometheus_config(
                (PROMETHEUS_DIR / "prometheus.yml").read_text(),
                gateway=f"127.0.0.1:{group.port}",
                workers=group.worker_targets,
                npu_exporter=None,
                interval_s=args.scrape_interval,
            )
            with PrometheusServer(config, directory).running() as prometheus:
                print(f"gateway {gateway}, Prometheus {prometheus}", flush=True)
                started = time.time()
                phases = demo_phases(args.duration)
                result = asyncio.run(run_load(gateway, _model(gateway), phases))
                print(f"load done: HTTP statuses {dict(result.statuses)}", flush=True)
                time.sleep(3 * args.scrape_interval)  # the last scrapes and rule evaluations
                range_s = time.time() - started + 10
                snapshot = [
                    sys.executable,
                    str(Path(__file__).with_name("dashboard_snapshot.py")),
                    f"--prometheus={prometheus}",
                    f"--dashboard={args.dashboard}",
                    f"--out={args.out}",
                    f"--range={int(range_s)}s",
                    f"--rate-interval={int(max(4 * args.scrape_interval, 15))}s",
                ]
                code = subprocess.call(snapshot)
                if args.keep:
                    print("running; Ctrl-C or SIGTERM stops", flush=True)
                    with contextlib.suppress(KeyboardInterrupt):
                        signal.pause()
    return code


if __name__ == "__main__":
    sys.exit(main())
