"""What a small non-streaming request costs a proxy (issue 16): the gateway, vllm-router, nginx
and a bare Python relay, each in front of the same two instant upstreams, under the same wrk load;
per proxy requests/s, latency and the CPU its process tree spent per request.

The pure parts live here (wrk's Lua script and the parsing of its output, nginx's configuration,
the per-proxy summary against vllm-router, py-spy's collapsed stacks, the Markdown); the processes
are started in `__main__`.
"""

from __future__ import annotations

import base64
import json
import math
import random
import re
import statistics
import struct
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULT_MARK = "SMALL_REQUESTS_RESULT "
REFERENCE = "vllm-router"
CHAT = "/v1/chat/completions"

# wrk's `done` hook prints the exact figures (microseconds) as one JSON line after its report.
_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '%s{"requests":%.0f,"duration_us":%.0f,"p50_us":%.0f,"p99_us":%.0f,' ..
    '"connect":%.0f,"read":%.0f,"write":%.0f,"status":%.0f,"timeout":%.0f}\\n',
    "MARK", summary.requests, summary.duration, latency:percentile(50),
    latency:percentile(99), e.connect, e.read, e.write, e.status, e.timeout))
end
"""


VARY = "Benchmark."  # where wrk numbers each request's body (`wrk_script`)


def wrk_script(body: bytes) -> str:
    """The Lua script wrk runs: every request a POST of `body`, numbered after its first
    `VARY` so that no two bodies are the same (a gateway coalescing identical greedy requests
    would otherwise answer most of them from one worker request, docs/cache.md)."""
    text = body.decode()
    if "]==]" in text:
        raise ValueError("body would end the Lua long string")
    at = text.find(VARY)
    if at < 0:
        raise ValueError(f"body has no {VARY!r} to number")
    prefix, suffix = text[: at + len(VARY)], text[at + len(VARY) :]
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"local prefix = [==[{prefix}]==]\n"
        f"local suffix = [==[{suffix}]==]\n"
        "local count = 0\n"
        "request = function()\n"
        "  count = count + 1\n"
        "  return wrk.format(nil, nil, nil, prefix .. count .. suffix)\n"
        "end\n" + _DONE.replace("MARK", RESULT_MARK)
    )


def chat_body(model: str, max_tokens: int = 8, image_kb: int = 0, stream: bool = False) -> bytes:
    """The request every run sends: a short prompt; with `image_kb`, also a page image of about
    that many kilobytes as a base64 data URL, as MinerU's client sends pages; with `stream`, a
    streamed request."""
    text = f"{VARY}\nText Recognition:"
    content: Any = text
    if image_kb > 0:
        image = base64.b64encode(noise_png(image_kb)).decode()
        content = [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
            {"type": "text", "text": text},
        ]
    message = {"role": "user", "content": content}
    request = {"model": model, "messages": [message], "max_tokens": max_tokens, "temperature": 0}
    if stream:
        request["stream"] = True
    return json.dumps(request, separators=(",", ":")).encode()


def noise_png(kilobytes: int) -> bytes:
    """A valid greyscale PNG of seeded noise, square, about `kilobytes` KB (noise does not
    compress, so its size is its pixel count): a page image's bytes without a page."""
    side = max(1, round(math.sqrt(kilobytes * 1024)))
    noise = random.Random(0).randbytes(side * side)
    rows = b"".join(b"\0" + noise[row * side : (row + 1) * side] for row in range(side))

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows, 1))
        + chunk(b"IEND", b"")
    )


@dataclass(frozen=True)
class WrkResult:
    requests: int
    duration_s: float
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int  # socket errors, timeouts and non-2xx/3xx answers


