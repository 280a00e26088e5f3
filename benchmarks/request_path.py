"""What the gateway costs per small request in-process: its server protocol and its own work,
without sockets on the client's side (issue 16).

The gateway's server protocol and app run in-process, on 16 keep-alive connections at a time, with
the small request of `benchmarks.small_requests`: each request is handed to the protocol as the
bytes its socket would deliver and the answer is taken from what it writes (no sockets on the
client's side), against two of that benchmark's instant upstreams through the gateway's own
client. What is measured is the gateway's side of a request less the client socket's system
calls: the server protocol, parsing and limits, cost, admission and routing, the worker's round
trip, accounting.

Two figures per gateway tree, each from the difference of two runs (so start-up and warm-up cancel):

- CPU per request (`time.process_time`), noisy on a shared machine like any timing;
- with `--instructions`, instructions per request as valgrind's callgrind counts them: the same
  on every run of the same code, whatever else the machine does, so a change of a few percent
  shows (the figure to compare changes by; not a time).

`--candidate NAME=DIR` measures the gateway from DIR/src too (a worktree of another commit).
`--workers N` starts N upstreams instead of 2 (routing's work grows with the workers).
`--image-kb N` sends a page image of about N KB in every request instead (MinerU's page
requests). `--stream-events N` streams every answer instead, as N token events
`--event-gap-ms` apart (20 by default: under callgrind, 50 times slower, each event still comes
in a read of its own, as on a real machine), so that the figure is a stream's: its request, its
events through the splice, its end. `--floor` adds the same harness around relaying alone
(`_floor`, on the same server protocol: the body read, a worker taken in turn, the gateway's
client, the answer written through the link), so that the gateway's own work is its figure less
the floor's.

    python -m benchmarks.request_path --instructions --candidate before=/tmp/base \\
        --out benchmarks/results/request_path.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.routing.fleet import Processes
from benchmarks.routing.runs import git_commit
from benchmarks.small_requests import CHAT, VARY, chat_body, upstream

MODEL = "tiny"
CONCURRENCY = 16
CPU_RUNS = 10  # plain runs are this many times longer than callgrind's
EVENT_GAP_MS = 20.0  # streamed: each event in a read of its own even under callgrind
RESULT_MARK = "REQUEST_PATH_RESULT "
REPO = Path(__file__).resolve().parents[1]


# -- the child: one gateway tree, one run --------------------------------------------------------
class _Client:
    """A client's keep-alive connection to the gateway's server protocol, in-process: requests
    are handed to the protocol as the bytes a socket would deliver, and what it writes back is
    the answer: a sized answer in one write, a streamed one (chunked) up to its last chunk."""

    def __init__(self, protocol: Any) -> None:
        self._answer: asyncio.Future[bytes] | None = None
        self._parts: list[bytes] = []
        self._chunked = False
        self._protocol = protocol
        protocol.connection_made(self)

    async def request(self, raw: bytes) -> bytes:
        self._answer = asyncio.get_running_loop().create_future()
        self._parts = []
        self._protocol.data_received(raw)
        return await self._answer

    # What the protocol uses of its transport.
    def write(self, data: bytes) -> None:
        if self._answer is None or self._answer.done():
            return
        if not self._parts:  # the head: this harness's own work is kept off the events
            self._chunked = data.lower().find(b"transfer-encoding: chunked") >= 0
        self._parts.append(data)
        if not self._chunked or data.endswith(b"0\r\n\r\n"):
            self._answer.set_result(b"".join(self._parts))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(
            name, default
        )

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return False  # a refused request (400, 431) is closed at once, not lingered on

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _run(
    upstreams: Sequence[str],
    requests: int,
    warmup: int,
    floor: bool = False,
    image_kb: int = 0,
    stream: bool = False,
) -> dict[str, Any]:
    from mineru_gateway.api.app import create_app
    from mineru_gateway.api.connection import Edge, GatewayHttpProtocol
    from mineru_gateway.config import GatewaySettings
    from mineru_gateway.entry import server
    from mineru_gateway.entry.logs import configure_logging

    configure_logging("warning", "json")
    app = create_app(GatewaySettings(workers=list(upstreams), log_level="warning"))
    body = chat_body(MODEL, image_kb=image_kb, stream=stream)
    # Every request numbered, made before the run: identical greedy requests in flight would
    # share one worker request (docs/cache.md) and measure coalescing instead of relaying.
    raws = iter([_numbered(body, number) for number in range(warmup + requests)])
    answered: list[int] = []

    async with app.api.router.lifespan_context(app.api) as state:
        await _until_healthy(app, state)
        edge = Edge(_floor if floor else app)
        edge.app_state = dict(state or {})
        clients = [_Client(GatewayHttpProtocol(edge)) for _ in range(CONCURRENCY)]

        async def loop(client: _Client, count: int) -> None:
            for _ in range(count):
                answer = await client.request(next(raws))
                whole = not stream or answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
                answered.append(int(answer.startswith(b"HTTP/1.1 200 ") and whole))

        await asyncio.gather(*(loop(client, warmup // CONCURRENCY) for client in clients))
        answered.clear()
        gc.collect()
        gc.freeze()  # as the server does once listening (entry/server.py)
        young = getattr(server, "GC_YOUNG", None)  # a candidate tree may predate it
        if young is not None:
            gc.set_threshold(young, *gc.get_threshold()[1:])
        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(loop(client, requests // CONCURRENCY) for client in clients))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - started
    done = (requests // CONCURRENCY) * CONCURRENCY
    return {
        "requests": done,
        "cpu_s": cpu,
        "wall_s": wall,
        "answered": sum(answered),
        "body_bytes": len(body),
    }


def _numbered(body: bytes, number: int) -> bytes:
    """The request with `body` numbered after its first VARY, as wrk numbers them."""
    mark = VARY.encode()
    body = body.replace(mark, mark + b"%d" % number, 1)
    return (
        b"POST %b HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (CHAT.encode(), len(body), body)
    )


_turn = itertools.count()


async def _floor(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Relaying alone, with the gateway's own parts: its body reader, its client, its link."""
    from mineru_gateway.api.connection import ClientLink
    from mineru_gateway.api.context import gateway_context
    from mineru_gateway.api.requests import read_body

    context = gateway_context(scope)
    link = ClientLink.of(scope)
    assert link is not None
    body = await read_body(receive, None, context.settings.max_body_bytes)
    workers = context.registry.membership.workers
    url = workers[next(_turn) % len(workers)].url + CHAT
    upstream = await context.client.post(url, body, {"Content-Type": "application/json"})
    try:
        answer = await upstream.read()
    finally:
        upstream.close()
    await link.respond(upstream.status, [(b"content-type", b"application/json")], answer)


