"""Raw HTTP/1.1 on real sockets, for tests that need bytes exactly where they want them: a
server on 127.0.0.1 whose connections a test handles by hand, and the framing such a handler
reads and writes (the gateway's own HTTP/1.1 client is tested against it, tests/workers); and a
client's side, for the gateway's server protocol (tests/api)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def content_length(head: bytes) -> int:
    """The Content-Length of a request's or an answer's head (0 without one)."""
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """The next request on a connection, head and body (framed by Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    return head + await reader.readexactly(content_length(head))


@asynccontextmanager
async def raw_server(handle: Handler, **options: Any) -> AsyncIterator[str]:
    """A server on a free port of 127.0.0.1 handing each connection to `handle` (`options` go
    to `asyncio.start_server`): its URL."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0, **options)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


def connect(url: str, timeout: float = 10.0) -> socket.socket:
    """A blocking client connection to the server at `url` (http://host:port)."""
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def until_closed(client: socket.socket) -> bytes:
    """Everything the server sends on `client` until it closes the connection."""
    answer = bytearray()
    while chunk := client.recv(65536):
        answer += chunk
    return bytes(answer)


def exchange(url: str, data: bytes) -> bytes:
    """Sends `data` on a new connection and reads until the server closes it."""
    with connect(url) as client:
        client.sendall(data)
        return until_closed(client)
