"""The cache's Redis client against a real redis-server: one pipelined connection, callers that
give up, a restarted server, a password and a database in the URL."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis import Redis

from mineru_gateway.redis_link import RedisLink, RedisReplyError
from tests.cache.conftest import RedisServer


def received(server: RedisServer) -> int:
    """Connections the server has accepted so far, this one asking included."""
    with Redis(port=server.port) as inspector:
        return int(inspector.info("stats")["total_connections_received"])


async def test_concurrent_commands_share_one_connection_and_each_gets_its_reply(
    redis_server: RedisServer,
) -> None:
    before = received(redis_server)
    link = RedisLink(redis_server.url)
    keys = [b"key-%d" % n for n in range(200)]
    await asyncio.gather(*(link.set(key, key * 1000, px=60_000) for key in keys))
    values = await asyncio.gather(*(link.get(key) for key in keys))
    assert values == [key * 1000 for key in keys]
    assert await link.get(b"absent") is None
    assert received(redis_server) == before + 2  # the link's one, and this count's
    await link.close()


async def test_a_caller_that_gives_up_leaves_the_connection_usable(
    redis_server: RedisServer,
) -> None:
    before = received(redis_server)
    link = RedisLink(redis_server.url)
    await link.set(b"a", b"first", px=60_000)
    await link.set(b"b", b"second", px=60_000)
    with Redis(port=redis_server.port) as pauser:
        pauser.client_pause(300)  # milliseconds: every client's commands wait
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await link.get(b"a")
    assert await link.get(b"b") == b"second"  # not the reply the first caller left
    assert received(redis_server) == before + 3  # the link's one, the pauser's, this count's
    await link.close()


async def test_a_restarted_server_is_reached_again_by_the_next_command(
    redis_server: RedisServer,
) -> None:
    link = RedisLink(redis_server.url)
    await link.set(b"a", b"1", px=60_000)
    redis_server.stop()
    with pytest.raises(OSError):
        await link.get(b"a")
    redis_server.start()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert await link.get(b"a") is None  # a new server, empty
            break
        except OSError:
            assert time.monotonic() < deadline, "the link never reconnected"
            await asyncio.sleep(0.05)
    await link.close()


async def test_the_urls_password_and_database_are_used() -> None:
    server = RedisServer("--requirepass", "s3cret")
    server.start()
    try:
        link = RedisLink(f"redis://:s3cret@127.0.0.1:{server.port}/3")
        await link.set(b"k", b"v", px=60_000)
        with Redis(port=server.port, db=3, password="s3cret") as inspector:
            assert inspector.get(b"k") == b"v"
            assert inspector.pttl(b"k") > 0
        await link.close()
        wrong = RedisLink(f"redis://:nope@127.0.0.1:{server.port}/0")
        with pytest.raises(RedisReplyError):
            await wrong.get(b"k")
        await wrong.close()
    finally:
        server.stop()


async def test_any_command_and_arrays_nil_and_errors_come_back(redis_server: RedisServer) -> None:
    link = RedisLink(redis_server.url)
    script = "return {1, 'two', {3, false}, redis.error_reply('NOPE inner')}"
    reply = await link.call("EVAL", script, 0)
    assert isinstance(reply, list) and reply[:3] == [1, b"two", [3, None]]
    assert isinstance(reply[3], RedisReplyError) and "NOPE" in str(reply[3])
    assert await link.call("ZADD", "z", 1, "a") == 1
    with pytest.raises(RedisReplyError, match="NOSCRIPT"):
        await link.call("EVALSHA", "0" * 40, 0)
    await link.close()


async def test_a_pipeline_sends_together_and_raises_an_error_after_every_reply(
    redis_server: RedisServer,
) -> None:
    link = RedisLink(redis_server.url)
    assert await link.pipeline([]) == []
    replies = await link.pipeline([("SET", "a", "1"), ("INCR", "a"), ("GET", "a")])
    assert replies == [b"OK", 2, b"2"]
    with pytest.raises(RedisReplyError, match="NOSCRIPT"):
        await link.pipeline([("EVALSHA", "0" * 40, 0), ("INCR", "a")])
    assert await link.get(b"a") == b"3"  # the command after the error ran, its reply was read
    await link.close()


async def test_a_script_redis_lacks_is_given_to_it_and_the_commands_sent_again(
    redis_server: RedisServer,
) -> None:
    link = RedisLink(redis_server.url)
    sha = link.script("return tonumber(ARGV[1]) + 1")
    assert await link.call("EVALSHA", sha, 0, 1) == 2  # never loaded: loaded on NOSCRIPT
    with Redis(port=redis_server.port) as witness:
        witness.script_flush()
    assert await link.pipeline([("EVALSHA", sha, 0, 2), ("EVALSHA", sha, 0, 3)]) == [3, 4]
    await link.close()