async def _until_healthy(app: Any, state: Any) -> None:
    from mineru_gateway.api.context import gateway_context

    registry = gateway_context({"state": dict(state)}).registry
    for _ in range(200):
        if all(worker.healthy for worker in registry.membership.workers):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the upstreams did not become healthy")


def child(argv: Sequence[str]) -> None:
    import uvloop

    parser = argparse.ArgumentParser()
    parser.add_argument("--upstreams", required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=1600)
    parser.add_argument("--floor", action="store_true")
    parser.add_argument("--image-kb", type=int, default=0)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args(argv)
    urls = args.upstreams.split(",")
    result = uvloop.run(
        _run(urls, args.requests, args.warmup, args.floor, args.image_kb, args.stream)
    )
    print(RESULT_MARK + json.dumps(result), flush=True)


# -- the parent: upstreams, runs, differences ------------------------------------------------
@contextlib.contextmanager
def upstreams(count: int = 2, events: int = 0, gap_ms: float = 0) -> Iterator[list[str]]:
    """`count` of `benchmarks.small_requests`' instant upstreams, stopped on exit; with
    `events`, streaming every answer as that many token events, `gap_ms` apart."""
    procs = Processes(Path(tempfile.mkdtemp(prefix="request-path-bench-")))
    extra = upstream.streaming(events, gap_ms)
    try:
        yield [url for url, _ in upstream.start(procs, MODEL, count, extra=extra)]
    finally:
        procs.stop_all()


def run_once(
    source: Path,
    urls: Sequence[str],
    requests: int,
    *,
    instructions: bool,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    """One child run of the gateway from `source` (its `src`), with the child's `extra`
    arguments (`--floor`, `--image-kb N`); with `instructions`, under callgrind, whose total
    instruction count is added to the result."""
    argv = [sys.executable, "-m", "benchmarks.request_path", "--child"]
    argv += ["--upstreams", ",".join(urls), "--requests", str(requests), *extra]
    if instructions:
        argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv]
    env = dict(os.environ, PYTHONPATH=f"{source / 'src'}{os.pathsep}{REPO}")
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return parse_child(done.stdout, done.stderr if instructions else None)


def parse_child(stdout: str, callgrind: str | None) -> dict[str, Any]:
    line = next(line for line in stdout.splitlines() if line.startswith(RESULT_MARK))
    result: dict[str, Any] = json.loads(line[len(RESULT_MARK) :])
    if callgrind is not None:
        found = re.search(r"Collected : (\d+)", callgrind)
        if found is None:
            raise RuntimeError("callgrind printed no instruction count")
        result["instructions"] = int(found.group(1))
    return result


def per_request(short: dict[str, Any], long: dict[str, Any]) -> dict[str, float]:
    """The cost of the requests the long run made beyond the short one's."""
    extra = long["requests"] - short["requests"]
    figures = {"cpu_us": (long["cpu_s"] - short["cpu_s"]) / extra * 1e6}
    if "instructions" in long:
        figures["instructions"] = (long["instructions"] - short["instructions"]) / extra
    return figures


