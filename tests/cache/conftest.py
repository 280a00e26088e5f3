"""The real `redis-server` fixture (tests/support/redis_server.py)."""

from tests.support.redis_server import RedisServer, redis_server

__all__ = ["RedisServer", "redis_server"]
