"""What the gateway's polling costs a real vLLM worker: CPU of vLLM's API server process (its
engine is a child process, not counted) per `GET /metrics` and per `GET /health`, read from /proc
over `--reads` sequential reads of each, on an idle engine (issue 16).

The gateway reads every worker's `/metrics` each `load_interval_s` (0.2 s); with `serve
--processes N` the first process reads for all (siblings.py), so the cost does not grow with N.

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

from mineru_gateway.config import GatewaySettings
from mineru_gateway.testing import cpu_seconds, start_vllm_server, vllm_paths_from_env

PATHS = ("/health", "/metrics")
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


def markdown(document: dict[str, Any]) -> str:
    metrics = document["paths"]["/metrics"]
    share = metrics["server_cpu_ms_per_read"] / LOAD_INTERVAL_S / 1e3
    rows = [
        f"| `{path}` | {cost['server_cpu_ms_per_read']:.2f} ms | {cost['wall_ms_per_read']:.2f} ms "
        f"| {cost['bytes']:,} |"
        for path, cost in document["paths"].items()
    ]
    return "\n".join(
        [
            "# What one read costs vLLM's API server (issue 16)",
            "",
            f"Command: `{document['command']}` ({document['when']}, "
            f"{document['machine']['cpus']} CPUs, vLLM CPU build, tiny model, idle engine).",
            "",
            "| read | API-server CPU per read | wall per read | answer bytes |",
            "|---|---|---|---|",
            *rows,
            "",
            f"At the gateway's default `load_interval_s` ({LOAD_INTERVAL_S} s), the gateway's "
            f"`/metrics` reads take {share:.1%} of one core of every worker's API server, "
            "whatever its number of processes (the first reads for all).",
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
