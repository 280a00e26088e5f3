"""The supervisor with real worker processes (simulated vLLM workers and small scripts)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from mineru_gateway.testing import free_port, free_port_block, group_pids, wait_until_async
from mineru_gateway.workers.launcher import build_sim_command
from mineru_gateway.workers.supervisor import (
    ManagedWorker,
    RestartPolicy,
    Supervisor,
    WorkerSpec,
)

FAST = RestartPolicy(
    start_timeout_s=30,
    start_poll_s=0.1,
    health_interval_s=0.2,
    health_timeout_s=0.5,
    unhealthy_after=2,
    stop_timeout_s=2,
    backoff_s=0.2,
    backoff_cap_s=1,
)


def sim_spec(name: str, *extra: str) -> WorkerSpec:
    port = free_port_block()
    command = build_sim_command(0, base_port=port, extra_args=("--time-scale=0.01", *extra))
    return WorkerSpec(name, command.argv, command.url())


def script_spec(name: str, code: str) -> WorkerSpec:
    """A worker that runs `code` and never answers /health (nothing listens on its port)."""
    return WorkerSpec(name, [sys.executable, "-c", code], f"http://127.0.0.1:{free_port()}")


def alive(pid: int) -> bool:
    """Running (not a zombie) process `pid`."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


async def health(worker: ManagedWorker) -> int:
    async with httpx.AsyncClient() as client:
        return (await client.get(worker.spec.url + "/health", timeout=5)).status_code


