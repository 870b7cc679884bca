"""Sessions as trees of turns, and the index that finds the turn a request extends.

A turn node holds its place in the tree and, by reference, the turn (`Turn`): only what it added, the prompt ids after
its parent's completion and its own completion ids (as compact arrays), so memory grows with the tokens of a tree, not
with turns x history. A request
attaches at the deepest stored turn whose whole message history it repeats; what it appends becomes a new
child. Nodes are never modified or removed, so concurrent requests that extend the same turn simply become
siblings: there is no lost update and no version to check.
"""

from __future__ import annotations

import json
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tito_addon.chat_images import ImageSpan
from tito_addon.sessions.message_keys import MessageKey, reasoning_matches
from tito_addon.sessions.turn_entity import RecordedTurn, Turn

SegmentKey = tuple[MessageKey, ...]


class ChildIndex:
    """Children of one position, found by the keys of the messages they add (appended + assistant)."""

    __slots__ = ("by_length",)

    def __init__(self) -> None:
        self.by_length: dict[int, dict[SegmentKey, list[TurnNode]]] = {}

    def add(self, node: TurnNode) -> None:
        keys = node.turn.segment_keys
        self.by_length.setdefault(len(keys), {}).setdefault(keys, []).append(node)

    def remove(self, node: TurnNode) -> None:
        keys = node.turn.segment_keys
        table = self.by_length.get(len(keys), {})
        nodes = table.get(keys, [])
        if node in nodes:
            nodes.remove(node)
            if not nodes:
                del table[keys]
            if not table:
                self.by_length.pop(len(keys), None)

    def candidates(self, keys: Sequence[MessageKey], start: int) -> Iterable[TurnNode]:
        if len(self.by_length) == 1:  # the usual shape (every child appends as many messages): no generator
            ((length, table),) = self.by_length.items()
            return table.get(tuple(keys[start : start + length]), ()) if start + length <= len(keys) else ()
        return [
            node
            for length, table in self.by_length.items()
            if start + length <= len(keys)
            for node in table.get(tuple(keys[start : start + length]), ())
        ]

    def __len__(self) -> int:
        return sum(len(nodes) for table in self.by_length.values() for nodes in table.values())


@dataclass(eq=False)
class TurnNode:
    """A turn's place in its session's tree: its session, id, parent and children; the turn itself by reference."""

    session: Session
    turn_id: int
    parent: TurnNode | None
    turn: Turn
    children: ChildIndex = field(default_factory=ChildIndex)
    # The ids up to the end of its completion: held, since a node and its ancestors never change, so the next turn's
    # prompt does not walk the path to its root.
    end_len: int = field(init=False)
    # Whether its sequence holds an image: a text session's turn never walks its chain for them.
    holds_images: bool = field(init=False)

    def __post_init__(self) -> None:
        self.end_len = (self.parent.end_len if self.parent is not None else 0) + self.turn.tokens
        self.holds_images = bool(self.turn.images) or (self.parent is not None and self.parent.holds_images)

    @property
    def message_end(self) -> int:
        return self.turn.message_end

    @property
    def prompt_len(self) -> int:
        return self.end_len - len(self.turn.completion_ids)

    def full_ids(self) -> list[int]:
        """Prompt + completion ids of this turn, exactly as the model saw and produced them."""
        chain = []
        node: TurnNode | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        out = array("I")
        for node in reversed(chain):
            out.extend(node.turn.prompt_added_ids)
            out.extend(node.turn.completion_ids)
        return out.tolist()

    def image_spans(self) -> list[ImageSpan]:
        """The images of its whole sequence, in order."""
        spans: list[ImageSpan] = []
        node: TurnNode | None = self
        while node is not None and node.holds_images:  # (none before the first turn that added one)
            spans[:0] = node.turn.images
            node = node.parent
        return spans

    def reasoning_compatible(self, reasonings: Sequence[str | None], start: int) -> bool:
        stored = self.turn.reasoning
        if not stored:
            return True  # nothing stored to disagree with (see reasoning_matches): no walk over its messages
        # Only the answer, the segment's last message, has a reasoning of its own.
        return reasoning_matches(stored, reasonings[start + len(self.turn.segment_keys) - 1])


