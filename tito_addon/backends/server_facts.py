"""Each backend server's version, asked once per backend URL and kept for the proxy's life.

A fresh proxy's first turns arrive together: they share one question to the server (one probe in flight per
URL) instead of each asking. What a probe returns is kept, an "unknown" answer included (each kind's probe decides
what it answers when the server does not say); a probe that raises keeps nothing, so the turns that waited on it
get its error and the next turn asks again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class ServerVersions[V]:
    def __init__(self, probe: Callable[[str, dict[str, str]], Awaitable[V]]) -> None:
        self._probe = probe
        self._known: dict[str, V] = {}
        self._asking: dict[str, asyncio.Future[V]] = {}

    async def get(self, base_url: str, headers: dict[str, str]) -> V:
        """The version of the server at `base_url`; probed (with the first asker's `headers`) until one is kept."""
        try:
            return self._known[base_url]
        except KeyError:  # only until the first probe of this backend ends
            pass
        asking = self._asking.get(base_url)
        if asking is None:
            asking = self._asking[base_url] = asyncio.ensure_future(self._ask(base_url, headers))
            asking.add_done_callback(lambda _: self._asking.pop(base_url, None))
        return await asyncio.shield(asking)  # one waiter cancelled (its agent hung up) leaves the others theirs

    async def _ask(self, base_url: str, headers: dict[str, str]) -> V:
        found = await self._probe(base_url, headers)
        self._known[base_url] = found
        return found
