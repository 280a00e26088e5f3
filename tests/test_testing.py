"""The shared test helpers of mineru_gateway.testing: waiting on conditions and URLs, free ports,
the counting worker.

The real-vLLM harness in the same module has tests/test_real_vllm_harness.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from mineru_gateway.testing import (
    CountingWorker,
    free_port_block,
    http_get,
    process_tree,
    tree_cpu_seconds,
    tree_cpu_times,
    wait_http_ok,
    wait_until,
    wait_until_async,
)
from tests.support.servers import serve

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Scope]]
Send = Callable[[Scope], Awaitable[None]]


def test_wait_until_returns_the_first_truthy_value() -> None:
    values = iter([0, None, "", "found"])
    assert wait_until(lambda: next(values), timeout=5, poll=0.001) == "found"


def test_wait_until_names_what_did_not_happen_in_time() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^the moon: not within 0\.2 s$"):
        wait_until(lambda: False, timeout=0.2, what="the moon", poll=0.01)
    assert 0.2 <= time.monotonic() - started < 2


async def test_wait_until_async_takes_plain_and_async_conditions() -> None:
    values = iter([False, False, 7])

    async def later() -> int:
        return next(values)

    assert await wait_until_async(later, 5, poll=0.001) == 7
    assert await wait_until_async(lambda: "at once") == "at once"
    with pytest.raises(TimeoutError, match=r"never: not within 0\.1 s"):
        await wait_until_async(lambda: 0, 0.1, "never", poll=0.01)


def ready_on_call(ready: int) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """An ASGI app that answers 503 until its `ready`-th request, then 200; the body counts."""
    calls = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal calls
        calls += 1
        status = 200 if calls >= ready else 503
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": str(calls).encode()})

    return app


def test_wait_http_ok_waits_through_error_statuses() -> None:
    with serve(ready_on_call(3), lifespan="off") as url:
        wait_http_ok(url, timeout=10)
        assert http_get(url) == (200, b"4")


def test_wait_http_ok_times_out_with_the_last_answer() -> None:
    with serve(ready_on_call(10**6), lifespan="off") as url:
        assert http_get(url) == (503, b"1")
        with pytest.raises(TimeoutError, match=r"not ready after 0\.1 s \(last: 503\)"):
            wait_http_ok(url, timeout=0.1)


def test_wait_http_ok_fails_at_once_when_the_process_exits(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text("could not bind\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    proc.wait()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="process exited with 4 before") as info:
        wait_http_ok("http://127.0.0.1:9/", timeout=30, proc=proc, log=log)
    assert "could not bind" in str(info.value)
    assert time.monotonic() - started < 5


def test_a_port_block_is_free_and_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    base = free_port_block(4)
    assert base >= 10000 and base + 4 <= low
    with ExitStack() as stack:
        for port in range(base, base + 4):
            stack.enter_context(socket.socket()).bind(("127.0.0.1", port))


def test_a_process_tree_holds_the_children_and_their_cpu() -> None:
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert process_tree(os.getpid())[0] == os.getpid()
        assert child.pid in process_tree(os.getpid())
        before = tree_cpu_seconds(os.getpid())
        user_before, _ = tree_cpu_times(os.getpid())
        # This process mostly sleeps in the wait: the second of CPU is the busy child's.
        wait_until(lambda: tree_cpu_seconds(os.getpid()) > before + 1.0, 20, "the child's CPU")
        # A loop that makes no system call spends it in user space.
        assert tree_cpu_times(os.getpid())[0] > user_before + 0.8
        assert sum(tree_cpu_times(child.pid)) == pytest.approx(
            tree_cpu_seconds(child.pid), abs=0.05
        )
    finally:
        child.kill()
        child.wait()
    assert child.pid not in process_tree(os.getpid())


async def test_the_counting_worker_counts_what_it_holds_and_what_came_over_its_limit() -> None:
    worker = CountingWorker(hold_s=1.0, limit=2)
    with serve(worker) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            models = (await client.get("/v1/models")).json()
            assert [card["id"] for card in models["data"]] == ["counting-model"]
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/nowhere")).status_code == 404
            body = {"model": "counting-model", "messages": [{"role": "user", "content": "hi"}]}
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for _ in range(3))
            )
    assert [a.json()["choices"][0]["message"]["content"] for a in answers] == ["ok"] * 3
    assert (worker.peak, worker.over, worker.served, worker.now) == (3, 1, 3, 0)
    worker.reset_peak()
    assert worker.peak == 0
