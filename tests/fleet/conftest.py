"""The real `redis-server` fixture (tests/support/redis_server.py)."""

from tests.support.redis_server import redis_server

__all__ = ["redis_server"]
