"""What a fleet of W workers costs one gateway replica, at rest and per request
(docs/operate/fleet-scale.md).

For each W (8, 128, 512, 1,024 by default), a fake fleet (fake.py: W real listening ports in one
process) and `mineru-gateway serve` with its default settings, then, all CPU from /proc (the
machine is shared: wall time says little):

- at rest: the gateway's CPU (cores), the GETs each worker answers per second (from the fleet's
  own counts), the gateway's RSS;
- `/metrics`: its size, and the CPU of one scrape (scrapes far enough apart that none is a cached
  render);
- requests: after 2 per worker unmeasured (the gateway connects to each worker once), `--requests`
  small chat completions in 3 rounds, `--concurrency` at a time; the gateway's CPU per request,
  less its CPU at rest over the same time (the rounds' median), and relative to W=8;
- decisions, in this process: the time of one routing decision and lease (`Dispatcher.acquire` and
  release) over a registry of W workers of which a quarter are full, p50 and p99;
- replicas: `--replicas` gateways over the smallest fleet (where each worker is read most often),
  sharing fleet state in one `redis-server`: the GETs each worker answers them all, counted by the
  fleet.

    python -m benchmarks.fleet --out benchmarks/results/fleet.json

`--baseline-src DIR` also times the decisions of another checkout's code (its `src`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from benchmarks.cache.__main__ import redis
from benchmarks.fleet.fake import CONNECTIONS
from benchmarks.fleet.report import render

from mineru_gateway.testing import cpu_seconds, free_port, process_tree
from mineru_gateway.workers.health import MODELS_EVERY_S

WARM_S = 5.0  # after every worker is healthy: the first reads and listings settle
IDLE_S = 15.0
SCRAPES = 3
WARM_REQUESTS_PER_WORKER = 2  # per process, before the requests measured
ROUNDS = 3  # of the requests measured
SCRAPE_GAP_S = 1.5  # longer than a cached render is kept (metrics.py, ExpositionCache)
REPLICAS, PROCESSES_PER_REPLICA = 4, 8  # the deployment the GET target is stated for
MODEL = "fleet-model"


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


def tree_cpu(pid: int) -> float:
    return sum(cpu_seconds(member) for member in process_tree(pid))


def get(url: str, timeout: float = 30.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        body: bytes = answer.read()
        return body


@contextlib.contextmanager
def fleet(workers: int) -> Iterator[tuple[list[str], str]]:
    """The fake fleet: its workers' URLs and its control URL."""
    command = [sys.executable, "-m", "benchmarks.fleet.fake", "--workers", str(workers)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        started = orjson.loads(process.stdout.readline())
        urls = [f"http://127.0.0.1:{port}" for port in started["ports"]]
        yield urls, f"http://127.0.0.1:{started['control']}/stats"
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def gateway(urls: list[str], settings: dict[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """`mineru-gateway serve` over `urls`, once every worker is healthy: its URL and pid."""
    port = free_port()
    env = {**os.environ, "MINERU_GATEWAY_WORKERS": ",".join(urls), **(settings or {})}
    command = [sys.executable, "-m", "mineru_gateway", "serve", "--port", str(port)]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(OSError, ValueError):
                if orjson.loads(get(url + "/ready", 5))["healthy_workers"] == len(urls):
                    break
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"the gateway over {len(urls)} workers never became ready")
            time.sleep(0.5)
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def gets_per_worker(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict:
    ports = set(after)
    rates = []
    by_path: dict[str, float] = {}
    for port in ports:
        total = 0
        for path, count in after[port].items():
            if path == CONNECTIONS:
                continue
            done = count - before.get(port, {}).get(path, 0)
            total += done
            by_path[path] = by_path.get(path, 0) + done
        rates.append(total / seconds)
    count = max(1, len(ports))
    return {
        "mean": statistics.fmean(rates) if rates else 0.0,
        "max": max(rates, default=0.0),
        "by_path": {path: done / seconds / count for path, done in sorted(by_path.items())},
    }


async def load(url: str, requests: int, concurrency: int) -> list[float]:
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    )
    latencies: list[float] = []
    left = iter(range(requests))

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in left:
            start = time.perf_counter()
            async with session.post(
                url + "/v1/chat/completions",
                data=body,
                headers={"content-type": "application/json"},
            ) as answer:
                await answer.read()
                if answer.status != 200:
                    raise RuntimeError(f"status {answer.status}")
            latencies.append(time.perf_counter() - start)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return latencies


def connections(stats: dict[str, Any]) -> int:
    """Connections the fleet has accepted."""
    return sum(paths.get(CONNECTIONS, 0) for paths in stats.values())


def measure(workers: int, requests: int, concurrency: int) -> dict[str, Any]:
    with fleet(workers) as (urls, stats), gateway(urls) as (url, pid):
        time.sleep(WARM_S)
        pids = process_tree(pid)
        counts, cpu, start = orjson.loads(get(stats)), tree_cpu(pid), time.monotonic()
        time.sleep(IDLE_S)
        idle_s = time.monotonic() - start
        idle_cores = (tree_cpu(pid) - cpu) / idle_s
        idle_counts = orjson.loads(get(stats))
        gets = gets_per_worker(counts, idle_counts, idle_s)
        idle_connections = (connections(idle_counts) - connections(counts)) / idle_s
        rss = rss_mib(pids)
        scrape_cpu, size = [], 0
        for _ in range(SCRAPES):
            time.sleep(SCRAPE_GAP_S)
            cpu, start = tree_cpu(pid), time.monotonic()
            size = len(get(url + "/metrics"))
            spent = tree_cpu(pid) - cpu - idle_cores * (time.monotonic() - start)
            scrape_cpu.append(max(0.0, spent))
        # Connected to every worker first: the steady state is measured, not the first
        # connection to each worker (what it costs: the report).
        asyncio.run(load(url, WARM_REQUESTS_PER_WORKER * workers, concurrency))
        # Rounds, and their median: other jobs on the machine move a single round's figure.
        rounds, latencies, walls = [], [], []
        opened = connections(orjson.loads(get(stats)))
        for _ in range(ROUNDS):
            cpu, start = tree_cpu(pid), time.monotonic()
            latencies += asyncio.run(load(url, requests // ROUNDS, concurrency))
            wall = time.monotonic() - start
            walls.append(wall)
            rounds.append((tree_cpu(pid) - cpu - idle_cores * wall) / (requests // ROUNDS))
        request_cpu, wall = statistics.median(rounds), sum(walls)
        # Those the reads and probes open at rest left out: what the requests opened.
        opened = connections(orjson.loads(get(stats))) - opened - idle_connections * wall
    return {
        "workers": workers,
        "idle_cores": idle_cores,
        "gets_per_worker_per_s": gets,
        "rss_mib": rss,
        "metrics_bytes": size,
        "scrape_cpu_ms": statistics.median(scrape_cpu) * 1e3,
        "cpu_us_per_request": request_cpu * 1e6,
        "latency_ms_p50": statistics.median(latencies) * 1e3,
        "requests_per_s": ROUNDS * (requests // ROUNDS) / wall,
        "cpu_us_per_request_rounds": [r * 1e6 for r in rounds],
        "connections_per_request": max(0.0, opened) / (ROUNDS * (requests // ROUNDS)),
    }


def measure_replicas(workers: int, replicas: int) -> dict[str, Any]:
    """The GETs each worker answers `replicas` gateways sharing fleet state."""
    with contextlib.ExitStack() as stack:
        store = redis(stack)
        urls, stats = stack.enter_context(fleet(workers))
        shared = {"MINERU_GATEWAY_FLEET_STATE": store}
        for _ in range(replicas):
            stack.enter_context(gateway(urls, shared))
        time.sleep(WARM_S)  # every replica has counted the others (a few share periods)
        counts, start = orjson.loads(get(stats)), time.monotonic()
        time.sleep(IDLE_S)
        gets = gets_per_worker(counts, orjson.loads(get(stats)), time.monotonic() - start)
    return {
        "workers": workers,
        "replicas": replicas,
        "gets_per_worker_per_s": gets,
    }


DECISIONS = """
import asyncio, inspect, json, random, sys, time
from mineru_gateway.cost import Cost
from mineru_gateway.flow import FairQueue, RoomPolicy, TenantPolicy
from mineru_gateway.routing import QueueLength
from mineru_gateway.workers.dispatcher import Admission, Dispatcher
from mineru_gateway.workers.registry import WorkerRegistry
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient

async def main(size, decisions):
    extra = {}
    if "sample" in inspect.signature(WorkerRegistry).parameters:
        extra["sample"] = 8
    registry = WorkerRegistry([f"http://w{n}:1" for n in range(size)],
        UpstreamClient(Timeouts(1, 1, 1)), QueueLength(), batch_limit=4,
        rng=random.Random(1), **extra)
    for worker in registry.membership.workers:
        worker.healthy, worker.models = True, {"m": {"id": "m"}}
    dispatcher = Dispatcher(registry, FairQueue(), RoomPolicy(headroom=0.0, min_headroom=0))
    cost = Cost(prefill=0.0, hold=1.0)
    for worker in registry.membership.workers[::4]:
        for _ in range(4):
            registry.routing.acquire(worker, cost)
    ask = Admission(TenantPolicy("a"), 0, cost, 100, "m")
    held = [await dispatcher.acquire(ask) for _ in range(size)]  # a request on most others
    times = []
    for _ in range(decisions):
        start = time.perf_counter_ns()
        grant = await dispatcher.acquire(ask)
        grant.release()
        times.append(time.perf_counter_ns() - start)
    times.sort()
    print(json.dumps({"p50_us": times[len(times) // 2] / 1e3,
                      "p99_us": times[int(len(times) * 0.99)] / 1e3}))
    for grant in held:
        grant.release()

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
"""


def decision_times(size: int, decisions: int, src: str | None = None) -> dict[str, float]:
    """The time of one decision over `size` workers, by this checkout's code or `src`'s."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    command = [sys.executable, "-c", DECISIONS, str(size), str(decisions)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def summarise(
    runs: list[dict[str, Any]], replica_runs: list[dict[str, Any]], decisions: dict[str, Any]
) -> dict[str, Any]:
    """The targets (docs/operate/fleet-scale.md), from the runs."""
    base = next(r["cpu_us_per_request"] for r in runs if r["workers"] == 8)
    for run in runs:
        run["cpu_per_request_vs_w8"] = run["cpu_us_per_request"] / base
    largest = max(r["workers"] for r in runs)
    at_largest = [r for r in runs if r["workers"] == largest]
    # The model listing comes every MODELS_EVERY_S, maybe not within the window: counted in anyway.
    worst_rate = max(r["gets_per_worker_per_s"]["max"] for r in runs) + 1 / MODELS_EVERY_S
    shared = [run["gets_per_worker_per_s"]["max"] for run in replica_runs]
    return {
        "largest_fleet": largest,
        "cpu_per_request_vs_w8_at_largest": max(r["cpu_per_request_vs_w8"] for r in at_largest),
        "idle_cores_at_largest": max(r["idle_cores"] for r in at_largest),
        "metrics_bytes_at_largest": max(r["metrics_bytes"] for r in at_largest),
        "gets_per_worker_per_s_one_replica_worst": worst_rate,
        "gets_per_worker_per_s_4_replicas_alone": REPLICAS * worst_rate,
        "gets_per_worker_per_s_replicas_sharing": max(shared, default=0.0) + 1 / MODELS_EVERY_S,
        "decisions": decisions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="8,128,512,1024")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--decisions", type=int, default=3000)
    parser.add_argument("--baseline-src", default=None)
    parser.add_argument("--replicas", type=int, default=REPLICAS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fleet.json"))
    parser.add_argument(
        "--report-only", action="store_true", help="write the .md from the --out JSON only"
    )
    args = parser.parse_args()
    if args.report_only:
        result = json.loads(args.out.read_text())
        decided = result["summary"]["decisions"]
        result["summary"] = summarise(result["runs"], result.get("replica_runs", []), decided)
        write(args.out, result)
        return
    sizes = [int(n) for n in args.workers.split(",")]
    decisions: dict[str, Any] = {}
    for size in sizes:
        decisions[str(size)] = {"this": decision_times(size, args.decisions)}
        if args.baseline_src:
            decisions[str(size)]["baseline"] = decision_times(
                size, args.decisions, args.baseline_src
            )
        print(f"decisions W={size}: {decisions[str(size)]}", flush=True)
    runs = []
    for size in sizes:
        run = measure(size, args.requests, args.concurrency)
        print(json.dumps(run), flush=True)
        runs.append(run)
    replica_runs = []
    if args.replicas > 1:
        replica_runs.append(measure_replicas(min(sizes), args.replicas))
        print(json.dumps(replica_runs[-1]), flush=True)
    result = {
        "command": "python -m benchmarks.fleet " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "runs": runs,
        "replica_runs": replica_runs,
        "summary": summarise(runs, replica_runs, decisions),
    }
    write(args.out, result)
    print(json.dumps(result["summary"], indent=2))


def write(out: Path, result: dict[str, Any]) -> None:
    """`out` (JSON) and its report next to it (.md)."""
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(render(result))
