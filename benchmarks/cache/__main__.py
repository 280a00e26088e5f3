"""`python -m benchmarks.cache --out benchmarks/results/cache.json` (module docstring of
benchmarks/cache/__init__.py); writes the .json and a .md beside it."""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
from benchmarks.cache import raw, report
from benchmarks.mineru_client import client_venv
from benchmarks.mineru_client import run as mineru_runs
from benchmarks.small_requests import noise_png

from mineru_gateway.api.payload import loads
from mineru_gateway.api.requests import parse_request
from mineru_gateway.cache.answers import Answer as StoredAnswer
from mineru_gateway.cache.answers import decode as decode_answer
from mineru_gateway.cache.answers import encode as encode_answer
from mineru_gateway.cache.keys import cache_tag
from mineru_gateway.request import Request
from mineru_gateway.testing import free_port, wait_until

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
    """A `redis-server` of its own (Debian's package, `make system-deps`), stopped with
    `stack`, once it answers: its URL."""
    port = free_port()
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: `make system-deps`")
    argv = [binary, "--port", str(port), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(proc.wait, 10)
    stack.callback(proc.terminate)
    wait_until(lambda: _pongs(port), 10.0, "redis-server start")
    return f"redis://127.0.0.1:{port}/0"


def _pongs(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def arrived(workers: list[str]) -> int:
    """Requests the simulated workers have received so far."""
    async with httpx.AsyncClient(timeout=30) as client:
        states = [(await client.get(w + "/sim/state")).json() for w in workers]
    return sum(int(s["arrived"]) for s in states)


async def metric(url: str, name: str) -> float:
    """The sum of a gateway's series `name` over its labels."""
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(url + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if _named(line, name))


def _named(line: str, name: str) -> bool:
    return line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ")


def encode(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def pages(first: int, count: int, size: int = 100) -> list[bytes]:
    image = base64.b64encode(noise_png(size)).decode()
    return [encode(page(first + n, image)) for n in range(count)]


async def two_passes(
    gateway: tuple[str, int], workers: list[str], bodies: list[bytes], connections: int = 32
) -> dict[str, Any]:
    """The same batch sent twice: each pass's worker requests, hits, wall and gateway CPU."""
    url, pid = gateway
    result: dict[str, Any] = {"pages": len(bodies)}
    for name in ("first", "second"):
        before, cpu = await arrived(workers), cpu_s(pid)
        started = time.perf_counter()
        answers = await raw.post_all(url, bodies, connections)
        result[name] = {
            "wall_s": round(time.perf_counter() - started, 3),
            "worker_requests": await arrived(workers) - before,
            "hits": sum(a.cache == "hit" for a in answers),
            "gateway_cpu_s": round(cpu_s(pid) - cpu, 3),
        }
        await asyncio.sleep(0.5)  # the first pass's writes land
    return result


async def duplicates(url: str, workers: list[str], first: int) -> dict[str, Any]:
    unique = pages(first, 160)
    rng = random.Random(1)
    bodies = unique + [rng.choice(unique) for _ in range(40)]
    rng.shuffle(bodies)
    before = await arrived(workers)
    answers = await raw.post_all(url, bodies, 64)
    mixed = {
        "sent": len(bodies),
        "distinct": len(unique),
        "worker_requests": await arrived(workers) - before,
        "coalesced": sum(a.cache == "coalesced" for a in answers),
        "hits": sum(a.cache == "hit" for a in answers),
    }
    image = base64.b64encode(noise_png(100)).decode()
    same = [encode(page(first + 500, image, tokens=2000))] * 100  # seconds in flight
    before = await arrived(workers)
    answers = await raw.post_all(url, same, 100)
    burst = {
        "sent": 100,
        "worker_requests": await arrived(workers) - before,
        "coalesced": sum(a.cache == "coalesced" for a in answers),
    }
    return {"twenty_percent_duplicates": mixed, "hundred_identical": burst}


async def hit_latency(
    gateways: dict[str, tuple[str, int]], worker_url: str, samples: int
) -> dict[str, Any]:
    """A 2 MB page request answered from each store, one at a time on one connection; the gateway's
    CPU per hit; and the worker's own answer to such a request."""
    image = base64.b64encode(noise_png(1500)).decode()
    body = encode(page(9000, image, tokens=300))
    result: dict[str, Any] = {"request_bytes": len(body)}
    worker = await raw.Connection.open(worker_url)
    misses = [(await worker.post(encode(page(9100 + n, image, 300)))).seconds for n in range(5)]
    await worker.close()
    result["worker_answer"] = _percentiles(misses)
    for name, (url, pid) in gateways.items():
        connection = await raw.Connection.open(url)
        assert (await connection.post(body)).cache == "miss"
        await asyncio.sleep(0.5)
        times, cpu = [], cpu_s(pid)
        for _ in range(samples):
            answer = await connection.post(body)
            assert answer.cache == "hit", answer
            times.append(answer.seconds)
        cpu = cpu_s(pid) - cpu
        await connection.close()
        result[name] = _percentiles(times) | {"gateway_cpu_ms": round(cpu / samples * 1e3, 2)}
    result["in_process_ms"] = hit_parts(body)
    return result


def hit_parts(body: bytes) -> dict[str, float]:
    """Where a hit's gateway time goes, measured in this process on the same body: the parse
    every request has, the cache key on top of it (BLAKE3, and sha256 for comparison), and
    reading a stored answer back."""
    payload = loads(body)
    request = Request("chat", payload)
    canonical = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
    stored = encode_answer(StoredAnswer(200, "application/json", b"x" * 4000))
    parts = {
        "parse": lambda: parse_request("chat", body),
        "key_blake3": lambda: cache_tag(request, ""),
        "key_sha256_same_bytes": lambda: hashlib.sha256(canonical).digest(),
        "read_stored_answer": lambda: decode_answer(stored),
    }
    return {name: round(_best_ms(call), 3) for name, call in parts.items()}


def _best_ms(call: Callable[[], object], repeat: int = 30) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        call()
        best = min(best, time.process_time() - started)
    return best * 1e3


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "samples": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(p99 * 1000, 2),
    }


async def small_requests(
    gateways: dict[str, tuple[str, int]], requests: int, rounds: int
) -> dict[str, Any]:
    """CPU per small request and its latency, each gateway in turn, `rounds` times, the order
    rotated each round (same run, interleaved); every request distinct, so every cacheable one
    is a miss. The ratio to cache_off is the median of the rounds' ratios."""
    names = list(gateways)
    cpu: dict[str, list[float]] = {name: [] for name in names}
    latency: dict[str, list[float]] = {name: [] for name in names}
    offset = 0
    for number in range(rounds):
        for name in names[number % len(names) :] + names[: number % len(names)]:
            url, pid = gateways[name]
            bodies = [encode(small(offset + n)) for n in range(requests)]
            offset += requests
            before = cpu_s(pid)
            answers = await raw.post_all(url, bodies, 16)
            cpu[name].append((cpu_s(pid) - before) / requests)
            latency[name] += [a.seconds for a in answers]
    off = cpu[names[0]]
    return {
        name: {
            "requests": requests * rounds,
            "cpu_us_per_request": round(statistics.mean(cpu[name]) * 1e6, 1),
            "cpu_ratio_to_off": round(
                statistics.median(c / o for c, o in zip(cpu[name], off, strict=True)), 3
            ),
            "latency": _percentiles(latency[name]),
        }
        for name in names
    }


async def shared_redis(stack: ExitStack, workers: list[str], store: str) -> dict[str, Any]:
    """A page computed through one gateway replica is a hit through another on the same
    Redis."""
    one = gateway(stack, workers, "--cache", store)
    two = gateway(stack, workers, "--cache", store)
    bodies = pages(20_000, 50)
    before = await arrived(workers)
    computed = await raw.post_all(one[0], bodies, 16)
    middle = await arrived(workers)
    await asyncio.sleep(0.5)
    served = await raw.post_all(two[0], bodies, 16)
    return {
        "two_replicas_redis": {
            "pages": len(bodies),
            "first_through_one": {"worker_requests": middle - before, "misses": _count(computed)},
            "then_through_two": {
                "worker_requests": await arrived(workers) - middle,
                "hits": _count(served, "hit"),
            },
        }
    }


def _count(answers: list[raw.Answer], label: str = "miss") -> int:
    return sum(a.cache == label for a in answers)


async def memory_bound(args: argparse.Namespace) -> dict[str, Any]:
    """The gateway's RSS while `args.distinct` distinct answers go through the memory cache,
    against its bound: RSS before the first, every tenth of the way, and at the end."""
    bound = args.memory_bound_mib * 1024 * 1024
    with ExitStack() as stack:
        worker = sim(stack, 0.001)
        settings = ("--cache", "memory", "--cache-max-bytes", str(bound))
        # One tenant here: its share is the whole cache, so the bound is what is tested.
        url, pid = gateway(stack, [worker], *settings, "--cache-tenant-share", "1")
        await raw.post_all(url, [encode(bounded(n)) for n in range(1000)], 32)  # warm
        start = rss_mb(pid)
        samples = []
        step = args.distinct // 10
        for first in range(1000, 1000 + args.distinct, step):
            await raw.post_all(url, [encode(bounded(n)) for n in range(first, first + step)], 32)
            samples.append(round(rss_mb(pid), 1))
        held = await metric(url, "mineru_gateway_cache_bytes")
        evictions = await metric(url, "mineru_gateway_cache_evictions_total")
        stored = await metric(url, "mineru_gateway_cache_stored_bytes_total")
    return {
        "distinct_answers": args.distinct,
        "cache_max_bytes": bound,
        "cache_max_mib": args.memory_bound_mib,
        "stored_mib": round(stored / 2**20, 1),
        "held_mib_at_end": round(held / 2**20, 1),
        "evictions": int(evictions),
        "rss_mib_before": round(start, 1),
        "rss_mib_samples": samples,
        "rss_mib_peak": max(samples),
        "overhead_mib": round(max(samples) - start - args.memory_bound_mib, 1),
    }


def bounded(number: int) -> dict[str, Any]:
    """A distinct small greedy request whose answer is about 1.2 kB."""
    request = small(number)
    request["max_tokens"] = 4096
    request["vllm_xargs"] = {"sim_output_tokens": 100}
    return request


def mineru_client(args: argparse.Namespace) -> dict[str, Any]:
    """MinerU's own client parsing the same batch twice through a gateway with the memory cache
    (benchmarks/mineru_client, run `memory_cache_two_passes`)."""
    python = client_venv.ensure()
    settings = argparse.Namespace(
        pages=args.mineru_pages,
        workers=2,
        max_num_seqs=16,
        time_scale=args.mineru_time_scale,
        seed=0,
        run_timeout_s=900.0,
    )
    logs = Path(tempfile.mkdtemp(prefix="cache-bench-mineru-"))
    run = mineru_runs.execute(mineru_runs.RUNS["memory_cache_two_passes"], settings, python, logs)
    return {
        "client": client_venv.PACKAGE,
        "pages": args.mineru_pages,
        "sim_time_scale": args.mineru_time_scale,
        "passes": run["passes"],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    with ExitStack() as stack:
        workers = [sim(stack, args.time_scale) for _ in range(2)]
        slow_worker = sim(stack, 1.0)
        store = redis(stack)
        gateways = {
            "cache_off": gateway(stack, workers, "--no-coalesce"),
            "coalescing": gateway(stack, workers),  # the defaults
            "memory_missing": gateway(stack, workers, "--cache", "memory"),
            "redis_missing": gateway(stack, workers, "--cache", store),
        }
        result["small_requests"] = await small_requests(gateways, args.small_requests, args.rounds)
        result["second_pass"] = {
            "memory": await two_passes(gateways["memory_missing"], workers, pages(0, args.pages)),
            "redis": await two_passes(gateways["redis_missing"], workers, pages(0, args.pages)),
        }
        result["duplicates"] = {
            "coalescing": await duplicates(gateways["coalescing"][0], workers, 1000),
            "memory": await duplicates(gateways["memory_missing"][0], workers, 2000),
        }
        hits = {
            "memory": gateway(stack, [slow_worker], "--cache", "memory"),
            "redis": gateway(stack, [slow_worker], "--cache", store),
        }
        result["hit_latency"] = await hit_latency(hits, slow_worker, args.samples)
        result["shared_redis"] = await shared_redis(stack, workers, store)
    result["memory_bound"] = await memory_bound(args)
    if args.mineru_pages:
        result["mineru_client"] = mineru_client(args)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cache.json"))
    parser.add_argument("--pages", type=int, default=200)
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--small-requests", type=int, default=2000, help="per gateway per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--distinct", type=int, default=100_000)
    parser.add_argument("--memory-bound-mib", type=int, default=64)
    parser.add_argument("--mineru-pages", type=int, default=50, help="0: no MinerU client run")
    # The client's own work per page (resizing, encoding) is what a pass costs when the workers
    # answer at once: at the workers' real pace, the pass times show what the cache saves.
    parser.add_argument("--mineru-time-scale", type=float, default=1.0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results = asyncio.run(run(args))
    document = {
        "command": "python -m benchmarks.cache " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        },
        "duration_s": round(time.perf_counter() - started, 1),
        "results": results,
    }
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(report.markdown(document))
    print(report.markdown(document))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
