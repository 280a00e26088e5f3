"""The routing benchmark on simulated workers: scenarios x routers x offered rates.

Method (issue 3):
- 4 simulated 910B workers (`mineru-gateway sim`, started fresh per scenario), a MinerU-like mix
  (`workload.py`), open-loop Poisson arrivals (`loadgen.py`); every router sees the identical
  request sequence at a given rate (seeded).
- Scenarios: (a) identical workers; (b) worker 0 at half speed (`--speed 0.5`); (c) extra traffic
  sent straight to worker 0, bypassing the router, at `direct_share` of one worker's capacity.
- Routers: the gateway with each routing policy, vLLM's DP balancer (emulated, `dp_balancer.py`)
  and vllm-router (PyPI) with `power_of_two` and `round_robin`, each started fresh per scenario.
- Capacity: one worker's saturated throughput on the mix is measured first (`C_w`, requests/s).
  A scenario's capacity is `K = (sum of worker speeds - direct_share) * C_w`; offered rates are
  fractions of K, the same fractions for every router.
- Per run: warm-up, a measured window, then a tail at the same rate until every measured request
  has its first token (or its end, at the fixed rates, for E2E), then everything is cancelled and
  the next run starts only when every worker is idle.
- Goodput: the highest offered rate whose TTFT p99 stays within the SLO (`stats.goodput`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from . import fleet, loadgen, report, vllm_real, workload
from .runs import (
    FOREIGN_CPU_LIMIT,
    MACHINE_BUSY_LIMIT,
    cpu_share,
    git_commit,
    least_disturbed,
    stop_on_sigterm,
)
from .stats import RunResult, passes, summarise

RESULTS = Path(__file__).resolve().parents[1] / "results"
# One simulated worker's capacity on the default mix, requests/s at time scale 1: its saturated
# throughput measured here over 15-30 s windows (26.5-29 requests/s; shorter or longer windows
# move it because the running batch's mix of long and short answers settles slowly), and where a
# single worker's TTFT p99 crosses the SLO under this benchmark's run protocol (25-30 requests/s).
# It only sets the scale of the offered rates; `--calibrate` measures it again.
DEFAULT_WORKER_CAPACITY = 27.0
ALL_ROUTERS = tuple(fleet.ROUTERS)


@dataclass(frozen=True)
class Scenario:
    key: str
    name: str
    title: str
    speeds: tuple[float, ...]
    direct_share: float = 0.0  # extra traffic to worker 0, as a fraction of one worker's capacity

    def capacity_workers(self) -> float:
        return sum(self.speeds) - self.direct_share


def scenarios(slow_speed: float, direct_share: float) -> dict[str, Scenario]:
    return {
        "a": Scenario("a", "a_identical", "(a) 4 identical workers", (1.0, 1.0, 1.0, 1.0)),
        "b": Scenario(
            "b",
            "b_slow_worker",
            f"(b) worker 0 at {slow_speed:g}x speed",
            (slow_speed, 1.0, 1.0, 1.0),
        ),
        "c": Scenario(
            "c",
            "c_direct_traffic",
            f"(c) extra traffic straight to worker 0 ({direct_share:.0%} of a worker)",
            (1.0, 1.0, 1.0, 1.0),
            direct_share,
        ),
    }


@dataclass(frozen=True)
class Plan:
    """How each (scenario, router) pair is swept. Times and rates are engine-time figures (the
    simulator at time scale s runs s times slower than the NPU it stands for)."""

    time_scale: float
    warmup_s: float
    window_s: float
    ttft_tail_cap_s: float
    e2e_tail_cap_s: float
    grid: tuple[float, ...]  # fractions of capacity always run
    fixed: tuple[float, ...]  # fractions tabulated (and checked against the targets)
    e2e: tuple[float, ...]  # fractions where E2E is measured too (longer tails)
    extra: int  # adaptive runs that narrow the SLO crossing (`next_fraction`)
    resolution: float  # no adaptive run once the crossing is bracketed this tightly
    max_fraction: float
    slo_ms: float  # TTFT p99
    seed: int

    def wall(self, seconds: float) -> float:
        return seconds * self.time_scale

    def phases(self, fraction: float) -> loadgen.Phases:
        e2e = any(abs(fraction - f) < 1e-9 for f in self.e2e)
        return loadgen.Phases(
            warmup_s=self.wall(self.warmup_s),
            window_s=self.wall(self.window_s),
            tail_cap_s=self.wall(self.e2e_tail_cap_s if e2e else self.ttft_tail_cap_s),
            wait_for="done" if e2e else "first_token",
        )

    def next_fraction(self, verdicts: dict[float, bool]) -> float | None:
        """The next rate to try, from what passed and failed so far: above the highest pass if
        nothing above it failed, else halfway into the bracket around the SLO crossing (on a
        0.05 grid); None when the bracket is tight enough or the range is exhausted."""
        low = max((f for f, ok in verdicts.items() if ok), default=None)
        high = min(
            (f for f, ok in verdicts.items() if not ok and (low is None or f > low)), default=None
        )
        if high is None:
            assert low is not None
            step_up = round(low + 0.1, 2)
            return step_up if step_up <= self.max_fraction + 1e-9 else None
        if low is None:
            return round(round(max(0.05, 0.6 * high) / 0.05) * 0.05, 2) if high > 0.1 else None
        if high - low <= self.resolution + 1e-9:
            return None
        middle = low + max(0.05, math.floor((high - low) / 2 / 0.05 + 1e-9) * 0.05)
        return round(middle, 2) if middle < high - 1e-9 else None


def gateway_policies() -> list[str]:
    """Routing policies the gateway in this tree accepts (one list: `routing.POLICY_NAMES`)."""
    from mineru_gateway import routing

    return list(routing.POLICY_NAMES)


def gateway_defaults() -> dict[str, Any]:
    """The gateway's routing-related settings as this tree defines them (recorded with results)."""
    from mineru_gateway.config import GatewaySettings

    wanted = ("load", "stale", "routing", "health", "retries", "cost", "kv", "pace")
    return {
        name: field.default
        for name, field in GatewaySettings.model_fields.items()
        if any(word in name for word in wanted) and not callable(field.default)
    }


