"""`python -m benchmarks.cache --out benchmarks/results/cache.json` (module docstring of
benchmarks/cache/__init__.py); writes the .json and a .md beside it."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
from benchmarks.small_requests import noise_png

from mineru_gateway.testing import free_port, wait_until

CHAT = "/v1/chat/completions"
MODEL = "opendatalab/MinerU2.5-2509-1.2B"


def page(number: int, image: str, tokens: int | None = None) -> dict[str, Any]:
    """Page `number` as MinerU's client asks for it (greedy), its answer `tokens` long."""
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
        {"type": "text", "text": f"Layout Detection: page {number}"},
    ]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "top_p": 0.01,
        "max_tokens": 4096,
        "vllm_xargs": {
            "no_repeat_ngram_size": 100,
            "sim_output_tokens": tokens or 100 + number * 37 % 400,
        },
    }


def small(number: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"hi {number}"}],
        "temperature": 0.0,
        "max_tokens": 8,
        "vllm_xargs": {"sim_output_tokens": 1},
    }


@contextmanager
def process(argv: Sequence[str], url: str, ready: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _answers(url + ready), 30.0, f"{argv[2:4]} up", poll=0.1)
        yield proc
    finally:
        proc.terminate()
        proc.wait(15)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def sim(stack: ExitStack, time_scale: float) -> str:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "mineru_gateway", "sim", "--port", str(port)]
    stack.enter_context(process([*argv, "--time-scale", str(time_scale)], url, "/health"))
    return url


def gateway(stack: ExitStack, workers: list[str], *settings: str) -> tuple[str, int]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "mineru_gateway", "serve", "--port", str(port)]
    argv += ["--workers", ",".join(workers), "--log-level", "warning", *settings]
    proc = stack.enter_context(process(argv, url, "/ready"))
    return url, proc.pid


