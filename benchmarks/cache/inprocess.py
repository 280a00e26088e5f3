"""What coalescing and each store cost a request they do not help, counted in-process.

The end-to-end figures of `benchmarks.cache` are CPU from /proc on a shared machine: a difference
of a few percent between gateways is within their noise. Here the gateway's server protocol and
app run in-process as in benchmarks/request_path.py (its in-process client, 16 keep-alive
connections), every request distinct, greedy and small, so that every cacheable one is a miss,
against a simulated worker (`mineru-gateway sim`, its own process, so its work is not counted).
Per gateway: instructions per request under callgrind (the same on every run of the same code,
whatever else the machine does) and CPU per request, each from the difference of two runs so
that start-up and warm-up cancel.

    python -m benchmarks.cache.inprocess --out benchmarks/results/cache.inprocess.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.cache.__main__ import redis, sim
from benchmarks.request_path import CONCURRENCY, RESULT_MARK, _Client, _until_healthy

REPO = Path(__file__).resolve().parents[2]
CHAT = b"/v1/chat/completions"


def request(number: int) -> bytes:
    """A distinct small greedy chat request, as raw HTTP/1.1 bytes."""
    body = json.dumps(
        {
            "model": "opendatalab/MinerU2.5-2509-1.2B",
            "messages": [{"role": "user", "content": f"hi {number}"}],
            "temperature": 0.0,
            "max_tokens": 8,
            "vllm_xargs": {"sim_output_tokens": 1},
        },
        separators=(",", ":"),
    ).encode()
    return (
        b"POST %b HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (CHAT, len(body), body)
    )


async def _run(worker: str, requests: int, warmup: int) -> dict[str, Any]:
    from mineru_gateway.api.app import create_app
    from mineru_gateway.api.connection import Edge, GatewayHttpProtocol
    from mineru_gateway.config import GatewaySettings
    from mineru_gateway.entry.logs import configure_logging

    configure_logging("warning", "json")
    # coalesce and cache come from MINERU_GATEWAY_COALESCE and MINERU_GATEWAY_CACHE.
    app = create_app(GatewaySettings(workers=[worker], log_level="warning"))
    # Distinct from every other run's too: Redis outlives a run, and a request of an earlier
    # one would be a hit.
    first = secrets.randbelow(10**15)
    numbers = iter(range(first, first + 10**9))
    answered: list[int] = []

    async with app.api.router.lifespan_context(app.api) as state:
        await _until_healthy(app, state)
        edge = Edge(app)
        edge.app_state = dict(state or {})
        clients = [_Client(GatewayHttpProtocol(edge)) for _ in range(CONCURRENCY)]

        async def loop(client: _Client, count: int) -> None:
            for raw in [request(next(numbers)) for _ in range(count)]:
                answer = await client.request(raw)
                answered.append(int(answer.startswith(b"HTTP/1.1 200 ")))

        await asyncio.gather(*(loop(client, warmup // CONCURRENCY) for client in clients))
        answered.clear()
        gc.collect()
        gc.freeze()  # as the server does once listening (entry/server.py)
        cpu = time.process_time()
        await asyncio.gather(*(loop(client, requests // CONCURRENCY) for client in clients))
        cpu = time.process_time() - cpu
    done = (requests // CONCURRENCY) * CONCURRENCY
    return {"requests": done, "cpu_s": cpu, "answered": sum(answered)}


def child(argv: Sequence[str]) -> None:
    import uvloop

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=800)
    args = parser.parse_args(argv)
    result = uvloop.run(_run(args.worker, args.requests, args.warmup))
    print(RESULT_MARK + json.dumps(result), flush=True)


def run_once(
    worker: str, requests: int, settings: dict[str, str], instructions: bool
) -> dict[str, Any]:
    argv = [sys.executable, "-m", "benchmarks.cache.inprocess", "--child"]
    argv += ["--worker", worker, "--requests", str(requests)]
    if instructions:
        argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv]
    env = os.environ | {"PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"} | settings
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=True)
    line = next(line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK))
    result: dict[str, Any] = json.loads(line[len(RESULT_MARK) :])
    if result["answered"] != result["requests"]:
        raise RuntimeError(f"requests went unanswered: {result}")
    if instructions:
        found = re.search(r"Collected : (\d+)", done.stderr)
        assert found, "callgrind printed no instruction count"
        result["instructions"] = int(found.group(1))
    return result


def measure(worker: str, settings: dict[str, str], requests: int) -> dict[str, float]:
    """Per request: CPU from two plain runs (10x and 30x `requests`), instructions from two
    under callgrind (1x and 3x)."""
    short, long = (run_once(worker, n, settings, False) for n in (10 * requests, 30 * requests))
    cpu = (long["cpu_s"] - short["cpu_s"]) / (long["requests"] - short["requests"])
    few, many = (run_once(worker, n, settings, True) for n in (requests, 3 * requests))
    counted = (many["instructions"] - few["instructions"]) / (many["requests"] - few["requests"])
    return {"instructions": round(counted), "cpu_us": round(cpu * 1e6, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks/results/cache.inprocess.json"
    )
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        worker = sim(stack, 0.001)
        store = redis(stack)
        gateways = {
            "cache_off": {"MINERU_GATEWAY_COALESCE": "false", "MINERU_GATEWAY_CACHE": "off"},
            "coalescing": {"MINERU_GATEWAY_COALESCE": "true", "MINERU_GATEWAY_CACHE": "off"},
            "memory_missing": {"MINERU_GATEWAY_CACHE": "memory"},
            # Callgrind slows the gateway fifty times: a lookup within the default 50 ms would
            # time out, pause Redis and count nothing of it.
            "redis_missing": {
                "MINERU_GATEWAY_CACHE": store,
                "MINERU_GATEWAY_CACHE_REDIS_TIMEOUT_S": "5",
            },
        }
        for name, settings in gateways.items():
            results[name] = measure(worker, settings, args.requests)
            print(name, results[name], flush=True)
    off = results["cache_off"]
    for row in results.values():
        row["instructions_against_off"] = round(row["instructions"] / off["instructions"], 3)
    document = {
        "command": "python -m benchmarks.cache.inprocess " + " ".join(argv),
        "requests": args.requests,
        "results": results,
    }
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
