"""Workers whose own vLLM queue is full (`--max-num-queued-reqs`): what clients see through the
gateway, against two workers with room, in the same run.

Two simulated workers (vLLM 0.32's dialect, real 910B pace) behind one `mineru-gateway serve`,
`--clients` concurrent clients sending `--requests` MinerU-sized text requests in all:

- `roomy`: both workers take everything (the baseline);
- `one_full`: one worker refuses every request with vLLM's queue-full 503;
- `both_capped`: each worker takes `--cap` requests and refuses the rest, while the gateway
  believes it may send 64: the surplus waits in the gateway's queue.

    python -m benchmarks.queue_full --out benchmarks/results/queue_full.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from mineru_gateway.testing import free_port, wait_http_ok

RESULTS = Path(__file__).resolve().parent / "results"
CLI = [sys.executable, "-m", "mineru_gateway"]
BODY = {"messages": [{"role": "user", "content": "\nText Recognition:"}], "max_tokens": 48}


@contextmanager
def process(argv: Sequence[str], url: str) -> Iterator[str]:
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http_ok(url + "/health", timeout=30)
        yield url
    finally:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def sim(stack: ExitStack, *flags: str) -> str:
    port = free_port()
    argv = [*CLI, "sim", "--port", str(port), "--vllm-version", "0.32.0", *flags]
    return stack.enter_context(process(argv, f"http://127.0.0.1:{port}"))


def gateway(stack: ExitStack, workers: list[str]) -> str:
    port = free_port()
    argv = [*CLI, "serve", "--port", str(port), "--workers", ",".join(workers)]
    argv += ["--batch-limit", "64", "--busy-hold-s", "0.2", "--log-level", "warning"]
    return stack.enter_context(process(argv, f"http://127.0.0.1:{port}"))


async def load(url: str, clients: int, requests: int) -> dict[str, Any]:
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    left = iter(range(requests))
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one_client() -> None:
            for _ in left:
                started = time.perf_counter()
                response = await client.post("/v1/chat/completions", json=BODY)
                latencies.append(time.perf_counter() - started)
                statuses[response.status_code] += 1

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "latency_p50_s": round(statistics.median(latencies), 3),
        "latency_p99_s": round(latencies[int(0.99 * (len(latencies) - 1))], 3),
        "requests_per_s": round(requests / wall, 2),
    }


def gateway_counts(url: str, workers: list[str]) -> dict[str, Any]:
    text = httpx.get(url + "/metrics").text
    listed = httpx.get(url + "/v1/workers").json()["workers"]

    def total(name: str, worker: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") and f'worker="{worker}"' in line
        )

    return {
        "refused_queue_full": [total("mineru_gateway_worker_queue_full_total", w) for w in workers],
        "ejections": [total("mineru_gateway_worker_ejections_total", w) for w in workers],
        "states": [next(x["state"] for x in listed if x["url"] == w) for w in workers],
        "served": [httpx.get(w + "/sim/state").json()["completed"] for w in workers],
    }


SCENARIOS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "roomy": ((), ()),
    "one_full": (("--max-num-queued-reqs", "0"), ()),
    "both_capped": (("--max-num-queued-reqs", "{cap}"), ("--max-num-queued-reqs", "{cap}")),
}


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    flags = [[f.format(cap=args.cap) for f in group] for group in SCENARIOS[name]]
    with ExitStack() as stack:
        workers = [sim(stack, *group) for group in flags]
        url = gateway(stack, workers)
        figures = asyncio.run(load(url, args.clients, args.requests))
        return {"scenario": name, **figures, **gateway_counts(url, workers)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=60)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--cap", type=int, default=8, help="both_capped: each worker's limit")
    parser.add_argument("--out", type=Path, default=RESULTS / "queue_full.json")
    args = parser.parse_args(argv)
    runs = [run(name, args) for name in SCENARIOS]
    base = runs[0]
    for figures in runs:
        figures["latency_p50_vs_roomy"] = round(figures["latency_p50_s"] / base["latency_p50_s"], 3)
        figures["latency_p99_vs_roomy"] = round(figures["latency_p99_s"] / base["latency_p99_s"], 3)
        print(json.dumps(figures))
    result = {
        "command": "python -m benchmarks.queue_full " + " ".join(argv or sys.argv[1:]),
        "clients": args.clients,
        "requests": args.requests,
        "cap": args.cap,
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(report(result))
    return 0


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Workers with a full vLLM queue, through the gateway",
        "",
        f"`{result['command'].strip()}`: {result['clients']} clients, {result['requests']} "
        f"requests per scenario, two simulated workers (vLLM 0.32, 910B pace); `both_capped`: "
        f"each worker takes {result['cap']} requests (`--max-num-queued-reqs`), the gateway "
        "believes 64.",
        "",
        "| scenario | statuses | p50 s | p99 s | p50 / roomy | p99 / roomy | req/s | refused "
        "(503s sent elsewhere), per worker | ejections | states | served, per worker |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['scenario']} | {r['statuses']} | {r['latency_p50_s']} | {r['latency_p99_s']} "
            f"| {r['latency_p50_vs_roomy']} | {r['latency_p99_vs_roomy']} | {r['requests_per_s']} "
            f"| {r['refused_queue_full']} | {r['ejections']} | {r['states']} | {r['served']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
