"""Starts two instant upstreams and every proxy in front of them, then runs wrk against each proxy
in turn (rounds alternate proxies), reading each proxy's CPU from /proc around its run; optionally
profiles the gateway with py-spy under the same load. Every process is stopped on exit.

    python -m benchmarks.small_requests --out benchmarks/results/small_requests.json

`--candidate NAME=DIR` adds the proxy `gateway@NAME`: the gateway run from DIR/src (a scratch
worktree with a change), so that a change is measured against the unchanged gateway in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.routing import fleet, suite
from benchmarks.routing.runs import git_commit, stop_on_sigterm

from mineru_gateway.testing import free_port, tree_cpu_seconds, tree_cpu_times, wait_http_ok

from . import (
    CHAT,
    Run,
    chat_body,
    markdown,
    nginx_config,
    parse_wrk,
    summarize,
    top_frames,
    upstream,
    wrk_script,
)

PROXIES = (
    "gateway",
    "vllm-router",
    "nginx",
    "dp-balancer",
    "floor-asgi",
    "floor-link",
    "floor-raw",
)
VLLM_ROUTER_VENV = Path.home() / ".cache/mineru-gateway/vllm-router-0.1.17"


@dataclass
class Proxy:
    name: str
    url: str
    handle: subprocess.Popen[bytes]


def gateway_argv(port: int, upstreams: Sequence[str], extra: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        *("-m", "mineru_gateway", "serve", "--port", str(port)),
        *("--workers", ",".join(upstreams), "--log-level", "warning", *extra),
    ]


class Bench:
    def __init__(self, args: argparse.Namespace, procs: fleet.Processes) -> None:
        self.args = args
        self.procs = procs
        self.upstreams: list[str] = []
        self.upstream_pids: list[int] = []
        self.proxies: dict[str, Proxy] = {}

    def start_upstreams(self) -> None:
        extra = upstream.streaming(self.args.stream_events, self.args.event_gap_ms)
        started = upstream.start(self.procs, self.args.model, self.args.upstreams, extra=extra)
        for url, handle in started:
            self.upstreams.append(url)
            self.upstream_pids.append(handle.pid)

    def start(self, name: str) -> None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv, env, ready = self._command(name, port)
        handle = self.procs.spawn(name.replace("@", "-"), argv, env)
        log = self.procs.log_dir / f"{name.replace('@', '-')}.log"
        wait_http_ok(url + ready, fleet.READY_TIMEOUT_S, handle, log)
        self.proxies[name] = Proxy(name, url, handle)

    def _command(self, name: str, port: int) -> tuple[list[str], dict[str, str], str]:
        up = self.upstreams
        if name == "gateway":
            return gateway_argv(port, up, self.args.gateway_arg), {}, "/ready"
        if name.startswith("gateway@"):
            candidate = name.removeprefix("gateway@")
            src = self.args.candidates[candidate]
            env = {"PYTHONPATH": f"{src}/src:{Path.cwd()}"}
            extra = [*self.args.gateway_arg, *self.args.candidate_args.get(candidate, [])]
            return gateway_argv(port, up, extra), env, "/ready"
        if name == "vllm-router":
            settings = fleet.RouterSettings(vllm_router_bin=fleet.find_vllm_router())
            return fleet.ROUTERS["vllm_router_rr"].argv(port, up, settings), {}, "/health"
        if name == "dp-balancer":
            return fleet.ROUTERS["vllm_dp"].argv(port, up, fleet.RouterSettings()), {}, "/ready"
        if name.startswith("floor-"):
            mode = name.removeprefix("floor-")
            floors = [sys.executable, "-m", "benchmarks.small_requests.floors", "--mode", mode]
            return [*floors, "--port", str(port), "--upstreams", ",".join(up)], {}, "/health"
        if name == "nginx":
            directory = self.procs.log_dir / "nginx"
            directory.mkdir(exist_ok=True)
            config = directory / "nginx.conf"
            streaming = bool(self.args.stream_events)
            config.write_text(nginx_config(port, up, directory, os.geteuid() == 0, streaming))
            return ["nginx", "-c", str(config), "-p", str(directory)], {}, "/health"
        raise ValueError(name)

    def wrk(self, urls: Sequence[str], seconds: float) -> list[str]:
        """One wrk per url, all at once; their outputs in the same order."""
        script = self.procs.log_dir / "post.lua"
        if not script.exists():
            script.write_text(wrk_script(request_body(self.args)))
        started = [
            subprocess.Popen(
                [
                    "wrk",
                    *(f"-t{self.args.threads}", f"-c{self.args.connections}", f"-d{seconds:g}s"),
                    *("--timeout", "5s", "-s", str(script), url + CHAT),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for url in urls
        ]
        return [proc.communicate(timeout=seconds + 30)[0] for proc in started]

    def measure(self, names: Sequence[str], round_: int) -> list[Run]:
        """`names` under load at the same time (usually one): the same neighbours for each."""
        proxies = [self.proxies[name] for name in names]
        urls = [proxy.url for proxy in proxies]
        self.wrk(urls, self.args.warmup)
        before = [tree_cpu_times(proxy.handle.pid) for proxy in proxies]
        up_before = sum(tree_cpu_seconds(pid) for pid in self.upstream_pids)
        outputs = self.wrk(urls, self.args.duration)
        after = [tree_cpu_times(proxy.handle.pid) for proxy in proxies]
        up_cpu = sum(tree_cpu_seconds(pid) for pid in self.upstream_pids) - up_before
        runs = []
        for name, output, (user0, sys0), (user1, sys1) in zip(
            names, outputs, before, after, strict=True
        ):
            wrk = asdict(parse_wrk(output))
            cpu_s, user_s = user1 + sys1 - user0 - sys0, user1 - user0
            run = Run(name, round_, **wrk, cpu_s=cpu_s, upstreams_cpu_s=up_cpu, cpu_user_s=user_s)
            print(
                f"round {round_} {name:22s} {run.requests_per_s:9.0f} req/s  "
                f"p50 {run.p50_ms:6.2f} ms  p99 {run.p99_ms:6.2f} ms  "
                f"{run.cpu_us_per_request:6.0f} us CPU/request "
                f"({run.user_us_per_request:.0f} user)  "
                f"{run.requests_per_cpu_s:7.0f} req/CPU-s  errors {run.errors}",
                flush=True,
            )
            runs.append(run)
        return runs

    def profile(self, name: str) -> dict[str, Any]:
        """py-spy on `name`'s process tree while wrk sends the same load (not a measured run:
        sampling slows the process)."""
        proxy = self.proxies[name]
        raw = self.procs.log_dir / "profile.txt"
        seconds = self.args.duration
        argv = [
            self.args.py_spy,
            *("record", "--pid", str(proxy.handle.pid), "--rate", "250"),
            *("--duration", f"{seconds:g}", "--format", "raw", "--output", str(raw)),
        ]
        spy = self.procs.spawn("py-spy", argv)
        time.sleep(1.0)
        self.wrk([proxy.url], seconds + 1)
        spy.wait(timeout=60)
        command = shlex.join(["py-spy", *argv[1:]])
        return {"proxy": name, "command": command, "top": top_frames(raw.read_text())}


def request_body(args: argparse.Namespace) -> bytes:
    """What every request of a run sends."""
    events = args.stream_events
    return chat_body(args.model, max_tokens=events or 8, image_kb=args.image_kb, stream=events > 0)


def versions(args: argparse.Namespace) -> dict[str, str]:
    found: dict[str, str] = {}
    for package in ("mineru-gateway", "uvicorn", "uvloop", "httptools", "fastapi", "aiohttp"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[package] = importlib.metadata.version(package)
    found["vllm-router"] = _vllm_router_version()
    found["nginx"] = _first_line(["nginx", "-v"]).rsplit("/", 1)[-1]
    found["wrk"] = _first_line(["wrk", "-v"]).split(" ")[1]
    found["python"] = sys.version.split()[0]
    return found


def _vllm_router_version() -> str:
    for info in VLLM_ROUTER_VENV.glob("lib/python*/site-packages/vllm_router-*.dist-info"):
        return info.name.removeprefix("vllm_router-").removesuffix(".dist-info")
    return "unknown"


def _first_line(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    return (done.stdout + done.stderr).strip().splitlines()[0]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.small_requests", description=__doc__.split("\n\n")[0]
    )
    split: Callable[[str], list[str]] = lambda text: [x for x in text.split(",") if x]  # noqa: E731
    parser.add_argument("--proxies", type=split, default=list(PROXIES))
    parser.add_argument("--candidate", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--gateway-arg", action="append", default=[], help="extra `serve` args")
    parser.add_argument(
        "--candidate-arg",
        action="append",
        default=[],
        metavar="NAME=ARG",
        help="an extra `serve` arg for candidate NAME only (--candidate-arg=info=--log-level=info)",
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="load the gateway and each candidate at the same time (needs --candidate)",
    )
    parser.add_argument(
        "--upstreams",
        type=int,
        default=2,
        help="instant upstreams behind every proxy (an Atlas 800T A2 runs 8 workers)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=fleet.MODEL)
    parser.add_argument(
        "--image-kb", type=int, default=0, help="send a page image of about this many KB too"
    )
    parser.add_argument(
        "--stream-events",
        type=int,
        default=0,
        help="stream every answer as this many token events (0: non-streaming requests)",
    )
    parser.add_argument(
        "--event-gap-ms",
        type=float,
        default=2.0,
        help="with --stream-events: every open stream's next event is written this often",
    )
    parser.add_argument("--profile", action="store_true", help="py-spy the gateway afterwards")
    parser.add_argument("--py-spy", default=str(Path(sys.executable).with_name("py-spy")))
    parser.add_argument("--out", type=Path, default=suite.RESULTS / "small_requests.json")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.candidates = dict(item.split("=", 1) for item in args.candidate)
    args.candidate_args = {}
    for item in args.candidate_arg:
        name, _, arg = item.partition("=")
        if name not in args.candidates:
            parser.error(f"--candidate-arg {item!r}: no --candidate named {name!r}")
        args.candidate_args.setdefault(name, []).append(arg)
    args.proxies += [f"gateway@{name}" for name in args.candidates]
    return args


def notes(args: argparse.Namespace) -> list[str]:
    return [
        f"{os.cpu_count()} CPUs shared by wrk, the upstreams and the proxy: a proxy that cannot "
        "get a full core shows it in requests/s, not in CPU per request (the figure compared).",
        "gateway: `serve --workers U1,U2,... --log-level warning`; vllm-router: `--policy "
        "round_robin --disable-retries`; nginx: one worker process, keepalive 128 to the "
        "upstreams, no access log; dp-balancer: benchmarks/routing/dp_balancer.py (raw ASGI on "
        "uvicorn + aiohttp); floor-asgi, floor-link and floor-raw: "
        "benchmarks/small_requests/floors.py, relays with nothing but relaying over the "
        "gateway's own client (a raw ASGI app on uvicorn answering through `send`; the same on "
        "the gateway's server protocol answering through its client link; an asyncio protocol "
        "over httptools).",
        *(
            f"gateway@{name}: the gateway from {src}/src"
            + "".join(f" {arg}" for arg in args.candidate_args.get(name, []))
            for name, src in args.candidates.items()
        ),
        *([STREAM_NOTE] if args.stream_events else []),
    ]


STREAM_NOTE = (
    "Streamed answers: nginx passes them on unbuffered (`proxy_buffering off`), as an SSE proxy "
    "must; CPU per token event is the CPU per request over the answer's token events (its usage "
    "event and [DONE] ride along)."
)


def rotated(names: Sequence[str], round_: int) -> list[str]:
    """Round r starts at the r-th proxy: none always runs first, or right after the same one."""
    shift = round_ % len(names)
    return [*names[shift:], *names[:shift]]


def groups(args: argparse.Namespace, round_: int) -> list[list[str]]:
    """What runs at once in round `round_`: each proxy alone, or with `--together` the unchanged
    gateway beside each candidate in turn (a paired comparison: whatever else loads the machine
    loads both alike)."""
    if not args.together:
        return [[name] for name in rotated(args.proxies, round_)]
    candidates = [name for name in args.proxies if name.startswith("gateway@")]
    return [["gateway", name] for name in rotated(candidates, round_)]


def run(args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    bench.start_upstreams()
    for name in args.proxies:
        bench.start(name)
    time.sleep(2.5)  # every proxy sees every upstream healthy
    runs = [
        run
        for r in range(args.rounds)
        for group in groups(args, r)
        for run in bench.measure(group, r)
    ]
    body = request_body(args)
    document = {
        "settings": {
            "threads": args.threads,
            "connections": args.connections,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "rounds": args.rounds,
            "model": args.model,
            "body_bytes": len(body),
            "image_kb": args.image_kb,
            "upstreams": args.upstreams,
            "stream_events": args.stream_events,
            "event_gap_ms": args.event_gap_ms,
            "proxies": args.proxies,
            "candidates": args.candidates,
            "candidate_args": args.candidate_args,
            "together": args.together,
        },
        "versions": versions(args),
        "summary": summarize(runs, events_per_request=args.stream_events),
        "runs": [r.as_dict() for r in runs],
        "notes": notes(args),
    }
    if args.profile:
        document["profile"] = bench.profile("gateway")
    return document


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    started, commit = time.time(), git_commit()
    procs = fleet.Processes(Path(tempfile.mkdtemp(prefix="small-requests-bench-")))
    print(f"logs in {procs.log_dir}", flush=True)
    try:
        measured = run(args, Bench(args, procs))
    except KeyboardInterrupt:
        print("interrupted: every process stopped, nothing written", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
    command = "python -m benchmarks.small_requests " + shlex.join(args.argv)
    document = suite.run_header(command, commit, started) | measured
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(document))
    print(f"results in {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
