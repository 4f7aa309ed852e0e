"""Connecting to Redis the way every service needs it.

redis-py's default asyncio pool raises ``MaxConnectionsError`` at once when more commands are in
flight than it has connections (a burst of requests at the gateway did exactly that). A bounded
*blocking* pool makes callers wait for a free connection instead, up to ``timeout`` seconds.
"""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis

MAX_CONNECTIONS = 64


def connect_redis(url: str, max_connections: int = MAX_CONNECTIONS, timeout: float = 10.0) -> Redis:
    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout)
    return Redis(connection_pool=pool)
