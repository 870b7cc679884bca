"""The session space in Redis as one proxy sees it: attachments found by path lookups, turns mirrored locally.

The turn service works on `TurnNode`s (their ids feed the engine, their identity keys the encoded-prefix cache).
Here they are local mirrors of what Redis holds, built once per process and kept in a bounded cache: a committed turn
never changes and its (session, turn id) never names another, so a mirror is never stale. What can change — which
turns exist, which session a prompt belongs to, whether a session is live — is read from Redis on every request
(one round trip when the turns it extends are cached) or decided there atomically (claims, commits, closes).
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tito_addon.sessions.message_keys import MessageKey
from tito_addon.sessions.path_keys import ROOT, assistant_ends, deepest_of, extend, running
from tito_addon.sessions.redis_tree import NewTurn, RedisTree, StoredNode
from tito_addon.sessions.session_tree import Attachment, Session, TurnNode


@dataclass(eq=False)
class SharedNode(TurnNode):
    """A mirrored turn, with what a child needs to be indexed: its path digest and its ancestors' ids."""

    path: bytes = ROOT
    chain: tuple[int, ...] = ()


@dataclass(frozen=True)
class Located:
    attachment: Attachment
    state: str | None  # a named session: "0" live, "1" closed, None never seen (automatic: None)
    request_path: bytes  # the digest of all the request's message keys


def created_of(session_id: str) -> float:
    """Automatic ids begin with their creation time (µs, hex), so every proxy breaks ties the same way."""
    try:
        return int(session_id[:14], 16) / 1e6 if len(session_id) == 32 else 0.0
    except ValueError:
        return 0.0