@dataclass(eq=False)
class Session:
    session_id: str
    automatic: bool
    namespace: str = ""
    roots: ChildIndex = field(default_factory=ChildIndex)
    next_turn_id: int = 0
    turns: int = 0
    tokens: int = 0
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    inflight: int = 0
    # First-request keys under which this (automatic) session is indexed as a prompt group.
    prompt_keys: list[SegmentKey] = field(default_factory=list)
    root_nodes: list[TurnNode] = field(default_factory=list)
    # Ids agents hold for this session's turns (`resp_…`), indexed in the store while the session lives.
    reply_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Attachment:
    """Where a request attaches: its session (None: a new one) and the turn it extends (None: a first turn)."""

    session: Session | None
    parent: TurnNode | None
    matched: int  # messages covered by the parent's history
    ambiguous: bool = False


SWEEP_INTERVAL_S = 5.0
MIN_SWEEP_INTERVAL_S = 0.25


def sweep_interval(idle_timeout: float) -> float:
    """How often a process sweeps for idle sessions: every 5 s, or a quarter of a shorter idle timeout, so an idle
    session is closed at most a quarter of its timeout late."""
    if idle_timeout <= 0:
        return SWEEP_INTERVAL_S
    return min(SWEEP_INTERVAL_S, max(MIN_SWEEP_INTERVAL_S, idle_timeout / 4))