def available_routers(wanted: Sequence[str]) -> tuple[list[str], list[str]]:
    policies = set(gateway_policies())
    have_vllm_router = bool(fleet.find_vllm_router())
    ok, missing = [], []
    for name in wanted:
        spec = fleet.ROUTERS[name]
        unusable = (spec.kind == "gateway" and spec.policy not in policies) or (
            spec.kind == "vllm_router" and not have_vllm_router
        )
        (missing if unusable else ok).append(name)
    return ok, missing


@dataclass(frozen=True)
class Stage:
    """What the runs of one sweep share: the session, the scenario, its workers and the router."""

    session: aiohttp.ClientSession
    scenario: Scenario
    workers: fleet.SimWorkers
    router: fleet.RunningRouter

    def cpu(self) -> dict[str, float]:
        """A `fleet.cpu_sample` of the router and the workers."""
        return fleet.cpu_sample({"router": [self.router.pid], "workers": self.workers.pids})


class Bench:
    def __init__(self, args: argparse.Namespace, plan: Plan, mix: workload.Mix) -> None:
        self.args = args
        self.plan = plan
        self.mix = mix
        self.procs = fleet.Processes(fleet.temp_log_dir())
        self.router_settings = fleet.RouterSettings(
            gateway_args=tuple(args.gateway_arg),
            dp_interval_s=args.dp_interval * plan.time_scale,
            vllm_router_bin=fleet.find_vllm_router(),
        )
        self.results: list[RunResult] = []
        self.worker_capacity = args.worker_capacity
        self.on_result: Callable[[], None] = lambda: None

    # -- calibration ---------------------------------------------------------------------
    async def calibrate(self, session: aiohttp.ClientSession) -> float:
        """One worker's saturated throughput on the mix, requests/s (engine time)."""
        workers = fleet.SimWorkers(self.procs, self.plan.time_scale, [1.0])
        workers.start()
        try:
            rate = 1.4 * DEFAULT_WORKER_CAPACITY / self.plan.time_scale
            phases = loadgen.Phases(self.plan.wall(30), self.plan.wall(30), 0.0)
            arrivals = workload.arrivals(self.mix, self.plan.seed + 99, rate, phases.total + 1)
            outcome = await loadgen.run_open_loop(session, workers.urls[0], arrivals, phases)
            capacity = outcome.window_done / phases.window_s * self.plan.time_scale
            await fleet.wait_idle(session, workers.urls)
        finally:
            workers.stop()
        print(f"calibration: one worker completes {capacity:.2f} requests/s at saturation")
        return capacity

    # -- one run -------------------------------------------------------------------------
    async def run_one(self, stage: Stage, fraction: float) -> RunResult:
        plan, session, urls = self.plan, stage.session, stage.workers.urls
        per_worker = self.worker_capacity / plan.time_scale  # wall requests/s
        rate = fraction * stage.scenario.capacity_workers() * per_worker
        phases = plan.phases(fraction)
        seed = plan.seed * 10_000 + round(fraction * 1000)  # same requests for every router
        arrivals = workload.arrivals(self.mix, seed, rate, phases.total + 1)
        before = await fleet.sim_states(session, urls)
        cpu_before = stage.cpu()
        stop = asyncio.Event()
        background = self._direct_traffic(stage, seed, per_worker, phases, stop)
        started = time.perf_counter()
        outcome = await loadgen.run_open_loop(session, stage.router.url, arrivals, phases)
        stop.set()
        bg_records = await background if background is not None else []
        wall = time.perf_counter() - started
        cpu_after = stage.cpu()
        idle = await fleet.wait_idle(session, urls)
        after = await fleet.sim_states(session, urls)
        result = summarise(
            outcome,
            scenario=stage.scenario.name,
            router=stage.router.spec.name,
            fraction=fraction,
            rate=rate,
            window_s=phases.window_s,
            wait_for=phases.wait_for,
            time_scale=plan.time_scale,
        )
        routed = [a["arrived"] - b["arrived"] for a, b in zip(after, before, strict=True)]
        routed[0] -= len(bg_records)
        result.worker_requests = routed
        result.background_sent = len(bg_records)
        result.cpu = cpu_share(cpu_before, cpu_after, wall)
        result.wall_s = round(wall, 2)
        result.idle_wait_s = round(idle, 2)
        await asyncio.sleep(1.0)  # let routers' load views see the idle workers
        return result

    def _direct_traffic(
        self,
        stage: Stage,
        seed: int,
        per_worker: float,
        phases: loadgen.Phases,
        stop: asyncio.Event,
    ) -> asyncio.Task[list[loadgen.Record]] | None:
        """Scenario (c)'s extra traffic straight to worker 0, bypassing the router, until `stop`."""
        share = stage.scenario.direct_share
        if share <= 0:
            return None
        arrivals = workload.arrivals(self.mix, seed + 5000, share * per_worker, phases.total + 60)
        load = loadgen.background_load(stage.session, stage.workers.urls[0], arrivals, stop)
        return asyncio.create_task(load)

    async def wait_quiet(self, stage: Stage, limit_s: float = 60.0) -> float:
        """Waits (up to `limit_s`) until processes that are not ours use under
        `FOREIGN_CPU_LIMIT` cores: this machine is shared. Returns the last foreign load seen."""
        deadline = time.monotonic() + limit_s
        while True:
            before = stage.cpu()
            await asyncio.sleep(1.0)
            foreign = cpu_share(before, stage.cpu(), 1.0)["foreign_cores"]
            if foreign < FOREIGN_CPU_LIMIT or time.monotonic() > deadline:
                return foreign

    async def run_guarded(self, stage: Stage, fraction: float) -> RunResult:
        """`run_one`, repeated when other processes took more than `FOREIGN_CPU_LIMIT` cores or
        the machine was nearly saturated (`least_disturbed`)."""

        async def attempt() -> RunResult:
            quiet = await self.wait_quiet(stage)
            result = await self.run_one(stage, fraction)
            result.extra["foreign_cores_before"] = round(quiet, 3)
            return result

        best, attempts = await least_disturbed(attempt, lambda r: r.cpu, MACHINE_BUSY_LIMIT)
        best.extra["attempts"] = attempts
        return best

    # -- the suite -----------------------------------------------------------------------
    async def run(self, chosen: Sequence[Scenario], routers: Sequence[str]) -> None:
        async with loadgen.new_session() as session:
            if self.args.calibrate:
                self.worker_capacity = await self.calibrate(session)
            for scenario in chosen:
                await self.run_scenario(session, scenario, routers)

    async def run_scenario(
        self, session: aiohttp.ClientSession, scenario: Scenario, routers: Sequence[str]
    ) -> None:
        workers: fleet.SimWorkers | None = None
        try:
            for name in routers:
                done = {
                    r.fraction: r
                    for r in self.results
                    if r.scenario == scenario.name and r.router == name
                }
                if self._next(done) is None:
                    continue  # resumed: nothing left to run for this pair
                if workers is None:
                    workers = fleet.SimWorkers(self.procs, self.plan.time_scale, scenario.speeds)
                    workers.start()
                await self.sweep(session, scenario, name, workers, done)
        finally:
            if workers is not None:
                workers.stop()

    def _next(self, done: dict[float, RunResult]) -> float | None:
        for fraction in self.plan.grid:
            if fraction not in done:
                return fraction
        adaptive = [f for f in done if f not in self.plan.grid]
        if len(adaptive) >= self.plan.extra:
            return None
        verdicts = {f: passes(r, self.plan.slo_ms) for f, r in done.items()}
        fraction = self.plan.next_fraction(verdicts)
        return None if fraction is None or fraction in done else fraction

    async def sweep(
        self,
        session: aiohttp.ClientSession,
        scenario: Scenario,
        name: str,
        workers: fleet.SimWorkers,
        done: dict[float, RunResult],
    ) -> None:
        spec = fleet.ROUTERS[name]
        router = fleet.RunningRouter(spec, self.procs, workers.urls, self.router_settings)
        stage = Stage(session, scenario, workers, router)
        try:
            await router.ready()
            await self.run_rates(stage, done)
        finally:
            router.stop()

    async def run_rates(self, stage: Stage, done: dict[float, RunResult]) -> None:
        """Every rate still to run for one (scenario, router) pair, on a ready `stage`."""
        while (fraction := self._next(done)) is not None:
            result = await self.run_guarded(stage, fraction)
            done[fraction] = result
            self.results.append(result)
            self.on_result()
            print(report.format_run(result, self.plan.slo_ms), flush=True)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.routing", description=__doc__.split("\n\n")[0]
    )
    _add_selection_arguments(parser)
    _add_plan_arguments(parser)
    _add_fleet_arguments(parser)
    _add_output_arguments(parser)
    _add_vllm_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    _fill_defaults(args)
    return args


