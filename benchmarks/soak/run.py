"""`python -m benchmarks.soak [--minutes 10] [--out benchmarks/results/soak.json]`.

The gateway (`mineru-gateway serve`, its own process) in front of simulated workers, under a
closed loop of MinerU-like requests for the whole run. The warm-up goes through every fault once,
in short windows: what a first burst of connections or a first firehose allocates is the
gateway's working set, and a leak is what grows after it. Then the load pauses and the
gateway's RSS and descriptors are read idle (the start); then the soak, one fault window every
`period_s`, in turn from FAULTS; then the load stops, the gateway settles, and the same are read
again (the end), with its in-flight and queue counters, which must be back to zero.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from benchmarks.flow.stand import raise_fd_limit, rss_mb
from benchmarks.routing import fleet
from benchmarks.routing.runs import git_commit, stop_on_sigterm
from benchmarks.routing.workload import Request
from prometheus_client.parser import text_string_to_metric_families

from . import faults, load, report

RESULTS = Path(__file__).resolve().parents[1] / "results"
ADMIN_KEY = "soak-admin"
FAULTS = (
    "kill9",
    "sigstop",
    "storm",
    "garbage",
    "cut_stream",
    "silent",
    "metrics_hang",
    "slow_readers",
    "disconnect_burst",
    "idle_connections",
)
ZEROED = (
    "mineru_gateway_requests_in_flight",
    "mineru_gateway_queue_requests",
    "mineru_gateway_tenant_requests_in_flight",
)


@dataclass(frozen=True)
class Plan:
    minutes: float = 10.0
    warmup_period_s: float = 12.0  # the warm-up's windows: every fault once
    warmup_window_s: float = 8.0
    settle_s: float = 10.0  # idle before each measurement: keep-alive connections age out
    period_s: float = 50.0  # one fault window starts every period
    window_s: float = 20.0
    workers: int = 3
    time_scale: float = 2.0
    clients: int = 12
    sample_s: float = 10.0

    @property
    def pool_limit(self) -> int:
        """Most connections to workers the gateway can have had open at once: every client's
        request on one worker, and a probe, a scrape and a lent worker's requests on each."""
        return (self.workers + 1) * (self.clients + 2) + 4  # the slow readers


@dataclass
class Stand:
    """What the faults act on."""

    gateway: str
    pid: int
    sims: faults.SimFleet
    lent: faults.FaultWorker
    plan: Plan
    current: str = "none"
    log: list[dict[str, Any]] = field(default_factory=list)


def gateway_args(plan: Plan) -> tuple[str, ...]:
    return (
        *("--admin-keys", ADMIN_KEY, "--health-interval-s", "1", "--health-timeout-s", "1"),
        *("--first-byte-timeout-s", "10", "--idle-stream-timeout-s", "5"),
        *("--connect-timeout-s", "2", "--batch-limit", "128"),
    )


def fault_runner(stand: Stand, name: str, index: int, seconds: float) -> Awaitable[dict[str, Any]]:
    """The coroutine of fault `name`'s `index`-th window (workers are faulted in turn)."""
    sims, lent = stand.sims, stand.lent
    worker = index % len(sims.urls)
    runners: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
        "kill9": lambda: faults.kill_and_restart(sims, worker, seconds),
        "sigstop": lambda: faults.freeze(sims, worker, seconds),
        "storm": lambda: faults.lent_for(stand.gateway, ADMIN_KEY, lent, "storm", seconds),
        "garbage": lambda: faults.lent_for(stand.gateway, ADMIN_KEY, lent, "garbage", seconds),
        "cut_stream": lambda: faults.lent_for(stand.gateway, ADMIN_KEY, lent, "cut", seconds),
        "silent": lambda: faults.lent_for(stand.gateway, ADMIN_KEY, lent, "silent", seconds),
        "metrics_hang": lambda: faults.lent_for(
            stand.gateway, ADMIN_KEY, lent, "metrics_hang", seconds
        ),
        "slow_readers": lambda: _with_firehose(stand, seconds),
        "disconnect_burst": lambda: faults.disconnect_burst(stand.gateway, 300, hold_s=3.0),
        "idle_connections": lambda: faults.idle_connections(stand.gateway, 1000, seconds),
    }
    return runners[name]()


