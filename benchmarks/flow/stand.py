"""What the scenarios run on: simulated workers (`routing/fleet.py`), one gateway at a time in
front of them (flow control on or off), and what is read off them: CPU, peak RSS, /metrics."""

from __future__ import annotations

import asyncio
import hashlib
import resource
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from benchmarks.routing import fleet, loadgen, workload
from benchmarks.routing.runs import (
    FOREIGN_CPU_LIMIT,
    MACHINE_BUSY_LIMIT,
    cpu_share,
    least_disturbed,
)

from mineru_gateway.testing import process_tree

from .common import Clock

MODES = ("pass_through", "flow_control")  # the baseline first


def tenant_label(key: str) -> str:
    """The gateway's label for an API key that is its own tenant (`api/tenants.py`)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def raise_fd_limit() -> int:
    """Thousands of open connections need more descriptors than the usual 1024 (children
    inherit the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def gateway_args(mode: str, extra: Sequence[str]) -> tuple[str, ...]:
    flow = "true" if mode == "flow_control" else "false"
    return ("--flow-control", flow, *extra)


@dataclass
class Gateway:
    """A running `mineru-gateway serve` with the `queue` routing policy."""

    mode: str
    router: fleet.RunningRouter
    args: tuple[str, ...]

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def pid(self) -> int:
        return self.router.pid

    def stop(self) -> None:
        self.router.stop()


async def start_gateway(
    procs: fleet.Processes, workers: Sequence[str], mode: str, extra: Sequence[str]
) -> Gateway:
    args = gateway_args(mode, extra)
    router = fleet.RunningRouter(
        fleet.ROUTERS["queue"], procs, workers, fleet.RouterSettings(gateway_args=args)
    )
    try:
        await router.ready()
    except BaseException:
        router.stop()
        raise
    return Gateway(mode, router, args)


@contextmanager
def sim_workers(
    procs: fleet.Processes, time_scale: float, count: int
) -> Iterator[fleet.SimWorkers]:
    """`count` identical simulated workers, stopped on the way out."""
    workers = fleet.SimWorkers(procs, time_scale, [1.0] * count)
    workers.start()
    try:
        yield workers
    finally:
        workers.stop()


async def guarded(attempt: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """`attempt`, run again (at most twice) when other processes took over half a core or the
    machine was nearly saturated (`runs.least_disturbed`): this machine is shared."""
    best, attempts = await least_disturbed(attempt, lambda r: r["cpu"], MACHINE_BUSY_LIMIT)
    best["attempts"] = attempts
    return best


def first_token_phases(
    clock: Clock, warmup_s: float, window_s: float, tail_cap_s: float
) -> loadgen.Phases:
    """Open-loop phases in wall time from engine seconds; the tail waits for first tokens."""
    return loadgen.Phases(
        warmup_s=clock.wall(warmup_s),
        window_s=clock.wall(window_s),
        tail_cap_s=clock.wall(tail_cap_s),
        wait_for="first_token",
    )


@dataclass
class OpenLoop:
    """One open-loop load through a gateway, and what was read around it."""

    outcome: loadgen.RunOutcome
    cut: float  # perf_counter when the load ended and everything still open was cancelled
    cpu: dict[str, float]
    foreign_cores_before: float
    metrics_before: dict[str, Any]


async def open_loop(
    session: aiohttp.ClientSession,
    gateway: Gateway,
    worker_pids: Sequence[int],
    arrivals: Sequence[workload.Arrival],
    phases: loadgen.Phases,
    quiet_wait_s: float,
) -> OpenLoop:
    """Waits for a quiet machine, then sends `arrivals` through `gateway`, metering the CPU of
    the gateway and the workers."""
    parts = {"gateway": process_tree(gateway.pid), "workers": worker_pids}
    foreign = await wait_quiet(parts, quiet_wait_s)
    meter = CpuMeter(parts)
    before = await gateway_metrics(session, gateway.url)
    meter.start()
    outcome = await loadgen.run_open_loop(session, gateway.url, arrivals, phases)
    cut = time.perf_counter()
    cpu = meter.stop()
    return OpenLoop(outcome, cut, cpu, foreign, before)


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM (peak resident set) of `pid` and its descendants, MiB."""
    total, seen = 0, False
    for each in process_tree(pid):
        try:
            for line in Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
                    seen = True
        except OSError:
            continue
    return round(total / 1024, 1) if seen else None


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


async def wait_quiet(parts: Mapping[str, Sequence[int]], limit_s: float) -> float:
    """Waits (up to `limit_s`) until processes that are not ours use under
    `runs.FOREIGN_CPU_LIMIT` cores (this machine is shared); returns the last foreign load seen."""
    deadline = time.monotonic() + limit_s
    while True:
        before = fleet.cpu_sample(dict(parts))
        await asyncio.sleep(1.0)
        foreign = cpu_share(before, fleet.cpu_sample(dict(parts)), 1.0)["foreign_cores"]
        if foreign < FOREIGN_CPU_LIMIT or time.monotonic() > deadline:
            if foreign >= FOREIGN_CPU_LIMIT:
                print(f"  (other processes still use {foreign:.2f} cores: going on)", flush=True)
            return foreign


class CpuMeter:
    """Cores used by the gateway, the workers and this load generator between `start` and
    `stop` (`fleet.cpu_sample`, `runs.cpu_share`)."""

    def __init__(self, parts: Mapping[str, Sequence[int]]) -> None:
        self.parts = dict(parts)
        self._before: dict[str, float] = {}
        self._started = 0.0

    def start(self) -> None:
        self._before = fleet.cpu_sample(self.parts)
        self._started = asyncio.get_running_loop().time()

    def stop(self) -> dict[str, float]:
        wall = max(1e-3, asyncio.get_running_loop().time() - self._started)
        return cpu_share(self._before, fleet.cpu_sample(self.parts), wall)


async def gateway_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """The flow-control series of the gateway's /metrics, summed by their interesting labels."""
    async with session.get(url + "/metrics") as response:
        text = (await response.read()).decode()
    wanted = {
        "mineru_gateway_rejections_total": ("tenant", "reason"),
        "mineru_gateway_tenant_requests_total": ("tenant", "status"),
        "mineru_gateway_tenant_tokens_total": ("tenant", "kind"),
        "mineru_gateway_queue_wait_seconds_count": ("tenant",),
        "mineru_gateway_queue_wait_seconds_sum": ("tenant",),
        "mineru_gateway_queue_requests": ("tenant", "priority"),
        "mineru_gateway_queue_bytes": (),
    }
    out: dict[str, dict[str, float]] = {name: {} for name in wanted}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name = line.split(" ", 1)[0]
        if name not in wanted:
            continue
        labels = _labels(rest.rsplit("}", 1)[0]) if rest else {}
        key = ",".join(labels.get(label, "") for label in wanted[name]) or "all"
        out[name][key] = out[name].get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _labels(text: str) -> dict[str, str]:
    labels = {}
    for part in text.split('",'):
        if "=" in part:
            key, value = part.split("=", 1)
            labels[key.strip()] = value.strip().strip('"')
    return labels


def metrics_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Counters' increase between two `gateway_metrics` (gauges: the later value)."""
    out: dict[str, dict[str, float]] = {}
    for name, series in after.items():
        gauge = name in ("mineru_gateway_queue_requests", "mineru_gateway_queue_bytes")
        base = before.get(name, {})
        out[name] = {
            k: round(v if gauge else v - base.get(k, 0.0), 3)
            for k, v in series.items()
            if gauge or v - base.get(k, 0.0)
        }
    return out


class Sampler:
    """Every `interval` wall seconds: the gateway's queue per tenant and the workers' running
    and waiting requests (from the simulators' /sim/state), for the time-series plots."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        gateway: str,
        workers: Sequence[str],
        interval: float,
        origin: float,
        simulated: bool = True,
    ) -> None:
        self.session, self.gateway, self.workers = session, gateway, workers
        self.interval, self.origin, self.simulated = interval, origin, simulated
        self.samples: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> list[dict[str, Any]]:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return self.samples

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            sample: dict[str, Any] = {"t": round(time.perf_counter() - self.origin, 2)}
            try:
                metrics = await gateway_metrics(self.session, self.gateway)
                queue = metrics["mineru_gateway_queue_requests"]
                sample["queued"] = {k.split(",")[0]: v for k, v in queue.items() if v}
                if self.simulated:
                    states = await fleet.sim_states(self.session, self.workers)
                    sample["running"] = sum(s["running"] for s in states)
                    sample["waiting"] = sum(s["waiting"] for s in states)
                else:
                    counts = await asyncio.gather(
                        *(fleet.metrics_counts(self.session, url) for url in self.workers)
                    )
                    sample["running"] = sum(c["vllm:num_requests_running"] for c in counts)
                    sample["waiting"] = sum(c["vllm:num_requests_waiting"] for c in counts)
            except (aiohttp.ClientError, TimeoutError, KeyError):
                sample["error"] = True
            self.samples.append(sample)
            await asyncio.sleep(max(0.05, self.interval - (loop.time() - now)))
