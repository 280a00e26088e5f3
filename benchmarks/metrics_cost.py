"""What recording metrics costs per relayed SSE event, against the gateway's whole cost per event.

Times the relay's per-chunk bookkeeping (clock read, inter-token histogram, token count, usage
check) on realistic vLLM chunks, with and without it, and prints it next to the gateway's CPU time
per event measured by `gateway_overhead.py` (read from its JSON).

    python benchmarks/metrics_cost.py --overhead benchmarks/results/gateway_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from mineru_gateway.api.answer import AnswerClock
from mineru_gateway.metrics import ITL_BUCKETS, Series

CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":" the"},"logprobs":null,"finish_reason":null,'
    b'"token_ids":null}]}\n\n'
)


async def discard(message: Any) -> None:
    return None


async def per_event_seconds(record: bool, events: int) -> float:
    """Seconds per relayed event: the write alone, or (`record`) with the relay's bookkeeping
    (`AnswerClock.note`, as `api/relay.py` calls it for every event)."""
    clock = AnswerClock("chat")
    clock.measure_gaps(Series(ITL_BUCKETS))

    async def chunk(data: bytes) -> None:
        if record:
            clock.note(data)
        await discard({"type": "http.response.body", "body": data, "more_body": True})

    start = time.perf_counter()
    for _ in range(events):
        await chunk(CHUNK)
    return (time.perf_counter() - start) / events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--overhead", type=Path, help="gateway_overhead.py's JSON result")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = [
        (
            asyncio.run(per_event_seconds(False, args.events)),
            asyncio.run(per_event_seconds(True, args.events)),
        )
        for _ in range(5)
    ]
    bare = min(r[0] for r in runs)
    recorded = min(r[1] for r in runs)
    cost_us = (recorded - bare) * 1e6
    result: dict[str, Any] = {"metrics_cost_us_per_event": cost_us}
    print(f"metrics bookkeeping: {cost_us:.2f} us per relayed event")
    if args.overhead:
        summary = json.loads(args.overhead.read_text())["summary"]
        for row in (r for r in summary if r.get("proxy", "gateway") == "gateway"):
            share = cost_us / row["gateway_cpu_us_per_event"]
            row_out = {"concurrency": row["concurrency"], "share_of_gateway_cpu": share}
            result.setdefault("shares", []).append(row_out)
            print(
                f"c={row['concurrency']}: gateway CPU {row['gateway_cpu_us_per_event']:.1f} "
                f"us/event, metrics {100 * share:.1f}% of it"
            )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