async def _with_firehose(stand: Stand, seconds: float) -> dict[str, Any]:
    async with faults.lend(stand.gateway, ADMIN_KEY, stand.lent, "firehose"):
        await _until_serves(stand.gateway, faults.FIREHOSE_MODEL)
        return await faults.slow_readers(stand.gateway, 4, seconds)


async def _until_serves(gateway: str, model: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(50):
            async with session.get(gateway + "/v1/models") as response:
                if model in (await response.text()):
                    return
            await asyncio.sleep(0.2)


async def schedule(stand: Stand, seconds: float, period_s: float, window_s: float) -> None:
    """One `window_s` fault window every `period_s`, FAULTS in turn, until `seconds` are over."""
    started = time.monotonic()
    for index in range(int(seconds // period_s)):
        await asyncio.sleep(max(0.0, started + index * period_s + 2 - time.monotonic()))
        name = FAULTS[index % len(FAULTS)]
        stand.current = name
        began = time.monotonic() - started
        details = await fault_runner(stand, name, index // len(FAULTS), window_s)
        stand.current = "none"
        stand.log.append({"fault": name, "at_s": round(began, 1), **details})
        print(f"  {began:6.1f} s  {name}: {details}", flush=True)


# -- what is measured ---------------------------------------------------------------------------


async def counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    totals = dict.fromkeys(ZEROED, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    async with session.get(url + "/v1/workers") as response:
        workers = orjson.loads(await response.read())["workers"]
    totals["workers_in_flight"] = sum(worker["in_flight"] for worker in workers)
    totals["healthy_workers"] = sum(worker["state"] == "healthy" for worker in workers)
    return totals


def resources(stand: Stand) -> dict[str, Any]:
    """The gateway's RSS and descriptors: in all, and those that are connections kept alive to
    workers (`pool`: aiohttp keeps as many idle ones as its probes and scrapes go on reusing,
    oldest first, so their number drifts with no leak), and the rest."""
    fds = os.listdir(f"/proc/{stand.pid}/fd")
    worker_ports = {_port(url) for url in (*stand.sims.urls, stand.lent.url)}
    pool = sum(remote in worker_ports for _, remote in tcp_connections(stand.pid))
    return {
        "rss_mb": rss_mb(stand.pid),
        "fds": len(fds),
        "pool": pool,
        "other_fds": len(fds) - pool,
    }


def tcp_connections(pid: int) -> list[tuple[int, int]]:
    """(local, remote) ports of the TCP sockets `pid` has open."""
    mine = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            mine.add(os.readlink(fd).removeprefix("socket:[").removesuffix("]"))
    rows = (line.split() for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:])
    return [(_hex_port(row[1]), _hex_port(row[2])) for row in rows if row[9] in mine]


def _hex_port(address: str) -> int:
    return int(address.rsplit(":", 1)[1], 16)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def sampler(stand: Stand, every_s: float, into: list[dict[str, Any]]) -> None:
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while True:
            sample: dict[str, Any] = {"t_s": round(time.monotonic() - started, 1)}
            sample["fault"] = stand.current
            sample |= resources(stand) | await counters(session, stand.gateway)
            into.append(sample)
            await asyncio.sleep(every_s)


async def idle_reading(stand: Stand) -> dict[str, Any]:
    """Resources and counters once the gateway has been idle for `settle_s`."""
    await asyncio.sleep(stand.plan.settle_s)
    async with aiohttp.ClientSession() as session:
        return resources(stand) | await counters(session, stand.gateway)


# -- the run ----------------------------------------------------------------------------------


async def soak(plan: Plan, procs: fleet.Processes) -> dict[str, Any]:
    sims = faults.SimFleet(procs, plan.workers, plan.time_scale)
    for index in range(plan.workers):
        sims.start(index)
    await asyncio.gather(*(sims.ready(index) for index in range(plan.workers)))
    lent = faults.FaultWorker(window_s=plan.window_s)
    await lent.start()
    router = fleet.RunningRouter(
        fleet.ROUTERS["queue"], procs, sims.urls, fleet.RouterSettings(gateway_args(plan))
    )
    try:
        await router.ready()
        stand = Stand(router.url, router.pid, sims, lent, plan)
        return await measured_run(stand)
    finally:
        router.stop()
        await lent.stop()
        sims.stop_all()


async def measured_run(stand: Stand) -> dict[str, Any]:
    plan = stand.plan
    bodies = load.requests(pages=60, seed=1)
    warm, tally, samples = load.Tally(), load.Tally(), list[dict[str, Any]]()
    warmup_s = len(FAULTS) * plan.warmup_period_s + 4
    print(f"warm-up: {warmup_s:.0f} s, every fault once", flush=True)
    await faulted_load(stand, bodies, warm, warmup_s, plan.warmup_period_s, plan.warmup_window_s)
    stand.log.clear()
    start = await idle_reading(stand)
    print(f"start: {start}", flush=True)
    sampling = asyncio.create_task(sampler(stand, plan.sample_s, samples))
    began = time.monotonic()
    await faulted_load(stand, bodies, tally, plan.minutes * 60, plan.period_s, plan.window_s)
    soak_s = time.monotonic() - began
    sampling.cancel()
    end = await idle_reading(stand)
    print(f"end: {end}", flush=True)
    return summarise(stand, start, end, tally, warm, samples, soak_s)


async def faulted_load(
    stand: Stand,
    bodies: Sequence[Request],
    tally: load.Tally,
    seconds: float,
    period_s: float,
    window_s: float,
) -> None:
    """The clients' closed loop for `seconds`, with the fault schedule beside it."""
    clients, label = stand.plan.clients, lambda: stand.current
    await asyncio.gather(
        load.closed_loop(stand.gateway, bodies, clients, load.deadline(seconds), label, tally),
        schedule(stand, seconds, period_s, window_s),
    )


def summarise(
    stand: Stand,
    start: dict[str, Any],
    end: dict[str, Any],
    tally: load.Tally,
    warm: load.Tally,
    samples: list[dict[str, Any]],
    soak_s: float,
) -> dict[str, Any]:
    lost = {kind: n for kind, n in tally.kinds.items() if kind.startswith("lost")}
    ratios = {name: round(end[name] / start[name], 3) for name in ("rss_mb", "fds", "other_fds")}
    # Flat: memory, and every descriptor but the pool of idle connections to workers, which
    # must stay within what the clients and probes can have opened (`Plan.pool_limit`).
    flat = ratios["rss_mb"] <= 1.05 and ratios["other_fds"] <= 1.05
    pool_bounded = end["pool"] <= stand.plan.pool_limit
    return {
        "plan": asdict(stand.plan),
        "soak_s": round(soak_s, 1),
        "requests": sum(tally.kinds.values()),
        "completed": tally.kinds["ok"],
        "kinds": dict(tally.kinds.most_common()),
        "lost": lost,
        "by_fault": {name: dict(kinds.most_common()) for name, kinds in tally.by_fault.items()},
        "warmup_kinds": dict(warm.kinds),
        "warmup_lost": {kind: n for kind, n in warm.kinds.items() if kind.startswith("lost")},
        "start": start,
        "end": end,
        "end_over_start": ratios,
        "flat_within_5_percent": flat,
        "pool_within_limit": pool_bounded,
        "pool_limit": stand.plan.pool_limit,
        "counters_zero_at_end": not any(end[name] for name in (*ZEROED, "workers_in_flight")),
        "peak_rss_mb": max((s["rss_mb"] or 0.0 for s in samples), default=None),
        "peak_fds": max((s["fds"] for s in samples), default=None),
        "faults": stand.log,
        "samples": samples,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=Plan.minutes)
    parser.add_argument("--period-s", type=float, default=Plan.period_s)
    parser.add_argument("--window-s", type=float, default=Plan.window_s)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    raise_fd_limit()
    plan = Plan(minutes=args.minutes, period_s=args.period_s, window_s=args.window_s)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"soak-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    procs = fleet.Processes(logs)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(soak(plan, procs))
    finally:
        procs.stop_all()
    result |= {
        "commit": git_commit(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "logs": str(logs),
    }
    args.out.write_text(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
    report.write(result, args.out.with_suffix(".md"))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    clean = not result["lost"] and not result["warmup_lost"] and result["counters_zero_at_end"]
    return 0 if clean else 1
