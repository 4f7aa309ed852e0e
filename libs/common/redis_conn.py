"""Connecting to Redis the way every service needs it.

redis-py's default asyncio pool raises ``MaxConnectionsError`` at once when more commands are in
flight than it has connections (a burst of requests at the gateway did exactly that). A bounded
*blocking* pool makes callers wait for a free connection instead, up to ``timeout`` seconds.
"""

from __future__ import annotations

import redis
from redis.asyncio import BlockingConnectionPool, Redis

MAX_CONNECTIONS = 64


def connect_redis(url: str, max_connections: int = MAX_CONNECTIONS, timeout: float = 10.0) -> Redis:
    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout)
    return Redis(connection_pool=pool)


def connect_redis_sync(url: str, timeout_s: float) -> redis.Redis:
    """A blocking client for a thread of its own (the scheduler's lease keeper): every connect,
    read and write gives up after ``timeout_s``, so one hung call cannot hold the thread longer."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


# A key held by an owner token (a lease): renewed or deleted only by its holder, atomically.
# KEYS[1] = the key, ARGV[1] = the holder's token (RENEW: ARGV[2] = the TTL in ms).
# 1: done; 0: the key is not (any more) the holder's: it expired, or another took it.
RENEW_IF_HELD = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
DELETE_IF_HELD = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
