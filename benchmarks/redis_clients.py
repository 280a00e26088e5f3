"""Client-side CPU per GET: the gateway's own Redis client against redis-py's asyncio client.

Starts `redis-server` on a free port, stores one small value, and has each client GET it from
`--concurrency` coroutines at once on uvloop, `--gets` in all, `--rounds` times; prints this
process's CPU time (user + system) per GET, the median round. Redis's own CPU is not counted:
it runs in its own process. Why the gateway keeps one client of its own: docs/cache.md ("Redis").

    python -m benchmarks.redis_clients
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack

import uvloop
from benchmarks.cache.__main__ import redis
from redis.asyncio import Redis

from mineru_gateway.redis_link import RedisLink

KEY, VALUE = b"mineru-gateway:bench", b"x" * 64


async def cpu_per_get(get: Callable[[], Awaitable[object]], gets: int, concurrency: int) -> float:
    """Microseconds of this process's CPU per GET, `gets` of them from `concurrency` loops."""
    each = gets // concurrency

    async def loop() -> None:
        for _ in range(each):
            await get()

    await asyncio.gather(*(loop() for _ in range(concurrency)))  # warm: connections made
    started = time.process_time()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return (time.process_time() - started) / (each * concurrency) * 1e6


async def measure(url: str, gets: int, concurrency: int, rounds: int) -> dict[str, float]:
    link = RedisLink(url)
    redis_py = Redis.from_url(url)
    await link.set(KEY, VALUE, px=600_000)
    assert await link.get(KEY) == VALUE and await redis_py.get(KEY) == VALUE
    found: dict[str, list[float]] = {"RedisLink (redis_link.py)": [], "redis-py asyncio": []}
    try:
        for _ in range(rounds):  # interleaved: a busy moment of the machine hits both
            found["RedisLink (redis_link.py)"].append(
                await cpu_per_get(lambda: link.get(KEY), gets, concurrency)
            )
            found["redis-py asyncio"].append(
                await cpu_per_get(lambda: redis_py.get(KEY), gets, concurrency)
            )
    finally:
        await link.close()
        await redis_py.aclose()
    return {name: statistics.median(values) for name, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gets", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with ExitStack() as stack:
        figures = uvloop.run(measure(redis(stack), args.gets, args.concurrency, args.rounds))
    print(
        f"{args.gets} GETs of {len(VALUE)} bytes, {args.concurrency} concurrent, uvloop, "
        f"median of {args.rounds} rounds"
    )
    for name, micros in figures.items():
        print(f"{name:28} {micros:6.1f} us CPU per GET")


if __name__ == "__main__":
    main()
