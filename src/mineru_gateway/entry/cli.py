"""`mineru-gateway`: serve the gateway, run a simulated worker, or bring up a whole group."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from collections.abc import Sequence
from typing import Any

import pydantic
import structlog

from mineru_gateway import __version__
from mineru_gateway.api.app import create_app
from mineru_gateway.api.context import Lifecycle
from mineru_gateway.config import GatewaySettings
from mineru_gateway.entry import server
from mineru_gateway.entry.admin import __doc__ as ADMIN_DESCRIPTION
from mineru_gateway.entry.admin import add_admin_arguments, run_admin
from mineru_gateway.entry.compose import add_compose_arguments, run_compose
from mineru_gateway.entry.flags import HelpFormatter, Switch
from mineru_gateway.entry.group import (
    add_group_arguments,
    bind_gateway,
    group_options_from_args,
    run_group,
    worker_port_taken,
)
from mineru_gateway.entry.logs import configure_logging
from mineru_gateway.sim import add_sim_arguments, create_sim_app, sim_config_from_args
from mineru_gateway.telemetry import (
    DEFAULT_EXPORTER_PORT,
    DEFAULT_INTERVAL_S,
    create_exporter_app,
    parse_device_workers,
)
from mineru_gateway.workers.launcher import (
    WORKER_DESCRIPTION,
    add_worker_arguments,
    check_model,
    run_worker,
)

log = structlog.get_logger("mineru_gateway.cli")


def _add_settings_arguments(parser: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    """One flag per setting, documented with its environment variable; unset flags defer to it."""
    group = parser.add_argument_group(
        "gateway settings", "each also read from MINERU_GATEWAY_<NAME>; flags win"
    )
    for name, field in GatewaySettings.model_fields.items():
        if name in skip:
            continue
        env = f"MINERU_GATEWAY_{name.upper()}"
        default = field.get_default(call_default_factory=True)
        shown = ",".join(default) if isinstance(default, list) else default
        help_text = f"{field.description or ''} [env {env}; default {shown}]"
        flag = f"--{name.replace('_', '-')}"
        if field.annotation is bool:
            group.add_argument(flag, dest=name, action=Switch, default=None, help=help_text)
        else:
            group.add_argument(flag, dest=name, default=None, help=help_text)


def settings_from_args(args: argparse.Namespace, **overrides: Any) -> GatewaySettings:
    given = {
        name: value
        for name in GatewaySettings.model_fields
        if (value := getattr(args, name, None)) is not None
    }
    return GatewaySettings(**(given | overrides))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mineru-gateway",
        description="OpenAI-compatible gateway for MinerU2.5 over vLLM(-Ascend) workers.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="run the gateway in front of running workers", formatter_class=HelpFormatter
    )
    _add_settings_arguments(serve)
    serve.set_defaults(handler=_serve)

    sim = commands.add_parser("sim", help="run one simulated vLLM worker")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8000)
    sim.add_argument("--log-level", default="warning")
    add_sim_arguments(sim)
    sim.set_defaults(handler=_sim)

    up = commands.add_parser(
        "up",
        help="start N workers and the gateway as one supervised group",
        formatter_class=HelpFormatter,
    )
    add_group_arguments(up)
    _add_settings_arguments(up, skip=("workers",))
    up.set_defaults(handler=_up)

    worker = commands.add_parser(
        "worker",
        help="run one vLLM(-Ascend) server pinned to one device (the command compose/k8s run)",
        description=WORKER_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_worker_arguments(worker)
    worker.set_defaults(handler=run_worker)

    admin = commands.add_parser(
        "workers",
        help="list, drain, undrain or rolling-restart the workers of a running gateway (admin)",
        description=ADMIN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_admin_arguments(admin)
    admin.set_defaults(handler=run_admin)

    exporter = commands.add_parser(
        "npu-exporter",
        help="export npu-smi readings on /metrics (for hosts where the gateway does not run)",
        formatter_class=HelpFormatter,
    )
    exporter.add_argument("--host", default="0.0.0.0")
    exporter.add_argument("--port", type=int, default=DEFAULT_EXPORTER_PORT)
    exporter.add_argument(
        "--npu-smi", default=None, help="npu-smi path (default: npu-smi on PATH, at each reading)"
    )
    exporter.add_argument(
        "--npu-exporter-names",
        action=Switch,
        default=True,
        help="also export Ascend npu-exporter's names (npu_chip_info_*): false where Ascend's "
        "exporter runs on the same host, or each chip counts twice (default true)",
    )
    exporter.add_argument("--interval-s", type=float, default=DEFAULT_INTERVAL_S)
    exporter.add_argument(
        "--devices", default="", help="which worker uses which NPU: 0=http://w0:30001,1=..."
    )
    exporter.add_argument("--log-level", default="info")
    exporter.set_defaults(handler=_npu_exporter)

    compose = commands.add_parser(
        "compose",
        help="write docker-compose.yml and Prometheus' worker targets for a host's NPUs",
        description="Writes docker-compose.yml and deploy/prometheus/targets/workers.yml for "
        "one worker per NPU: worker services, the gateway's workers, the NPU exporter's devices "
        "and Prometheus' targets, all from one NPU list.",
    )
    add_compose_arguments(compose)
    compose.set_defaults(handler=run_compose)
    return parser


def _refused(command: str, settings: GatewaySettings) -> bool:
    """Says on stderr, in one line, why these settings must not serve; True if so."""
    problem = settings.open_access_refusal()
    if problem is not None:
        print(f"mineru-gateway {command}: {problem}", file=sys.stderr)
    return problem is not None


def _serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if _refused("serve", settings):
        return 2
    configure_logging(settings.log_level, settings.log_format)
    try:  # bound here, so a taken port is one line, not uvicorn's log and exit
        sock = bind_gateway(settings.host, settings.port)
    except OSError as error:
        where = f"{settings.host}:{settings.port}"
        print(f"mineru-gateway serve: cannot listen on {where}: {error.strerror}", file=sys.stderr)
        return 1
    with sock:
        run_gateway(settings, sock)
    return 0


def run_gateway(settings: GatewaySettings, sock: socket.socket) -> None:
    """The gateway on `sock` until SIGTERM/SIGINT, which first stops it admitting requests."""
    lifecycle = Lifecycle()
    server.run(
        create_app(settings, lifecycle),
        settings.host,
        settings.port,
        graceful_timeout_s=settings.drain_timeout_s,
        on_signal=lifecycle.start_draining,
        sockets=[sock],
        timeouts=server.edge_timeouts(settings),
    )


def _sim(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, "json")
    app = create_sim_app(sim_config_from_args(args))
    tasks: set[asyncio.Task[None]] = set()

    def shut_down() -> None:  # vLLM aborts (or drains) its requests on SIGTERM
        task = asyncio.get_running_loop().create_task(app.state.sim.shut_down())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server.run(app, args.host, args.port, on_signal=shut_down)
    return 0


def _npu_exporter(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, "json")
    devices = parse_device_workers(args.devices) if args.devices else {}
    app = create_exporter_app(
        npu_smi_path=args.npu_smi,
        interval_s=args.interval_s,
        device_workers=devices,
        npu_exporter_names=args.npu_exporter_names,
    )
    server.run(app, args.host, args.port)
    return 0


def _up(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, workers=[])
    if args.engine == "sim" and "allow_no_auth" not in settings.model_fields_set:
        # The embedded default: simulated workers, nothing behind them to protect.
        settings = settings.model_copy(update={"allow_no_auth": True})
    if _refused("up", settings):
        return 2
    try:
        sock = bind_gateway(settings.host, settings.port)
    except OSError as error:
        where = f"{settings.host}:{settings.port}"
        print(f"mineru-gateway up: cannot listen on {where}: {error.strerror}", file=sys.stderr)
        return 1
    with sock:
        port = sock.getsockname()[1]
        try:
            group = group_options_from_args(args, gateway_port=port)
            check_model(group.vllm)
        except ValueError as error:
            print(f"mineru-gateway up: {error}", file=sys.stderr)
            return 2
        problem = worker_port_taken(group)
        if problem is not None:
            print(f"mineru-gateway up: {problem}", file=sys.stderr)
            return 1
        update: dict[str, object] = {"workers": group.worker_urls(), "port": port}
        if settings.batch_limit is None:  # the group knows its workers' batch
            update["batch_limit"] = group.batch_limit()
        settings = settings.model_copy(update=update)
        configure_logging(settings.log_level, settings.log_format)
        return run_group(settings, group, sock)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except pydantic.ValidationError as error:
        print(f"mineru-gateway: invalid settings:\n{error}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
