"""The tests' Redis: the project's one redis-server starter, and an atomic byte count of the shared tier."""

from __future__ import annotations

import redis

from kvtier.bench.redis_server import RedisServer, redis_server_binary
from kvtier.rollout.server import free_port

__all__ = ["RedisServer", "free_port", "redis_server_binary", "stored_bytes"]

STORED_BYTES = """local n = 0
    for _, k in ipairs(redis.call('KEYS', 'kvtier:*')) do
      if not string.find(k, '!', 1, true) then n = n + redis.call('STRLEN', k) end end
    return n"""  # the tier's values (not its '!' metadata), summed in one atomic step


def stored_bytes(client: redis.Redis) -> int:
    """What the shared tier's values weigh in Redis right now, read atomically (a watcher's sample)."""
    return int(client.eval(STORED_BYTES, 0))
