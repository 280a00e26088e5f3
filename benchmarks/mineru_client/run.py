"""MinerU's own client parsing a batch of pages through an overloaded gateway (issue 13, measure 4).

Each run starts two simulated workers and a gateway in front of them with the run's limits, runs
`driver.py` in the client's own virtualenv (`client_venv.py`: mineru-vl-utils 2.0.7 as shipped)
on `--pages` synthetic pages, reads the gateway's /metrics, and stops everything. The question:
does every page complete when the gateway sheds with 429 + Retry-After, which the client retries?

    python -m benchmarks.mineru_client --pages 100 --out benchmarks/results/flow_mineru_client.json

The run `memory_cache_two_passes` (not among the defaults; benchmarks/cache runs it) parses the
same batch twice, a new client process each time, through a gateway with the memory cache, and
counts the worker requests of each pass: a second pass should need none (docs/cache.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import client_venv, report

DRIVER = Path(__file__).resolve().with_name("driver.py")
API_KEY = "sk-mineru-batch"
READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Run:
    """One configuration: the gateway's flags and the client's settings."""

    name: str
    what: str
    gateway: tuple[str, ...] = ()
    mode: str = "pages"
    max_concurrency: int = 100
    max_retries: int = 3
    api_key: bool = False
    passes: int = 1  # the same batch parsed again, by a new client process each time


RUNS = {
    run.name: run
    for run in (
        Run("baseline", "gateway limits off (default queue of 4096): nothing is shed"),
        Run(
            "max_queued_8",
            "whole gateway queue limited to 8 requests: the client's 100 at once overflow",
            ("--max-queued", "8"),
        ),
        Run(
            "tenant_max_queued_8",
            "one API key = one tenant, that tenant's queue limited to 8 (whole queue unlimited)",
            ("--tenant-max-queued", "8"),
            api_key=True,
        ),
        Run(
            "max_queued_32",
            "operator's fix, partly: a larger queue, still below the client's 100 at once",
            ("--max-queued", "32"),
        ),
        Run(
            "max_queued_96",
            "operator's fix: queue >= client concurrency minus what the workers hold",
            ("--max-queued", "96"),
        ),
        Run(
            "max_queued_8_concurrency_16",
            "user's fix: MinerU's max_concurrency (vlm.max_concurrency) lowered to 16",
            ("--max-queued", "8"),
            max_concurrency=16,
        ),
        Run(
            "max_queued_8_retries_10",
            "user's fix via the library API only: MinerUClient(max_retries=10)",
            ("--max-queued", "8"),
            max_retries=10,
        ),
        Run(
            "max_queued_8_windows",
            "as MinerU parses a document: windows of 64 pages, one batch call each",
            ("--max-queued", "8"),
            mode="windows",
        ),
        Run(
            "max_queued_8_windows_concurrency_16",
            "as MinerU parses a document, with max_concurrency lowered to 16",
            ("--max-queued", "8"),
            mode="windows",
            max_concurrency=16,
        ),
        Run(
            "memory_cache_two_passes",
            "the same batch parsed twice through a gateway with the memory cache",
            ("--cache", "memory"),
            passes=2,
        ),
    )
}
# The flow-control runs; `memory_cache_two_passes` is the cache benchmark's (benchmarks/cache).
DEFAULT_RUNS = tuple(name for name, run in RUNS.items() if run.passes == 1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Stand:
    """Processes of one run, stopped by their own process groups (never by name)."""

    log_dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> int:
        with (self.log_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=os.environ | (env or {}),
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc.pid

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        self.procs.clear()


def wait_ok(url: str, stand: Stand, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url, timeout=2) as response,
        ):
            if response.status == 200:
                return
        if any(proc.poll() is not None for proc in stand.procs):
            raise RuntimeError(f"a process exited before {url} answered; logs: {stand.log_dir}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {timeout_s:g} s; logs: {stand.log_dir}")
        time.sleep(0.2)


def scrape(url: str) -> dict[str, dict[str, float]]:
    """The gateway's flow-control counters, by their interesting labels."""
    wanted = {
        "mineru_gateway_rejections_total": ("reason",),
        "mineru_gateway_tenant_requests_total": ("status",),
        "mineru_gateway_queue_wait_seconds_count": (),
        "mineru_gateway_queue_wait_seconds_sum": (),
    }
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, dict[str, float]] = {name: {} for name in wanted}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        if name not in wanted:
            continue
        labels = dict(
            (k.strip(), v.strip().strip('"'))
            for k, _, v in (part.partition("=") for part in rest.rstrip("}").split('",'))
            if k
        )
        key = ",".join(labels.get(label, "") for label in wanted[name]) or "all"
        out[name][key] = out[name].get(key, 0.0) + float(value)
    return out