def redis(stack: ExitStack) -> str:
    port = free_port()
    binary = shutil.which("redis-server")
    assert binary, "redis-server: make system-deps"
    argv = [binary, "--port", str(port), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    stack.callback(proc.wait, 10)
    stack.callback(proc.terminate)
    time.sleep(0.5)
    return f"redis://127.0.0.1:{port}/0"


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def arrived(client: httpx.AsyncClient, workers: list[str]) -> int:
    states = [(await client.get(w + "/sim/state")).json() for w in workers]
    return sum(int(s["arrived"]) for s in states)


async def send_all(
    client: httpx.AsyncClient, url: str, bodies: list[bytes], concurrency: int
) -> tuple[float, list[str]]:
    """Wall seconds to send every body (`concurrency` at a time); each answer's X-Cache."""
    gate = asyncio.Semaphore(concurrency)
    labels: list[str] = []

    async def one(body: bytes) -> None:
        async with gate:
            answer = await client.post(url + CHAT, content=body, headers=JSON)
            answer.raise_for_status()
            labels.append(answer.headers.get("x-cache", "-"))

    started = time.perf_counter()
    await asyncio.gather(*(one(body) for body in bodies))
    return time.perf_counter() - started, labels


JSON = {"content-type": "application/json"}


def encode(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


async def second_pass(
    client: httpx.AsyncClient, url: str, workers: list[str], pages: int
) -> dict[str, Any]:
    image = base64.b64encode(noise_png(100)).decode()
    bodies = [encode(page(n, image)) for n in range(pages)]
    result: dict[str, Any] = {"pages": pages}
    for name in ("first", "second"):
        before = await arrived(client, workers)
        wall, labels = await send_all(client, url, bodies, 32)
        result[name] = {
            "wall_s": round(wall, 3),
            "worker_requests": await arrived(client, workers) - before,
            "hits": labels.count("hit"),
        }
        await asyncio.sleep(0.3)  # the first pass's writes land
    return result


async def duplicates(
    client: httpx.AsyncClient, url: str, workers: list[str], first: int
) -> dict[str, Any]:
    image = base64.b64encode(noise_png(100)).decode()
    unique = [encode(page(first + n, image)) for n in range(160)]
    rng = random.Random(1)
    bodies = unique + [rng.choice(unique) for _ in range(40)]
    rng.shuffle(bodies)
    before = await arrived(client, workers)
    wall, labels = await send_all(client, url, bodies, 64)
    mixed = {
        "sent": len(bodies),
        "distinct": len(unique),
        "worker_requests": await arrived(client, workers) - before,
        "coalesced": labels.count("coalesced"),
        "wall_s": round(wall, 3),
    }
    same = [encode(page(first + 500, image, tokens=2000))] * 100  # seconds in flight
    before = await arrived(client, workers)
    wall, labels = await send_all(client, url, same, 100)
    burst = {
        "sent": 100,
        "worker_requests": await arrived(client, workers) - before,
        "coalesced": labels.count("coalesced"),
        "wall_s": round(wall, 3),
    }
    return {"twenty_percent_duplicates": mixed, "hundred_identical": burst}


async def hit_latency(
    client: httpx.AsyncClient, urls: dict[str, str], worker_url: str, samples: int
) -> dict[str, Any]:
    image = base64.b64encode(noise_png(1500)).decode()
    body = encode(page(9000, image, tokens=300))
    result: dict[str, Any] = {"request_bytes": len(body)}
    misses = []
    for n in range(5):
        fresh = encode(page(9100 + n, image, tokens=300))
        started = time.perf_counter()
        (await client.post(worker_url + CHAT, content=fresh, headers=JSON)).raise_for_status()
        misses.append(time.perf_counter() - started)
    result["worker_answer_ms"] = _percentiles(misses)
    for name, url in urls.items():
        first = await client.post(url + CHAT, content=body, headers=JSON)
        assert first.headers["x-cache"] == "miss", first.headers
        await asyncio.sleep(0.3)
        times = []
        for _ in range(samples):
            started = time.perf_counter()
            answer = await client.post(url + CHAT, content=body, headers=JSON)
            times.append(time.perf_counter() - started)
            assert answer.headers["x-cache"] == "hit"
        result[name] = _percentiles(times)
    return result


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "samples": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(p99 * 1000, 2),
    }


async def small_cpu(
    client: httpx.AsyncClient, gateways: dict[str, tuple[str, int]], requests: int, rounds: int
) -> dict[str, Any]:
    """CPU per small request, each gateway in turn, `rounds` times (same run, interleaved)."""
    totals = {name: [0.0, 0] for name in gateways}
    offset = 0
    for _ in range(rounds):
        for name, (url, pid) in gateways.items():
            bodies = [encode(small(offset + n)) for n in range(requests)]
            offset += requests
            before = cpu_s(pid)
            await send_all(client, url, bodies, 16)
            totals[name][0] += cpu_s(pid) - before
            totals[name][1] += requests
    return {
        name: {"requests": int(count), "cpu_us_per_request": round(cpu / count * 1e6, 1)}
        for name, (cpu, count) in totals.items()
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with ExitStack() as stack:
        workers = [sim(stack, args.time_scale) for _ in range(2)]
        slow_worker = sim(stack, 1.0)
        store = redis(stack)
        memory = gateway(stack, workers, "--cache", "memory")
        shared = gateway(stack, workers, "--cache", store)
        coalescing = gateway(stack, workers)  # the defaults: coalescing on, cache off
        off = gateway(stack, workers, "--coalesce", "false")
        hits_memory = gateway(stack, [slow_worker], "--cache", "memory")
        hits_redis = gateway(stack, [slow_worker], "--cache", store)
        limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            result: dict[str, Any] = {
                "second_pass": {
                    "memory": await second_pass(client, memory[0], workers, args.pages),
                    "redis": await second_pass(client, shared[0], workers, args.pages),
                },
                "duplicates": {
                    "coalescing": await duplicates(client, coalescing[0], workers, 1000),
                    "memory": await duplicates(client, memory[0], workers, 2000),
                },
                "hit_latency": await hit_latency(
                    client,
                    {"memory": hits_memory[0], "redis": hits_redis[0]},
                    slow_worker,
                    args.samples,
                ),
                "small_request_cpu": await small_cpu(
                    client,
                    {"cache_off": off, "memory_missing": memory, "redis_missing": shared},
                    args.small_requests,
                    args.rounds,
                ),
                "rss_mb": {
                    "memory_cache": round(rss_mb(memory[1]), 1),
                    "cache_off": round(rss_mb(off[1]), 1),
                },
            }
    return result


def markdown(document: dict[str, Any]) -> str:
    r = document["results"]
    lines = [
        "# Coalescing and the result cache (`make bench-cache`)",
        "",
        f"Command: `{document['command']}`. Simulated workers (`mineru-gateway sim`, time scale "
        f"{document['settings']['time_scale']}; 1.0 for the worker answers in (c)), each server "
        "its own process. Raw figures: cache.json.",
        "",
        "## (a) A batch of pages sent twice",
        "",
        "| store | pass | worker requests | hits | wall s |",
        "|---|---|---|---|---|",
    ]
    for store, passes in r["second_pass"].items():
        for name in ("first", "second"):
            p = passes[name]
            lines.append(
                f"| {store} | {name} | {p['worker_requests']} | {p['hits']} | {p['wall_s']} |"
            )
    lines += [
        "",
        "## (b) Duplicates: coalescing alone (the defaults), and with the memory cache",
        "",
        "| gateway | batch | requests sent | distinct | worker requests | coalesced |",
        "|---|---|---|---|---|---|",
    ]
    for name, d in r["duplicates"].items():
        mixed, burst = d["twenty_percent_duplicates"], d["hundred_identical"]
        lines += [
            f"| {name} | 20% duplicates | {mixed['sent']} | {mixed['distinct']} | "
            f"{mixed['worker_requests']} | {mixed['coalesced']} |",
            f"| {name} | 100 identical at once | {burst['sent']} | 1 | "
            f"{burst['worker_requests']} | {burst['coalesced']} |",
        ]
    lines += [
        "",
        f"## (c) A hit's latency, {r['hit_latency']['request_bytes']:,}-byte page request",
        "",
        "| answered by | samples | p50 ms | p99 ms |",
        "|---|---|---|---|",
    ]
    for name in ("memory", "redis", "worker_answer_ms"):
        h = r["hit_latency"][name]
        label = "worker (a miss, 300 tokens)" if name == "worker_answer_ms" else f"{name} hit"
        lines.append(f"| {label} | {h['samples']} | {h['p50_ms']} | {h['p99_ms']} |")
    lines += [
        "",
        "## (d) Small requests: gateway CPU per request, same run, interleaved rounds",
        "",
        "| gateway | requests | CPU us per request |",
        "|---|---|---|",
    ]
    for name, c in r["small_request_cpu"].items():
        lines.append(f"| {name} | {c['requests']} | {c['cpu_us_per_request']} |")
    lines += ["", f"RSS after the run (MB): {r['rss_mb']}.", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cache.json"))
    parser.add_argument("--pages", type=int, default=200)
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--small-requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results = asyncio.run(run(args))
    document = {
        "command": "python -m benchmarks.cache " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "duration_s": round(time.perf_counter() - started, 1),
        "results": results,
    }
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(document))
    print(markdown(document))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
