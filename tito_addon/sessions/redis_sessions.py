"""`SessionSpace` in a Redis that several proxies share: any of them serves any turn of any session.

What can change — which turns exist, which session a prompt belongs to, whether a session is live — is read from
Redis on every request (one round trip when the turns it extends are cached) or decided there atomically (claims,
commits, closes: `redis_tree`). The turn layer works on `TurnNode`s (their ids feed the engine, their identity keys the
encoded-prefix cache): here they are local mirrors of what Redis holds, built once per process and kept in a bounded
cache. A committed turn never changes and its (session, turn id) never names another, so a mirror is never stale.

A turn's session and id are claimed before the backend runs (the first proxy to claim a first request's prompt wins
its GRPO group); its record line is on disk before the commit, so a turn any agent can extend is always on disk.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tito_addon.sessions.link_stores import RedisLinks
from tito_addon.sessions.path_keys import ROOT, assistant_ends, deepest_of, extend, running
from tito_addon.sessions.redis_tree import (
    RedisTree,
    StoredTurn,
    StoreUnavailable,
    reasoning_digest,
    redis_client,
)
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
from tito_addon.sessions.session_tree import Attachment, Session, TurnNode
from tito_addon.sessions.turn_entity import RecordedTurn

logger = logging.getLogger(__name__)

# A named session's state as its Redis hash says it (`closed`: 0 live, 1 closed, 2 closed by its driver; no hash).
STATES = {
    "0": SessionState.LIVE,
    "1": SessionState.CLOSED,
    "2": SessionState.CLOSED_BY_DRIVER,
    None: SessionState.UNKNOWN,
}


@dataclass(eq=False)
class MirroredNode(TurnNode):
    """A mirrored turn (its reasoning a digest, as Redis holds it), with what a child needs to be indexed: its path
    digest and its ancestors' ids."""

    path: bytes = ROOT
    chain: tuple[int, ...] = ()


def created_of(session_id: str) -> float:
    """Automatic ids begin with their creation time (µs, hex), so every proxy breaks ties the same way."""
    try:
        return int(session_id[:14], 16) / 1e6 if len(session_id) == 32 else 0.0
    except ValueError:
        return 0.0


