"""Processes under test: simulated workers and the routers in front of them, each its own process,
started the way users start them (`python -m mineru_gateway sim|serve`, `vllm-router`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from mineru_gateway.testing import cpu_seconds, free_port, wait_http_ok, wait_until_async

MODEL = "opendatalab/MinerU2.5-2509-1.2B"
READY_TIMEOUT_S = 90.0
HERE = Path(__file__).resolve().parent


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot. Busy counts user, nice and system
    time only: interrupt and softirq time (loopback networking) is charged to no process, so
    leaving it out lets `busy - ours` measure what other processes took."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system = values[0], values[1], values[2]
    return float(user + nice + system), float(sum(values[:8]))


def cpu_sample(parts: dict[str, Sequence[int]]) -> dict[str, float]:
    """CPU seconds so far of each named group of processes, of this process (`loadgen`), and the
    machine's busy and total jiffies (`_busy`, `_total`): two samples make `runs.cpu_share`."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    busy, total = machine_busy()
    sample = {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in parts.items()}
    return sample | {"loadgen": usage.ru_utime + usage.ru_stime, "_busy": busy, "_total": total}


class Processes:
    """Children of this benchmark, stopped by their own ids (never by name)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(
        self, name: str, argv: Sequence[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{name}.log").open("ab")
        full_env = os.environ.copy() | (env or {})
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout)
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in list(reversed(self.procs)):
            self.stop(proc)


@dataclass
class SimWorkers:
    """N simulated vLLM workers; `speeds[i]` below 1 makes worker i a degraded one."""

    procs: Processes
    time_scale: float
    speeds: Sequence[float]
    extra_args: Sequence[str] = ()
    urls: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    _handles: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> None:
        for index, speed in enumerate(self.speeds):
            port = free_port()
            argv = [
                sys.executable,
                *("-m", "mineru_gateway", "sim", "--port", str(port)),
                *("--time-scale", str(self.time_scale), "--speed", str(speed)),
                *("--model-name", MODEL, "--engine-label", str(index)),
                *("--seed", str(index), "--log-level", "warning"),
                *self.extra_args,
            ]
            handle = self.procs.spawn(f"sim-{index}", argv)
            self._handles.append(handle)
            self.urls.append(f"http://127.0.0.1:{port}")
            self.pids.append(handle.pid)
        for url, handle in zip(self.urls, self._handles, strict=True):
            wait_http_ok(url + "/health", READY_TIMEOUT_S, handle)

    def stop(self) -> None:
        for handle in self._handles:
            self.procs.stop(handle)
        self._handles.clear()


async def sim_states(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, Any]]:
    async def one(url: str) -> dict[str, Any]:
        async with session.get(url + "/sim/state") as response:
            state: dict[str, Any] = orjson.loads(await response.read())
            return state

    return list(await asyncio.gather(*(one(url) for url in urls)))


async def wait_idle(
    session: aiohttp.ClientSession, urls: Sequence[str], limit_s: float = 300.0
) -> float:
    """Waits until every worker has nothing running, waiting or open; returns seconds waited."""
    start = time.monotonic()

    async def idle() -> bool:
        states = await sim_states(session, urls)
        return all(s["running"] == 0 and s["waiting"] == 0 and s["in_flight"] == 0 for s in states)

    await wait_until_async(idle, limit_s, "simulated workers idle", poll=0.1)
    return time.monotonic() - start


async def metrics_counts(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Selected `vllm:` series of one worker (summed over labels)."""
    async with session.get(url + "/metrics") as response:
        text = (await response.read()).decode()
    wanted = (
        "vllm:request_success_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:generation_tokens_total",
    )
    out = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


# -- routers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterSpec:
    """One router under test. `kind`: gateway (our `serve`), vllm_dp (vLLM's DP balancer,
    emulated in `dp_balancer.py`) or vllm_router (the PyPI `vllm-router`, a Rust binary)."""

    name: str
    kind: str
    policy: str
    own_counts_only: bool  # sees only the requests it sent itself (issue 3's targets)

    def argv(self, port: int, workers: Sequence[str], settings: RouterSettings) -> list[str]:
        if self.kind == "gateway":
            return [
                sys.executable,
                *("-m", "mineru_gateway", "serve", "--port", str(port)),
                *("--workers", ",".join(workers), "--routing-policy", self.policy),
                *("--log-level", "warning"),
                *settings.gateway_args,
            ]
        if self.kind == "vllm_dp":
            return [
                sys.executable,
                *("-m", "benchmarks.routing.dp_balancer", "--port", str(port)),
                *("--workers", ",".join(workers)),
                *("--interval", str(settings.dp_interval_s)),
            ]
        if self.kind == "vllm_router":
            return [
                settings.vllm_router_bin,
                *("--host", "127.0.0.1", "--port", str(port)),
                *("--worker-urls", *workers, "--policy", self.policy),
                *("--log-level", "warning", "--disable-retries"),
                *("--request-timeout-secs", "3600"),
            ]
        raise ValueError(self.kind)

    @property
    def ready_path(self) -> str:
        return "/health" if self.kind == "vllm_router" else "/ready"


@dataclass(frozen=True)
class RouterSettings:
    gateway_args: tuple[str, ...] = ()
    dp_interval_s: float = 0.1
    vllm_router_bin: str = ""


ROUTERS: dict[str, RouterSpec] = {
    spec.name: spec
    for spec in (
        RouterSpec("queue", "gateway", "queue", own_counts_only=False),
        RouterSpec("p2c", "gateway", "p2c", own_counts_only=False),
        RouterSpec("least_inflight", "gateway", "least_inflight", own_counts_only=True),
        RouterSpec("round_robin", "gateway", "round_robin", own_counts_only=True),
        RouterSpec("vllm_dp", "vllm_dp", "4*waiting+running", own_counts_only=False),
        RouterSpec("vllm_router_p2", "vllm_router", "power_of_two", own_counts_only=True),
        RouterSpec("vllm_router_rr", "vllm_router", "round_robin", own_counts_only=True),
    )
}


class RunningRouter:
    def __init__(
        self,
        spec: RouterSpec,
        procs: Processes,
        workers: Sequence[str],
        settings: RouterSettings,
    ) -> None:
        self.spec = spec
        self.procs = procs
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.handle = procs.spawn(f"router-{spec.name}", spec.argv(port, workers, settings))

    async def ready(self) -> RunningRouter:
        url = self.url + self.spec.ready_path
        await asyncio.to_thread(wait_http_ok, url, READY_TIMEOUT_S, self.handle)
        # The gateway is ready with one healthy worker; give every router time to see all.
        await asyncio.sleep(2.5)
        return self

    @property
    def pid(self) -> int:
        return self.handle.pid

    def stop(self) -> None:
        self.procs.stop(self.handle)


def find_vllm_router() -> str:
    """The `vllm-router` binary: $VLLM_ROUTER, PATH, or the cached virtualenv."""
    candidates = [
        os.environ.get("VLLM_ROUTER", ""),
        shutil.which("vllm-router") or "",
        str(Path.home() / ".cache/mineru-gateway/vllm-router-0.1.17/bin/vllm-router"),
    ]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return ""


def temp_log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="routing-bench-"))
