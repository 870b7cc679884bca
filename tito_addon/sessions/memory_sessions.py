"""`SessionSpace` in this process: its own tree (`MemoryTree`), nothing shared, nothing awaited.

A turn's session and id are settled by its commit, which runs without a suspension point: identical first requests
in flight together (a GRPO group) join whichever committed first, and no other turn interleaves between the checks
and the insert. A claim only marks the session it extends as in flight, so no sweep or driver closes it meanwhile.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from tito_addon.sessions.link_stores import MemoryLinks
from tito_addon.sessions.session_space import (
    Claim,
    ClosedSession,
    Located,
    Lookup,
    Placement,
    RecordLine,
    SessionState,
    SessionStatus,
)
from tito_addon.sessions.session_tree import MemoryTree, Session, TurnNode
from tito_addon.sessions.turn_entity import RecordedTurn
from tito_addon.tito_errors import SessionClosed

MAX_CLOSED_NAMES = 65536


class MemorySessions:
    sweeps_inline = True  # sweeping this process's own tree costs nothing: done on every turn

    def __init__(self, tree: MemoryTree | None = None) -> None:
        self.tree = tree if tree is not None else MemoryTree()
        # Names their driver closed here, with the turn id a new tree under the name continues at: a first turn still
        # in flight when its driver closed the name is refused (or starts that new tree) at its commit.
        self.closed_names: OrderedDict[str, int] = OrderedDict()
        self.links = MemoryLinks()

    def configure(self, *, idle_timeout: float, max_sessions: int) -> None:
        self.tree.idle_timeout = idle_timeout
        self.tree.max_sessions = max_sessions

    async def locate(self, lookup: Lookup) -> Located:
        session_id = lookup.session_id
        attachment = self.tree.locate(session_id, lookup.keys, lookup.reasonings, lookup.namespace)
        if session_id is None:
            return Located(attachment)
        if attachment.session is not None:
            return Located(attachment, SessionState.LIVE)
        # Not live here: closed by its driver in this process, else whatever its record says (the caller reads it).
        closed = session_id in self.closed_names
        return Located(attachment, SessionState.CLOSED_BY_DRIVER if closed else SessionState.UNKNOWN)

    async def reply_turn(self, reply_id: str) -> TurnNode | None:
        return self.tree.replies.get(reply_id)

    async def claim(self, placement: Placement, reopen_closed: bool) -> Claim:
        busy = placement.attachment.session
        if busy is not None:
            busy.inflight += 1  # protects it from a sweep or a driver's close while the backend works
        return Claim(placement, busy, None, busy=busy, reopen_closed=reopen_closed)

    async def commit(self, claim: Claim, record: RecordLine) -> TurnNode:
        placement = claim.placement
        named = placement.session_id
        session = claim.session
        if session is None and named is not None:
            session = self.tree.sessions.get(named)  # made by another first turn meanwhile
        if session is None and named in self.closed_names and not claim.reopen_closed:
            raise SessionClosed(named)  # its driver closed it while this first turn ran
        if session is None and named is None:
            # Looked up again now: identical first requests that were in flight together (a GRPO group) join the
            # group of whichever committed first.
            session = self.tree.prompt_group(placement.namespace, placement.keys)
        if session is None:
            session = self.tree.new_session(named, placement.namespace, placement.new_session_id)
            if named is not None and named in self.closed_names:
                session.next_turn_id = self.closed_names[named]  # a new tree under a closed name: ids continue
        turn = record(session.session_id, session.next_turn_id)
        node = self.tree.commit(session, placement.parent, turn)
        claim.committed = True
        return node

    async def release(self, claim: Claim) -> None:
        if claim.busy is not None:
            claim.busy.inflight -= 1
            self.tree.touch(claim.busy)
            claim.busy = None

    async def holds(self, session_id: str, turn_id: int) -> bool:
        return True  # a commit here never fails halfway

    async def restore(self, session_id: str, recorded: Sequence[RecordedTurn], next_turn_id: int) -> bool:
        if session_id in self.tree.sessions:
            return False
        session = self.tree.new_session(session_id)
        self.tree.put_back(session, recorded)
        # Live even with no turn put back (a new tree after its driver's close), so its ids continue: never reuse the
        # id of a turn left out, nor of a torn line.
        live = self.tree.sessions.setdefault(session_id, session)
        live.next_turn_id = max(live.next_turn_id, next_turn_id)
        self.closed_names.pop(session_id, None)
        return True

    async def sweep(self) -> list[ClosedSession]:
        return [ClosedSession(s.session_id, s.turns, reason) for s, reason in self.tree.sweep()]

    def close_all(self, reason: str) -> list[ClosedSession]:
        closed = []
        for session in list(self.tree.sessions.values()):
            self.tree.remove(session)
            closed.append(ClosedSession(session.session_id, session.turns, reason))
        return closed

    async def close_by_driver(self, session_id: str) -> tuple[str, int]:
        session = self.tree.sessions.get(session_id)
        if session is None:
            return "unknown", 0
        if session.inflight:
            return "busy", 0
        self.tree.remove(session)  # no await between the check and the removal: no turn can slip in
        self.closed_names[session_id] = session.next_turn_id
        while len(self.closed_names) > MAX_CLOSED_NAMES:
            self.closed_names.popitem(last=False)
        return "closed", session.turns

    async def status(self, session_id: str) -> SessionStatus:
        session = self.tree.sessions.get(session_id)
        if session is None:
            return SessionStatus(session_id, live=False)
        return self._status(session)

    async def live(self, limit: int) -> list[SessionStatus]:
        return [self._status(session) for session in itertools.islice(reversed(self.tree.sessions.values()), limit)]

    @staticmethod
    def _status(session: Session) -> SessionStatus:
        return SessionStatus(
            session.session_id,
            live=True,
            in_flight=session.inflight,
            last_activity=session.last_used,
        )