def _add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """What runs: the engine, and which routers in which scenarios."""
    parser.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    parser.add_argument("--quick", action="store_true", help="a ~5 minute smoke run")
    parser.add_argument("--routers", type=_names, help=f"from {', '.join(ALL_ROUTERS)}")
    parser.add_argument("--scenarios", type=_names, default=["a", "b", "c"])


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep of each (scenario, router) pair: `Plan`'s fields."""
    parser.add_argument("--fractions", type=_floats, help="fractions of capacity always run")
    parser.add_argument("--fixed", type=_floats, help="fractions tabulated (default: --fractions)")
    parser.add_argument("--e2e", type=_floats, help="fractions where E2E is measured too")
    parser.add_argument("--extra", type=int, help="adaptive runs per (scenario, router)")
    parser.add_argument("--resolution", type=float, default=0.1)
    parser.add_argument("--max-fraction", type=float, default=1.3)
    parser.add_argument("--time-scale", type=float, help="simulator time scale")
    parser.add_argument("--slo-ms", type=float, default=500.0, help="TTFT p99 SLO (engine ms)")
    parser.add_argument("--warmup", type=float, help="engine seconds before the window")
    parser.add_argument("--window", type=float, help="measured engine seconds")
    parser.add_argument("--ttft-tail-cap", type=float, default=5.0, help="engine seconds")
    parser.add_argument("--e2e-tail-cap", type=float, default=35.0, help="engine seconds")