class MemoryTree:
    """This process's sessions (`MemorySessions` serves them to turns; replay indexes its recordings in one): all live
    sessions in least-recently-used order, with prefix indexes over automatic sessions.

    `auto_roots` finds the session a request continues from its messages alone; `auto_prompts` groups identical
    first requests (a GRPO group, or retries) into one session whose samples are sibling roots. Lookups cost
    what the request's messages cost to hash, whatever the number of live sessions.
    """

    def __init__(self, *, idle_timeout: float = 0.0, max_sessions: int = 0) -> None:
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        # Automatic sessions live in namespaces (backend + model): the same prompt sent to two models is two
        # experiments, never one session.
        self.auto_roots: dict[str, ChildIndex] = {}
        self.auto_prompts: dict[tuple[str, SegmentKey], Session] = {}
        # A reply id names the turn it answered (OpenAI Responses' `previous_response_id` continues it).
        self.replies: dict[str, TurnNode] = {}
        self._kwargs: dict[str, dict[str, Any]] = {}
        self.idle_timeout = idle_timeout
        self.max_sessions = max_sessions

    def locate(
        self,
        session_id: str | None,
        keys: Sequence[MessageKey],
        reasonings: Sequence[str | None],
        namespace: str = "",
    ) -> Attachment:
        if session_id is not None:
            session = self.sessions.get(session_id)
            if session is None:
                return Attachment(None, None, 0)
            node, ambiguous = self._deepest(session.roots, keys, reasonings)
            return Attachment(session, node, node.message_end if node else 0, ambiguous)
        node, ambiguous = self._deepest(self.auto_roots.get(namespace, ChildIndex()), keys, reasonings)
        if node is None:
            return Attachment(self.prompt_group(namespace, keys), None, 0)
        return Attachment(node.session, node, node.message_end, ambiguous)

    @staticmethod
    def _deepest(
        index: ChildIndex, keys: Sequence[MessageKey], reasonings: Sequence[str | None]
    ) -> tuple[TurnNode | None, bool]:
        """Deepest matching turn below `index`; on equal depth the oldest wins and the match is ambiguous.

        Iterative, so a history of any number of turns is walked without recursion limits; the walk is written out
        (no list, generator or property per level), as a long session walks hundreds of levels on every turn."""
        keys = tuple(keys)  # (a tuple's slice is the lookup key itself)
        count = len(keys)
        deepest: list[TurnNode] = []
        depth = -1
        pending = [(index, 0)]
        while pending:
            children, start = pending.pop()
            for length, table in children.by_length.items():
                end = start + length
                if end > count:
                    continue
                for candidate in table.get(keys[start:end], ()):
                    if not candidate.reasoning_compatible(reasonings, start):
                        continue
                    turn = candidate.turn
                    pending.append((candidate.children, turn.message_end))
                    if turn.message_end > depth:
                        depth, deepest = turn.message_end, [candidate]
                    elif turn.message_end == depth:
                        deepest.append(candidate)
        if not deepest:
            return None, False
        best = min(deepest, key=lambda node: (node.session.created, node.turn_id))
        return best, len(deepest) > 1

    def prompt_group(self, namespace: str, keys: Sequence[MessageKey]) -> Session | None:
        """The automatic session whose first request was exactly these messages (a GRPO group)."""
        return self.auto_prompts.get((namespace, tuple(keys)))

    def touch(self, session: Session) -> None:
        if session.session_id in self.sessions:
            self.sessions.move_to_end(session.session_id)
        session.last_used = time.time()

    def sweep(self, now: float | None = None) -> list[tuple[Session, str]]:
        """Remove idle sessions, then the least recently used beyond capacity; never one with a turn in flight.
        Returns what was removed and why (`idle`, `evicted`), for the recorder to close."""
        now = time.time() if now is None else now
        closed: list[tuple[Session, str]] = []
        if self.idle_timeout > 0:
            for session in self.sessions.values():  # nothing is removed until after both loops
                if now - session.last_used < self.idle_timeout:
                    break  # LRU order: everything after this one was used more recently
                if session.inflight == 0:
                    closed.append((session, "idle"))
        if self.max_sessions > 0:
            excess = len(self.sessions) - len(closed) - self.max_sessions
            leaving = {id(s) for s, _ in closed}
            for session in self.sessions.values():
                if excess <= 0:
                    break
                if session.inflight == 0 and id(session) not in leaving:
                    closed.append((session, "evicted"))
                    excess -= 1
        for session, _ in closed:
            self.remove(session)
        return closed

    def remove(self, session: Session) -> None:
        self.sessions.pop(session.session_id, None)
        roots = self.auto_roots.get(session.namespace)
        for root in session.root_nodes:
            if roots is not None:
                roots.remove(root)
        if roots is not None and not len(roots):
            del self.auto_roots[session.namespace]
        for keys in session.prompt_keys:
            if self.auto_prompts.get((session.namespace, keys)) is session:
                del self.auto_prompts[(session.namespace, keys)]
        for reply_id in session.reply_ids:
            node = self.replies.get(reply_id)
            if node is not None and node.session is session:
                del self.replies[reply_id]

    def _interned(self, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        """Every turn of a run usually has the same kwargs: keep one dict for them, not one per turn."""
        if not kwargs:
            return None
        try:
            key = json.dumps(kwargs, sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError):
            return dict(kwargs)
        if len(self._kwargs) >= 1024 and key not in self._kwargs:
            self._kwargs.clear()
        return self._kwargs.setdefault(key, dict(kwargs))

    def new_session(self, session_id: str | None, namespace: str = "", automatic_id: str | None = None) -> Session:
        if session_id is None:
            return Session(session_id=automatic_id or uuid.uuid4().hex, automatic=True, namespace=namespace)
        return Session(session_id=session_id, automatic=False, namespace=namespace)

    def commit(self, session: Session, parent: TurnNode | None, turn: Turn, turn_id: int | None = None) -> TurnNode:
        """Add a turn (a live one, or a recorded one put back under its own id). Synchronous: no other request can
        interleave between the checks and the insert."""
        live = self.sessions.setdefault(session.session_id, session)
        self.sessions.move_to_end(live.session_id)
        if turn_id is None:
            turn_id = live.next_turn_id
        kwargs = self._interned(turn.chat_template_kwargs)
        if kwargs is not turn.chat_template_kwargs:
            turn = turn.with_values(chat_template_kwargs=kwargs)
        node = TurnNode(session=live, turn_id=turn_id, parent=parent, turn=turn)
        live.next_turn_id = max(live.next_turn_id, turn_id + 1)
        live.turns += 1
        live.tokens += turn.tokens
        live.last_used = time.time()
        if turn.reply_id is not None:
            self.replies[turn.reply_id] = node
            live.reply_ids.append(turn.reply_id)
        if parent is not None:
            parent.children.add(node)
        else:
            live.roots.add(node)
            if live.automatic:
                self.auto_roots.setdefault(live.namespace, ChildIndex()).add(node)
                live.root_nodes.append(node)
                prompt = turn.segment_keys[:-1]
                if (live.namespace, prompt) not in self.auto_prompts:
                    self.auto_prompts[(live.namespace, prompt)] = live
                    live.prompt_keys.append(prompt)
        return node

    def put_back(self, session: Session, recorded: Iterable[RecordedTurn]) -> dict[int, TurnNode]:
        """Recorded turns (parents first) back into a session's tree: resume after a restart, offline replay."""
        out: dict[int, TurnNode] = {}
        for turn in recorded:
            parent = out[turn.parent_turn_id] if turn.parent_turn_id is not None else None
            out[turn.turn_id] = self.commit(session, parent, turn.turn, turn.turn_id)
        return out
