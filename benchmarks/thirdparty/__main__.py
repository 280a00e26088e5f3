"""Runs guidellm unchanged against the gateway: 2 simulated workers, the gateway in front of them,
then one `guidellm run` (a short constant-rate sweep) from guidellm's own virtualenv; writes the
results document and its Markdown. Every process is stopped on exit, Ctrl-C and SIGTERM included.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.routing import fleet, suite
from benchmarks.routing.runs import cpu_share, git_commit, stop_on_sigterm

from . import TOOL, Workload, guidellm_argv, notes, problems, summarize, tool_version, write

CACHE = Path.home() / ".cache" / "mineru-gateway"
GUIDELLM = CACHE / "guidellm-0.8.1" / "bin" / "guidellm"
# No Hugging Face hub here: the tokenizer is a local directory and must never be looked up.
# guidellm's own worker processes default to 10; 2 cores are enough for these rates.
TOOL_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "GUIDELLM__MAX_WORKER_PROCESSES": "2",
    # guidellm runs in its own interpreter: none of ours may leak into it (empty means unset).
    "PYTHONPATH": "",
    "PYTHONHOME": "",
    "VIRTUAL_ENV": "",
}


def tool_command(argv: Sequence[str]) -> str:
    """The command as a shell would run it: guidellm's environment, then its arguments."""
    env = [f"{key}={value}" for key, value in TOOL_ENV.items() if value]
    return " ".join([*env, shlex.join(argv)])


def run_guidellm(
    procs: fleet.Processes, argv: Sequence[str], result: Path, limit_s: float
) -> dict[str, Any]:
    """One `guidellm run`, its output in the log directory; returns its JSON result."""
    proc = procs.spawn(TOOL, argv, TOOL_ENV)
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        code = None
    log = procs.log_dir / f"{TOOL}.log"
    if code != 0:
        raise RuntimeError(f"{TOOL} exited with {code}; log {log}")
    procs.stop(proc)
    document: dict[str, Any] = json.loads(result.read_text())
    return document


def measure(args: argparse.Namespace, procs: fleet.Processes) -> dict[str, Any]:
    workers = fleet.SimWorkers(procs, args.time_scale, [1.0] * args.workers)
    workers.start()
    gateway = fleet.ROUTERS["queue"]
    router = fleet.RunningRouter(gateway, procs, workers.urls, fleet.RouterSettings())
    asyncio.run(router.ready())
    workload = Workload(
        model=fleet.MODEL,
        tokenizer=args.tokenizer,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        rates=tuple(args.rates),
        seconds=args.seconds,
        warmup_s=args.warmup,
    )
    result_path = procs.log_dir / f"{TOOL}.json"
    argv = guidellm_argv(args.guidellm, router.url, workload, result_path)
    print(f"running: {shlex.join(argv)}", flush=True)
    limit_s = len(workload.rates) * (workload.seconds + 60) + 120
    parts: dict[str, Sequence[int]] = {"gateway": [router.pid], "workers": workers.pids}
    before, started = fleet.cpu_sample(parts), time.perf_counter()
    result = run_guidellm(procs, argv, result_path, limit_s)
    cpu = cpu_share(before, fleet.cpu_sample(parts), time.perf_counter() - started)
    rows = summarize(result)
    return {
        "tool": {
            "name": TOOL,
            "version": tool_version(result),
            "command": tool_command(argv),
            "result_file": str(result_path),
        },
        "settings": {
            "workers": args.workers,
            "time_scale": args.time_scale,
            "model": fleet.MODEL,
            "tokenizer": args.tokenizer,
            "prompt_tokens": workload.prompt_tokens,
            "output_tokens": workload.output_tokens,
            "rates": list(workload.rates),
            "seconds": workload.seconds,
            "warmup_s": workload.warmup_s,
            "gateway": "mineru-gateway serve, default settings (routing policy queue)",
        },
        "summary": rows,
        # Cores used over guidellm's whole run (its start-up included); `foreign_cores` is
        # everything else on the machine: guidellm itself and whatever else ran.
        "cpu": {key: value for key, value in cpu.items() if key != "loadgen"},
        "problems": problems(rows, workload.output_tokens),
        "notes": notes(rows, workload),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.thirdparty", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--guidellm",
        default=os.environ.get("MINERU_GUIDELLM", str(GUIDELLM)),
        help="guidellm's executable (scripts/install-guidellm.sh)",
    )
    parser.add_argument(
        "--tokenizer",
        default=os.environ.get("MINERU_TINY_MODEL", str(CACHE / "tiny-qwen2")),
        help="a local model directory with tokenizer files (`make vllm` builds the tiny one)",
    )
    parser.add_argument(
        "--rates", type=lambda text: [float(x) for x in text.split(",") if x], default=[2, 4, 8]
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="per rate, warm-up included")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds left out, per rate")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2, help="simulated workers")
    parser.add_argument("--time-scale", type=float, default=0.1, help="simulator time scale")
    parser.add_argument("--out", type=Path, default=suite.RESULTS / "thirdparty.json")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.tokenizer = str(Path(args.tokenizer).expanduser())
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path(args.guidellm).exists():
        print(f"{args.guidellm} is missing: run scripts/install-guidellm.sh", file=sys.stderr)
        return 2
    stop_on_sigterm()
    started, commit = time.time(), git_commit()
    procs = fleet.Processes(Path(tempfile.mkdtemp(prefix="thirdparty-bench-")))
    print(f"logs in {procs.log_dir}", flush=True)
    try:
        measured = measure(args, procs)
    except KeyboardInterrupt:
        print("interrupted: every process stopped, nothing written", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
    command = "python -m benchmarks.thirdparty " + shlex.join(args.argv)
    document = suite.run_header(command, commit, started) | measured
    write(document, args.out)
    print("; ".join(document["problems"]) or "no problems", f"results in {args.out}", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
