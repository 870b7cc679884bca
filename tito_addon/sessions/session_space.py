"""The sessions, as the turn layer sees them: one interface, two implementations.

A turn locates the stored turn it extends, claims its place (marked in flight, so no sweep or driver closes its
session meanwhile), commits once the backend answered and its record line is on disk, and releases its claim however
it ended. Sessions close when idle, beyond capacity or by their driver, and a named one comes back from its records.
`MemorySessions` keeps all of it in this process; `RedisSessions` in a Redis that several proxies share. The turn
service, the control API and the sweeper are written once, against `SessionSpace`; nothing else of either
implementation is reached from outside the sessions layer.

Everything here speaks in texts (reasoning) and ids; what Redis stores as digests is its own business.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tito_addon.canonical_chat import ChatMessage
from tito_addon.sessions.message_keys import MessageKey
from tito_addon.sessions.session_tree import Attachment, Session, TurnNode
from tito_addon.sessions.turn_entity import RecordedTurn, Turn


class SessionState(enum.Enum):
    """What a named session is, where the sessions live."""

    LIVE = "live"
    CLOSED = "closed"  # idle, evicted or shut down: its record resumes it
    CLOSED_BY_DRIVER = "closed_by_driver"  # its rollout driver closed it: refused or a new tree (tito_after_close)
    UNKNOWN = "unknown"  # never seen here (an automatic request's state too)


@dataclass(frozen=True)
class Lookup:
    """What a request says of where it goes: the session it names (None: an automatic one), its messages (their keys
    and reasoning texts) and its namespace (backend + model: automatic sessions never cross it)."""

    session_id: str | None
    messages: Sequence[ChatMessage]
    keys: Sequence[MessageKey]
    reasonings: Sequence[str | None]
    namespace: str

    @functools.cached_property
    def roles(self) -> list[str]:
        """Asked only where the sessions look turns up by path (Redis): not worth a walk over every message else."""
        return [message.role for message in self.messages]


@dataclass(frozen=True)
class Located:
    """Where a request attaches, and what the sessions know of the session it names."""

    attachment: Attachment
    state: SessionState = SessionState.UNKNOWN
    group: bytes = b""  # the digest of all the request's message keys (its GRPO group), where the sessions use one


class Placement(Protocol):
    """What a prepared turn tells the sessions of where it goes (the turn layer's prepared turn is one)."""

    session_id: str | None  # the session the request names
    attachment: Attachment
    parent: TurnNode | None  # the turn it extends (None: a first turn, or a fresh render that starts a new root)
    namespace: str  # backend + model: automatic sessions never cross it
    keys: list[MessageKey]  # the request's message keys (a first request's GRPO group)
    group: bytes

    @property
    def new_session_id(self) -> str: ...


@dataclass
class Claim:
    """A turn's place while the backend runs: its session and turn id where they are decided before the commit."""

    placement: Placement
    session: Session | None  # None: a new session, made by the commit
    turn_id: int | None  # None: the commit numbers it
    busy: Session | None = None  # the session this process marked in flight (memory)
    reopen_closed: bool = False  # a name its driver closed starts a new tree (tito_after_close=new)
    committed: bool = False

    @property
    def session_id(self) -> str:
        """The session the turn will be committed in (a reply id names it before the backend runs)."""
        if self.session is not None:
            return self.session.session_id
        return self.placement.session_id or self.placement.new_session_id


# Builds the turn's record line for the session and turn id the commit settled on, writes it, and returns the turn as
# its line says it: the line is on disk before any agent can extend the turn.
RecordLine = Callable[[str, int], Turn]


@dataclass(frozen=True)
class ClosedSession:
    session_id: str
    turns: int
    reason: str  # idle, evicted, shutdown


@dataclass(frozen=True)
class SessionStatus:
    """A live session, or what the sessions know of one: whether it is live, its turns in flight, its last use."""

    session_id: str
    live: bool
    in_flight: int | None = 0  # None: not known here (a Redis listing)
    last_activity: float | None = None


class LinkStore(Protocol):
    """What later roots may link to (`sessions/link_stores`): per scope and kind, entries newest first; and claims."""

    async def add(self, scope: str, entries: list[tuple[str, dict[str, Any]]]) -> None:
        """Entries (kind, entry) of one turn, newest last."""
        ...

    async def entries(self, scope: str, kind: str) -> list[dict[str, Any]]: ...

    async def claim(self, key: str) -> bool:
        """True the first time `key` is claimed, wherever the sessions live."""
        ...


class SessionSpace(Protocol):
    """Where sessions live. Every method but the listing of this process's own sessions may await a store."""

    #: Whether this process sweeps on every turn (its own sessions, at no cost) or only periodically (a shared store).
    sweeps_inline: bool
    #: What later roots of its sessions may link to, kept where the sessions are.
    links: LinkStore

    async def locate(self, lookup: Lookup) -> Located:
        """The deepest stored turn whose messages the request repeats (of the named session, or of the namespace's
        automatic sessions), with the named session's state."""
        ...

    async def reply_turn(self, reply_id: str) -> TurnNode | None:
        """The turn a reply id (`resp_…`) answered, while its session lives."""
        ...

    async def claim(self, placement: Placement, reopen_closed: bool) -> Claim:
        """Mark the turn in flight in its session (`reopen_closed`: a name its driver closed starts a new tree)."""
        ...

    async def commit(self, claim: Claim, record: RecordLine) -> TurnNode:
        """Settle the turn's session and id, have its line written, then add it to the tree. Raises `SessionClosed`
        or `SessionGone` when the session closed meanwhile (the line, if written, must then be withdrawn), or
        `StoreUnavailable` when the store's answer is unknown."""
        ...

    async def release(self, claim: Claim) -> None:
        """The turn is over (committed or not): it no longer holds its session in flight."""
        ...

    async def holds(self, session_id: str, turn_id: int) -> bool:
        """Whether a committed turn is stored (settles a commit whose answer was lost)."""
        ...

    async def restore(self, session_id: str, recorded: Sequence[RecordedTurn], next_turn_id: int) -> bool:
        """Put a named session back from its records unless it is live; its turn ids continue at `next_turn_id`
        at least. False when it was live already (another proxy put it back first)."""
        ...

    async def sweep(self) -> list[ClosedSession]:
        """Close idle sessions, then the least recently used beyond capacity; never one with a turn in flight."""
        ...

    def close_all(self, reason: str) -> list[ClosedSession]:
        """At shutdown: this process's own sessions (shared ones live on in their store)."""
        ...

    async def close_by_driver(self, session_id: str) -> tuple[str, int]:
        """A rollout driver's close, now: ("closed", turns), ("busy", 0) with a turn in flight, else ("unknown", 0)
        (not live here: already closed, or never seen)."""
        ...

    async def status(self, session_id: str) -> SessionStatus: ...

    async def live(self, limit: int) -> list[SessionStatus]:
        """The most recently used live sessions."""
        ...
