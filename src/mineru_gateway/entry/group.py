"""`mineru-gateway up`: N workers and the gateway as one supervised group, in one process.

- The gateway's socket is bound first, before anything starts: a port already taken is one line
  on stderr and exit status 1. Worker N listens on the gateway's port + 1 + N (unless
  `--worker-base-port` says otherwise); those ports are checked free the same way. Then the
  workers start in parallel. The gateway answers 503 until a worker is healthy: its registry adds a
  worker to routing only after a good probe, and drops it again when it fails.
- A worker that cannot start (its port taken, or exiting before its first healthy check
  `give_up_after` times in a row) stops the group: the last lines of its log are shown and the
  process exits 1, rather than restarting it for ever.
- Worker logs go to a directory of this run's own (`--log-dir`, by default under
  `$XDG_STATE_HOME/mineru-gateway/logs/`), named when the gateway starts listening.
- The supervisor restarts a worker that exits or stops answering `/health`, with backoff; the
  gateway serves on the others meanwhile and takes the worker back once its probe passes.
- SIGHUP (or `POST /v1/workers/restart`, `mineru-gateway workers restart`): a rolling restart,
  one worker at a time: drained, restarted, healthy again, then the next (workers/rolling.py).
- SIGTERM/SIGINT: the gateway stops accepting connections and lets in-flight requests finish for
  up to `drain_timeout_s` (the server's graceful shutdown; a second signal skips the wait), then the
  workers are stopped (TERM, then KILL, whole process groups) and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import structlog

from mineru_gateway.api.app import WorkerControl, create_app
from mineru_gateway.api.context import Lifecycle
from mineru_gateway.config import DEFAULT_WORKER_BASE_PORT, GatewaySettings, LauncherSettings
from mineru_gateway.entry import server
from mineru_gateway.entry.flags import Switch
from mineru_gateway.sim import SimConfig
from mineru_gateway.workers.launcher import (
    VllmOptions,
    WorkerCommand,
    add_vllm_arguments,
    batch_size,
    build_sim_command,
    build_vllm_command,
    cpu_binds,
    flag_value,
    vllm_options,
)
from mineru_gateway.workers.supervisor import (
    RestartPolicy,
    Supervisor,
    WorkerFailure,
    WorkerSpec,
)

log = structlog.get_logger("mineru_gateway.group")

Engine = Literal["sim", "vllm"]
WORKER_HOST = "127.0.0.1"  # workers of a local group are reached by this process only


@dataclass(frozen=True, slots=True)
class GroupOptions:
    """Everything `up` needs besides the gateway's settings."""

    engine: Engine
    num_workers: int
    log_dir: Path
    base_port: int = DEFAULT_WORKER_BASE_PORT
    sim_args: tuple[str, ...] = ()
    vllm: VllmOptions | None = None
    cpus: tuple[int, ...] = ()  # cores to share among cpu vLLM workers
    log_to_terminal: bool = False
    policy: RestartPolicy = field(default_factory=RestartPolicy)

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError("--workers must be at least 1")
        if self.engine == "vllm" and self.vllm is None:
            raise ValueError("engine vllm needs vLLM options")

    def commands(self, environ: Mapping[str, str]) -> list[WorkerCommand]:
        """One command per worker, from the one builder (workers.launcher)."""
        if self.engine == "sim" or self.vllm is None:
            return [
                build_sim_command(i, base_port=self.base_port, extra_args=self.sim_args)
                for i in range(self.num_workers)
            ]
        binds: Sequence[str | None] = [None] * self.num_workers
        if self.vllm.platform == "cpu":
            binds = cpu_binds(self.num_workers, self.cpus or sorted(os.sched_getaffinity(0)))
        return [
            build_vllm_command(i, self.vllm, cpu_bind=binds[i], environ=environ)
            for i in range(self.num_workers)
        ]

    def specs(self, environ: Mapping[str, str]) -> list[WorkerSpec]:
        return [
            WorkerSpec(f"worker-{i}", command.argv, command.url(), command.environ(environ))
            for i, command in enumerate(self.commands(environ))
        ]

    def worker_urls(self) -> list[str]:
        return [command.url() for command in self.commands({})]

    def batch_limit(self) -> int | None:
        """Each worker's running batch, as the group starts them: flow control's `batch_limit`."""
        if self.engine == "vllm" and self.vllm is not None:
            return batch_size(self.vllm)
        value = flag_value(self.sim_args, "max-num-seqs")
        return int(value) if value is not None and value.isdigit() else SimConfig().max_num_seqs