class RedisSessions:
    sweeps_inline = False  # a sweep costs round trips: done periodically, off the turns' path

    def __init__(
        self,
        tree: RedisTree,
        *,
        idle_timeout: float = 1800.0,
        max_sessions: int = 0,
        busy_s: float = 660.0,
        cache_ids: int = 64 * 1024 * 1024,
    ) -> None:
        self.tree = tree
        self.url = ""
        self.idle_timeout = idle_timeout
        self.max_sessions = max_sessions
        self.busy_s = busy_s  # a claimed turn counts as in flight this long (then as abandoned)
        self.cache_ids = cache_ids
        self._nodes: OrderedDict[tuple[str, int], MirroredNode] = OrderedDict()
        self._cached_ids = 0
        self._sessions: dict[str, Session] = {}
        self.links = RedisLinks(tree.client, tree.prefix, tree.run)

    @classmethod
    def connect(cls, url: str) -> RedisSessions:
        """The session space of one Redis URL (`tito_session_store`); kept across reconfiguration, so its cache of
        mirrored turns stays warm."""
        sessions = cls(RedisTree(redis_client(url)))
        sessions.url = url
        return sessions

    def configure(self, *, idle_timeout: float, max_sessions: int, upstream_timeout: float) -> None:
        self.idle_timeout = idle_timeout
        self.max_sessions = max_sessions
        # A claimed turn counts as in flight for as long as the backend may take, then as abandoned.
        self.busy_s = upstream_timeout + 60

    async def aclose(self) -> None:
        client = self.tree.client
        await client.aclose()
        await client.connection_pool.disconnect()

    def session(self, session_id: str, automatic: bool, namespace: str = "") -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            if len(self._sessions) >= 65536:
                self._sessions.clear()  # nodes keep their own; only new mirrors are made afresh
            session = Session(session_id=session_id, automatic=automatic, namespace=namespace)
            session.created = created_of(session_id)
            self._sessions[session_id] = session
        return session

    def _cache(self, node: MirroredNode) -> None:
        key = (node.session.session_id, node.turn_id)
        if key in self._nodes:
            return
        self._nodes[key] = node
        self._cached_ids += node.turn.tokens
        while self._cached_ids > self.cache_ids and len(self._nodes) > 1:
            _, old = self._nodes.popitem(last=False)
            self._cached_ids -= old.turn.tokens

    def cached(self, session_id: str, turn_id: int) -> MirroredNode | None:
        node = self._nodes.get((session_id, turn_id))
        if node is not None:
            self._nodes.move_to_end((session_id, turn_id))
        return node

    async def hydrate(
        self, pairs: Sequence[tuple[str, int]], automatic: bool, namespace: str
    ) -> dict[tuple[str, int], MirroredNode]:
        """Mirrors of these turns and their ancestors: at most two round trips (the turns, then the ancestors
        their chains name) for what is not cached; a turn whose ancestors are gone is left out."""
        out: dict[tuple[str, int], MirroredNode] = {}
        missing = []
        for pair in pairs:
            node = self.cached(*pair)
            if node is not None:
                out[pair] = node
            else:
                missing.append(pair)
        if not missing:
            return out
        stored = await self.tree.nodes(missing)
        ancestors = {
            (sid, turn) for (sid, _), node in stored.items() for turn in node.chain
            if (sid, turn) not in stored and self.cached(sid, turn) is None
        }  # fmt: skip
        if ancestors:
            stored.update(await self.tree.nodes(ancestors))
        for (sid, _), found in sorted(stored.items(), key=lambda item: len(item[1].chain)):
            parent = None
            if found.parent_turn_id is not None:
                parent = self.cached(sid, found.parent_turn_id)
                if parent is None:
                    continue
            self._cache(self._mirror(found, parent, self.session(sid, automatic, namespace)))
        for pair in missing:
            node = self.cached(*pair)
            if node is not None:
                out[pair] = node
        return out

    @staticmethod
    def _mirror(stored: StoredTurn, parent: MirroredNode | None, session: Session) -> MirroredNode:
        path = extend(parent.path if parent is not None else ROOT, stored.turn.segment_keys)
        return MirroredNode(session, stored.turn_id, parent, stored.turn, path=path, chain=stored.chain)

    async def locate(self, lookup: Lookup) -> Located:
        """Where a request attaches, decided exactly as `MemoryTree.locate` decides it (reasonings compared as
        digests, which is what Redis holds)."""
        session_id, namespace = lookup.session_id, lookup.namespace
        digests = running(lookup.keys)
        ends = assistant_ends(lookup.roles)
        state, found = await self.tree.lookup(session_id, namespace, [digests[end] for end in ends])
        automatic = session_id is None
        nodes = await self.hydrate([pair for entries in found for pair in entries], automatic, namespace)
        hydrated = [[nodes[pair] for pair in entries if pair in nodes] for entries in found]
        node, ambiguous = deepest_of(ends, hydrated, [reasoning_digest(r) or None for r in lookup.reasonings])
        if node is not None:
            attachment = Attachment(node.session, node, node.message_end, ambiguous)
        elif session_id is not None and state == "0":
            attachment = Attachment(self.session(session_id, False), None, 0)
        else:
            attachment = Attachment(None, None, 0)
        return Located(attachment, STATES[state], digests[-1])

    async def reply_turn(self, reply_id: str) -> MirroredNode | None:
        found = await self.tree.by_reply(reply_id)
        if found is None:
            return None
        meta = await self.tree.meta(found[0])
        automatic = meta.get("automatic") == "1"
        return (await self.hydrate([found], automatic, meta.get("namespace", ""))).get(found)

    async def claim(self, placement: Placement, reopen_closed: bool) -> Claim:
        """The session and turn id a turn that is about to run will have, marked in flight until the backend's
        deadline (then it counts as abandoned)."""
        attached = placement.attachment.session
        if placement.session_id is not None:
            sid, automatic, namespace = placement.session_id, False, ""
        elif attached is not None:
            sid, automatic, namespace = attached.session_id, attached.automatic, attached.namespace
        else:  # a first request: its GRPO group's session, whichever proxy claimed that prompt first
            sid, automatic, namespace = None, True, placement.namespace
        parent = placement.parent
        now = time.time()
        sid, turn = await self.tree.claim(
            sid,
            namespace,
            placement.group,
            placement.new_session_id,
            now_ms=int(now * 1000),
            busy_until_ms=int((now + self.busy_s) * 1000),
            create=not automatic,
            parent_turn_id=parent.turn_id if parent is not None else None,
            reopen_closed=reopen_closed,
        )
        return Claim(placement, self.session(sid, automatic, namespace), turn, reopen_closed=reopen_closed)

    async def commit(self, claim: Claim, record: RecordLine) -> MirroredNode:
        """Have the claimed turn's line written, commit it, and mirror it: the next turn on this proxy costs no
        fetch."""
        session, turn_id = claim.session, claim.turn_id
        assert session is not None and turn_id is not None
        turn = record(session.session_id, turn_id)
        parent = claim.placement.parent
        assert parent is None or isinstance(parent, MirroredNode)
        path = extend(parent.path if parent is not None else ROOT, turn.segment_keys)
        chain = (*parent.chain, parent.turn_id) if parent is not None else ()
        turn = turn.with_values(reasoning=reasoning_digest(turn.reasoning) or None)  # what Redis compares
        stored = StoredTurn(session.session_id, turn_id, parent.turn_id if parent is not None else None, chain, turn)
        now_ms = int(time.time() * 1000)
        await self.tree.commit(
            stored, automatic=session.automatic, namespace=session.namespace, path=path, now_ms=now_ms
        )
        claim.committed = True
        node = MirroredNode(session, turn_id, parent, turn, path=path, chain=chain)
        self._cache(node)
        return node

    async def release(self, claim: Claim) -> None:
        """A turn that did not commit no longer holds its session in flight (a commit clears its own claim)."""
        if claim.committed or claim.session is None or claim.turn_id is None:
            return
        try:
            await self.tree.release(claim.session.session_id, claim.turn_id)
        except StoreUnavailable as error:  # the claim's deadline frees it anyway
            logger.warning(
                "tito: could not release turn %d of session %s: %s",
                claim.turn_id,
                claim.session.session_id,
                error.message,
            )

    async def holds(self, session_id: str, turn_id: int) -> bool:
        return await self.tree.node(session_id, turn_id) is not None

    async def restore(self, session_id: str, recorded: Sequence[RecordedTurn], next_turn_id: int) -> bool:
        """Put a named session's recorded turns (parents first) back, unless another proxy did it first."""
        paths: dict[int, bytes] = {}
        chains: dict[int, tuple[int, ...]] = {}
        ordered, stored = [], []
        for each in recorded:
            turn_id, parent, turn = each.turn_id, each.parent_turn_id, each.turn
            paths[turn_id] = extend(paths[parent] if parent is not None else ROOT, turn.segment_keys)
            chains[turn_id] = (*chains[parent], parent) if parent is not None else ()
            ordered.append(paths[turn_id])
            digested = turn.with_values(reasoning=reasoning_digest(turn.reasoning) or None)
            stored.append(StoredTurn(session_id, turn_id, parent, chains[turn_id], digested))
        return await self.tree.restore(
            session_id, stored, ordered, now_ms=int(time.time() * 1000), next_at_least=next_turn_id
        )

    async def sweep(self) -> list[ClosedSession]:
        """Close idle sessions, then the least recently active beyond capacity, never one with a turn in flight;
        each closed by exactly one proxy (this one, when listed: it writes the close line)."""
        now = int(time.time() * 1000)
        closed: list[ClosedSession] = []
        if self.idle_timeout > 0:
            cutoff = now - int(self.idle_timeout * 1000)
            for sid in await self.tree.idle(cutoff):
                turns = await self.tree.close(sid, now_ms=now, idle_before_ms=cutoff)
                if turns is not None:
                    closed.append(ClosedSession(sid, turns, "idle"))
        if self.max_sessions > 0:
            for sid in await self.tree.oldest_beyond(self.max_sessions):
                turns = await self.tree.close(sid, now_ms=now, idle_before_ms=None)
                if turns is not None:
                    closed.append(ClosedSession(sid, turns, "evicted"))
        return closed

    def close_all(self, reason: str) -> list[ClosedSession]:
        return []  # shared sessions live on in Redis when this proxy stops

    async def close_by_driver(self, session_id: str) -> tuple[str, int]:
        status, turns = await self.tree.close_by_driver(session_id, now_ms=int(time.time() * 1000))
        return (status, turns) if status in ("closed", "busy") else ("unknown", 0)

    async def status(self, session_id: str) -> SessionStatus:
        meta = await self.tree.meta(session_id)
        in_flight = await self.tree.in_flight(session_id, now_ms=int(time.time() * 1000))
        return SessionStatus(session_id, live=meta.get("closed") == "0", in_flight=in_flight)

    async def live(self, limit: int) -> list[SessionStatus]:
        found = await self.tree.live_sessions(limit)
        return [SessionStatus(sid, live=True, in_flight=None, last_activity=last) for sid, last, meta in found]