def parse_wrk(output: str) -> WrkResult:
    """The figures of one wrk run, from the line the Lua `done` hook printed."""
    for line in output.splitlines():
        if line.startswith(RESULT_MARK):
            data = json.loads(line[len(RESULT_MARK) :])
            break
    else:
        raise ValueError("no result line in wrk's output (was the Lua script used?)")
    duration_s = data["duration_us"] / 1e6
    errors = sum(data[key] for key in ("connect", "read", "write", "status", "timeout"))
    return WrkResult(
        requests=int(data["requests"]),
        duration_s=duration_s,
        requests_per_s=data["requests"] / duration_s if duration_s > 0 else 0.0,
        p50_ms=data["p50_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
        errors=int(errors),
    )


def nginx_config(
    port: int, upstreams: Sequence[str], directory: Path, as_root: bool, streaming: bool = False
) -> str:
    """nginx as a plain reverse proxy: one worker, keep-alive to both upstreams, no access log
    (the gateway at `--log-level warning` writes none either), everything in `directory`.
    Request bodies up to 64 MB (the gateway's default limit) are taken and held in memory, as the
    gateway holds them: by default nginx refuses bodies over 1 MB and writes any over 16 KB (a
    page image) to a temporary file first. With `streaming`, answers are passed on as they
    arrive (`proxy_buffering off`), as an SSE proxy must: by default nginx holds them."""
    servers = "".join(f"    server {url.removeprefix('http://')};\n" for url in upstreams)
    temp = "".join(
        f"  {kind}_temp_path {directory / kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        ("user root;\n" if as_root else "")
        + "daemon off;\nworker_processes 1;\n"
        + f"pid {directory / 'nginx.pid'};\nerror_log {directory / 'error.log'} warn;\n"
        + "events { worker_connections 4096; }\n"
        + "http {\n  access_log off;\n"
        + "  client_max_body_size 64m;\n  client_body_buffer_size 64m;\n"
        + temp
        + f"  upstream workers {{\n{servers}    keepalive 128;\n  }}\n"
        + f"  server {{\n    listen 127.0.0.1:{port};\n    location / {{\n"
        + "      proxy_pass http://workers;\n      proxy_http_version 1.1;\n"
        + ("      proxy_buffering off;\n" if streaming else "")
        + '      proxy_set_header Connection "";\n    }\n  }\n}\n'
    )


@dataclass(frozen=True)
class Run:
    """One proxy under one wrk run."""

    proxy: str
    round: int
    requests: int
    duration_s: float
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_s: float  # the proxy's process tree, during the wrk run
    upstreams_cpu_s: float
    cpu_user_s: float = float("nan")  # of cpu_s, in user space (the rest in the kernel)

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_s / self.requests * 1e6 if self.requests else float("nan")

    @property
    def user_us_per_request(self) -> float:
        """The proxy's own code's share of `cpu_us_per_request`; the kernel's (system calls,
        the loopback network) is the rest."""
        return self.cpu_user_s / self.requests * 1e6 if self.requests else float("nan")

    @property
    def requests_per_cpu_s(self) -> float:
        return self.requests / self.cpu_s if self.cpu_s > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "cpu_us_per_request": self.cpu_us_per_request,
            "user_us_per_request": self.user_us_per_request,
            "requests_per_cpu_s": self.requests_per_cpu_s,
        }


def summarize(
    runs: Iterable[Run], reference: str = REFERENCE, events_per_request: int = 0
) -> list[dict[str, Any]]:
    """Per proxy, in order of first appearance: the median of its runs for each figure, and
    requests/s and requests per CPU-second against `reference`'s medians (None without it).
    With `events_per_request` (streamed answers of that many token events), also the CPU per
    token event."""
    grouped: dict[str, list[Run]] = {}
    for run in runs:
        grouped.setdefault(run.proxy, []).append(run)
    rows = [_median_row(proxy, group) for proxy, group in grouped.items()]
    for row in rows:
        row["cpu_us_per_event"] = (
            row["cpu_us_per_request"] / events_per_request if events_per_request > 0 else None
        )
    ref = next((row for row in rows if row["proxy"] == reference), None)
    for row in rows:
        row["requests_per_s_vs_ref"] = _ratio(row["requests_per_s"], ref, "requests_per_s")
        row["requests_per_cpu_s_vs_ref"] = _ratio(
            row["requests_per_cpu_s"], ref, "requests_per_cpu_s"
        )
        row["cpu_per_request_vs_ref"] = _ratio(row["cpu_us_per_request"], ref, "cpu_us_per_request")
    return rows


def _median_row(proxy: str, group: Sequence[Run]) -> dict[str, Any]:
    def median(name: str) -> float:
        return statistics.median(getattr(run, name) for run in group)

    return {
        "proxy": proxy,
        "runs": len(group),
        "requests_per_s": median("requests_per_s"),
        "p50_ms": median("p50_ms"),
        "p99_ms": median("p99_ms"),
        "cpu_cores": statistics.median(run.cpu_s / run.duration_s for run in group),
        "cpu_us_per_request": median("cpu_us_per_request"),
        "user_us_per_request": median("user_us_per_request"),
        "kernel_us_per_request": statistics.median(
            run.cpu_us_per_request - run.user_us_per_request for run in group
        ),
        "requests_per_cpu_s": median("requests_per_cpu_s"),
        "errors": sum(run.errors for run in group),
    }


def _ratio(value: float, ref: Mapping[str, Any] | None, key: str) -> float | None:
    if ref is None or not ref[key]:
        return None
    return float(value / ref[key])


# -- py-spy ----------------------------------------------------------------------------------


EVENT_LOOP_FRAME = "Runner.run (asyncio/runners.py)"
EVENT_LOOP = "(event loop: uvloop's own C code)"
_LINE = re.compile(r":\d+\)$")


def _function(frame: str) -> str:
    """`f (file.py:12)` -> `f (file.py)`: a function's lines counted together."""
    return _LINE.sub(")", frame)