def default_log_dir(
    environ: Mapping[str, str], gateway_port: int, started: datetime | None = None
) -> Path:
    """This run's own directory: `$XDG_STATE_HOME/mineru-gateway/logs/<UTC time>-port<port>`
    (`~/.local/state` without XDG_STATE_HOME), so runs from different checkouts never share
    a worker's log."""
    state = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    stamp = (started or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
    return Path(state) / "mineru-gateway" / "logs" / f"{stamp}-port{gateway_port}"


def add_group_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `mineru-gateway up` other than the gateway's settings."""
    parser.add_argument(
        "--engine",
        choices=["sim", "vllm"],
        default="sim",
        help="what the workers run: sim (simulated vLLM workers, no model needed) or vllm "
        "(default: sim)",
    )
    parser.add_argument(
        "--workers",
        "-n",
        dest="num_workers",
        type=int,
        default=4,
        metavar="N",
        help="how many workers to start, a count (`serve --workers` takes worker URLs instead) "
        "(default: 4)",
    )
    parser.add_argument(
        "--worker-base-port",
        type=int,
        metavar="PORT",
        help="worker N listens on PORT + N [env MINERU_GATEWAY_WORKER_BASE_PORT; default: the "
        "gateway's port + 1]",
    )
    parser.add_argument(
        "--sim-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for each simulated worker, e.g. --sim-arg=--time-scale=10",
    )
    add_vllm_arguments(parser)
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra vLLM argument for each worker, e.g. --vllm-arg=--max-num-seqs=64",
    )
    supervision = parser.add_argument_group("supervision")
    supervision.add_argument(
        "--log-dir",
        type=Path,
        help="one log file per worker here [default: a directory of this run's own, "
        "$XDG_STATE_HOME/mineru-gateway/logs/<time>-port<port>, named at start]",
    )
    supervision.add_argument(
        "--log-to-terminal",
        action=Switch,
        default=False,
        help="also print worker output on the terminal, each line prefixed [worker-N] (a "
        "worker_output event with --log-format json) (default: off)",
    )
    policy = RestartPolicy()
    for flag, default, help_text in (
        ("--start-timeout-s", policy.start_timeout_s, "a worker not healthy by then is restarted"),
        ("--stop-timeout-s", policy.stop_timeout_s, "SIGTERM to a worker, then SIGKILL"),
        ("--restart-backoff-s", policy.backoff_s, "first restart delay, doubled each failure"),
        ("--restart-backoff-max-s", policy.backoff_cap_s, "longest restart delay"),
    ):
        supervision.add_argument(
            flag, type=float, default=default, help=f"{help_text} (default {default:g})"
        )
    supervision.add_argument(
        "--unhealthy-after",
        type=int,
        default=policy.unhealthy_after,
        metavar="N",
        help=f"restart a worker after N failed /health checks in a row "
        f"(every {policy.health_interval_s:g} s; default {policy.unhealthy_after})",
    )


def group_options_from_args(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    gateway_port: int | None = None,
) -> GroupOptions:
    """`up`'s flags (and MINERU_GATEWAY_* variables) as options; ValueError when inconsistent.
    Workers listen from `gateway_port` + 1 on unless a base port is given."""
    environ = os.environ if environ is None else environ
    launcher = LauncherSettings.from_args(args)
    vllm = None
    if args.engine == "vllm":
        vllm = vllm_options(launcher, args.vllm_arg, host=WORKER_HOST)
        if shutil.which(vllm.vllm_python, path=environ.get("PATH")) is None:
            raise ValueError(
                f"vLLM's Python {vllm.vllm_python!r} was not found: set --vllm-python or "
                "MINERU_GATEWAY_VLLM_PYTHON to the interpreter of vLLM's environment"
            )
    base_port = launcher.worker_base_port
    if "worker_base_port" not in launcher.model_fields_set and gateway_port:
        base_port = gateway_port + 1
    if vllm is not None:
        vllm = replace(vllm, base_port=base_port)
    defaults = RestartPolicy()
    policy = RestartPolicy(
        start_timeout_s=args.start_timeout_s,
        stop_timeout_s=args.stop_timeout_s,
        backoff_s=args.restart_backoff_s,
        backoff_cap_s=args.restart_backoff_max_s,
        unhealthy_after=args.unhealthy_after,
        health_interval_s=defaults.health_interval_s,
    )
    return GroupOptions(
        engine=args.engine,
        num_workers=args.num_workers,
        log_dir=args.log_dir or default_log_dir(environ, gateway_port or 0),
        base_port=base_port,
        sim_args=tuple(args.sim_arg),
        vllm=vllm,
        log_to_terminal=args.log_to_terminal,
        policy=policy,
    )


