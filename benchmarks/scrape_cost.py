"""What the gateway's polling costs a real vLLM worker: CPU of vLLM's API server process (its
engine is a child process, not counted) per `GET /health`, per read of the whole `/metrics` page
and per read of the gateway's load series only (`LOAD_PATH`, `/metrics/?name[]=...`), from /proc
over `--reads` sequential reads of each, on an idle engine (issue 16).

The gateway reads every worker's load each `load_interval_s` (0.2 s), filtered where vLLM can
filter (vllm_contract.py).

    python -m benchmarks.scrape_cost --out benchmarks/results/scrape_cost.json

Needs the vLLM CPU build and the tiny model (`make vllm`; MINERU_VLLM_PYTHON and
MINERU_TINY_MODEL as `make test` sets them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import uvloop

from mineru_gateway.config import GatewaySettings
from mineru_gateway.routing import RoundRobin
from mineru_gateway.testing import cpu_seconds, start_vllm_server, vllm_paths_from_env
from mineru_gateway.vllm_contract import FULL_PATH, LOAD_PATH
from mineru_gateway.workers.registry import HealthPolicy, WorkerRegistry
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient

PATHS = ("/health", FULL_PATH, LOAD_PATH)
LABELS = {LOAD_PATH: "/metrics/?name[]=... (the gateway's load read)"}
LOAD_INTERVAL_S: float = GatewaySettings.model_fields["load_interval_s"].default


def read_cost(url: str, pid: int, reads: int) -> dict[str, float]:
    """CPU of `pid` and wall time per read of `url`, and the size of one answer."""
    size = len(urllib.request.urlopen(url).read())
    time.sleep(2.0)  # what the first read started settles
    cpu, start = cpu_seconds(pid), time.monotonic()
    for _ in range(reads):
        urllib.request.urlopen(url).read()
    return {
        "server_cpu_ms_per_read": (cpu_seconds(pid) - cpu) / reads * 1e3,
        "wall_ms_per_read": (time.monotonic() - start) / reads * 1e3,
        "bytes": size,
    }


def gateway_read_cost(url: str, path: str, reads: int) -> float:
    """Milliseconds of this process's CPU per load read of the worker at `url` through
    `path`, as the gateway's registry reads it (the GET, the scan for the load series)."""

    async def measure() -> float:
        client = UpstreamClient(Timeouts(5, 5, 5))
        registry = WorkerRegistry(
            [url], client, RoundRobin(), HealthPolicy(interval_s=60, timeout_s=5)
        )
        worker = registry.membership.workers[0]
        worker.load_path = path
        await client.start()
        try:
            await registry.read_load(worker)  # connects
            cpu = time.process_time()
            for _ in range(reads):
                await registry.read_load(worker)
            cpu = time.process_time() - cpu
        finally:
            await client.close()
        if worker.scrape is None or worker.load_path != path:
            raise RuntimeError(f"{url}{path} gave no load reading")
        return cpu / reads * 1e3

    return uvloop.run(measure())


def markdown(document: dict[str, Any]) -> str:
    paths = document["paths"]
    shares = {
        path: paths[path]["server_cpu_ms_per_read"] / LOAD_INTERVAL_S / 1e3
        for path in (LOAD_PATH, FULL_PATH)
        if path in paths
    }
    rows = [
        f"| `{LABELS.get(path, path)}` | {cost['server_cpu_ms_per_read']:.2f} ms "
        f"| {cost['wall_ms_per_read']:.2f} ms | {cost['bytes']:,} | "
        + (f"{gateway:.2f} ms |" if (gateway := cost.get("gateway_cpu_ms_per_read")) else "- |")
        for path, cost in paths.items()
    ]
    if LOAD_PATH in shares:
        polling = (
            f"the gateway's load reads take {shares[LOAD_PATH]:.1%} of one core of every "
            f"worker's API server ({shares[FULL_PATH]:.1%} if they read the whole page, as they "
            "do from a vLLM with several API servers)"
        )
    else:
        share = shares[FULL_PATH]
        polling = f"`/metrics` reads take {share:.1%} of one core of every worker's API server"
    return "\n".join(
        [
            "# What one read of a worker costs its vLLM API server, and the gateway (issue 16)",
            "",
            f"Command: `{document['command']}` ({document['when']}, "
            f"{document['machine']['cpus']} CPUs, vLLM CPU build, tiny model, idle engine).",
            "",
            "| read | API-server CPU per read | wall per read | answer bytes "
            "| gateway CPU per load read |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"At the gateway's default `load_interval_s` ({LOAD_INTERVAL_S} s), {polling}, "
            "whatever the gateway's number of processes (the first reads for all).",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reads", type=int, default=300)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    python, model = vllm_paths_from_env()
    server = start_vllm_server(python, model)
    try:
        server.wait_ready(300)
        paths = {path: read_cost(server.url + path, server.proc.pid, args.reads) for path in PATHS}
        for path in (FULL_PATH, LOAD_PATH):
            paths[path]["gateway_cpu_ms_per_read"] = gateway_read_cost(server.url, path, args.reads)
    finally:
        server.stop()
    document = {
        "command": "python -m benchmarks.scrape_cost " + " ".join(argv or sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"reads": args.reads},
        "paths": paths,
    }
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(document))
    for path, cost in paths.items():
        print(f"{path}: {cost}")


if __name__ == "__main__":
    main()
