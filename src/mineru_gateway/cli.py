"""`mineru-gateway`: serve the gateway, run a simulated worker, or bring up a whole group."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import pydantic
import structlog

from mineru_gateway import __version__, server
from mineru_gateway.api.app import create_app
from mineru_gateway.config import GatewaySettings
from mineru_gateway.logs import configure_logging
from mineru_gateway.sim import add_sim_arguments, create_sim_app, sim_config_from_args
from mineru_gateway.workers.supervisor import Supervisor, WorkerSpec

log = structlog.get_logger("mineru_gateway.cli")

UP_WORKER_BASE_PORT = 30001


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
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, help=help_text)


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

    serve = commands.add_parser("serve", help="run the gateway in front of running workers")
    _add_settings_arguments(serve)
    serve.set_defaults(handler=_serve)

    sim = commands.add_parser("sim", help="run one simulated vLLM worker")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8000)
    sim.add_argument("--log-level", default="warning")
    add_sim_arguments(sim)
    sim.set_defaults(handler=_sim)

    up = commands.add_parser("up", help="start N workers and the gateway as one supervised group")
    up.add_argument("--engine", choices=["sim"], default="sim", help="worker engine")
    up.add_argument(
        "--workers", "-n", dest="num_workers", type=int, default=4, help="how many workers"
    )
    up.add_argument("--worker-base-port", type=int, default=UP_WORKER_BASE_PORT)
    up.add_argument(
        "--sim-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for each simulated worker, e.g. --sim-arg=--time-scale=10",
    )
    _add_settings_arguments(up, skip=("workers",))
    up.set_defaults(handler=_up)
    return parser


def _serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    configure_logging(settings.log_level, settings.log_format)
    server.run(create_app(settings), settings.host, settings.port, settings.log_level)
    return 0


def _sim(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, "json")
    config = sim_config_from_args(args)
    server.run(create_sim_app(config), args.host, args.port, args.log_level)
    return 0


def sim_worker_specs(count: int, base_port: int, extra: Sequence[str]) -> list[WorkerSpec]:
    specs = []
    for index in range(count):
        port = base_port + index
        argv = [sys.executable, "-m", "mineru_gateway", "sim", "--port", str(port), *extra]
        specs.append(WorkerSpec(f"sim-{index}", argv, f"http://127.0.0.1:{port}"))
    return specs


def _up(args: argparse.Namespace) -> int:
    specs = sim_worker_specs(args.num_workers, args.worker_base_port, args.sim_arg)
    settings = settings_from_args(args, workers=[spec.url for spec in specs])
    configure_logging(settings.log_level, settings.log_format)
    supervisor = Supervisor(specs)

    async def main() -> None:
        try:
            await supervisor.start()
            gateway = server.make_server(
                create_app(settings), settings.host, settings.port, settings.log_level
            )
            log.info("gateway_listening", url=f"http://{settings.host}:{settings.port}")
            await gateway.serve()
        finally:
            await supervisor.stop()

    server.run_async(main)
    return 0


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
