"""The gateway's one Redis client: commands on one pipelined connection (docs/cache.md, "Redis").

The cache (cache/stores.py) sends a GET or SET on every cacheable request, and fleet state
(fleet/) a few commands per admission, so a command's cost is the Redis path's cost. A general
client pays for generality on each command: a connection taken from a pool under a lock and given
back, a check for unread data, one connection per concurrent command (each opened with its own
handshake when a burst comes); measured, it costs several times this one's CPU per GET
(benchmarks/results/redis_clients.md). Here one connection carries every command of a link in
order. Redis answers a connection's commands in the order they came, so replies go to their
waiters first in, first out; a waiter that gave up (its timeout) leaves a reply that is read and
dropped, and the connection stays usable. A lost connection fails every waiter at once; the next
command opens a new one.

URLs: `redis://[[user]:password@]host[:port][/db]`, `rediss://` (TLS), `unix://path?db=N`.
Replies are RESP2: a simple string, an error, an integer, a bulk string, nil, or an array of
those (what a Lua script returns). `pipeline` sends several commands at once and awaits all their
replies: the round trip redis-py's pipelines make.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit


class RedisReplyError(Exception):
    """Redis answered a command with an error, or with something no command here asks for."""


Reply = bytes | int | list[Any] | None  # an array's items are Replies
Argument = bytes | str | int
_BULK, _SIMPLE, _ERROR, _INTEGER, _ARRAY = b"$+-:*"


class RedisLink:
    """One lazily opened connection to the Redis a URL names."""

    def __init__(self, url: str, connect_timeout_s: float = 1.0) -> None:
        self._target = _Target.parse(url)
        self._connect_timeout_s = connect_timeout_s
        self._protocol: _Replies | None = None
        self._opening: asyncio.Future[_Replies] | None = None
        self._scripts: dict[str, bytes] = {}  # SHA1 -> Lua source, given to a Redis without it

    def script(self, source: str) -> str:
        """The SHA1 to run `source` by (EVALSHA). A Redis that does not have it (a new one, a
        restarted one, a flushed script cache) answers NOSCRIPT: it is given every script and
        the command (or the pipeline) sent again, once."""
        sha = hashlib.sha1(source.encode()).hexdigest()
        self._scripts[sha] = source.encode()
        return sha

    async def get(self, key: bytes) -> bytes | None:
        reply = await self._call((b"GET", key))
        if reply is not None and not isinstance(reply, bytes):
            raise RedisReplyError(f"GET answered {reply!r}")
        return reply

    async def set(self, key: bytes, value: bytes, px: int) -> None:
        await self._call((b"SET", key, value, b"PX", b"%d" % px))

    async def call(self, *command: Argument) -> Reply:
        """Any command; its reply. An error reply is raised as RedisReplyError."""
        encoded = _encoded(command)
        try:
            return await self._call(encoded)
        except RedisReplyError as error:
            if not self._lacks_scripts(error):
                raise
        await self._load_scripts()
        return await self._call(encoded)

    async def pipeline(self, commands: list[tuple[Argument, ...]]) -> list[Reply]:
        """The commands written together, their replies awaited together (in order). After
        every reply is in, the first error reply among them is raised as RedisReplyError."""
        if not commands:
            return []
        encoded = [_encoded(command) for command in commands]
        replies = await self._send_all(encoded)
        if any(
            isinstance(reply, RedisReplyError) and self._lacks_scripts(reply) for reply in replies
        ):
            await self._load_scripts()
            replies = await self._send_all(encoded)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return cast(list[Reply], replies)

    async def _send_all(self, commands: list[tuple[bytes, ...]]) -> list[Reply | BaseException]:
        protocol = self._protocol
        if protocol is None or protocol.lost:
            protocol = await self._open()
        return await asyncio.gather(*protocol.send(commands), return_exceptions=True)

    def _lacks_scripts(self, error: RedisReplyError) -> bool:
        return bool(self._scripts) and str(error).startswith("NOSCRIPT")

    async def _load_scripts(self) -> None:
        await self.pipeline([(b"SCRIPT", b"LOAD", source) for source in self._scripts.values()])

    async def close(self) -> None:
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        if self._protocol is not None:
            self._protocol.close()
            self._protocol = None

    async def _call(self, command: tuple[bytes, ...]) -> Reply:
        protocol = self._protocol
        if protocol is None or protocol.lost:
            protocol = await self._open()
        return await protocol.call(command)

    async def _open(self) -> _Replies:
        """The connection, opened once for all callers that need it now. A caller giving up
        (its timeout) does not stop the opening for the others."""
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(self._connect())
            self._opening.add_done_callback(_retrieved)
        return await asyncio.shield(self._opening)

    async def _connect(self) -> _Replies:
        async with asyncio.timeout(self._connect_timeout_s):  # a host that never answers
            return await self._handshake()

    async def _handshake(self) -> _Replies:
        loop = asyncio.get_running_loop()
        target = self._target
        if target.path is not None:
            _, protocol = await loop.create_unix_connection(_Replies, target.path)
        else:
            _, protocol = await loop.create_connection(
                _Replies, target.host, target.port, ssl=target.tls
            )
        try:
            if target.password is not None:
                login = (target.username,) if target.username is not None else ()
                await protocol.call((b"AUTH", *login, target.password))
            if target.db:
                await protocol.call((b"SELECT", b"%d" % target.db))
        except BaseException:
            protocol.close()
            raise
        self._protocol = protocol
        return protocol


class _Target:
    __slots__ = ("db", "host", "password", "path", "port", "tls", "username")

    def __init__(self) -> None:
        self.host = "127.0.0.1"
        self.port = 6379
        self.path: str | None = None
        self.db = 0
        self.username: bytes | None = None
        self.password: bytes | None = None
        self.tls: ssl.SSLContext | None = None

    @classmethod
    def parse(cls, url: str) -> _Target:
        parts = urlsplit(url)
        target = cls()
        query = parse_qs(parts.query)
        if parts.scheme == "unix":
            target.path = unquote(parts.path)
        else:
            target.host = parts.hostname or target.host
            target.port = parts.port or target.port
            database = parts.path.strip("/")
            if database:
                target.db = int(database)
            if parts.scheme == "rediss":
                target.tls = ssl.create_default_context()
        if "db" in query:
            target.db = int(query["db"][0])
        if parts.username:
            target.username = unquote(parts.username).encode()
        if parts.password is not None:
            target.password = unquote(parts.password).encode()
        return target


class _Replies(asyncio.Protocol):
    """Sends commands and hands each reply to the oldest waiter."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiters: deque[asyncio.Future[Reply]] = deque()
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    async def call(self, command: tuple[bytes, ...]) -> Reply:
        (waiter,) = self.send([command])
        return await waiter

    def send(self, commands: list[tuple[bytes, ...]]) -> list[asyncio.Future[Reply]]:
        """Writes the commands in one go; a future for each one's reply."""
        if self.lost or self._transport is None:
            raise ConnectionError("the connection to Redis is closed")
        loop = asyncio.get_running_loop()
        parts: list[bytes] = []
        waiters: list[asyncio.Future[Reply]] = []
        for command in commands:
            parts.append(b"*%d\r\n" % len(command))
            for argument in command:
                parts += (b"$%d\r\n" % len(argument), argument, b"\r\n")
            waiters.append(loop.create_future())
        self._transport.writelines(parts)
        self._waiters.extend(waiters)
        return waiters

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while self._buffer:
            try:
                used, reply = _parse(self._buffer)
            except RedisReplyError as error:
                self._fail(error)
                self.close()
                return
            if not used:
                return
            del self._buffer[:used]
            if not self._waiters:
                self._fail(RedisReplyError("Redis answered a command never sent"))
                self.close()
                return
            waiter = self._waiters.popleft()
            if not waiter.done():  # else its caller gave up: the reply is dropped
                if isinstance(reply, RedisReplyError):
                    waiter.set_exception(reply)
                else:
                    waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(ConnectionError(f"the connection to Redis was lost: {exc}"))

    def close(self) -> None:
        self.lost = True
        if self._transport is not None:
            self._transport.close()

    def _fail(self, error: Exception) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)