class Running:
    """A started supervisor, stopped (and checked for leftovers) at the end of the test."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.groups: set[int] = set()

    @property
    def workers(self) -> list[ManagedWorker]:
        return self.supervisor.workers

    async def ready(self) -> None:
        await asyncio.wait_for(self.supervisor.wait_all_ready(), 30)
        self.groups |= {w.pid for w in self.workers if w.pid is not None}


@pytest.fixture
async def supervise() -> AsyncIterator[Callable[..., Running]]:
    started: list[Running] = []

    def start(specs: Sequence[WorkerSpec], policy: RestartPolicy = FAST, **kw: Any) -> Running:
        running = Running(Supervisor(specs, policy, **kw))
        started.append(running)
        return running

    yield start
    for running in started:
        groups = running.groups | {w.pid for w in running.workers if w.pid is not None}
        await running.supervisor.stop()
        for pgid in groups:
            assert group_pids(pgid) == [], f"processes left in group {pgid}"


@pytest.mark.parametrize(
    ("failures", "delay"), [(0, 0.2), (1, 0.4), (2, 0.8), (3, 1.0), (10, 1.0), (10_000, 1.0)]
)
def test_backoff_doubles_up_to_the_cap(failures: int, delay: float) -> None:
    assert FAST.delay(failures) == pytest.approx(delay)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"unhealthy_after": 0}, "unhealthy_after"),
        ({"health_timeout_s": 0}, "health_timeout_s must be positive"),
        ({"backoff_s": 5, "backoff_cap_s": 1}, "backoff_s <= backoff_cap_s"),
        ({"give_up_after": 0}, "give_up_after must be at least 1"),
    ],
)
def test_invalid_policies_are_refused(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RestartPolicy(**fields)  # type: ignore[arg-type]


async def test_workers_start_in_parallel_and_log_to_their_own_files(
    supervise: Callable[..., Running], tmp_path: Path
) -> None:
    running = supervise([sim_spec("worker-0"), sim_spec("worker-1")], log_dir=tmp_path)
    await running.supervisor.start()
    starts = [w.started_at for w in running.workers]
    assert max(starts) - min(starts) < 1.0  # neither waited for the other to be healthy
    await running.ready()
    assert [w.state for w in running.workers] == ["healthy", "healthy"]
    assert [await health(w) for w in running.workers] == [200, 200]
    for worker in running.workers:
        log = (tmp_path / f"{worker.name}.log").read_text()
        assert log.startswith("==== ")
        assert f"mineru-gateway: start 1 of {worker.name}: " in log


async def test_a_killed_worker_is_restarted_and_serves_again(
    supervise: Callable[..., Running], tmp_path: Path
) -> None:
    running = supervise([sim_spec("worker-0"), sim_spec("worker-1")], log_dir=tmp_path)
    await running.supervisor.start()
    await running.ready()
    victim, other = running.workers
    old_pid = victim.pid
    assert old_pid is not None
    os.killpg(old_pid, signal.SIGKILL)
    await wait_until_async(
        lambda: victim.restarts == 1 and victim.state == "healthy", 30, "restarted"
    )
    assert victim.pid != old_pid
    assert victim.last_reason == "exited with status -9"
    assert victim.last_delay_s == pytest.approx(FAST.backoff_s)
    assert await health(victim) == 200
    assert other.restarts == 0 and other.state == "healthy"
    assert (tmp_path / "worker-0.log").read_text().count("==== ") == 2
    running.groups.add(old_pid)


async def test_an_exit_is_noticed_at_once_and_stop_does_not_wait_for_a_check(
    supervise: Callable[..., Running],
) -> None:
    running = supervise([sim_spec("worker-0")], replace(FAST, health_interval_s=60))
    await running.supervisor.start()
    await running.ready()
    worker = running.workers[0]
    assert worker.pid is not None
    running.groups.add(worker.pid)
    killed_at = time.monotonic()
    os.kill(worker.pid, signal.SIGKILL)
    await wait_until_async(lambda: worker.restarts == 1, 5, "restart")
    assert time.monotonic() - killed_at < 2  # not after the 60 s health interval
    await running.ready()
    began = time.monotonic()
    await running.supervisor.stop()
    assert time.monotonic() - began < 5


async def test_a_worker_answering_503_is_restarted(supervise: Callable[..., Running]) -> None:
    running = supervise([sim_spec("worker-0")])
    await running.supervisor.start()
    await running.ready()
    worker = running.workers[0]
    old_pid = worker.pid
    async with httpx.AsyncClient() as client:
        await client.post(worker.spec.url + "/sim/control", json={"healthy": False})
    await wait_until_async(
        lambda: worker.restarts == 1 and worker.state == "healthy", 30, "restarted"
    )
    assert worker.last_reason == "unhealthy: /health answered 503 (2 checks in a row)"
    assert old_pid is not None and not alive(old_pid)
    assert await health(worker) == 200


async def test_a_hung_worker_is_killed_and_restarted(supervise: Callable[..., Running]) -> None:
    """A stopped process neither answers /health nor acts on SIGTERM: it takes SIGKILL."""
    running = supervise([sim_spec("worker-0")], replace(FAST, stop_timeout_s=0.5))
    await running.supervisor.start()
    await running.ready()
    worker = running.workers[0]
    old_pid = worker.pid
    assert old_pid is not None
    os.kill(old_pid, signal.SIGSTOP)
    await wait_until_async(
        lambda: worker.restarts == 1 and worker.state == "healthy", 30, "restarted"
    )
    assert worker.last_reason is not None and "timed out" in worker.last_reason
    assert not alive(old_pid)


async def test_restarts_back_off_exponentially_up_to_the_cap(
    supervise: Callable[..., Running],
) -> None:
    policy = replace(FAST, backoff_s=0.1, backoff_cap_s=0.4, give_up_after=100)
    running = supervise([script_spec("crashy", "raise SystemExit(3)")], policy)
    began = time.monotonic()
    await running.supervisor.start()
    worker = running.workers[0]
    await wait_until_async(lambda: worker.starts >= 5, 30, "five starts")
    elapsed = time.monotonic() - began
    assert elapsed >= 0.1 + 0.2 + 0.4 + 0.4  # the waits before starts 2, 3, 4 and 5
    assert worker.last_delay_s == pytest.approx(0.4)
    assert worker.last_reason == "exited with status 3"


async def test_a_worker_not_healthy_within_the_start_budget_is_restarted(
    supervise: Callable[..., Running],
) -> None:
    policy = replace(FAST, start_timeout_s=0.5)
    running = supervise([script_spec("slow", "import time; time.sleep(60)")], policy)
    await running.supervisor.start()
    worker = running.workers[0]
    await wait_until_async(lambda: worker.pid is not None, 10, "started")
    first_pid = worker.pid
    await wait_until_async(lambda: worker.starts >= 2, 30, "restart after the start budget")
    assert worker.last_reason is not None
    assert worker.last_reason.startswith("not healthy within 0.5 s")
    assert first_pid is not None and not alive(first_pid)
    running.groups.add(first_pid)


async def test_a_worker_that_cannot_be_started_is_retried(
    supervise: Callable[..., Running], tmp_path: Path
) -> None:
    spec = WorkerSpec("missing", [str(tmp_path / "no-such-python")], "http://127.0.0.1:9")
    running = supervise([spec], replace(FAST, give_up_after=2))
    await running.supervisor.start()
    worker = running.workers[0]
    await wait_until_async(lambda: worker.starts >= 2, 10, "a second attempt")
    assert worker.last_reason is not None and worker.last_reason.startswith("could not start")
    failure = await asyncio.wait_for(running.supervisor.wait_failed(), 10)
    assert failure.reason.startswith("could not start") and "2 starts in a row" in failure.reason
    assert worker.starts == 2


async def test_a_worker_exiting_at_once_repeatedly_fails_with_the_end_of_its_log(
    supervise: Callable[..., Running], tmp_path: Path
) -> None:
    code = "import sys; print('loading'); print('no model at /nowhere', file=sys.stderr); exit(3)"
    running = supervise([script_spec("worker-0", code)], log_dir=tmp_path)
    await running.supervisor.start()
    failure = await asyncio.wait_for(running.supervisor.wait_failed(), 20)
    worker = running.workers[0]
    assert failure.worker == "worker-0" and failure.log == tmp_path / "worker-0.log"
    assert failure.reason == "exited with status 3 (3 starts in a row)"
    assert failure.last_lines == ("loading", "no model at /nowhere")  # the last start's only
    await asyncio.sleep(FAST.backoff_cap_s + 0.5)
    assert worker.starts == 3 and worker.state == "stopped"  # no fourth start


async def test_a_worker_whose_port_is_taken_fails_at_its_first_exit(
    supervise: Callable[..., Running], tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = build_sim_command(0, base_port=port)
        spec = WorkerSpec("worker-0", command.argv, command.url())
        running = supervise([spec], replace(FAST, give_up_after=5), log_dir=tmp_path)
        await running.supervisor.start()
        failure = await asyncio.wait_for(running.supervisor.wait_failed(), 30)
    assert running.workers[0].starts == 1
    assert failure.reason.endswith(f"(port of http://127.0.0.1:{port} in use)")
    assert any("address already in use" in line for line in failure.last_lines)


async def test_a_worker_healthy_once_is_restarted_however_often_it_dies(
    supervise: Callable[..., Running],
) -> None:
    running = supervise([sim_spec("worker-0")], replace(FAST, give_up_after=1))
    await running.supervisor.start()
    worker = running.workers[0]
    for restarts in (1, 2):
        await running.ready()
        assert worker.pid is not None
        running.groups.add(worker.pid)
        os.killpg(worker.pid, signal.SIGKILL)
        await wait_until_async(lambda: worker.restarts == restarts, 10, "restarted")  # noqa: B023
    await running.ready()
    assert running.supervisor.failure is None


async def test_stop_ends_the_whole_process_group_even_children_that_ignore_sigterm(
    supervise: Callable[..., Running],
) -> None:
    sim = sim_spec("worker-0")
    shell = f"trap '' TERM; sleep 1000 & exec {shlex.join(sim.argv)}"
    spec = WorkerSpec("worker-0", ["/bin/sh", "-c", shell], sim.url)
    running = supervise([spec], replace(FAST, stop_timeout_s=1))
    await running.supervisor.start()
    await running.ready()
    pgid = running.workers[0].pid
    assert pgid is not None and len(group_pids(pgid)) == 2  # the sim and its `sleep`
    began = time.monotonic()
    await running.supervisor.stop()
    assert group_pids(pgid) == []
    assert time.monotonic() - began < 10
    assert running.workers[0].state == "stopped"


async def test_worker_output_goes_to_its_file_and_prefixed_to_the_terminal(
    supervise: Callable[..., Running], tmp_path: Path
) -> None:
    code = "print('hello'); print('wor', end='', flush=True); print('ld', flush=True); "
    code += "import time; time.sleep(60)"
    terminal = io.BytesIO()
    running = supervise(
        [script_spec("w-1", code)], log_dir=tmp_path, log_to_terminal=True, terminal=terminal
    )
    await running.supervisor.start()
    await wait_until_async(lambda: b"world" in terminal.getvalue(), 20, "output on the terminal")
    await running.supervisor.stop()
    assert terminal.getvalue() == b"[w-1] hello\n[w-1] world\n"
    log = (tmp_path / "w-1.log").read_text()
    assert log.splitlines()[1:] == ["hello", "world"]


async def test_worker_output_on_the_terminal_is_json_events_with_json_output(
    supervise: Callable[..., Running], tmp_path: Path
) -> None:
    code = "print('hello', flush=True); import time; time.sleep(60)"
    terminal = io.BytesIO()
    running = supervise(
        [script_spec("w-1", code)],
        log_dir=tmp_path,
        log_to_terminal=True,
        terminal=terminal,
        json_output=True,
    )
    await running.supervisor.start()
    await wait_until_async(lambda: b"hello" in terminal.getvalue(), 20, "output on the terminal")
    await running.supervisor.stop()
    [event] = [json.loads(line) for line in terminal.getvalue().splitlines()]
    assert (event["event"], event["worker"], event["line"]) == ("worker_output", "w-1", "hello")
    assert (tmp_path / "w-1.log").read_text().splitlines()[1:] == ["hello"]
