"""A fake fleet of vLLM workers in one process: W listening ports on 127.0.0.1, each answering
what the gateway asks of a vLLM worker (`/health`, `/v1/models`, `/metrics`, chat completions)
at once and with a fixed, idle load. It counts the GETs each port is asked, by path, so that the
benchmark can tell what the gateway costs each worker, and the connections each port accepts
(as the path `#connections`).

    python -m benchmarks.fleet.fake --workers 1024

prints one JSON line, {"ports": [...], "control": port}, then serves until killed;
`GET /stats` on the control port answers the counts so far.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from typing import cast

import orjson
import uvloop

MODEL = "fleet-model"
CONNECTIONS = "#connections"  # a count kept with the GETs' paths: connections accepted
MODELS = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
METRICS = (
    b'vllm:num_requests_running{model_name="fleet-model"} 0.0\n'
    b'vllm:num_requests_waiting{model_name="fleet-model"} 0.0\n'
    b'vllm:kv_cache_usage_perc{model_name="fleet-model"} 0.0\n'
    b'vllm:inter_token_latency_seconds_sum{model_name="fleet-model"} 0.0\n'
    b'vllm:inter_token_latency_seconds_count{model_name="fleet-model"} 0.0\n'
)
ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-fleet",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }
)


def response(status: bytes, body: bytes, kind: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: " + kind + b"\r\ncontent-length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


class Worker(asyncio.Protocol):
    """One connection to one fake worker: requests one after another (keep-alive)."""

    def __init__(self, gets: Counter[tuple[int, str]]) -> None:
        self._port = 0
        self._gets = gets
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self._port = transport.get_extra_info("sockname")[1]
        self._gets[(self._port, CONNECTIONS)] += 1

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buffer[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self._buffer) < end + 4 + length:
                return
            self._buffer = self._buffer[end + 4 + length :]
            method, target = head.split(b" ", 2)[:2]
            assert self._transport is not None
            self._transport.write(self._answer(method, target.decode()))

    def _answer(self, method: bytes, target: str) -> bytes:
        path = target.split("?", 1)[0].rstrip("/") or "/"
        if method == b"GET":
            self._gets[(self._port, path)] += 1
        if path == "/health":
            return response(b"200 OK", b"")
        if path == "/v1/models":
            return response(b"200 OK", MODELS)
        if path == "/metrics":
            return response(b"200 OK", METRICS, b"text/plain; version=0.0.4")
        if path in ("/v1/chat/completions", "/v1/completions"):
            return response(b"200 OK", ANSWER)
        return response(b"404 Not Found", b"{}")


class Control(asyncio.Protocol):
    def __init__(self, gets: Counter[tuple[int, str]]) -> None:
        self._gets = gets

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        counts: dict[str, dict[str, int]] = {}
        for (port, path), count in self._gets.items():
            counts.setdefault(str(port), {})[path] = count
        transport.write(response(b"200 OK", orjson.dumps(counts)))
        transport.close()


async def serve(workers: int) -> None:
    loop = asyncio.get_running_loop()
    gets: Counter[tuple[int, str]] = Counter()
    ports = []
    for _ in range(workers):
        server = await loop.create_server(lambda: Worker(gets), "127.0.0.1", 0, backlog=64)
        ports.append(server.sockets[0].getsockname()[1])
    control = await loop.create_server(lambda: Control(gets), "127.0.0.1", 0)
    line = {"ports": ports, "control": control.sockets[0].getsockname()[1]}
    sys.stdout.write(orjson.dumps(line).decode() + "\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, required=True)
    uvloop.run(serve(parser.parse_args().workers))


if __name__ == "__main__":
    main()