class SharedSessions:
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
        self.idle_timeout = idle_timeout
        self.max_sessions = max_sessions
        self.busy_s = busy_s  # a claimed turn counts as in flight this long (then as abandoned)
        self.cache_ids = cache_ids
        self._nodes: OrderedDict[tuple[str, int], SharedNode] = OrderedDict()
        self._cached_ids = 0
        self._sessions: dict[str, Session] = {}

    def session(self, session_id: str, automatic: bool, namespace: str = "") -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            if len(self._sessions) >= 65536:
                self._sessions.clear()  # nodes keep their own; only new mirrors are made afresh
            session = Session(session_id=session_id, automatic=automatic, namespace=namespace)
            session.created = created_of(session_id)
            self._sessions[session_id] = session
        return session

    def _cache(self, node: SharedNode) -> None:
        key = (node.session.session_id, node.turn_id)
        if key in self._nodes:
            return
        self._nodes[key] = node
        self._cached_ids += len(node.added_ids) + len(node.completion_ids)
        while self._cached_ids > self.cache_ids and len(self._nodes) > 1:
            _, old = self._nodes.popitem(last=False)
            self._cached_ids -= len(old.added_ids) + len(old.completion_ids)

    def cached(self, session_id: str, turn_id: int) -> SharedNode | None:
        node = self._nodes.get((session_id, turn_id))
        if node is not None:
            self._nodes.move_to_end((session_id, turn_id))
        return node

    async def hydrate(
        self, pairs: Sequence[tuple[str, int]], automatic: bool, namespace: str
    ) -> dict[tuple[str, int], SharedNode]:
        """Mirrors of these turns and their ancestors: at most two round trips (the turns, then the ancestors
        their chains name) for what is not cached; a turn whose ancestors are gone is left out."""
        out: dict[tuple[str, int], SharedNode] = {}
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
        for (sid, _), node in sorted(stored.items(), key=lambda item: len(item[1].chain)):
            parent = None
            if node.parent_turn_id is not None:
                parent = self.cached(sid, node.parent_turn_id)
                if parent is None:
                    continue
            mirror = self._mirror(node, parent, self.session(sid, automatic, namespace))
            self._cache(mirror)
        for pair in missing:
            node = self.cached(*pair)
            if node is not None:
                out[pair] = node
        return out

    @staticmethod
    def _mirror(node: StoredNode, parent: SharedNode | None, session: Session) -> SharedNode:
        return SharedNode(
            session=session,
            turn_id=node.turn_id,
            parent=parent,
            message_end=node.message_end,
            segment_keys=node.segment_keys,
            segment_reasoning=(None,) * (len(node.segment_keys) - 1) + (node.reasoning,),
            added_ids=node.added_ids,
            completion_ids=node.completion_ids,
            finish_reason=node.finish_reason,
            tools_sha256=node.tools_sha256,
            template_kwargs=node.template_kwargs,
            path=extend(parent.path if parent is not None else ROOT, node.segment_keys),
            chain=node.chain,
        )

    async def locate(
        self,
        session_id: str | None,
        keys: Sequence[MessageKey],
        reasonings: Sequence[str | None],
        roles: Sequence[str],
        namespace: str,
    ) -> Located:
        """Where a request attaches (reasonings as digests), decided exactly as `SessionStore.locate` decides it."""
        digests = running(keys)
        ends = assistant_ends(roles)
        state, found = await self.tree.lookup(session_id, namespace, [digests[end] for end in ends])
        automatic = session_id is None
        nodes = await self.hydrate([pair for entries in found for pair in entries], automatic, namespace)
        hydrated = [[nodes[pair] for pair in entries if pair in nodes] for entries in found]
        node, ambiguous = deepest_of(ends, hydrated, reasonings)
        if node is not None:
            attachment = Attachment(node.session, node, node.message_end, ambiguous)
        elif session_id is not None and state == "0":
            attachment = Attachment(self.session(session_id, False), None, 0)
        else:
            attachment = Attachment(None, None, 0)
        return Located(attachment, state, digests[-1])

    async def reply_turn(self, reply_id: str) -> SharedNode | None:
        found = await self.tree.by_reply(reply_id)
        if found is None:
            return None
        meta = await self.tree.meta(found[0])
        automatic = meta.get("automatic") == "1"
        return (await self.hydrate([found], automatic, meta.get("namespace", ""))).get(found)

    async def claim(
        self, session_id: str | None, automatic: bool, namespace: str, prompt: bytes, fresh_id: str,
        parent: TurnNode | None, reopen_closed: bool = False,
    ) -> tuple[Session, int]:  # fmt: skip
        """The session and turn id a turn that is about to run will have; marks it in flight."""
        now = time.time()
        sid, turn = await self.tree.claim(
            session_id, namespace, prompt, fresh_id, now_ms=int(now * 1000),
            busy_until_ms=int((now + self.busy_s) * 1000), create=not automatic,
            parent_turn_id=parent.turn_id if parent is not None else None, reopen_closed=reopen_closed,
        )  # fmt: skip
        return self.session(sid, automatic, namespace), turn

    async def commit(
        self,
        session: Session,
        turn_id: int,
        parent: SharedNode | None,
        message_end: int,
        segment_keys: tuple[MessageKey, ...],
        reasoning: str | None,
        added_ids: Sequence[int],
        completion_ids: Sequence[int],
        finish_reason: str | None,
        tools_sha256: str | None,
        template_kwargs: dict[str, Any] | None,
        reply_id: str | None,
    ) -> SharedNode:
        """Commit a claimed turn (its record line is on disk) and mirror it: the next turn on this proxy costs no
        fetch."""
        path = extend(parent.path if parent is not None else ROOT, segment_keys)
        chain = (*parent.chain, parent.turn_id) if parent is not None else ()
        await self.tree.commit(
            NewTurn(
                session_id=session.session_id, turn_id=turn_id, automatic=session.automatic,
                namespace=session.namespace, parent_turn_id=parent.turn_id if parent is not None else None,
                chain=chain, message_end=message_end, segment_keys=segment_keys, reasoning=reasoning,
                added_ids=added_ids, completion_ids=completion_ids, finish_reason=finish_reason, path=path,
                tools_sha256=tools_sha256, template_kwargs=template_kwargs, reply_id=reply_id,
            ),
            now_ms=int(time.time() * 1000),
        )  # fmt: skip
        node = SharedNode(
            session=session, turn_id=turn_id, parent=parent, message_end=message_end, segment_keys=segment_keys,
            segment_reasoning=(None,) * (len(segment_keys) - 1) + (reasoning,), added_ids=array("I", added_ids),
            completion_ids=array("I", completion_ids), finish_reason=finish_reason, tools_sha256=tools_sha256,
            template_kwargs=template_kwargs or None, path=path, chain=chain,
        )  # fmt: skip
        self._cache(node)
        return node

    async def sweep(self) -> list[tuple[str, int, str]]:
        """Close idle sessions, then the least recently active beyond capacity, never one with a turn in flight;
        each closed by exactly one proxy (this one, when listed: it writes the close line)."""
        now = int(time.time() * 1000)
        closed: list[tuple[str, int, str]] = []
        if self.idle_timeout > 0:
            cutoff = now - int(self.idle_timeout * 1000)
            for sid in await self.tree.idle(cutoff):
                turns = await self.tree.close(sid, now_ms=now, idle_before_ms=cutoff)
                if turns is not None:
                    closed.append((sid, turns, "idle"))
        if self.max_sessions > 0:
            for sid in await self.tree.oldest_beyond(self.max_sessions):
                turns = await self.tree.close(sid, now_ms=now, idle_before_ms=None)
                if turns is not None:
                    closed.append((sid, turns, "evicted"))
        return closed

    async def restore(self, session_id: str, nodes: Sequence[StoredNode], next_at_least: int) -> bool:
        """Put a named session's recorded turns (parents first) back, unless another proxy did it first."""
        paths: dict[int, bytes] = {}
        ordered = []
        for node in nodes:
            base = paths.get(node.parent_turn_id, ROOT) if node.parent_turn_id is not None else ROOT
            paths[node.turn_id] = extend(base, node.segment_keys)
            ordered.append(paths[node.turn_id])
        return await self.tree.restore(
            session_id, nodes, ordered, now_ms=int(time.time() * 1000), next_at_least=next_at_least
        )
