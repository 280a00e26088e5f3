"""`python -m benchmarks.flow --scenario NAME --out benchmarks/results/flow_NAME.json`."""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import uvloop
from benchmarks.routing import fleet
from benchmarks.routing.runs import git_commit, stop_on_sigterm

from . import common, flood, report, single, sweep, vllm
from .stand import raise_fd_limit

SCENARIOS = ("flood", "sweep", "single", "vllm")
Runner = Callable[[Any, list[str], fleet.Processes], Coroutine[Any, Any, dict[str, Any]]]
RUNNERS: dict[str, Runner] = {
    "flood": flood.run,
    "sweep": sweep.run,
    "single": single.run,
    "vllm": vllm.run,
}
PLANS: dict[str, Any] = {
    "flood": flood.FloodPlan,
    "sweep": sweep.SweepPlan,
    "single": single.SinglePlan,
    "vllm": vllm.VllmPlan,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.flow", description=__doc__)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "report"], required=True)
    parser.add_argument("--out", type=Path, help="results JSON (default results/flow_NAME.json)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a field of the scenario's plan (e.g. --set time_scale=2); see "
        "FloodPlan, SweepPlan, SinglePlan, VllmPlan",
    )
    parser.add_argument(
        "--gateway-arg", action="append", default=[], help="extra argument for both gateways"
    )
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.out is None:
        args.out = common.RESULTS / f"flow_{args.scenario}.json"
    return args


def plan_from(args: argparse.Namespace) -> Any:
    plan = PLANS[args.scenario]()
    types = {f.name: type(getattr(plan, f.name)) for f in fields(plan)}
    changes: dict[str, Any] = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in types:
            raise SystemExit(f"--set {item}: {type(plan).__name__} has no field {name!r}")
        kind = types[name]
        if kind is tuple:
            changes[name] = tuple(float(v) for v in value.split(",") if v)
        elif kind is bool:
            changes[name] = value.lower() in ("1", "true", "yes")
        else:
            changes[name] = kind(value)
    return replace(plan, **changes)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    if args.scenario == "report":
        print(report.write_summary(common.RESULTS))
        return 0
    stop_on_sigterm()
    raise_fd_limit()
    plan = plan_from(args)
    started = time.time()
    procs = fleet.Processes(fleet.temp_log_dir())
    print(f"{args.scenario}: {plan}; logs in {procs.log_dir}")
    runner: Runner = RUNNERS[args.scenario]
    try:
        body = uvloop.run(runner(plan, list(args.gateway_arg), procs))
    finally:
        procs.stop_all()
    document = common.header(args.scenario, args.argv, started)
    # Others edit src/ while benchmarks run: each gateway runs the tree as it was at its start.
    document["git_commit_at_end"] = git_commit()
    document["wall_time_s"] = round(time.time() - started, 1)
    document["logs"] = str(procs.log_dir)
    document |= body
    common.write_json(args.out, document)
    if not args.no_plots:
        report.plot(document, args.out.with_suffix(".png"))
    for item in document.get("checks", []):
        print(f"{item['result']}: {item['check']}: {item['measured']} (target {item['target']})")
    print(report.write_summary(args.out.parent))
    print(f"wall time {document['wall_time_s'] / 60:.1f} min; results in {args.out}")
    return 0
