"""A lean HTTP/1.1 client for the cache benchmark: keep-alive connections on asyncio streams.

The figures are the gateway's, so the client must cost little next to it: httpx spends more CPU
per small request than the gateway does, and on a shared 2-core machine that time is taken from
the gateway and shows in its latency.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Answer:
    status: int
    cache: str  # the X-Cache header, "-" when absent
    body: bytes
    seconds: float  # from the request's first byte written to the answer's last byte read


class Connection:
    """One keep-alive connection; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, url: str) -> Connection:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port, limit=1 << 22)
        return cls(reader, writer)

    async def post(self, body: bytes, path: str = CHAT) -> Answer:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        started = time.perf_counter()
        self._writer.writelines((head, body))
        await self._writer.drain()
        lines = (await self._reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = dict(_header(line) for line in lines[1:] if line)
        content = await self._reader.readexactly(int(headers[b"content-length"]))
        seconds = time.perf_counter() - started
        return Answer(status, headers.get(b"x-cache", b"-").decode(), content, seconds)

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()


def _header(line: bytes) -> tuple[bytes, bytes]:
    name, _, value = line.partition(b":")
    return name.strip().lower(), value.strip()


async def post_all(url: str, bodies: list[bytes], connections: int) -> list[Answer]:
    """Every body sent, `connections` at a time (each on its own connection); the answers in the
    order of `bodies`."""
    answers: list[Answer | None] = [None] * len(bodies)
    queue = iter(range(len(bodies)))

    async def worker() -> None:
        connection = await Connection.open(url)
        try:
            for index in queue:
                answers[index] = await connection.post(bodies[index])
        finally:
            await connection.close()

    await asyncio.gather(*(worker() for _ in range(min(connections, len(bodies)))))
    done = [answer for answer in answers if answer is not None]
    assert len(done) == len(bodies)
    return done