def gateway_figures(metrics: dict[str, dict[str, float]]) -> dict[str, Any]:
    rejections = metrics["mineru_gateway_rejections_total"]
    statuses = metrics["mineru_gateway_tenant_requests_total"]
    waits = metrics["mineru_gateway_queue_wait_seconds_count"].get("all", 0.0)
    wait_sum = metrics["mineru_gateway_queue_wait_seconds_sum"].get("all", 0.0)
    return {
        "rejections_total": int(sum(rejections.values())),
        "rejections_by_reason": {k: int(v) for k, v in rejections.items()},
        "tenant_requests_429": int(statuses.get("429", 0)),
        "tenant_requests_by_status": {k: int(v) for k, v in sorted(statuses.items())},
        "queue_wait_mean_s": round(wait_sum / waits, 3) if waits else None,
    }


def start_stand(
    stand: Stand, args: argparse.Namespace, gateway_argv: list[str], seeds: Sequence[int]
) -> tuple[str, list[str]]:
    """`args.workers` simulated workers (`args.time_scale`, `args.max_num_seqs`, one seed each)
    and a gateway in front of them with `gateway_argv`: the gateway's URL once it is ready, and
    the workers'."""
    workers = []
    for index, seed in zip(range(args.workers), seeds, strict=True):
        port = free_port()
        stand.spawn(
            f"sim-{index}",
            [
                sys.executable,
                *("-m", "mineru_gateway", "sim", "--port", str(port)),
                *("--time-scale", str(args.time_scale)),
                *("--max-num-seqs", str(args.max_num_seqs)),
                *("--seed", str(seed), "--engine-label", str(index)),
                *("--log-level", "warning"),
            ],
        )
        workers.append(f"http://127.0.0.1:{port}")
    for url in workers:
        wait_ok(url + "/health", stand)
    port = free_port()
    stand.spawn(
        "gateway",
        [
            sys.executable,
            *("-m", "mineru_gateway", "serve", "--port", str(port)),
            *("--log-level", "warning"),
            *("--workers", ",".join(workers)),
            *gateway_argv,
        ],
    )
    gateway = f"http://127.0.0.1:{port}"
    wait_ok(gateway + "/ready", stand)
    return gateway, workers