def _retrieved(opening: asyncio.Future[Any]) -> None:
    """An opening's failure is read: by its callers, or by nobody when all of them gave up."""
    if not opening.cancelled():
        opening.exception()


def _encoded(command: tuple[Argument, ...]) -> tuple[bytes, ...]:
    return tuple(
        a if isinstance(a, bytes) else (a.encode() if isinstance(a, str) else b"%d" % a)
        for a in command
    )


def _parse(buffer: bytearray, at: int = 0) -> tuple[int, Any]:
    """(bytes used, the reply) of the first whole reply in `buffer` from `at`; (0, None) when it
    is not all in yet. An error reply is returned as a RedisReplyError, not raised (inside an
    array too)."""
    end = buffer.find(b"\r\n", at)
    if end < 0:
        return 0, None
    kind, line = buffer[at], bytes(buffer[at + 1 : end])
    try:
        number = int(line) if kind in (_BULK, _INTEGER, _ARRAY) else 0
    except ValueError:
        raise RedisReplyError(f"unexpected reply from Redis: {bytes(buffer[:32])!r}") from None
    used = end + 2 - at
    if kind == _BULK:
        if number < 0:
            return used, None
        start = end + 2
        if len(buffer) < start + number + 2:
            return 0, None
        with memoryview(buffer) as view:
            return used + number + 2, bytes(view[start : start + number])
    if kind == _SIMPLE:
        return used, line
    if kind == _ERROR:
        return used, RedisReplyError(line.decode("utf-8", "replace"))
    if kind == _INTEGER:
        return used, number
    if kind == _ARRAY:
        return _parse_array(buffer, at + used, number, used)
    raise RedisReplyError(f"unexpected reply from Redis: {bytes(buffer[:32])!r}")


def _parse_array(buffer: bytearray, at: int, count: int, used: int) -> tuple[int, Any]:
    """The `count` items of an array whose header took `used` bytes, from `at`."""
    if count < 0:
        return used, None
    items: list[Any] = []
    for _ in range(count):
        taken, item = _parse(buffer, at)
        if not taken:
            return 0, None
        items.append(item)
        at += taken
        used += taken
    return used, items
