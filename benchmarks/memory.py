"""The gateway's memory: its RSS while it holds 2,000 concurrent streams, and whether RSS stays
flat over 100,000 requests (issue 16).

Simulated workers and the gateway run as separate processes (`gateway_overhead.Fleet`); the load
is `gateway_overhead.closed_loop`'s streams. RSS is read from /proc (the gateway's process and its
children). Phase 1 holds `--streams` streams of long answers and samples RSS every second. Phase 2
sends short answers from `--clients` streams in windows until `--requests` have completed, and
reads RSS between windows, when the gateway is idle, so every reading is comparable: flat means
the last idle reading within 5% of the first (taken after the first window, once pools and
caches are warm).

    python -m benchmarks.memory --out benchmarks/results/memory.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import uvloop
from benchmarks.gateway_overhead import Fleet, closed_loop

from mineru_gateway.testing import process_tree

MODEL = "opendatalab/MinerU2.5-2509-1.2B"


def rss_mb(pid: int) -> float:
    """Resident memory of `pid` and its live children, in MB."""
    total_kb = 0
    for member in process_tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total_kb += int(line.split()[1])
    return total_kb / 1024


def body(max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Benchmark.\nText Recognition:"}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()


async def hold_streams(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """Phase 1: `args.streams` concurrent streams; RSS sampled every second."""
    idle = rss_mb(fleet.gateway_pid)
    readings: list[float] = []

    async def sample() -> None:
        while True:
            await asyncio.sleep(1.0)
            readings.append(rss_mb(fleet.gateway_pid))

    sampler = asyncio.create_task(sample())
    try:
        samples, errors, _ = await closed_loop(
            [fleet.gateway_url], args.streams, body(args.long_tokens), 5.0, args.hold_s
        )
    finally:
        sampler.cancel()
    return {
        "streams": args.streams,
        "answer_tokens": args.long_tokens,
        "completed": len([s for s in samples if s.done]),
        "errors": errors,
        "rss_idle_before_mb": round(idle, 1),
        "rss_peak_mb": round(max(readings, default=idle), 1),
        "rss_mean_mb": round(sum(readings) / max(1, len(readings)), 1),
        "rss_per_stream_kb": round((max(readings, default=idle) - idle) * 1024 / args.streams, 1),
    }


async def many_requests(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """Phase 2: windows of short answers until `args.requests` have completed."""
    done = 0
    errors = 0
    cold = rss_mb(fleet.gateway_pid)
    readings: list[dict[str, float]] = []
    while done < args.requests:
        window_s = args.window_s if readings else 5.0  # a short first window: warm, early
        samples, window_errors, _ = await closed_loop(
            [fleet.gateway_url], args.clients, body(args.short_tokens), 0.0, window_s
        )
        done += len([s for s in samples if s.done])
        errors += window_errors
        await asyncio.sleep(2.0)  # idle: what is left is what the gateway keeps
        readings.append({"requests": done, "rss_mb": round(rss_mb(fleet.gateway_pid), 1)})
        print(f"{done} requests, RSS {readings[-1]['rss_mb']} MB", flush=True)
    first, last = readings[0]["rss_mb"], readings[-1]["rss_mb"]
    return {
        "clients": args.clients,
        "answer_tokens": args.short_tokens,
        "completed": done,
        "errors": errors,
        "idle_readings": readings,
        "rss_cold_mb": round(cold, 1),
        "rss_first_mb": first,
        "rss_last_mb": last,
        "last_over_first": round(last / first, 3),
        "flat_within_5pct": abs(last / first - 1) <= 0.05,
    }


def markdown(document: dict[str, Any]) -> str:
    hold, many = document["hold"], document["many"]
    lines = [
        "## The gateway's memory",
        "",
        f"- Command: `{document['command']}` ({document['when']}, {document['machine']['cpus']} "
        f"CPUs; {document['settings']['workers']} simulated workers at time scale "
        f"{document['settings']['time_scale']}).",
        "",
        "| phase | load | completed | errors | RSS |",
        "|---|---|---|---|---|",
        f"| holding streams | {hold['streams']} concurrent streams of "
        f"{hold['answer_tokens']}-token answers | {hold['completed']} | {hold['errors']} | "
        f"idle {hold['rss_idle_before_mb']} MB, peak {hold['rss_peak_mb']} MB, mean "
        f"{hold['rss_mean_mb']} MB ({hold['rss_per_stream_kb']} KB per stream) |",
        f"| many requests | {many['clients']} clients, {many['answer_tokens']}-token answers | "
        f"{many['completed']} | {many['errors']} | idle before any request "
        f"{many['rss_cold_mb']} MB, after the first window "
        f"{many['rss_first_mb']} MB, at the end {many['rss_last_mb']} MB "
        f"({many['last_over_first']}x; flat within 5%: "
        f"{'yes' if many['flat_within_5pct'] else 'no'}) |",
        "",
        "Idle readings (requests completed so far, RSS MB): "
        + ", ".join(f"{r['requests']}: {r['rss_mb']}" for r in many["idle_readings"]),
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--long-tokens", type=int, default=256)
    parser.add_argument("--hold-s", type=float, default=20.0)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--short-tokens", type=int, default=4)
    parser.add_argument("--short-time-scale", type=float, default=0.02)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def run_phase(args: argparse.Namespace, time_scale: float, phase: Any) -> dict[str, Any]:
    sim_args = ["--time-scale", str(time_scale), "--model-name", MODEL]
    fleet = Fleet(args.workers, sim_args, ["--log-level", "warning"])
    fleet.start()
    try:
        result: dict[str, Any] = uvloop.run(phase(fleet, args))
        return result
    finally:
        fleet.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    hold = run_phase(args, args.time_scale, hold_streams)
    print(json.dumps(hold), flush=True)
    many = run_phase(args, args.short_time_scale, many_requests)
    document = {
        "command": "python -m benchmarks.memory " + " ".join(args.argv),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_time_s": round(time.time() - started, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {
            "workers": args.workers,
            "time_scale": args.time_scale,
            "short_time_scale": args.short_time_scale,
        },
        "hold": hold,
        "many": many,
    }
    print(markdown(document))
    if args.out:
        args.out.write_text(json.dumps(document, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(document))


if __name__ == "__main__":
    main()