def execute(run: Run, args: argparse.Namespace, python: Path, log_root: Path) -> dict[str, Any]:
    log_dir = log_root / run.name
    log_dir.mkdir(parents=True, exist_ok=True)
    stand = Stand(log_dir)
    try:
        gateway_argv = [
            *("--batch-limit", str(args.max_num_seqs)),
            *(("--api-keys", API_KEY) if run.api_key else ()),
            *run.gateway,
        ]
        gateway, workers = start_stand(stand, args, gateway_argv, seeds=range(args.workers))
        driver_argv = [
            *("--url", gateway, "--pages", str(args.pages), "--mode", run.mode),
            *("--max-concurrency", str(run.max_concurrency)),
            *("--max-retries", str(run.max_retries), "--seed", str(args.seed)),
        ]
        env = os.environ | {"MINERU_VL_API_KEY": API_KEY if run.api_key else ""}
        env.pop("MINERU_VL_MODEL_NAME", None)
        passes = []
        for _ in range(run.passes):
            before = arrived(workers)
            cpu = _children_cpu_s()
            started = time.perf_counter()
            with (log_dir / "driver.stderr").open("wb") as stderr:
                done = subprocess.run(
                    [str(python), str(DRIVER), *driver_argv],
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    timeout=args.run_timeout_s,
                    check=False,
                )
            elapsed = time.perf_counter() - started
            if done.returncode != 0:
                tail = (log_dir / "driver.stderr").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"driver failed ({done.returncode}) in {run.name}:\n{tail}")
            client_cpu = _children_cpu_s() - cpu
            passes.append((json.loads(done.stdout), arrived(workers) - before, elapsed, client_cpu))
        metrics = scrape(gateway)
    finally:
        stand.stop()
    client, _, elapsed, _ = passes[0]
    accounted = client["pages_completed"] + client["pages_failed"]
    return {
        "name": run.name,
        "what": run.what,
        "gateway_args": gateway_argv,  # the key is masked in the report (`report._row`)
        "client_settings": {
            "mode": run.mode,
            "max_concurrency": run.max_concurrency,
            "max_retries": run.max_retries,
            "api_key": run.api_key,
        },
        "pages_sent": client["pages_sent"],
        "pages_completed": client["pages_completed"],
        "pages_failed": client["pages_failed"],
        "pages_unaccounted": client["pages_sent"] - accounted,
        "errors": client["errors"],
        "wall_s": client["wall_s"],
        "driver_wall_s": round(elapsed, 3),
        "gateway": gateway_figures(metrics),
        "client": client["client"],
        "pages": client["pages"],
        **({"passes": [_pass(*one) for one in passes]} if run.passes > 1 else {}),
    }


def arrived(workers: list[str]) -> int:
    """Requests the simulated workers have received so far."""
    total = 0
    for url in workers:
        with urllib.request.urlopen(url + "/sim/state", timeout=10) as response:
            total += int(json.loads(response.read())["arrived"])
    return total


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children: the client's, around one pass."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _pass(
    client: dict[str, Any], worker_requests: int, elapsed: float, client_cpu: float
) -> dict[str, Any]:
    return {
        "pages_completed": client["pages_completed"],
        "pages_failed": client["pages_failed"],
        "worker_requests": worker_requests,
        "wall_s": client["wall_s"],
        "driver_wall_s": round(elapsed, 3),
        "client_cpu_s": round(client_cpu, 3),
    }


def git_commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=100)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--md", type=Path, help="markdown summary (default: --out with .md)")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"of {', '.join(RUNS)}")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument("--venv", type=Path, default=client_venv.DEFAULT_VENV)
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.runs.split(",") if name.strip()]
    unknown = [name for name in names if name not in RUNS]
    if unknown:
        parser.error(f"unknown runs: {', '.join(unknown)}")
    python = client_venv.ensure(args.venv)
    log_root = Path(tempfile.mkdtemp(prefix="mineru-client-bench-"))
    print(f"client venv {python.parent.parent}; logs in {log_root}", flush=True)
    runs = []
    for name in names:
        print(f"{name}: {RUNS[name].what} ...", flush=True)
        result = execute(RUNS[name], args, python, log_root)
        runs.append(result)
        gateway = result["gateway"]
        print(
            f"  {result['pages_completed']}/{result['pages_sent']} pages completed, "
            f"{result['pages_failed']} failed, {gateway['rejections_total']} shed (429), "
            f"{result['wall_s']:.1f} s",
            flush=True,
        )
    document = {
        "benchmark": "flow_mineru_client",
        "issue": "13, measure 4",
        "command": "python -m benchmarks.mineru_client " + " ".join(sys.argv[1:] or argv or []),
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        },
        "client_package": {
            "name": client_venv.PACKAGE,
            "venv": str(python.parent.parent),
            "installed": (python.parent.parent / client_venv.MARKER).read_text().split(),
        },
        "setup": {
            "pages": args.pages,
            "page_pixels": [1240, 1754],
            "workers": args.workers,
            "sim_max_num_seqs": args.max_num_seqs,
            "sim_time_scale": args.time_scale,
            "gateway_batch_limit": args.max_num_seqs,
            "seed": args.seed,
        },
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    md = args.md or args.out.with_suffix(".md")
    md.write_text(report.markdown(document))
    print(f"wrote {args.out} and {md}", flush=True)
    return 0
