"""Starting, watching, restarting and stopping worker processes (uvicorn's supervisor split,
STYLE.md): the supervisor only manages processes; routing learns about health from its own probes.

One task per worker runs its life:

    spawn -> starting --/health 200--> healthy --`unhealthy_after` failed checks--+
       ^        |  exits, or not healthy within `start_timeout_s`       | exits     |
       |        v                                                       v           v
       +-- back off <------------------------ stop its process group <-------------+

- Each worker runs in a session (process group) of its own, so stopping it reaches every process
  it spawned (vLLM starts an engine core and workers), and asks the kernel to SIGTERM it when the
  supervisor dies, so no worker outlives its supervisor even after a SIGKILL.
- Stopping a worker: SIGTERM to its main process (vLLM then shuts its engine core down in order),
  then SIGTERM to what is left of its group, then SIGKILL (as mineru_gateway/testing.py does).
- Restarts back off exponentially (`backoff_s * 2**n`, capped); a worker that had stayed healthy
  for `backoff_reset_s` starts again from `backoff_s`.
- Output goes to one file per worker (appended across restarts), and with `log_to_terminal` also
  to the terminal, each line prefixed `[name]` (or, with `json_output`, as a JSON event).
- A worker that cannot start is not restarted for ever: when it exits before its first healthy
  check with a port already in use in its log, or `give_up_after` times in a row, supervision
  fails (`wait_failed`) with the last lines of its log, and the group stops (entry/group.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Literal

import orjson
import structlog

from mineru_gateway.workers.http1 import ConnectFailed, Disconnected, Http1Pool, Malformed
from mineru_gateway.workers.upstream import KEEPALIVE_S

log = structlog.get_logger("mineru_gateway.supervisor")

PR_SET_PDEATHSIG = 1
GROUP_GRACE_S = 5.0  # after the main process: TERM to the rest of its group, then KILL
TAIL_LINES = 20  # of a worker's log, shown when it cannot start
_TAIL_BYTES = 64 * 1024
# Python's and uvicorn's words for EADDRINUSE: no restart can free the port.
PORT_IN_USE = re.compile(rb"address already in use|errno 98\b|eaddrinuse", re.IGNORECASE)

WorkerState = Literal["starting", "healthy", "unhealthy", "backoff", "stopped"]


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to start one worker, and where it answers once it is up."""

    name: str
    argv: Sequence[str]
    url: str
    env: Mapping[str, str] | None = None  # the complete environment; None: the supervisor's


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Start-up budget, health checks, stop grace and restart backoff."""

    start_timeout_s: float = 900.0  # vLLM on NPUs: model load and graph capture take minutes
    start_poll_s: float = 0.5  # /health while starting (a ready worker is noticed at once)
    health_interval_s: float = 5.0  # /health once healthy
    health_timeout_s: float = 5.0
    unhealthy_after: int = 3  # failed checks in a row before a healthy worker is restarted
    stop_timeout_s: float = 15.0  # SIGTERM to the main process until it exits
    backoff_s: float = 1.0
    backoff_cap_s: float = 60.0
    backoff_reset_s: float = 120.0
    give_up_after: int = 3  # exits in a row before a first healthy check that stop the group

    def __post_init__(self) -> None:
        if self.unhealthy_after < 1:
            raise ValueError("unhealthy_after must be at least 1")
        if self.give_up_after < 1:
            raise ValueError("give_up_after must be at least 1")
        for name in ("start_timeout_s", "start_poll_s", "health_interval_s", "health_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0 <= self.backoff_s <= self.backoff_cap_s:
            raise ValueError("need 0 <= backoff_s <= backoff_cap_s")

    def delay(self, failures: int) -> float:
        """Seconds before the restart that follows `failures` earlier failures in a row."""
        return float(min(self.backoff_s * 2 ** min(failures, 32), self.backoff_cap_s))


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """Why a worker could not start, and the end of its log."""

    worker: str
    reason: str
    log: Path | None
    last_lines: tuple[str, ...]


@dataclass(slots=True)
class ManagedWorker:
    """One worker's process and history, owned by its supervisor task."""

    spec: WorkerSpec
    state: WorkerState = "stopped"
    process: asyncio.subprocess.Process | None = None
    starts: int = 0
    failures: int = 0  # in a row, for the backoff
    early_exits: int = 0  # in a row, each before a first healthy check
    started_at: float = 0.0
    healthy_since: float | None = None
    last_reason: str | None = None  # why it was last restarted
    last_delay_s: float | None = None  # the backoff before that restart
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set while healthy
    restart_requested: asyncio.Event = field(default_factory=asyncio.Event)
    output_task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def restarts(self) -> int:
        return max(self.starts - 1, 0)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    """Runs a group of workers: starts them in parallel, restarts the failed ones, stops them all.

    `start()` returns at once; `wait_all_ready()` waits until every worker has been healthy.
    """

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        policy: RestartPolicy | None = None,
        *,
        log_dir: Path | None = None,
        log_to_terminal: bool = False,
        terminal: IO[bytes] | None = None,
        json_output: bool = False,
    ) -> None:
        self.workers = [ManagedWorker(spec) for spec in specs]
        self.policy = policy or RestartPolicy()
        self._log_dir = log_dir
        self._tee = log_to_terminal
        self._terminal = terminal
        self._json_output = json_output
        self.failure: WorkerFailure | None = None
        self._failed = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._pool: Http1Pool | None = None  # the probes' connections (the gateway's client)

    def log_path(self, worker: ManagedWorker) -> Path | None:
        return self._log_dir / f"{worker.name}.log" if self._log_dir is not None else None

    async def start(self) -> None:
        """Starts every worker (in parallel) and returns; each is then watched and restarted."""
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
        self._pool = Http1Pool(self.policy.health_timeout_s, KEEPALIVE_S)
        self._tasks = [
            asyncio.create_task(self._supervise(worker), name=f"supervise-{worker.name}")
            for worker in self.workers
        ]

    async def wait_all_ready(self) -> None:
        """Returns once every worker is healthy at the same time."""
        while not all(worker.ready.is_set() for worker in self.workers):
            await asyncio.gather(*(worker.ready.wait() for worker in self.workers))

    async def wait_failed(self) -> WorkerFailure:
        """Returns when a worker could not start (and will not be restarted again)."""
        await self._failed.wait()
        assert self.failure is not None
        return self.failure

    def worker_at(self, url: str) -> ManagedWorker:
        for worker in self.workers:
            if worker.spec.url == url:
                return worker
        raise KeyError(url)

    async def restart(self, url: str, poll_s: float = 0.05) -> None:
        """Stops the worker at `url` (TERM, then KILL) and starts it again at once, without
        backoff or counting a failure; returns once the new process answers `/health`. The
        caller drains it first (workers.rolling)."""
        worker = self.worker_at(url)
        starts = worker.starts
        worker.restart_requested.set()
        while worker.starts <= starts:  # noqa: ASYNC110 - the supervise task respawns it
            await asyncio.sleep(poll_s)
        await worker.ready.wait()

    async def stop(self) -> None:
        """Stops supervising, then stops every worker's whole process group."""
        self._stop.set()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker, result in zip(self.workers, results, strict=False):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.error("supervisor_task_failed", worker=worker.name, error=repr(result))
        await asyncio.gather(*(self._terminate(worker) for worker in self.workers))
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for worker in self.workers:
            worker.state = "stopped"

    # -- one worker's life ------------------------------------------------------------------
    async def _supervise(self, worker: ManagedWorker) -> None:
        while not self._stop.is_set():
            try:
                await self._spawn(worker)
            except OSError as error:
                reason = f"could not start: {error}"
                if self._gives_up(worker, reason):
                    return
            else:
                reason = await self._watch(worker)
                if self._stop.is_set():
                    return
                # Exited (not timed out) before its first healthy check this start.
                exited_early = worker.state == "starting" and not worker.running
                await self._terminate(worker)
                if exited_early and self._gives_up(worker, reason):
                    return
                if worker.restart_requested.is_set():
                    worker.restart_requested.clear()
                    self._set_unready(worker, "starting")
                    worker.last_reason, worker.last_delay_s = reason, 0.0
                    log.info("worker_restarting", worker=worker.name, reason=reason)
                    continue
            self._set_unready(worker, "backoff")
            delay = self._next_delay(worker)
            worker.last_reason, worker.last_delay_s = reason, delay
            log.warning(
                "worker_restarting",
                worker=worker.name,
                reason=reason,
                restart_in_s=delay,
                restarts=worker.restarts,
            )
            await self._back_off(worker, delay)

    def _gives_up(self, worker: ManagedWorker, reason: str) -> bool:
        """After an exit before a first healthy check: True (and the failure set) when another
        start would fail the same way."""
        worker.early_exits += 1
        tail = self._log_tail(worker)
        in_use = any(PORT_IN_USE.search(line.encode()) for line in tail)
        if not in_use and worker.early_exits < self.policy.give_up_after:
            return False
        if in_use:
            reason += f" (port of {worker.spec.url} in use)"
        elif worker.early_exits > 1:
            reason += f" ({worker.early_exits} starts in a row)"
        self._set_unready(worker, "stopped")
        if self.failure is None:
            self.failure = WorkerFailure(worker.name, reason, self.log_path(worker), tail)
            self._failed.set()
        log.error("worker_failed_to_start", worker=worker.name, reason=reason)
        return True

    def _log_tail(self, worker: ManagedWorker) -> tuple[str, ...]:
        """The last lines the worker's latest start wrote to its log."""
        path = self.log_path(worker)
        if path is None or not path.is_file():
            return ()
        with path.open("rb") as log_file:
            log_file.seek(max(path.stat().st_size - _TAIL_BYTES, 0))
            text = log_file.read().decode(errors="replace")
        lines = text.splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("==== ")]
        if starts:  # this start's lines only, not its header
            lines = lines[starts[-1] + 1 :]
        return tuple(lines[-TAIL_LINES:])

    async def _back_off(self, worker: ManagedWorker, delay: float) -> None:
        """Waits `delay` before the next start; a stop, or a requested restart, cuts it short."""
        waits = [
            asyncio.ensure_future(self._stop.wait()),
            asyncio.ensure_future(worker.restart_requested.wait()),
        ]
        try:
            await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        worker.restart_requested.clear()  # the start that follows is the one asked for

    def _next_delay(self, worker: ManagedWorker) -> float:
        stable = self.policy.backoff_reset_s
        if worker.healthy_since is not None and time.monotonic() - worker.healthy_since >= stable:
            worker.failures = 0
        delay = self.policy.delay(worker.failures)
        worker.failures += 1
        worker.healthy_since = None
        return delay

    async def _spawn(self, worker: ManagedWorker) -> None:
        spec = worker.spec
        worker.starts += 1
        worker.state = "starting"
        log_file = self._open_log(worker)
        try:
            stdout: IO[bytes] | int | None = log_file
            if self._tee:
                stdout = asyncio.subprocess.PIPE
            worker.process = await asyncio.create_subprocess_exec(
                *spec.argv,
                env=dict(spec.env) if spec.env is not None else None,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=stdout,
                stderr=asyncio.subprocess.STDOUT if stdout is not None else None,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError:
            if log_file is not None:
                log_file.close()
            raise
        worker.started_at = time.monotonic()
        if self._tee and worker.process.stdout is not None:
            render = _json_line if self._json_output else _prefixed_line
            worker.output_task = asyncio.create_task(
                _copy_output(worker.process.stdout, worker.name, log_file, self._terminal, render),
                name=f"output-{worker.name}",
            )
        elif log_file is not None:
            log_file.close()  # the child has its own descriptor
        log.info(
            "worker_started",
            worker=worker.name,
            pid=worker.process.pid,
            url=spec.url,
            start=worker.starts,
            log=str(self.log_path(worker)) if self._log_dir else None,
        )

    def _open_log(self, worker: ManagedWorker) -> IO[bytes] | None:
        path = self.log_path(worker)
        if path is None:
            return None
        log_file = path.open("ab")
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        header = f"==== {stamp} mineru-gateway: start {worker.starts} of {worker.name}: "
        log_file.write((header + " ".join(worker.spec.argv) + "\n").encode())
        log_file.flush()
        return log_file

    async def _watch(self, worker: ManagedWorker) -> str:
        """Waits until the worker must be restarted (or the supervisor stops); says why."""
        assert worker.process is not None
        process = worker.process
        exited = asyncio.ensure_future(process.wait())
        stopping = asyncio.ensure_future(self._stop.wait())
        requested = asyncio.ensure_future(worker.restart_requested.wait())
        deadline = worker.started_at + self.policy.start_timeout_s
        misses = 0
        try:
            while True:
                healthy = worker.state in ("healthy", "unhealthy")
                interval = self.policy.health_interval_s if healthy else self.policy.start_poll_s
                await asyncio.wait(
                    (exited, stopping, requested),
                    timeout=interval,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if stopping.done():
                    return "stopping"
                if requested.done():
                    return "restart requested"
                if exited.done():
                    return f"exited with status {process.returncode}"
                problem = await self._probe(worker)
                if problem is None:
                    misses = 0
                    self._set_healthy(worker)
                elif healthy:
                    misses += 1
                    self._set_unready(worker, "unhealthy")
                    log.warning(
                        "worker_check_failed",
                        worker=worker.name,
                        error=problem,
                        misses=misses,
                    )
                    if misses >= self.policy.unhealthy_after:
                        return f"unhealthy: {problem} ({misses} checks in a row)"
                elif time.monotonic() > deadline:
                    return f"not healthy within {self.policy.start_timeout_s:g} s ({problem})"
        finally:
            exited.cancel()
            stopping.cancel()
            requested.cancel()

    async def _probe(self, worker: ManagedWorker) -> str | None:
        """None when `/health` answers 200, else what went wrong."""
        assert self._pool is not None
        limit = self.policy.health_timeout_s
        try:
            answer = await self._pool.request("GET", f"{worker.spec.url}/health", {}, b"", limit)
        except TimeoutError:
            return f"/health timed out after {limit:g} s"
        except (ConnectFailed, Disconnected, Malformed) as error:
            return f"/health failed: {error}"
        answer.close()  # its body is not read: a connection whose answer has not ended goes
        return None if answer.status == 200 else f"/health answered {answer.status}"

    def _set_healthy(self, worker: ManagedWorker) -> None:
        if worker.state == "healthy":
            return
        if worker.state == "starting":
            log.info(
                "worker_ready",
                worker=worker.name,
                url=worker.spec.url,
                after_s=round(time.monotonic() - worker.started_at, 1),
                restarts=worker.restarts,
            )
            worker.healthy_since = time.monotonic()
            worker.early_exits = 0
        else:
            log.info("worker_recovered", worker=worker.name)
        worker.state = "healthy"
        worker.ready.set()

    def _set_unready(self, worker: ManagedWorker, state: WorkerState) -> None:
        worker.state = state
        worker.ready.clear()

    # -- stopping ---------------------------------------------------------------------------
    async def _terminate(self, worker: ManagedWorker) -> None:
        """Ends the worker's main process, then anything left in its process group."""
        process = worker.process
        if process is None:
            return
        if process.returncode is None:
            _signal_process(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.policy.stop_timeout_s)
            except TimeoutError:
                log.warning("worker_stop_timeout", worker=worker.name, pid=process.pid)
        pgid = process.pid  # start_new_session: the main process leads its own group
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGTERM)
            if not await _wait_group_gone(pgid, min(GROUP_GRACE_S, self.policy.stop_timeout_s)):
                log.warning("worker_group_killed", worker=worker.name, pgid=pgid)
                _signal_group(pgid, signal.SIGKILL)
                await _wait_group_gone(pgid, GROUP_GRACE_S)
        await process.wait()
        if worker.output_task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.output_task, GROUP_GRACE_S)
            worker.output_task = None
        log.info("worker_stopped", worker=worker.name, status=process.returncode)


def _prefixed_line(name: str, line: bytes) -> bytes:
    return f"[{name}] ".encode() + line + b"\n"


def _json_line(name: str, line: bytes) -> bytes:
    """A worker's output line as an event of the gateway's JSON log."""
    stamp = datetime.now(UTC).isoformat()
    text = line.decode(errors="replace")
    event = {"event": "worker_output", "worker": name, "line": text, "timestamp": stamp}
    return orjson.dumps(event) + b"\n"


async def _copy_output(
    stream: asyncio.StreamReader,
    name: str,
    log_file: IO[bytes] | None,
    terminal: IO[bytes] | None,
    render: Callable[[str, bytes], bytes] = _prefixed_line,
) -> None:
    """Copies a worker's output to its log file and, line by line, to the terminal."""
    out = terminal if terminal is not None else sys.stderr.buffer
    pending = b""
    try:
        while chunk := await stream.read(65536):
            if log_file is not None:
                log_file.write(chunk)
                log_file.flush()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if lines:
                out.write(b"".join(render(name, line) for line in lines))
                out.flush()
        if pending:
            out.write(render(name, pending))
            out.flush()
    finally:
        if log_file is not None:
            log_file.close()


def _signal_process(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _wait_group_gone(pgid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
