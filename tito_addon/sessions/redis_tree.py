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
    P:n:{sid}:{turn}     hash: parent, end, keys (16 B each), reasoning (digest), added, completion (4 B an id,
                         little-endian), chain (the ancestors' turn ids, 4 B each, root first), path, finish,
                         tools, kwargs, reply
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

import hashlib
import json
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tito_addon.sessions.message_keys import KEY_BYTES
from tito_addon.tito_errors import TitoError

TURN = 4  # bytes of a packed turn id
AUTO_ID = 32  # automatic session ids are 32 hex characters
TOMBSTONE_S = 7 * 24 * 3600  # how long a closed session's turn counter outlives it

CLAIM = """
local P, sid, now = ARGV[5], ARGV[1], ARGV[7]
if sid == '' then
  sid = redis.call('HGET', KEYS[1], ARGV[2])
  if not sid then
    sid = ARGV[3]
    redis.call('HSET', KEYS[1], ARGV[2], sid)
    redis.call('HSET', P .. ':s:{' .. sid .. '}', 'automatic', 1, 'namespace', ARGV[4], 'nsh', ARGV[9],
      'prompt', ARGV[2], 'created', now, 'next', 0, 'turns', 0, 'tokens', 0, 'closed', 0)
  end
end
local meta = P .. ':s:{' .. sid .. '}'
local closed = redis.call('HGET', meta, 'closed')
if not closed then
  if ARGV[6] ~= '1' then return {sid, -1} end
  redis.call('HSET', meta, 'automatic', 0, 'namespace', '', 'nsh', ARGV[9], 'created', now, 'next', 0, 'turns', 0,
    'tokens', 0, 'closed', 0)
elseif closed == '1' then
  if ARGV[6] ~= '1' or redis.call('HGET', meta, 'automatic') == '1' then return {sid, -1} end
  redis.call('HSET', meta, 'closed', 0)
  redis.call('PERSIST', meta)
end
if ARGV[10] ~= '' and redis.call('EXISTS', P .. ':n:{' .. sid .. '}:' .. ARGV[10]) == 0 then return {sid, -1} end
local turn = redis.call('HINCRBY', meta, 'next', 1) - 1
redis.call('ZADD', P .. ':b:{' .. sid .. '}', ARGV[8], turn)
redis.call('ZADD', KEYS[2], now, sid)
return {sid, turn}
"""

COMMIT = """
if redis.call('HGET', KEYS[1], 'closed') ~= '0' then return 0 end
redis.call('HSET', KEYS[2], 'parent', ARGV[1], 'end', ARGV[2], 'keys', ARGV[3], 'reasoning', ARGV[4],
  'added', ARGV[5], 'completion', ARGV[6], 'finish', ARGV[7], 'tools', ARGV[8], 'kwargs', ARGV[9], 'reply', ARGV[10],
  'path', ARGV[11], 'chain', ARGV[15])
local entries = redis.call('HGET', KEYS[3], ARGV[11]) or ''
redis.call('HSET', KEYS[3], ARGV[11], entries .. ARGV[12])
redis.call('HINCRBY', KEYS[1], 'turns', 1)
redis.call('HINCRBY', KEYS[1], 'tokens', tonumber(ARGV[13]))
if ARGV[10] ~= '' then redis.call('HSET', KEYS[4], ARGV[10], ARGV[14]) end
redis.call('ZREM', KEYS[6], ARGV[17])
redis.call('ZADD', KEYS[5], ARGV[16], ARGV[18])
return 1
"""

CLOSE = """
local sid, P, now = ARGV[1], ARGV[2], ARGV[3]
local meta = P .. ':s:{' .. sid .. '}'
local m = redis.call('HMGET', meta, 'closed', 'automatic', 'nsh', 'prompt', 'next', 'turns')
if m[1] ~= '0' then redis.call('ZREM', KEYS[1], sid) return -1 end
local busy = P .. ':b:{' .. sid .. '}'
redis.call('ZREMRANGEBYSCORE', busy, '-inf', now)
if redis.call('ZCARD', busy) > 0 then return -1 end
if ARGV[4] ~= '' then
  local score = redis.call('ZSCORE', KEYS[1], sid)
  if score and tonumber(score) > tonumber(ARGV[4]) then return -1 end
end
local auto = m[2] == '1'
local index = auto and (P .. ':ap:' .. m[3]) or (P .. ':p:{' .. sid .. '}')
for t = 0, tonumber(m[5]) - 1 do
  local node = P .. ':n:{' .. sid .. '}:' .. t
  local f = redis.call('HMGET', node, 'path', 'reply')
  if f[1] then
    if auto then
      local v = redis.call('HGET', index, f[1])
      if v then
        local kept = {}
        for i = 1, #v, 36 do
          local e = string.sub(v, i, i + 35)
          if string.sub(e, 1, 32) ~= sid then kept[#kept + 1] = e end
        end
        if #kept == 0 then redis.call('HDEL', index, f[1]) else redis.call('HSET', index, f[1], table.concat(kept)) end
      end
    end
    if f[2] and f[2] ~= '' then redis.call('HDEL', P .. ':r', f[2]) end
    redis.call('DEL', node)
  end
end
if not auto then redis.call('DEL', index) end
if auto and m[4] then
  local groups = P .. ':g:' .. m[3]
  if redis.call('HGET', groups, m[4]) == sid then redis.call('HDEL', groups, m[4]) end
end
redis.call('DEL', busy)
redis.call('HSET', meta, 'closed', 1)
redis.call('EXPIRE', meta, ARGV[5])
redis.call('ZREM', KEYS[1], sid)
return tonumber(m[6])
"""

RESTORE = """
local sid, now, P = ARGV[1], ARGV[2], ARGV[3]
local closed = redis.call('HGET', KEYS[1], 'closed')
if closed == '0' then return 0 end
local next = math.max(tonumber(redis.call('HGET', KEYS[1], 'next') or '0'), tonumber(ARGV[4]))
local turns, tokens = 0, 0
for i = 5, #ARGV, 13 do
  local t = tonumber(ARGV[i])
  redis.call('HSET', P .. ':n:{' .. sid .. '}:' .. t, 'parent', ARGV[i + 1], 'end', ARGV[i + 2], 'keys', ARGV[i + 3],
    'reasoning', ARGV[i + 4], 'added', ARGV[i + 5], 'completion', ARGV[i + 6], 'finish', ARGV[i + 7],
    'tools', ARGV[i + 8], 'kwargs', ARGV[i + 9], 'reply', ARGV[i + 10], 'path', ARGV[i + 11], 'chain', ARGV[i + 12])
  local entries = redis.call('HGET', KEYS[2], ARGV[i + 11]) or ''
  redis.call('HSET', KEYS[2], ARGV[i + 11], entries .. struct.pack('<I4', t))
  if ARGV[i + 10] ~= '' then redis.call('HSET', KEYS[3], ARGV[i + 10], sid .. '\\n' .. t) end
  if t + 1 > next then next = t + 1 end
  turns = turns + 1
  tokens = tokens + (#ARGV[i + 5] + #ARGV[i + 6]) / 4
end
redis.call('HSET', KEYS[1], 'automatic', 0, 'namespace', '', 'created', now, 'next', next, 'turns', turns,
  'tokens', tokens, 'closed', 0)
redis.call('PERSIST', KEYS[1])
redis.call('ZADD', KEYS[4], now, sid)
return 1
"""


class StoreUnavailable(TitoError):
    """The shared store cannot be reached or failed: the turn is refused (503), nothing forwarded or recorded."""

    status = 503
    error_type = "session_store_unavailable"


class SessionGone(TitoError):
    """The session (or the turn a request extends) closed between locating it and using it: send it again."""

    status = 409
    error_type = "session_closed"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} closed while this turn was in flight; send the request again")
        self.session_id = session_id


