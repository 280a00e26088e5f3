"""Rolling restarts of the workers `up` runs (issue 14): every worker is replaced, one at a time,
under steady load, and no request fails: not one error, not one SSE error event."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx

from mineru_gateway.testing import wait_until
from tests.test_group import Up, load, ups  # noqa: F401 - `ups` is a fixture

ADMIN = {"authorization": "Bearer admin-key"}


def restart_state(up: Up) -> dict[str, object]:
    answer: dict[str, object] = httpx.get(up.url + "/v1/workers/restart", headers=ADMIN).json()
    return answer


async def test_a_rolling_restart_of_four_workers_under_load_fails_no_request(
    tmp_path: Path,
    ups: list[Up],  # noqa: F811
) -> None:
    # A worker told to stop is cut off after 0.2 s: only draining keeps its requests whole.
    up = Up(
        tmp_path,
        "--workers",
        "4",
        "--sim-arg=--time-scale=3",
        "--admin-keys",
        "admin-key",
        "--stop-timeout-s",
        "0.2",
    )
    ups.append(up)
    up.wait_all_healthy(4)
    before = [up.worker_pid(i) for i in range(4)]
    command = [sys.executable, "-m", "mineru_gateway", "workers", "--gateway", up.url]
    command += ["--admin-key", "admin-key", "restart"]

    async def restart_all() -> subprocess.CompletedProcess[str]:
        await asyncio.sleep(1.0)  # load is running
        return await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=120, check=False
        )

    restarting = asyncio.create_task(restart_all())
    results = await load(up.url + "/v1/chat/completions", clients=8, seconds=6.0)
    while not restarting.done():  # the load ran out first: keep it up until the restart ends
        results += await load(up.url + "/v1/chat/completions", clients=8, seconds=2.0)
    done = await restarting

    assert done.returncode == 0, (done.stdout, done.stderr, up.log())
    outcomes = Counter(results)
    assert set(outcomes) == {"ok"}, (outcomes, up.log())
    assert outcomes["ok"] >= 40, outcomes
    phases = [worker["phase"] for worker in restart_state(up)["workers"]]  # type: ignore[index]
    assert phases == ["done"] * 4
    after = [up.worker_pid(i) for i in range(4)]
    assert all(old != new for old, new in zip(before, after, strict=True)), (before, after)
    listed = up.workers()
    assert [w["state"] for w in listed] == ["healthy"] * 4
    assert [w["in_flight"] for w in listed] == [0] * 4
    assert up.stop() == 0


def test_sighup_restarts_every_worker_of_up(tmp_path: Path, ups: list[Up]) -> None:  # noqa: F811
    up = Up(tmp_path, "--workers", "2", "--admin-keys", "admin-key")
    ups.append(up)
    up.wait_all_healthy(2)
    before = [up.worker_pid(i) for i in range(2)]
    up.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: restart_state(up).get("state") == "done", 60, up.log())
    assert [up.worker_pid(i) for i in range(2)] != before
    assert all(old != up.worker_pid(i) for i, old in enumerate(before))
    assert "rolling_restart_done" in up.log(tail=10**6)
    assert up.stop() == 0
