"""Session trees in Redis, for many proxies sharing one session space.

What several proxies must agree on lives here, each change atomic (one Lua script): which session a turn joins (a
named one, or the automatic session of its GRPO group: the first proxy to claim a prompt wins it), the next turn id
(never reused, not even after the session closes), the committed turns with the path index that finds them
(`path_keys`), which turns are in flight, and when a session closes. A turn is immutable once committed and its
(session, turn id) never names another turn, so what a proxy caches of it is never stale.

Layout (prefix `P`, `tito` by default; a session's own keys share the `{sid}` hash tag):
    P:s:{sid}            hash: next (turn id), turns, tokens, automatic, namespace, nsh, prompt, created, closed
                         (a closed session keeps this hash, without its turns, for `TOMBSTONE_S`: its turn ids
                         continue if it is resumed)
    P:n:{sid}:{turn}     string: the turn packed (`pack_turn`): parent, end, message keys (16 B each), reasoning
                         digest, path digest, added and completion ids and the ancestors' turn ids (4 B each,
                         little-endian, root first), then the turn's other fields (`Turn`) as JSON
    P:x:{sid}            string: per committed turn, its path digest and reply id (what a close must undo)
    P:p:{sid}            hash: path digest -> turn ids (4 B each) of the named session's turns ending there
    P:ap:{nsh}           hash: path digest -> (32 B session id + 4 B turn id)* of automatic sessions' turns
    P:g:{nsh}            hash: first-request digest -> automatic session id (a GRPO group)
    P:r                  hash: reply id -> session id + "\n" + turn id
    P:b:{sid}            sorted set: turn ids in flight, scored by the time (ms) after which they count as abandoned
    P:live               sorted set: live session ids, scored by their last activity (ms)

One Redis (or a primary with replicas). The scripts name keys they compute (a GRPO group's session is known only
once the script has read it), which a Redis Cluster refuses; see the README for what a cluster needs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tito_addon.sessions.message_keys import KEY_BYTES, reasoning_identity
from tito_addon.sessions.redis_scripts import CLAIM, CLOSE, COMMIT, RESTORE
from tito_addon.sessions.turn_entity import Turn
from tito_addon.tito_errors import SessionClosed, SessionGone, StoreUnavailable

TURN = 4  # bytes of a packed turn id
AUTO_ID = 32  # automatic session ids are 32 hex characters
TOMBSTONE_S = 7 * 24 * 3600  # how long a closed session's turn counter outlives it
CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 5.0
# Every turn in flight may await Redis at once (each command holds a connection until its reply): beyond this many,
# commands wait for a free connection instead of failing (redis-py's default pool refuses its 101st).
MAX_CONNECTIONS = 64


@dataclass(frozen=True)
class StoredTurn:
    """A committed turn as Redis holds it (immutable): its place (parent and ancestors' ids, root first) and the turn,
    whose reasoning is a digest here (`reasoning_digest`)."""

    session_id: str
    turn_id: int
    parent_turn_id: int | None
    chain: tuple[int, ...]
    turn: Turn


def pack_ids(ids: Any) -> bytes:
    packed = array("I", ids)
    if packed.itemsize != 4:  # pragma: no cover - every platform we run on has a 4-byte unsigned int
        raise RuntimeError("array('I') is not 4 bytes here")
    return packed.tobytes()


def unpack_ids(data: bytes) -> array:
    out = array("I")
    out.frombytes(data)
    return out


def reasoning_digest(text: str | None) -> str:
    # Of the reasoning's identity, so that digests compare as `reasoning_matches` compares texts.
    if not text:
        return ""
    return hashlib.blake2b(reasoning_identity(text).encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def namespace_hash(namespace: str) -> str:
    return hashlib.blake2b(namespace.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def redis_client(url: str) -> Any:
    """A client with short timeouts, so a store that is gone costs a turn a prompt 503, not a hung agent; it
    reconnects by itself when Redis is back."""
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


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


class RedisTree:
    def __init__(self, client: Any, prefix: str = "tito") -> None:
        self.client = client
        self.prefix = prefix
        self._claim = client.register_script(CLAIM)
        self._commit = client.register_script(COMMIT)
        self._close = client.register_script(CLOSE)
        self._restore = client.register_script(RESTORE)

    def _meta(self, sid: str) -> str:
        return f"{self.prefix}:s:{{{sid}}}"

    def _node(self, sid: str, turn: int) -> str:
        return f"{self.prefix}:n:{{{sid}}}:{turn}"

    def _ledger(self, sid: str) -> str:
        return f"{self.prefix}:x:{{{sid}}}"

    def _index(self, sid: str | None, namespace: str) -> str:
        if sid is not None:
            return f"{self.prefix}:p:{{{sid}}}"
        return f"{self.prefix}:ap:{namespace_hash(namespace)}"

    @property
    def _live(self) -> str:
        return f"{self.prefix}:live"

    async def run(self, call: Any) -> Any:
        try:
            return await call
        except Exception as exc:  # redis raises ConnectionError, TimeoutError, ResponseError, ...
            raise StoreUnavailable(f"the session store (Redis) failed: {type(exc).__name__}: {exc}") from exc

    async def claim(
        self,
        session_id: str | None,
        namespace: str,
        prompt: bytes,
        fresh_id: str,
        *,
        now_ms: int,
        busy_until_ms: int,
        create: bool = True,
        parent_turn_id: int | None = None,
        reopen_closed: bool = False,
    ) -> tuple[str, int]:
        """A turn id in the session a turn belongs to, marked in flight until `busy_until_ms`: `session_id` when
        given, else the automatic session of its first request (`prompt`: the digest of those messages), made
        `fresh_id` if no proxy claimed that prompt yet. A given session that is closed (or missing) is reopened only
        with `create`, one its driver closed only with `reopen_closed` too (else SessionClosed); a `parent_turn_id` that
        is gone raises SessionGone."""
        keys = [f"{self.prefix}:g:{namespace_hash(namespace)}", self._live]
        args = [
            session_id or "", prompt, fresh_id, namespace, self.prefix, "1" if create else "0", now_ms,
            busy_until_ms, namespace_hash(namespace), "" if parent_turn_id is None else parent_turn_id,
            "1" if reopen_closed else "0",
        ]  # fmt: skip
        sid, turn = await self.run(self._claim(keys=keys, args=args))
        if int(turn) == -2:
            raise SessionClosed(_text(sid))
        if int(turn) < 0:
            raise SessionGone(_text(sid))
        return _text(sid), int(turn)

    async def commit(self, stored: StoredTurn, *, automatic: bool, namespace: str, path: bytes, now_ms: int) -> None:
        """Add a claimed turn and its index entry, atomically (after its record line is on disk): `path` is its path
        digest, indexed in its named session or, `automatic`, in its namespace's automatic sessions."""
        sid, turn_id, reply_id = stored.session_id, stored.turn_id, stored.turn.reply_id
        if automatic and len(sid) != AUTO_ID:
            raise ValueError("automatic session ids are 32 characters")
        blob = pack_turn(stored, path)
        index = self._index(None if automatic else sid, namespace)
        keys = [
            self._meta(sid), self._node(sid, turn_id), index, f"{self.prefix}:r", self._live,
            f"{self.prefix}:b:{{{sid}}}", self._ledger(sid),
        ]  # fmt: skip
        args = [
            blob, path, index_entry(sid, turn_id, automatic), ledger_entry(path, reply_id), stored.turn.tokens,
            reply_id or "", f"{sid}\n{turn_id}", turn_id, now_ms, sid,
        ]  # fmt: skip
        if not await self.run(self._commit(keys=keys, args=args)):
            raise SessionGone(sid)

    async def lookup(
        self, session_id: str | None, namespace: str, paths: list[bytes]
    ) -> tuple[str | None, list[list[tuple[str, int]]]]:
        """The turns ending at each path digest (oldest first): of the named session, or of the namespace's
        automatic sessions; with a named session, also its state (`"0"` live, `"1"` closed, None unknown). One
        round trip whatever the number of digests."""
        async with self.client.pipeline(transaction=False) as pipe:
            if session_id is not None:
                pipe.hget(self._meta(session_id), "closed")
            if paths:
                pipe.hmget(self._index(session_id, namespace), paths)
            replies = await self.run(pipe.execute())
        state = _text(replies.pop(0)) or None if session_id is not None else None
        found = replies[0] if paths else []
        out = []
        for entries in found:
            entries = entries or b""
            if session_id is not None:
                out.append([(session_id, int.from_bytes(entries[i : i + TURN], "little"))
                            for i in range(0, len(entries), TURN)])  # fmt: skip
            else:
                step = AUTO_ID + TURN
                starts = range(0, len(entries), step)
                pairs = [(entries[i : i + AUTO_ID], entries[i + AUTO_ID : i + step]) for i in starts]
                out.append([(sid.decode(), int.from_bytes(turn, "little")) for sid, turn in pairs])
        return state, out

    async def nodes(self, wanted: Iterable[tuple[str, int]]) -> dict[tuple[str, int], StoredTurn]:
        """Committed turns, in one round trip; a turn that is not (or no longer) stored is left out."""
        wanted = list(dict.fromkeys(wanted))
        if not wanted:
            return {}
        async with self.client.pipeline(transaction=False) as pipe:
            for sid, turn in wanted:
                pipe.get(self._node(sid, turn))
            found = await self.run(pipe.execute())
        return {pair: parse_turn(*pair, blob) for pair, blob in zip(wanted, found, strict=True) if blob}

    async def node(self, session_id: str, turn_id: int) -> StoredTurn | None:
        return (await self.nodes([(session_id, turn_id)])).get((session_id, turn_id))

    async def by_reply(self, reply_id: str) -> tuple[str, int] | None:
        found = await self.run(self.client.hget(f"{self.prefix}:r", reply_id))
        if not found:
            return None
        sid, _, turn = _text(found).rpartition("\n")
        return sid, int(turn)

    async def meta(self, session_id: str) -> dict[str, str]:
        fields = await self.run(self.client.hgetall(self._meta(session_id)))
        decoded = {_text(k): v for k, v in fields.items()}
        return {k: v.hex() if k == "prompt" else _text(v) for k, v in decoded.items()}  # the prompt is a digest

    async def idle(self, before_ms: int, limit: int = 256) -> list[str]:
        """Live sessions whose last activity is older than `before_ms`."""
        found = await self.run(self.client.zrangebyscore(self._live, "-inf", before_ms, start=0, num=limit))
        return [_text(sid) for sid in found]

    async def oldest_beyond(self, capacity: int, limit: int = 256) -> list[str]:
        """The least recently active live sessions past the first `capacity` (newest kept)."""
        excess = await self.run(self.client.zcard(self._live)) - capacity
        if excess <= 0:
            return []
        found = await self.run(self.client.zrange(self._live, 0, min(excess, limit) - 1))
        return [_text(sid) for sid in found]

    async def close(self, session_id: str, *, now_ms: int, idle_before_ms: int | None) -> int | None:
        """Close a live session unless a turn of it is in flight (or, with `idle_before_ms`, it was used since):
        its turns and indexes go, its turn counter stays (`TOMBSTONE_S`). The number of turns it had, or None when
        it was not closed here (another proxy closed it first, or it is busy)."""
        args = [session_id, self.prefix, now_ms, "" if idle_before_ms is None else idle_before_ms, TOMBSTONE_S, "0"]
        turns = await self.run(self._close(keys=[self._live], args=args))
        return None if int(turns) < 0 else int(turns)

    async def close_by_driver(self, session_id: str, *, now_ms: int) -> tuple[str, int]:
        """A rollout driver's close: ("closed", turns) when it closed the live session now, ("already", 0) when it
        had closed before (now marked closed by its driver), ("busy", 0) with a turn in flight, ("unknown", 0)."""
        args = [session_id, self.prefix, now_ms, "", TOMBSTONE_S, "1"]
        turns = int(await self.run(self._close(keys=[self._live], args=args)))
        return {-2: ("already", 0), -3: ("busy", 0), -1: ("unknown", 0)}.get(turns, ("closed", turns))

    async def release(self, session_id: str, turn_id: int) -> None:
        """A claimed turn that will not commit (its backend failed, its agent left) is no longer in flight."""
        await self.run(self.client.zrem(f"{self.prefix}:b:{{{session_id}}}", turn_id))

    async def in_flight(self, session_id: str, *, now_ms: int) -> int:
        """Turns of the session in flight now (an abandoned claim past its deadline no longer counts)."""
        return int(await self.run(self.client.zcount(f"{self.prefix}:b:{{{session_id}}}", f"({now_ms}", "+inf")))

    async def live_sessions(self, limit: int) -> list[tuple[str, float, dict[str, str]]]:
        """The most recently active live sessions: (id, last activity in seconds, turns/tokens/automatic)."""
        found = await self.run(self.client.zrevrange(self._live, 0, max(limit, 1) - 1, withscores=True))
        fields = ("turns", "tokens", "automatic")
        async with self.client.pipeline(transaction=False) as pipe:
            for sid, _ in found:
                pipe.hmget(self._meta(_text(sid)), fields)
            metas = await self.run(pipe.execute()) if found else []
        return [
            (_text(sid), score / 1000, {k: _text(v) or "0" for k, v in zip(fields, meta, strict=True)})
            for (sid, score), meta in zip(found, metas, strict=True)
        ]

    async def restore(
        self, session_id: str, turns: Sequence[StoredTurn], paths: Sequence[bytes], *, now_ms: int, next_at_least: int
    ) -> bool:
        """Put a named session's recorded turns back (all at once) unless it is live; False when it already was."""
        tokens = sum(stored.turn.tokens for stored in turns)
        args: list[Any] = [session_id, now_ms, next_at_least, tokens]
        for stored, path in zip(turns, paths, strict=True):
            blob, turn_id, reply_id = pack_turn(stored, path), stored.turn_id, stored.turn.reply_id
            args += [
                turn_id, self._node(session_id, turn_id), blob, path,
                index_entry(session_id, turn_id, False), ledger_entry(path, reply_id), reply_id or "",
            ]  # fmt: skip
        keys = [
            self._meta(session_id), self._index(session_id, ""), f"{self.prefix}:r", self._live,
            self._ledger(session_id),
        ]  # fmt: skip
        return bool(await self.run(self._restore(keys=keys, args=args)))


# A turn's packed form: a fixed header, then its message keys, reasoning digest (if any), path digest, added,
# completion and ancestor ids (4 bytes each), then a small JSON of the turn's other fields, those not at their default.
# One string per turn costs Redis a fraction of a hash of a dozen fields (which loses its compact encoding once a value
# passes 64 bytes).
HEADER = struct.Struct("<iIHIIIB")
PACKED = ("message_end", "segment_keys", "reasoning", "prompt_added_ids", "completion_ids")
#: Every other field of `Turn`, with its default (left out of the JSON): a new field is packed without a line here.
TAIL = {
    f.name: None if f.default is dataclasses.MISSING else f.default
    for f in dataclasses.fields(Turn)
    if f.name not in PACKED
}


def pack_turn(stored: StoredTurn, path: bytes) -> bytes:
    turn = stored.turn
    if any(len(key) != KEY_BYTES for key in turn.segment_keys):
        raise ValueError("message keys are 16 bytes")
    if len(path) != KEY_BYTES:
        raise ValueError("a path digest is 16 bytes")
    reasoning = bytes.fromhex(turn.reasoning) if turn.reasoning else b""
    if len(reasoning) not in (0, KEY_BYTES):
        raise ValueError("a reasoning digest is 16 bytes")
    added, completion = pack_ids(turn.prompt_added_ids), pack_ids(turn.completion_ids)
    chain = pack_ids(stored.chain)
    rare = {name: value for name, default in TAIL.items() if (value := getattr(turn, name)) != default}
    tail = json.dumps(rare, sort_keys=True, default=_plain).encode()
    header = HEADER.pack(
        -1 if stored.parent_turn_id is None else stored.parent_turn_id,
        turn.message_end,
        len(turn.segment_keys),
        len(added) // TURN,
        len(completion) // TURN,
        len(chain) // TURN,
        bool(reasoning),
    )
    return b"".join((header, *turn.segment_keys, reasoning, path, added, completion, chain, tail))


def _plain(value: Any) -> Any:
    """A field's value as JSON: a dataclass (an image span) as its fields, read back by `Turn`."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    raise TypeError(f"{type(value).__name__} is not JSON")


def index_entry(session_id: str, turn_id: int, automatic: bool) -> bytes:
    """A path index entry: the turn id, after the session id in a namespace's index of automatic sessions."""
    entry = turn_id.to_bytes(TURN, "little")
    return session_id.encode() + entry if automatic else entry


def ledger_entry(path: bytes, reply_id: str | None) -> bytes:
    """What closing the session must undo for a turn: its path index entry and its reply id."""
    reply = (reply_id or "").encode()
    if len(reply) > 0xFFFF:
        raise ValueError("reply id too long")
    return path + len(reply).to_bytes(2, "little") + reply


def parse_turn(session_id: str, turn_id: int, blob: bytes) -> StoredTurn:
    parent, end, n_keys, n_added, n_completion, n_chain, has_reasoning = HEADER.unpack_from(blob)
    at = HEADER.size
    keys = tuple(blob[at + i * KEY_BYTES : at + (i + 1) * KEY_BYTES] for i in range(n_keys))
    at += n_keys * KEY_BYTES
    reasoning = blob[at : at + KEY_BYTES].hex() if has_reasoning else None
    at += KEY_BYTES if has_reasoning else 0
    at += KEY_BYTES  # the path digest (read by the scripts; a mirror recomputes it)
    spans = []
    for count in (n_added, n_completion, n_chain):
        spans.append(unpack_ids(blob[at : at + count * TURN]))
        at += count * TURN
    turn = Turn(end, keys, reasoning, spans[0], spans[1], **{**TAIL, **json.loads(blob[at:])})
    return StoredTurn(session_id, turn_id, None if parent < 0 else parent, tuple(spans[2]), turn)