def _add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """The workers and routers: capacity, the scenarios' skew, router settings, the seed."""
    parser.add_argument(
        "--worker-capacity",
        type=float,
        default=DEFAULT_WORKER_CAPACITY,
        help="one worker's capacity on the mix, requests/s (engine time): the unit of offered "
        "rates (K = capacity x effective workers)",
    )
    parser.add_argument(
        "--calibrate", action="store_true", help="measure the capacity instead (60 s, noisy)"
    )
    parser.add_argument("--direct-share", type=float, default=0.45)
    parser.add_argument("--slow-speed", type=float, default=0.5)
    parser.add_argument("--dp-interval", type=float, default=0.1, help="engine seconds")
    parser.add_argument(
        "--gateway-arg", action="append", default=[], help="extra argument for `serve`"
    )
    parser.add_argument("--seed", type=int, default=1)


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="results JSON (default under results/)")
    parser.add_argument(
        "--resume", action="store_true", help="keep the runs of an interrupted suite (.partial)"
    )
    parser.add_argument("--no-plots", action="store_true")


def _add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """`vllm_real.py`'s settings."""
    real = parser.add_argument_group("--engine vllm (real vLLM on CPU, 2 workers)")
    real.add_argument("--vllm-load", type=float, default=0.45, help="fraction of capacity")
    real.add_argument(
        "--vllm-direct", type=float, default=0.5, help="direct traffic, fraction of one worker"
    )
    real.add_argument(
        "--vllm-capacity",
        type=float,
        default=0.0,
        help="both workers' capacity, requests/s (0: the one measured at the start, which "
        "moves by 10-20%% between runs)",
    )
    real.add_argument("--vllm-warmup", type=float, default=15.0)
    real.add_argument("--vllm-window", type=float, default=60.0)
    real.add_argument("--vllm-length-scale", type=float, default=0.5)
    real.add_argument("--vllm-tolerance", type=float, default=0.1)
    real.add_argument(
        "--vllm-model",
        default="~/.cache/mineru-gateway/small-qwen2",
        help="model directory (`make small-model`; see benchmarks/routing/vllm_real.py)",
    )
    real.add_argument(
        "--vllm-server-arg",
        action="append",
        default=[],
        help="extra argument for each vLLM server (e.g. --vllm-server-arg=--max-num-seqs=4)",
    )