def top_frames(collapsed: str, limit: int = 15) -> dict[str, list[tuple[str, float]]]:
    """py-spy's `--format raw` (collapsed stacks, `frame;frame;frame count`): the functions with
    the largest share of samples, by self time (on top of the stack) and by total time (anywhere
    in it, once per sample). Frames up to the event loop (`Runner.run`: start-up, CLI, server)
    and py-spy's `process N:...` roots are left out: they are under every sample. The loop
    itself is C (uvloop), so samples with nothing above it are its own work: I/O, scheduling."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_function(f) for f in stack.split(";") if not f.startswith("process ")]
        loop = max((i for i, f in enumerate(frames) if f == EVENT_LOOP_FRAME), default=-1)
        frames = frames[loop + 1 :] or [EVENT_LOOP]
        samples += count
        own[frames[-1]] += count
        for frame in set(frames):
            total[frame] += count
    if not samples:
        return {"self": [], "total": []}
    return {
        "self": [(frame, n / samples) for frame, n in own.most_common(limit)],
        "total": [(frame, n / samples) for frame, n in total.most_common(limit)],
    }


# -- Markdown --------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 0, suffix: str = "") -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    events = any(row.get("cpu_us_per_event") is not None for row in rows)
    lines = [
        "| proxy | requests/s | p50 ms | p99 ms | proxy cores | CPU per request | "
        "of which user / kernel | "
        + ("CPU per token event | " if events else "")
        + f"requests per CPU-second | req/s vs {REFERENCE} | req per CPU-s vs {REFERENCE} | "
        "errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if events else ""),
    ]
    for row in rows:
        per_event = f"{_fmt(row.get('cpu_us_per_event'), 1, ' us')} | " if events else ""
        lines.append(
            f"| {row['proxy']} | {_fmt(row['requests_per_s'])} | {_fmt(row['p50_ms'], 2)} | "
            f"{_fmt(row['p99_ms'], 2)} | {_fmt(row['cpu_cores'], 2)} | "
            f"{_fmt(row['cpu_us_per_request'], 0, ' us')} | "
            f"{_fmt(row.get('user_us_per_request'))} / "
            f"{_fmt(row.get('kernel_us_per_request'), 0, ' us')} | {per_event}"
            f"{_fmt(row['requests_per_cpu_s'])} | "
            f"{_fmt(row['requests_per_s_vs_ref'], 2, 'x')} | "
            f"{_fmt(row['requests_per_cpu_s_vs_ref'], 2, 'x')} | {row['errors']} |"
        )
    return "\n".join(lines)


def profile_section(profile: Mapping[str, Any]) -> str:
    lines = [f"## Where the gateway's CPU goes (py-spy, {profile['command']})", ""]
    for kind in ("self", "total"):
        lines += [f"Top frames by {kind} time:", "", "| share | frame |", "|---|---|"]
        lines += [f"| {share:.1%} | `{frame}` |" for frame, share in profile["top"][kind]]
        lines.append("")
    return "\n".join(lines)


def _image_note(settings: Mapping[str, Any]) -> str:
    kilobytes = settings.get("image_kb", 0)
    return f": a {kilobytes} KB PNG page image as a base64 data URL" if kilobytes else ""


def _answer_note(settings: Mapping[str, Any]) -> str:
    count = settings.get("upstreams", 2)
    upstreams = f"{'two' if count == 2 else count} raw-asyncio upstreams"
    events = settings.get("stream_events", 0)
    if not events:
        return f"{upstreams} answering at once"
    return (
        f"{upstreams} streaming each answer as {events} token events (the recorded "
        f"vLLM stream's), every open stream's next event written together every "
        f"{settings['event_gap_ms']:g} ms, then its usage event and [DONE]"
    )


def markdown(document: Mapping[str, Any]) -> str:
    settings = document["settings"]
    title = "Small non-streaming requests: what a proxy costs per request"
    if settings.get("stream_events"):
        title = "Streamed requests: what a proxy costs per request and per token event"
    parts = [
        f"# {title}",
        "",
        f"`{document['command']}` ({document['when']}, {document['machine']['cpus']} CPUs, "
        f"commit {document['git_commit']}).",
        "",
        f"wrk `-t{settings['threads']} -c{settings['connections']} -d{settings['duration_s']:g}s`"
        f" after a {settings['warmup_s']:g} s warm-up, POST {CHAT} ({settings['body_bytes']:,} "
        f"bytes{_image_note(settings)}), {_answer_note(settings)}; "
        f"{settings['rounds']} rounds alternating proxies, medians. CPU is the proxy's process "
        "tree (/proc) during the measured run.",
        "",
        table(document["summary"]),
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in document["versions"].items()) + ".",
        "",
    ]
    parts += [f"- {note}" for note in document.get("notes", [])]
    if document.get("profile"):
        parts += ["", profile_section(document["profile"])]
    return "\n".join(parts).rstrip() + "\n"