@dataclass(frozen=True)
class StoredNode:
    """A committed turn as Redis holds it (immutable)."""

    session_id: str
    turn_id: int
    parent_turn_id: int | None
    message_end: int
    segment_keys: tuple[bytes, ...]
    reasoning: str | None  # the assistant message's reasoning digest (hex), None when it had none
    added_ids: array
    completion_ids: array
    finish_reason: str | None
    tools_sha256: str | None
    template_kwargs: dict[str, Any] | None
    reply_id: str | None
    chain: tuple[int, ...] = ()  # ancestors' turn ids, root first


@dataclass(frozen=True)
class NewTurn:
    """A claimed turn, ready to commit (its record line already on disk)."""

    session_id: str
    turn_id: int
    automatic: bool
    namespace: str
    parent_turn_id: int | None
    chain: tuple[int, ...]
    message_end: int
    segment_keys: tuple[bytes, ...]
    reasoning: str | None  # digest
    added_ids: Sequence[int]
    completion_ids: Sequence[int]
    finish_reason: str | None
    path: bytes
    tools_sha256: str | None = None
    template_kwargs: dict[str, Any] | None = None
    reply_id: str | None = None


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
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest() if text else ""


def namespace_hash(namespace: str) -> str:
    return hashlib.blake2b(namespace.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


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

    def _index(self, sid: str | None, namespace: str) -> str:
        if sid is not None:
            return f"{self.prefix}:p:{{{sid}}}"
        return f"{self.prefix}:ap:{namespace_hash(namespace)}"

    @property
    def _live(self) -> str:
        return f"{self.prefix}:live"

    async def _run(self, call: Any) -> Any:
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
    ) -> tuple[str, int]:
        """A turn id in the session a turn belongs to, marked in flight until `busy_until_ms`: `session_id` when
        given, else the automatic session of its first request (`prompt`: the digest of those messages), made
        `fresh_id` if no proxy claimed that prompt yet. A given session that is closed (or missing) is reopened only
        with `create`; a `parent_turn_id` that is gone raises SessionGone."""
        keys = [f"{self.prefix}:g:{namespace_hash(namespace)}", self._live]
        args = [
            session_id or "", prompt, fresh_id, namespace, self.prefix, "1" if create else "0", now_ms,
            busy_until_ms, namespace_hash(namespace), "" if parent_turn_id is None else parent_turn_id,
        ]  # fmt: skip
        sid, turn = await self._run(self._claim(keys=keys, args=args))
        if int(turn) < 0:
            raise SessionGone(_text(sid))
        return _text(sid), int(turn)

    async def commit(self, turn: NewTurn, *, now_ms: int) -> None:
        """Add a claimed turn and its index entry, atomically (after its record line is on disk)."""
        if any(len(key) != KEY_BYTES for key in turn.segment_keys):
            raise ValueError("message keys are 16 bytes")
        sid = turn.session_id
        entry = turn.turn_id.to_bytes(TURN, "little")
        if turn.automatic:
            if len(sid) != AUTO_ID:
                raise ValueError("automatic session ids are 32 characters")
            entry = sid.encode() + entry
        added, completion = pack_ids(turn.added_ids), pack_ids(turn.completion_ids)
        index = self._index(None if turn.automatic else sid, turn.namespace)
        keys = [
            self._meta(sid), self._node(sid, turn.turn_id), index, f"{self.prefix}:r", self._live,
            f"{self.prefix}:b:{{{sid}}}",
        ]  # fmt: skip
        args = [
            -1 if turn.parent_turn_id is None else turn.parent_turn_id, turn.message_end, b"".join(turn.segment_keys),
            turn.reasoning or "", added, completion, turn.finish_reason or "", turn.tools_sha256 or "",
            json.dumps(turn.template_kwargs or {}, sort_keys=True), turn.reply_id or "", turn.path, entry,
            (len(added) + len(completion)) // TURN, f"{sid}\n{turn.turn_id}", pack_ids(turn.chain), now_ms,
            turn.turn_id, sid,
        ]  # fmt: skip
        if not await self._run(self._commit(keys=keys, args=args)):
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
            replies = await self._run(pipe.execute())
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

    async def nodes(self, wanted: Iterable[tuple[str, int]]) -> dict[tuple[str, int], StoredNode]:
        """Committed turns, in one round trip; a turn that is not (or no longer) stored is left out."""
        wanted = list(dict.fromkeys(wanted))
        if not wanted:
            return {}
        async with self.client.pipeline(transaction=False) as pipe:
            for sid, turn in wanted:
                pipe.hgetall(self._node(sid, turn))
            found = await self._run(pipe.execute())
        return {pair: parse_node(*pair, fields) for pair, fields in zip(wanted, found, strict=True) if fields}

    async def node(self, session_id: str, turn_id: int) -> StoredNode | None:
        return (await self.nodes([(session_id, turn_id)])).get((session_id, turn_id))

    async def by_reply(self, reply_id: str) -> tuple[str, int] | None:
        found = await self._run(self.client.hget(f"{self.prefix}:r", reply_id))
        if not found:
            return None
        sid, _, turn = _text(found).rpartition("\n")
        return sid, int(turn)

    async def meta(self, session_id: str) -> dict[str, str]:
        fields = await self._run(self.client.hgetall(self._meta(session_id)))
        decoded = {_text(k): v for k, v in fields.items()}
        return {k: v.hex() if k == "prompt" else _text(v) for k, v in decoded.items()}  # the prompt is a digest

    async def idle(self, before_ms: int, limit: int = 256) -> list[str]:
        """Live sessions whose last activity is older than `before_ms`."""
        found = await self._run(self.client.zrangebyscore(self._live, "-inf", before_ms, start=0, num=limit))
        return [_text(sid) for sid in found]

    async def oldest_beyond(self, capacity: int, limit: int = 256) -> list[str]:
        """The least recently active live sessions past the first `capacity` (newest kept)."""
        excess = await self._run(self.client.zcard(self._live)) - capacity
        if excess <= 0:
            return []
        found = await self._run(self.client.zrange(self._live, 0, min(excess, limit) - 1))
        return [_text(sid) for sid in found]

    async def close(self, session_id: str, *, now_ms: int, idle_before_ms: int | None) -> int | None:
        """Close a live session unless a turn of it is in flight (or, with `idle_before_ms`, it was used since):
        its turns and indexes go, its turn counter stays (`TOMBSTONE_S`). The number of turns it had, or None when
        it was not closed here (another proxy closed it first, or it is busy)."""
        args = [session_id, self.prefix, now_ms, "" if idle_before_ms is None else idle_before_ms, TOMBSTONE_S]
        turns = await self._run(self._close(keys=[self._live], args=args))
        return None if int(turns) < 0 else int(turns)

    async def restore(self, session_id: str, nodes: Sequence[StoredNode], paths: Sequence[bytes], *, now_ms: int,
                      next_at_least: int) -> bool:  # fmt: skip
        """Put a named session's recorded turns back (all at once) unless it is live; False when it already was."""
        args: list[Any] = [session_id, now_ms, self.prefix, next_at_least]
        for node, path in zip(nodes, paths, strict=True):
            args += [
                node.turn_id, -1 if node.parent_turn_id is None else node.parent_turn_id, node.message_end,
                b"".join(node.segment_keys), node.reasoning or "", node.added_ids.tobytes(),
                node.completion_ids.tobytes(), node.finish_reason or "", node.tools_sha256 or "",
                json.dumps(node.template_kwargs or {}, sort_keys=True), node.reply_id or "", path,
                pack_ids(node.chain),
            ]  # fmt: skip
        keys = [self._meta(session_id), self._index(session_id, ""), f"{self.prefix}:r", self._live]
        return bool(await self._run(self._restore(keys=keys, args=args)))


def parse_node(session_id: str, turn_id: int, fields: dict[Any, bytes]) -> StoredNode:
    get = {_text(k): v for k, v in fields.items()}
    parent = int(get["parent"])
    keys = get["keys"]
    return StoredNode(
        session_id=session_id,
        turn_id=turn_id,
        parent_turn_id=None if parent < 0 else parent,
        message_end=int(get["end"]),
        segment_keys=tuple(keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)),
        reasoning=_text(get["reasoning"]) or None,
        added_ids=unpack_ids(get["added"]),
        completion_ids=unpack_ids(get["completion"]),
        finish_reason=_text(get["finish"]) or None,
        tools_sha256=_text(get["tools"]) or None,
        template_kwargs=json.loads(get["kwargs"]) or None,
        reply_id=_text(get["reply"]) or None,
        chain=tuple(unpack_ids(get.get("chain", b""))),
    )