def _fill_defaults(args: argparse.Namespace) -> None:
    """Defaults that depend on `--quick` and `--engine`, for what the command line left unset."""
    quick = args.quick
    defaults: dict[str, Any] = {
        "fractions": (0.6, 0.95) if quick else (0.85, 0.95),
        "e2e": () if quick else (0.85, 0.95),
        "extra": 0 if quick else 2,
        "time_scale": 1.0 if quick else 0.8,
        # A worker's running batch takes 40-60 s to settle near its capacity (longer on a slow
        # worker); shorter warm-ups hide overload, because continuous batching admits new
        # requests at once until the batch is full (measured: see README, Routing evidence).
        "warmup": 6.0 if quick else 40.0,
        "window": 8.0,
        "routers": ["queue", "round_robin"] if quick else list(ALL_ROUTERS),
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.fixed is None:
        args.fixed = args.fractions
    if args.out is None:
        stem = "routing_vllm" if args.engine == "vllm" else "routing"
        args.out = RESULTS / (f"{stem}_quick.json" if quick else f"{stem}.json")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    if args.engine == "vllm":
        return vllm_real.main(args)
    return run_suite(args)


def plan_from_args(args: argparse.Namespace) -> Plan:
    return Plan(
        time_scale=args.time_scale,
        warmup_s=args.warmup,
        window_s=args.window,
        ttft_tail_cap_s=args.ttft_tail_cap,
        e2e_tail_cap_s=args.e2e_tail_cap,
        grid=tuple(args.fractions),
        fixed=tuple(args.fixed),
        e2e=tuple(args.e2e),
        extra=args.extra,
        resolution=args.resolution,
        max_fraction=args.max_fraction,
        slo_ms=args.slo_ms,
        seed=args.seed,
    )


def run_suite(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    routers, missing = available_routers(args.routers)
    if missing:
        print(f"skipped (not available in this tree/machine): {', '.join(missing)}")
    table = scenarios(args.slow_speed, args.direct_share)
    chosen = [table[key] for key in args.scenarios]
    bench = Bench(args, plan, workload.Mix(model=fleet.MODEL))
    suite = SuiteResults(args, bench, chosen, routers, missing)
    suite.resume()
    bench.on_result = suite.save_partial
    try:
        uvloop.run(bench.run(chosen, routers))
    finally:
        bench.procs.stop_all()
    suite.save_final()
    return 0


@dataclass
class SuiteResults:
    """The suite's results document: saved after every run (`.partial.json`, which `--resume`
    reads back) and, with its summary, Markdown and plots, at the end."""

    args: argparse.Namespace
    bench: Bench
    chosen: list[Scenario]
    routers: list[str]
    missing: list[str]
    commit_at_start: str = field(default_factory=git_commit)
    started: float = field(default_factory=time.time)

    @property
    def partial(self) -> Path:
        path: Path = self.args.out.with_suffix(".partial.json")
        return path

    def resume(self) -> None:
        if not (self.args.resume and self.partial.exists()):
            return
        previous = json.loads(self.partial.read_text())
        self.bench.results = [RunResult(**run) for run in previous["runs"]]
        self.started -= previous.get("wall_time_s", 0.0)
        print(f"resuming with {len(self.bench.results)} runs from {self.partial}")

    def document(self) -> dict[str, Any]:
        command = "python -m benchmarks.routing " + " ".join(self.args.argv)
        return {
            **run_header(command, self.commit_at_start, self.started),
            "settings": self.settings(),
            "runs": [asdict(r) for r in self.bench.results],
        }

    def settings(self) -> dict[str, Any]:
        args, bench = self.args, self.bench
        return {
            "units": "engine time: wall durations / time_scale, rates x time_scale "
            "(load generator lag and CPU in wall time)",
            "plan": asdict(bench.plan),
            "worker_capacity_rps": round(bench.worker_capacity, 3),
            "scenarios": {s.name: asdict(s) for s in self.chosen},
            "routers": {name: asdict(fleet.ROUTERS[name]) for name in self.routers},
            "skipped_routers": self.missing,
            "mix": asdict(replace(bench.mix)),
            "mix_per_page": workload.describe(bench.mix),
            "dp_interval_s": args.dp_interval,
            "seed": args.seed,
            "gateway_args": args.gateway_arg,
            "gateway_defaults": gateway_defaults(),
            "vllm_router": fleet.find_vllm_router(),
        }

    def save_partial(self) -> None:
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        self.partial.write_text(json.dumps(self.document(), indent=1) + "\n")

    def save_final(self) -> None:
        out: Path = self.args.out
        final = self.document()
        final["summary"] = report.summarise_document(final)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(final, indent=1) + "\n")
        self.partial.unlink(missing_ok=True)
        markdown = report.markdown(final)
        out.with_suffix(".md").write_text(markdown)
        if not self.args.no_plots:
            with contextlib.suppress(ImportError):
                report.plots(final, out.parent, out.stem)
        print(markdown)
        print(f"wall time {final['wall_time_s'] / 60:.1f} min; results in {out}")


def run_header(command: str, commit_at_start: str, started: float) -> dict[str, Any]:
    """What every result document opens with: how it was made, from which commit, when, where."""
    return {
        "command": command,
        "git_commit": commit_at_start,
        "git_commit_at_end": git_commit(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_time_s": round(time.time() - started, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }
