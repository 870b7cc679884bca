"""Sessions as trees of turns, and the index that finds the turn a request extends.

A turn node holds only what it added: the prompt ids after its parent's completion and its own completion
ids (as compact arrays), so memory grows with the tokens of a tree, not with turns x history. A request
attaches at the deepest stored turn whose whole message history it repeats; what it appends becomes a new
child. Nodes are never modified or removed, so concurrent requests that extend the same turn simply become
siblings: there is no lost update and no version to check.
"""

from __future__ import annotations

import time
import uuid
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tito_addon.message_keys import MessageKey, reasoning_matches

SegmentKey = tuple[MessageKey, ...]


class ChildIndex:
    """Children of one position, found by the keys of the messages they add (appended + assistant)."""

    __slots__ = ("by_length",)

    def __init__(self) -> None:
        self.by_length: dict[int, dict[SegmentKey, list[TurnNode]]] = {}

    def add(self, node: TurnNode) -> None:
        self.by_length.setdefault(len(node.segment_keys), {}).setdefault(node.segment_keys, []).append(node)

    def candidates(self, keys: Sequence[MessageKey], start: int) -> Iterable[TurnNode]:
        for length, table in self.by_length.items():
            if start + length <= len(keys):
                yield from table.get(tuple(keys[start : start + length]), ())

    def __len__(self) -> int:
        return sum(len(nodes) for table in self.by_length.values() for nodes in table.values())


@dataclass(eq=False)
class TurnNode:
    session: Session
    turn_id: int
    parent: TurnNode | None
    message_end: int
    segment_keys: SegmentKey
    segment_reasoning: tuple[str | None, ...]
    added_ids: array
    completion_ids: array
    finish_reason: str | None
    # Digest of the request's tools, so a record line carries its tools only when they changed.
    tools_sha256: str | None = None
    children: ChildIndex = field(default_factory=ChildIndex)

    @property
    def prompt_len(self) -> int:
        return self.end_len - len(self.completion_ids)

    @property
    def end_len(self) -> int:
        total = 0
        node: TurnNode | None = self
        while node is not None:
            total += len(node.added_ids) + len(node.completion_ids)
            node = node.parent
        return total

    def full_ids(self) -> list[int]:
        """Prompt + completion ids of this turn, exactly as the model saw and produced them."""
        chain = []
        node: TurnNode | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        out = array("I")
        for node in reversed(chain):
            out.extend(node.added_ids)
            out.extend(node.completion_ids)
        return out.tolist()

    def reasoning_compatible(self, reasonings: Sequence[str | None], start: int) -> bool:
        return all(reasoning_matches(stored, reasonings[start + i]) for i, stored in enumerate(self.segment_reasoning))


@dataclass(eq=False)
class Session:
    session_id: str
    automatic: bool
    roots: ChildIndex = field(default_factory=ChildIndex)
    next_turn_id: int = 0
    turns: int = 0
    tokens: int = 0
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Attachment:
    """Where a request attaches: its session (None: a new one) and the turn it extends (None: a first turn)."""

    session: Session | None
    parent: TurnNode | None
    matched: int  # messages covered by the parent's history
    ambiguous: bool = False


class SessionStore:
    """All live sessions, with a prefix index over automatic sessions' first turns."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        # First turns of sessions that carry no client-given id, keyed by their messages, so a request
        # finds the session it continues without scanning sessions.
        self.auto_roots = ChildIndex()

    def locate(
        self, session_id: str | None, keys: Sequence[MessageKey], reasonings: Sequence[str | None]
    ) -> Attachment:
        if session_id is not None:
            session = self.sessions.get(session_id)
            if session is None:
                return Attachment(None, None, 0)
            node, ambiguous = self._deepest(session.roots, keys, reasonings, 0)
            return Attachment(session, node, node.message_end if node else 0, ambiguous)
        node, ambiguous = self._deepest(self.auto_roots, keys, reasonings, 0)
        if node is None:
            return Attachment(None, None, 0)
        return Attachment(node.session, node, node.message_end, ambiguous)

    def _deepest(
        self, index: ChildIndex, keys: Sequence[MessageKey], reasonings: Sequence[str | None], start: int
    ) -> tuple[TurnNode | None, bool]:
        """Deepest matching turn below `index`; on equal depth the oldest wins (ambiguous=True)."""
        best: TurnNode | None = None
        ambiguous = False
        for candidate in index.candidates(keys, start):
            if not candidate.reasoning_compatible(reasonings, start):
                continue
            deeper, deeper_ambiguous = self._deepest(candidate.children, keys, reasonings, candidate.message_end)
            found = deeper or candidate
            if best is None or found.message_end > best.message_end:
                best, ambiguous = found, deeper_ambiguous
            elif found.message_end == best.message_end:
                ambiguous = True
                if (found.session.created, found.turn_id) < (best.session.created, best.turn_id):
                    best = found
        return best, ambiguous

    def new_session(self, session_id: str | None) -> Session:
        if session_id is None:
            return Session(session_id=uuid.uuid4().hex, automatic=True)
        return Session(session_id=session_id, automatic=False)

    def commit(
        self,
        session: Session,
        parent: TurnNode | None,
        message_end: int,
        segment_keys: SegmentKey,
        segment_reasoning: tuple[str | None, ...],
        added_ids: Sequence[int],
        completion_ids: Sequence[int],
        finish_reason: str | None,
        tools_sha256: str | None = None,
        turn_id: int | None = None,
    ) -> TurnNode:
        """Add a turn. Synchronous: no other request can interleave between the checks and the insert."""
        live = self.sessions.setdefault(session.session_id, session)
        if turn_id is None:
            turn_id = live.next_turn_id
        node = TurnNode(
            session=live,
            turn_id=turn_id,
            parent=parent,
            message_end=message_end,
            segment_keys=segment_keys,
            segment_reasoning=segment_reasoning,
            added_ids=array("I", added_ids),
            completion_ids=array("I", completion_ids),
            finish_reason=finish_reason,
            tools_sha256=tools_sha256,
        )
        live.next_turn_id = max(live.next_turn_id, turn_id + 1)
        live.turns += 1
        live.tokens += len(added_ids) + len(completion_ids)
        live.last_used = time.time()
        if parent is not None:
            parent.children.add(node)
        else:
            live.roots.add(node)
            if live.automatic:
                self.auto_roots.add(node)
        return node