def bind_gateway(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound now (as uvicorn binds it); OSError when the port
    is taken. Port 0 picks a free one: its number is `getsockname()[1]`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def worker_port_taken(options: GroupOptions) -> str | None:
    """What is wrong with the workers' ports (out of range, or taken), or None."""
    last = options.base_port + options.num_workers - 1
    if not 1 <= options.base_port <= last <= 65535:
        return f"worker ports {options.base_port}-{last} are not all ports"
    for index in range(options.num_workers):
        port = options.base_port + index
        try:
            bind_gateway(WORKER_HOST, port).close()
        except OSError as error:
            return (
                f"worker-{index} cannot listen on {WORKER_HOST}:{port}: {error.strerror} "
                "(choose another --port, or --worker-base-port)"
            )
    return None


def run_group(settings: GatewaySettings, options: GroupOptions, sock: socket.socket) -> int:
    """Runs the group until SIGTERM/SIGINT: 0 once everything has stopped, 1 when a worker
    could not start. `sock`: the gateway's bound socket (`bind_gateway`)."""
    codes: list[int] = []

    async def main() -> None:
        codes.append(await serve_group(settings, options, sock=sock))

    server.run_async(main)
    return codes[0] if codes else 0


async def serve_group(
    settings: GatewaySettings,
    options: GroupOptions,
    environ: Mapping[str, str] | None = None,
    sock: socket.socket | None = None,
) -> int:
    specs = options.specs(os.environ if environ is None else environ)
    supervisor = Supervisor(
        specs,
        options.policy,
        log_dir=options.log_dir,
        log_to_terminal=options.log_to_terminal,
        json_output=settings.log_format == "json",
    )
    lifecycle = Lifecycle()
    control = WorkerControl(supervisor.restart, options.policy.start_timeout_s)
    gateway = server.make_server(
        create_app(settings, lifecycle, control),
        settings.host,
        settings.port,
        graceful_timeout_s=settings.drain_timeout_s,
        timeouts=server.edge_timeouts(settings),
    )
    gateway.on_signal = lifecycle.start_draining
    sockets = [sock] if sock is not None else None
    serving = asyncio.create_task(gateway.serve(sockets), name="gateway")
    # The server only exposes a flag for "listening": poll it briefly.
    while not gateway.started and not serving.done():  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    if not gateway.started:
        await serving  # stopped (or failed) before it listened
        return 1
    gateway_url = f"http://{settings.host}:{settings.port}"
    log.info(
        "gateway_listening",
        url=gateway_url,
        engine=options.engine,
        workers=[spec.url for spec in specs],
        worker_logs=str(options.log_dir),
    )
    started = time.monotonic()
    await supervisor.start()
    announce = asyncio.create_task(_announce_ready(supervisor, gateway_url, started))
    failed = asyncio.create_task(supervisor.wait_failed())
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, lifecycle.request_rolling_restart)
    try:
        await asyncio.wait((serving, failed), return_when=asyncio.FIRST_COMPLETED)
        if failed.done():
            gateway.should_exit = True  # no worker will come: stop rather than answer 503
        await serving
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        announce.cancel()
        failed.cancel()
        with _signals_deferred():
            await supervisor.stop()
    if supervisor.failure is not None:
        _report_failure(supervisor.failure, settings.log_format == "json")
        return 1
    log.info("group_stopped")
    return 0


def _report_failure(failure: WorkerFailure, as_json: bool) -> None:
    """Why the group stopped, with the end of the worker's log: an event in a JSON log, a few
    plain lines for people otherwise."""
    where = str(failure.log) if failure.log is not None else None
    if as_json:
        log.error(
            "group_failed",
            worker=failure.worker,
            reason=failure.reason,
            log=where,
            last_lines=list(failure.last_lines),
        )
        return
    lines = [f"mineru-gateway up: {failure.worker} could not start: {failure.reason}"]
    if failure.last_lines:
        lines.append(f"last lines of {where}:")
        lines += [f"  {line}" for line in failure.last_lines]
    print("\n".join(lines), file=sys.stderr, flush=True)


async def _announce_ready(supervisor: Supervisor, gateway_url: str, started: float) -> None:
    await supervisor.wait_all_ready()
    log.info(
        "all_workers_ready",
        workers=len(supervisor.workers),
        gateway=gateway_url,
        after_s=round(time.monotonic() - started, 1),
    )


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """While workers stop, another SIGTERM/SIGINT must not cut that short and leave them behind."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, log.info, "already_stopping_workers")
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
