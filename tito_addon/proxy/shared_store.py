"""The Redis connection behind `tito_session_store`: short timeouts, so a store that is gone costs a turn a prompt
503, not a hung agent; the client reconnects by itself when Redis is back."""

from __future__ import annotations

from typing import Any

from tito_addon.sessions.redis_tree import RedisTree
from tito_addon.sessions.shared_sessions import SharedSessions

CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 5.0
# Every turn in flight may await Redis at once (each command holds a connection until its reply): beyond this many,
# commands wait for a free connection instead of failing (redis-py's default pool refuses its 101st).
MAX_CONNECTIONS = 64


def redis_client(url: str) -> Any:
    from redis.asyncio import BlockingConnectionPool, Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=COMMAND_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=COMMAND_TIMEOUT_S,
        # A couple of quick retries ride out a dropped connection; an outage is answered within about a second.
        retry=Retry(ExponentialBackoff(cap=0.25, base=0.05), 2),
        health_check_interval=30,
    )
    return Redis(connection_pool=pool)


class SharedStore:
    """One Redis URL's client and session space, kept across reconfiguration (its turn cache stays warm)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis_client(url)
        self.sessions = SharedSessions(RedisTree(self.client))

    def configure(self, *, idle_timeout: float, max_sessions: int, upstream_timeout: float) -> SharedSessions:
        self.sessions.idle_timeout = idle_timeout
        self.sessions.max_sessions = max_sessions
        # A claimed turn counts as in flight for as long as the backend may take, then as abandoned.
        self.sessions.busy_s = upstream_timeout + 60
        return self.sessions

    async def close(self) -> None:
        await self.client.aclose()
        await self.client.connection_pool.disconnect()
