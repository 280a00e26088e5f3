"""Gateway configurations against one gateway, on the routing benchmark's machinery
(`benchmarks.routing`).

What this adds to `benchmarks.routing.suite`, whose run protocol, workload, scenarios and goodput
it keeps:
- the "router" is a group of `mineru-gateway serve` processes with the default settings over
  the same workers (`CONFIGURATIONS`): one gateway, or two gateways (replicas);
- the load generator's session is a `SplitSession`, which sends every other request to the other
  gateway. Each of two gateways then takes half the traffic and knows of the other's requests
  only from the workers' own queues (vLLM /metrics), as replicas behind a Kubernetes Service do
  (a Service spreads connections; one request per connection here, so requests);
- the report compares each configuration with one gateway per scenario: goodput under the TTFT
  SLO and TTFT p99.
Scenarios: (a) identical workers and (c) extra traffic straight to worker 0, the routing suite's.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import aiohttp
import uvloop
from benchmarks.routing import fleet, suite, workload
from benchmarks.routing.runs import stop_on_sigterm
from benchmarks.routing.stats import RunResult

from mineru_gateway.testing import process_tree

from . import summary


@dataclass(frozen=True)
class Configuration:
    gateways: int  # replicas, each sent its share of the requests in turn


CONFIGURATIONS = {
    summary.ONE: Configuration(1),
    summary.TWO: Configuration(2),
}
DEFAULT_CONFIGURATIONS = [summary.ONE, summary.TWO]
RESULTS = suite.RESULTS


class SplitSession:
    """An aiohttp session whose POSTs to the first gateway go to each gateway in turn.

    Everything else (other URLs, such as the direct traffic to a worker, and every other
    method) goes to the wrapped session unchanged. `sent` counts requests per gateway.
    """

    def __init__(self, session: aiohttp.ClientSession, gateways: Sequence[str]) -> None:
        self._session = session
        self._gateways = list(gateways)
        self._turn = 0
        self.sent = [0] * len(self._gateways)

    def post(self, url: str, **kwargs: Any) -> Any:
        prefix = self._gateways[0] + "/"
        if url.startswith(prefix):
            index, self._turn = self._turn, (self._turn + 1) % len(self._gateways)
            self.sent[index] += 1
            url = self._gateways[index] + url[len(prefix) - 1 :]
        return self._session.post(url, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


class GatewayGroup:
    """The gateways of a configuration (`mineru-gateway serve`, queue policy) over the same
    workers; `url` is the first one's, which `SplitSession` spreads over all of them."""

    def __init__(
        self,
        name: str,
        configuration: Configuration,
        procs: fleet.Processes,
        workers: Sequence[str],
        settings: fleet.RouterSettings,
    ) -> None:
        self.spec = replace(fleet.ROUTERS["queue"], name=name)
        self.members = [
            fleet.RunningRouter(self.spec, procs, workers, settings)
            for _ in range(configuration.gateways)
        ]

    @property
    def urls(self) -> list[str]:
        return [member.url for member in self.members]

    @property
    def url(self) -> str:
        return self.members[0].url

    @property
    def pids(self) -> list[int]:
        """Every process of every gateway, with its children."""
        return [pid for member in self.members for pid in process_tree(member.pid)]

    async def ready(self) -> GatewayGroup:
        for member in self.members:
            await member.ready()
        return self

    def stop(self) -> None:
        for member in self.members:
            member.stop()


@dataclass(frozen=True)
class GroupStage(suite.Stage):
    def cpu(self) -> dict[str, float]:
        """Every gateway of the group counts as the router."""
        return fleet.cpu_sample({"router": self.router.pids, "workers": self.workers.pids})


class ReplicaBench(suite.Bench):
    """The routing suite's sweep, with a `GatewayGroup` for a router."""

    async def sweep(
        self,
        session: aiohttp.ClientSession,
        scenario: suite.Scenario,
        name: str,
        workers: fleet.SimWorkers,
        done: dict[float, RunResult],
    ) -> None:
        group = GatewayGroup(
            name, CONFIGURATIONS[name], self.procs, workers.urls, self.router_settings
        )
        stage = GroupStage(SplitSession(session, group.urls), scenario, workers, group)
        try:
            await group.ready()
            await self.run_rates(stage, done)
        finally:
            group.stop()

    async def run_one(self, stage: suite.Stage, fraction: float) -> RunResult:
        """One run, plus how many of its requests each gateway took."""
        split: SplitSession = stage.session  # type: ignore[assignment]
        before = list(split.sent)
        result = await super().run_one(stage, fraction)
        result.extra["requests_per_gateway"] = [
            after - prior for after, prior in zip(split.sent, before, strict=True)
        ]
        return result


@dataclass
class ReplicaResults(suite.SuiteResults):
    """The routing suite's results document, with this benchmark's command, configurations and
    summary."""

    configurations: list[str] = field(default_factory=list)

    def document(self) -> dict[str, Any]:
        document = super().document()
        document["command"] = "python -m benchmarks.replicas " + " ".join(self.args.argv)
        return document

    def settings(self) -> dict[str, Any]:
        settings = super().settings()
        settings["configurations"] = {
            name: asdict(CONFIGURATIONS[name]) for name in self.configurations
        }
        return settings

    def save_final(self) -> None:
        final = self.document()
        final["summary"] = summary.summarise(final)
        summary.write(final, self.args.out, plots=not self.args.no_plots)
        self.partial.unlink(missing_ok=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.replicas", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of the whole pipeline")
    parser.add_argument("--scenarios", type=suite._names, default=["a", "c"])
    parser.add_argument(
        "--configurations",
        type=suite._names,
        default=list(DEFAULT_CONFIGURATIONS),
        help=f"from {', '.join(CONFIGURATIONS)} ({summary.ONE} is the reference)",
    )
    suite._add_plan_arguments(parser)
    suite._add_fleet_arguments(parser)
    suite._add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    _fill_defaults(args)
    return args


def _fill_defaults(args: argparse.Namespace) -> None:
    """The routing suite's plan, at the two rates its README tabulates (0.85 K and 1.0 K), no
    E2E tails (TTFT is the question here), no run narrowing the SLO crossing further (each run
    takes minutes at this time scale: `--extra 1` adds one per pair). Time scale
    2: the simulator runs twice as slowly as the NPU it stands for, so that two gateways, four
    workers and the load generator leave room on a shared 2-core machine (at 1 a quick run
    missed the SLO at 0.95 K in every configuration while other processes took half a core)."""
    quick = args.quick
    defaults: dict[str, Any] = {
        "fractions": (0.6, 0.95) if quick else (0.85, 1.0),
        "e2e": (),
        "extra": 0,
        "time_scale": 2.0,
        "warmup": 6.0 if quick else 40.0,
        "window": 8.0,
    }
    vars(args).update({key: value for key, value in defaults.items() if getattr(args, key) is None})
    args.fixed = args.fixed or args.fractions
    args.out = args.out or RESULTS / ("replicas_quick.json" if quick else "replicas.json")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    plan = suite.plan_from_args(args)
    table = suite.scenarios(args.slow_speed, args.direct_share)
    chosen = [table[key] for key in args.scenarios]
    bench = ReplicaBench(args, plan, workload.Mix(model=fleet.MODEL))
    results = ReplicaResults(args, bench, chosen, [], [], configurations=args.configurations)
    results.resume()
    bench.on_result = results.save_partial
    try:
        uvloop.run(bench.run(chosen, args.configurations))
    finally:
        bench.procs.stop_all()
    results.save_final()
    return 0
