"""Lossless failover across engines: a backend call that an engine's death broke is sent again, whole.

We hold every turn's exact ids, so each backend call of a turn is safe to send again as it was: render and derender
are pure, and a generate whose answer never arrived sampled nothing anyone was shown. What breaks a call is a refused
or reset connection, a 500/502/503/504 (a router answers those when its sticky engine is gone: it retries that same
engine and hands the caller the error, ../shared/docs/engine-routers.md §4), or a stream cut before its end. Behind a
router the call goes to the router again after a backoff long enough for it to drop the dead engine; with a fixed
engine list (`EngineList`) it goes at once to the next engine in the session's order. A stream cut after tokens
reached the agent goes on from the tokens it has (`resumed_generation`, as after a weight update's abort), so the
agent's stream and the record stay one generation.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

#: Answers that say the engine (or the router's way to it) failed, not the request: sent again.
RETRIED_STATUSES = frozenset({500, 502, 503, 504})


@dataclass(frozen=True)
class FailoverPolicy:
    """How often a broken backend call is sent again (`retries`: 0, never), and the backoff before a retry to the
    same URL: `wait_s`, doubled each time up to 8x. A retry to another engine of a fixed list does not wait."""

    retries: int = 0
    wait_s: float = 1.0

    def backoff(self, retry: int) -> float:
        return self.wait_s * min(2**retry, 8)


class EngineList:
    """A fixed list of engines given to the proxy, no router: each session runs on one engine chosen by a stable hash
    of its id (rendezvous hashing, so adding or removing an engine moves only the sessions it gains or had), and an
    engine a call found dead is tried last for `down_s` seconds, so its sessions move to their next engine instead of
    paying a failed call each turn. No policy beyond that: a router does load balancing."""

    def __init__(self, urls: list[str], down_s: float = 30.0) -> None:
        if not urls:
            raise ValueError("an engine list needs at least one engine")
        self.urls = list(dict.fromkeys(urls))
        self.down_s = down_s
        self._down_until: dict[str, float] = {}

    def ranked(self, session_id: str) -> list[str]:
        """The engines in the order this session tries them: its own first, those recently found dead last."""
        key = session_id.encode("utf-8", "surrogatepass")
        order = sorted(self.urls, key=lambda url: hashlib.sha256(url.encode() + b"\0" + key).digest(), reverse=True)
        now = time.monotonic()
        return sorted(order, key=lambda url: self._down_until.get(url, 0.0) > now)

    def failed(self, url: str) -> None:
        self._down_until[url] = time.monotonic() + self.down_s

    def answered(self, url: str) -> None:
        self._down_until.pop(url, None)

    def down(self) -> list[str]:
        now = time.monotonic()
        return [url for url in self.urls if self._down_until.get(url, 0.0) > now]


@dataclass
class FailoverLog:
    """One turn's way through its engines. Behind a router or a single URL it only notes the calls that failed over;
    with a fixed list, the backend addresses every call to the list's first URL (`canonical`, what its facts are
    kept under) and the log sends it to the engine the session is on now (`engines`, in the session's order)."""

    canonical: str | None = None
    engines: list[str] = field(default_factory=list)
    at: int = 0
    errors: list[str] = field(default_factory=list)
    engine_list: EngineList | None = None

    @classmethod
    def for_session(cls, engine_list: EngineList | None, session_id: str) -> FailoverLog:
        if engine_list is None:
            return cls()
        return cls(engine_list.urls[0], engine_list.ranked(session_id), engine_list=engine_list)

    def url(self, url: str) -> str:
        """Where a call addressed to `url` goes now."""
        canonical = self.canonical
        if canonical is None or not url.startswith(canonical) or url[len(canonical) : len(canonical) + 1] not in "/?":
            return url
        return self.engines[self.at] + url[len(canonical) :]

    @property
    def engine(self) -> str | None:
        """The engine the turn's calls go to now, where the proxy chose it."""
        return self.engines[self.at] if self.engines else None

    def failed(self, error: str) -> bool:
        """Note a failed call; with a list, the next call goes to the session's next engine. True when that engine
        was not tried yet in this turn (no backoff needed); False when the turn's calls went round them all."""
        self.errors.append(error)
        if self.engine_list is None or not self.engines:
            return False
        self.engine_list.failed(self.engines[self.at])
        self.at = (self.at + 1) % len(self.engines)
        return len(self.errors) < len(self.engines)

    def answered(self) -> None:
        if self.engine_list is not None and self.engines:
            self.engine_list.answered(self.engines[self.at])

    def record(self) -> dict[str, object] | None:
        """What the turn's record says: None when no call failed over."""
        if not self.errors:
            return None
        return {"retries": len(self.errors), "errors": self.errors[-8:]}
