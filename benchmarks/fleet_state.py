"""A tenant's `max_in_flight` across two gateway replicas, counted at the worker.

Starts `redis-server`, one counting upstream (each request held `--hold-ms`, the most held at
once recorded) and two `mineru-gateway serve` processes in front of it, then sends the one
tenant's requests to both replicas at once for `--seconds`: once with fleet state off (each
replica counts alone) and once with it on Redis. An over-admission is a request the worker
received while it already held `--limit` or more.

    python -m benchmarks.fleet_state --out benchmarks/results/fleet_state_limit.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from benchmarks.cache.__main__ import redis

from mineru_gateway.testing import CountingWorker, free_port, wait_http_ok, wait_until

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "counting-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@contextmanager
def upstream(app: CountingWorker) -> Iterator[str]:
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or None, 20.0, "upstream start")
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def gateway(worker: str, limit: int, fleet_state: str, log: Path) -> Any:
    port = free_port()
    argv = [
        *(sys.executable, "-m", "mineru_gateway", "serve", "--port", str(port)),
        *("--workers", worker, "--log-level", "warning"),
        f"--tenant-max-in-flight={limit}",
        f"--fleet-state={fleet_state}",
        "--fleet-state-timeout-s=1.0",
        "--coalesce=false",
        "--max-queue-wait-s=120",
    ]
    return port, process(argv, log)


async def load(urls: list[str], clients: int, seconds: float) -> dict[int, int]:
    """`clients` loops per URL, each sending one request after another for `seconds`."""
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients * len(urls))

    async def client_loop(client: httpx.AsyncClient, url: str) -> None:
        while time.monotonic() < deadline:
            try:
                status = (await client.post(url + "/v1/chat/completions", json=BODY)).status_code
            except httpx.HTTPError:
                status = 0
            statuses[status] = statuses.get(status, 0) + 1

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(client_loop(client, u) for u in urls for _ in range(clients)))
    return statuses


def run(args: argparse.Namespace, fleet_state: str, directory: Path) -> dict[str, Any]:
    app = CountingWorker(args.hold_ms / 1000, args.limit, MODEL)
    with ExitStack() as stack:
        worker = stack.enter_context(upstream(app))
        urls = []
        for index in range(2):
            port, started = gateway(worker, args.limit, fleet_state, directory / f"g{index}.log")
            stack.enter_context(started)
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_http_ok(url + "/ready", 30.0)
        statuses = asyncio.run(load(urls, args.clients, args.seconds))
    return {
        "fleet_state": "off" if fleet_state == "off" else "redis",
        "limit": args.limit,
        "peak_at_worker": app.peak,
        "over_admissions": app.over,
        "served": app.served,
        "statuses": {str(status): count for status, count in sorted(statuses.items())},
    }


def markdown(document: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {r['fleet_state']} | {r['limit']} | {r['peak_at_worker']} | {r['over_admissions']} "
        f"| {r['served']} | {', '.join(f'{k}: {v}' for k, v in r['statuses'].items())} |"
        for r in document["runs"]
    )
    return f"""# A tenant's max_in_flight across two gateway replicas

`{document["command"]}` ({document["when"]}).

Two `mineru-gateway serve` processes, one counting upstream holding each request
{document["hold_ms"]} ms, {document["clients"]} clients per replica sending the one tenant's
requests back to back for {document["seconds"]} s. Over-admissions: requests the worker received
while it already held the limit.

| fleet state | limit | peak at the worker | over-admissions | served | statuses |
|---|---|---|---|---|---|
{rows}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--clients", type=int, default=24, help="per replica")
    parser.add_argument("--hold-ms", type=float, default=50.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "fleet_state_limit.json")
    args = parser.parse_args(argv)
    directory = Path(args.out).with_suffix(".logs")
    directory.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        runs = [run(args, "off", directory), run(args, redis(stack), directory)]
    shutil.rmtree(directory, ignore_errors=True)
    document = {
        "command": "python -m benchmarks.fleet_state " + " ".join(argv or sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hold_ms": args.hold_ms,
        "clients": args.clients,
        "seconds": args.seconds,
        "runs": runs,
    }
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(document))
    for entry in runs:
        print(json.dumps(entry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