def measure(
    source: Path,
    urls: Sequence[str],
    requests: int,
    *,
    instructions: bool,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    """CPU per request from two plain runs of ten times `requests` (seconds each: shorter ones
    are noise); with `instructions`, instructions per request from two more of `requests`
    under callgrind (50 times slower: their CPU figures mean nothing)."""
    plain = (CPU_RUNS * requests, 3 * CPU_RUNS * requests)
    runs = [run_once(source, urls, n, instructions=False, extra=extra) for n in plain]
    if instructions:
        counted = (requests, 3 * requests)
        runs += [run_once(source, urls, n, instructions=True, extra=extra) for n in counted]
    unanswered = [run for run in runs if run["answered"] != run["requests"]]
    if unanswered:
        raise RuntimeError(f"requests went unanswered: {unanswered}")
    figures = per_request(runs[0], runs[1])
    if instructions:
        figures["instructions"] = per_request(runs[2], runs[3])["instructions"]
    # CPU per request straight from the long run too: it includes no start-up.
    return {
        **figures,
        "cpu_us_long_run": runs[1]["cpu_s"] / runs[1]["requests"] * 1e6,
        "runs": runs,
    }


def markdown(results: dict[str, Any]) -> str:
    rows = results["gateways"]
    first = next(iter(rows.values()))
    lines = [
        "# The gateway's own work per request",
        "",
        f"`{results['command']}` ({results['date']}, commit {results['commit']}).",
        "",
        "The gateway's server protocol and app driven in-process (no sockets on the client's"
        " side), 16 keep-alive connections at a time,"
        f" {results.get('body_bytes', 145):,}-byte bodies, against"
        f" {results.get('workers', 2)} instant upstreams"
        + _answers(results)
        + " through its own client; each figure is the difference of two runs"
        " (benchmarks/request_path.py).",
        "",
        "| gateway | instructions per request | against the first | CPU per request |",
        "|---|---|---|---|",
    ]
    for name, row in rows.items():
        count = row.get("instructions")
        ratio = f"{count / first['instructions']:.2f}x" if count and "instructions" in first else ""
        shown = f"{count:,.0f}" if count else "not counted"
        lines.append(f"| {name} | {shown} | {ratio} | {row['cpu_us']:.0f} us |")
    return "\n".join(lines) + "\n"


def _answers(results: dict[str, Any]) -> str:
    events = results.get("stream_events", 0)
    if not events:
        return ""
    gap = results.get("event_gap_ms", EVENT_GAP_MS)
    return (
        f" streaming each answer as {events} token events {gap:g} ms apart (then its usage"
        " event and [DONE]),"
    )


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        child(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidate", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--requests", type=int, default=1600, help="short run; the long is 3x")
    parser.add_argument("--instructions", action="store_true", help="count with callgrind")
    parser.add_argument("--floor", action="store_true", help="measure relaying alone too")
    parser.add_argument("--image-kb", type=int, default=0, help="a page image of about this size")
    parser.add_argument("--workers", type=int, default=2, help="upstreams (an Atlas box has 8)")
    parser.add_argument(
        "--stream-events", type=int, default=0, help="stream every answer as N token events"
    )
    parser.add_argument(
        "--event-gap-ms",
        type=float,
        default=EVENT_GAP_MS,
        help="between a stream's events: long enough for each to be read alone under callgrind",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sources = {"gateway": REPO}
    for candidate in args.candidate:
        name, _, directory = candidate.partition("=")
        sources[f"gateway@{name}"] = Path(directory).resolve()
    extra = ["--image-kb", str(args.image_kb)] if args.image_kb else []
    extra += ["--stream", "--warmup", "160"] if args.stream_events else []
    trees = [(name, source, extra) for name, source in sources.items()]
    if args.floor:
        trees.append(("floor", REPO, [*extra, "--floor"]))
    gateways = {}
    with upstreams(args.workers, args.stream_events, args.event_gap_ms) as urls:
        for name, source, child_args in trees:
            gateways[name] = measure(
                source, urls, args.requests, instructions=args.instructions, extra=child_args
            )
            print(name, {k: v for k, v in gateways[name].items() if k != "runs"}, flush=True)
    results = {
        "command": "python -m benchmarks.request_path " + " ".join(argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git_commit(),
        "body_bytes": len(
            chat_body(MODEL, image_kb=args.image_kb, stream=bool(args.stream_events))
        ),
        "workers": args.workers,
        "stream_events": args.stream_events,
        "event_gap_ms": args.event_gap_ms,
        "gateways": gateways,
    }
    print(markdown(results))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(results))


if __name__ == "__main__":
    main()
