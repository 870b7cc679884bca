"""Where what later roots may link to is kept (`turns/episode_places` decides what and how): in this process, or in
the Redis that several proxies share, so that a context rebuilt after a compaction, or a sub-agent, is placed the
same whichever proxy serves it.

Per scope (a named session, or the automatic sessions of a backend) two lists, newest first and bounded: the
summaries of compaction turns and the string arguments of tool calls, each entry a small JSON object. And a set of
claimed tool calls, so that sub-agents spawned together with the same task each follow their own call, on any proxy.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict, deque
from typing import Any

PER_SCOPE = 256
SCOPES = 4096
# A scope's lists outlive their last entry this long in Redis (an episode that pauses longer is not linked after it).
TTL_S = 7 * 24 * 3600


class MemoryLinks:
    """This process's lists (its own sessions)."""

    def __init__(self, per_scope: int = PER_SCOPE, scopes: int = SCOPES) -> None:
        self.per_scope = per_scope
        self.scopes = scopes
        self._lists: OrderedDict[tuple[str, str], deque[dict[str, Any]]] = OrderedDict()
        self._claimed: OrderedDict[str, None] = OrderedDict()

    async def add(self, scope: str, entries: list[tuple[str, dict[str, Any]]]) -> None:
        for kind, entry in entries:
            kept = self._lists.get((scope, kind))
            if kept is None:
                kept = self._lists[(scope, kind)] = deque(maxlen=self.per_scope)
                while len(self._lists) > 2 * self.scopes:
                    self._lists.popitem(last=False)
            self._lists.move_to_end((scope, kind))
            kept.appendleft(entry)

    async def entries(self, scope: str, kind: str) -> list[dict[str, Any]]:
        return list(self._lists.get((scope, kind), ()))

    async def claim(self, key: str) -> bool:
        if key in self._claimed:
            return False
        self._claimed[key] = None
        while len(self._claimed) > self.scopes * self.per_scope:
            self._claimed.popitem(last=False)
        return True


class RedisLinks:
    """The lists in Redis (`tito_session_store`): every proxy links the same way. `run` wraps each command (the
    store's timeouts and errors)."""

    def __init__(self, client: Any, prefix: str, run: Any, per_scope: int = PER_SCOPE) -> None:
        self.client = client
        self.prefix = prefix
        self.run = run
        self.per_scope = per_scope

    def _key(self, scope: str, kind: str) -> str:
        return f"{self.prefix}:links:{kind}:{hashlib.sha256(scope.encode()).hexdigest()[:32]}"

    async def add(self, scope: str, entries: list[tuple[str, dict[str, Any]]]) -> None:
        """One round trip for all of a turn's entries."""
        pipe = self.client.pipeline(transaction=True)
        for kind in dict.fromkeys(kind for kind, _ in entries):
            key = self._key(scope, kind)
            pipe.lpush(key, *(json.dumps(e, ensure_ascii=False) for k, e in entries if k == kind))
            pipe.ltrim(key, 0, self.per_scope - 1)
            pipe.expire(key, TTL_S)
        await self.run(pipe.execute())

    async def entries(self, scope: str, kind: str) -> list[dict[str, Any]]:
        found = await self.run(self.client.lrange(self._key(scope, kind), 0, self.per_scope - 1))
        return [json.loads(item) for item in found]

    async def claim(self, key: str) -> bool:
        name = f"{self.prefix}:links:claimed:{hashlib.sha256(key.encode()).hexdigest()[:32]}"
        return bool(await self.run(self.client.set(name, b"1", nx=True, ex=TTL_S)))
