"""Session trees in Redis, for many proxies sharing one session space (issue 13; not yet used by the proxy).

What several proxies must agree on lives here, each change atomic (one Lua script): which session a request joins
(a named one, or the automatic session of its GRPO group: the first proxy to claim a prompt wins it), the next turn
id (never reused), and the committed turns themselves with the path index that finds them (`path_keys`). A turn is
immutable once committed, so what a proxy caches of it is never stale.

Layout (prefix `tito`; a session's keys share the `{sid}` hash tag):
    {P}:s:{sid}            hash: next (turn id), turns, tokens, automatic, namespace
    {P}:n:{sid}:{turn}     hash: parent, end, keys (16 B each), reasoning, added, completion (4 B an id, LE),
                           finish, tools, kwargs, reply
    {P}:p:{sid}            hash: path digest -> turn ids (4 B each) of the named session's turns ending there
    {P}:ap:{ns}            hash: path digest -> (32 B session id + 4 B turn id)* of automatic sessions' turns
    {P}:g:{ns}             hash: first-request digest -> automatic session id (a GRPO group)
    {P}:r                  hash: reply id -> session id + turn id

One Redis for now: the claim script names the session's meta key only once it knows the session (a GRPO group's
first claim decides it), which a Redis Cluster refuses; splitting the claim by slot comes with the wiring.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass
from typing import Any

from tito_addon.sessions.message_keys import KEY_BYTES

TURN = 4  # bytes of a packed turn id
AUTO_ID = 32  # automatic session ids are 32 hex characters (uuid4().hex)

CLAIM = """
local sid = ARGV[1]
if sid == '' then
  sid = redis.call('HGET', KEYS[1], ARGV[2])
  if not sid then
    sid = ARGV[3]
    redis.call('HSET', KEYS[1], ARGV[2], sid)
  end
end
local meta = ARGV[5] .. ':s:{' .. sid .. '}'
if redis.call('EXISTS', meta) == 0 then
  redis.call('HSET', meta, 'automatic', ARGV[1] == '' and 1 or 0, 'namespace', ARGV[4], 'turns', 0, 'tokens', 0)
end
local turn = redis.call('HINCRBY', meta, 'next', 1) - 1
return {sid, turn}
"""

COMMIT = """
local meta, node, index, replies = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
redis.call('HSET', node, 'parent', ARGV[1], 'end', ARGV[2], 'keys', ARGV[3], 'reasoning', ARGV[4],
  'added', ARGV[5], 'completion', ARGV[6], 'finish', ARGV[7], 'tools', ARGV[8], 'kwargs', ARGV[9], 'reply', ARGV[10])
local entries = redis.call('HGET', index, ARGV[11]) or ''
redis.call('HSET', index, ARGV[11], entries .. ARGV[12])
redis.call('HINCRBY', meta, 'turns', 1)
redis.call('HINCRBY', meta, 'tokens', tonumber(ARGV[13]))
if ARGV[10] ~= '' then redis.call('HSET', replies, ARGV[10], ARGV[14]) end
return 1
"""


class StoreUnavailable(Exception):
    """The shared store cannot be reached or failed: the turn is refused, nothing is forwarded or recorded."""


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


class RedisTree:
    def __init__(self, client: Any, prefix: str = "tito") -> None:
        self.client = client
        self.prefix = prefix
        self._claim = client.register_script(CLAIM)
        self._commit = client.register_script(COMMIT)
        self._nodes: dict[tuple[str, int], StoredNode] = {}

    def _meta(self, sid: str) -> str:
        return f"{self.prefix}:s:{{{sid}}}"

    def _node(self, sid: str, turn: int) -> str:
        return f"{self.prefix}:n:{{{sid}}}:{turn}"

    def _index(self, sid: str | None, namespace: str) -> str:
        if sid is not None:
            return f"{self.prefix}:p:{{{sid}}}"
        return f"{self.prefix}:ap:{hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()}"

    def _groups(self, namespace: str) -> str:
        return f"{self.prefix}:g:{hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()}"

    async def _run(self, call: Any) -> Any:
        try:
            return await call
        except Exception as exc:  # redis raises ConnectionError, TimeoutError, ResponseError, ...
            raise StoreUnavailable(f"the session store failed: {type(exc).__name__}: {exc}") from exc

    async def claim(self, session_id: str | None, namespace: str, prompt: bytes, fresh_id: str) -> tuple[str, int]:
        """The session a committing turn belongs to and its turn id: `session_id` when named, else the automatic
        session of its first request (`prompt`: the digest of those messages), made `fresh_id` if none claimed it."""
        keys = [self._groups(namespace)]
        args = [session_id or "", prompt, fresh_id, namespace, self.prefix]
        sid, turn = await self._run(self._claim(keys=keys, args=args))
        return (sid.decode() if isinstance(sid, bytes) else sid), int(turn)

    async def commit(
        self,
        session_id: str,
        turn_id: int,
        *,
        automatic: bool,
        namespace: str,
        parent_turn_id: int | None,
        message_end: int,
        segment_keys: tuple[bytes, ...],
        reasoning: str | None,
        added_ids: Any,
        completion_ids: Any,
        finish_reason: str | None,
        path: bytes,
        tools_sha256: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        reply_id: str | None = None,
    ) -> None:
        """Add a claimed turn and its index entry, atomically (after its record line is on disk)."""
        if any(len(key) != KEY_BYTES for key in segment_keys):
            raise ValueError("message keys are 16 bytes")
        entry = turn_id.to_bytes(TURN, "little")
        if automatic:
            if len(session_id) != AUTO_ID:
                raise ValueError("automatic session ids are 32 characters")
            entry = session_id.encode() + entry
        added, completion = pack_ids(added_ids), pack_ids(completion_ids)
        keys = [
            self._meta(session_id),
            self._node(session_id, turn_id),
            self._index(None if automatic else session_id, namespace),
            f"{self.prefix}:r",
        ]
        args = [
            -1 if parent_turn_id is None else parent_turn_id, message_end, b"".join(segment_keys),
            reasoning_digest(reasoning), added, completion, finish_reason or "", tools_sha256 or "",
            json.dumps(template_kwargs or {}, sort_keys=True), reply_id or "", path, entry,
            (len(added) + len(completion)) // TURN, f"{session_id}\n{turn_id}",
        ]  # fmt: skip
        await self._run(self._commit(keys=keys, args=args))

    async def lookup(self, session_id: str | None, namespace: str, paths: list[bytes]) -> list[list[tuple[str, int]]]:
        """The turns ending at each path digest (oldest first): of the named session, or of the namespace's
        automatic sessions. One round trip whatever the number of digests."""
        if not paths:
            return []
        found = await self._run(self.client.hmget(self._index(session_id, namespace), paths))
        out = []
        for entries in found:
            entries = entries or b""
            if session_id is not None:
                out.append([(session_id, int.from_bytes(entries[i : i + TURN], "little"))
                            for i in range(0, len(entries), TURN)])  # fmt: skip
            else:
                step = AUTO_ID + TURN
                pairs = [
                    (entries[i : i + AUTO_ID], entries[i + AUTO_ID : i + step]) for i in range(0, len(entries), step)
                ]
                out.append([(sid.decode(), int.from_bytes(turn, "little")) for sid, turn in pairs])
        return out

    async def node(self, session_id: str, turn_id: int) -> StoredNode | None:
        """A committed turn, from this process's cache when it has it (a turn never changes once committed)."""
        cached = self._nodes.get((session_id, turn_id))
        if cached is not None:
            return cached
        fields = await self._run(self.client.hgetall(self._node(session_id, turn_id)))
        if not fields:
            return None
        get = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
        parent = int(get["parent"])
        keys = get["keys"]
        kwargs = json.loads(get["kwargs"]) or None
        node = StoredNode(
            session_id=session_id,
            turn_id=turn_id,
            parent_turn_id=None if parent < 0 else parent,
            message_end=int(get["end"]),
            segment_keys=tuple(keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)),
            reasoning=get["reasoning"].decode() or None,
            added_ids=unpack_ids(get["added"]),
            completion_ids=unpack_ids(get["completion"]),
            finish_reason=get["finish"].decode() or None,
            tools_sha256=get["tools"].decode() or None,
            template_kwargs=kwargs,
            reply_id=get["reply"].decode() or None,
        )
        self._nodes[(session_id, turn_id)] = node
        return node

    async def by_reply(self, reply_id: str) -> tuple[str, int] | None:
        found = await self._run(self.client.hget(f"{self.prefix}:r", reply_id))
        if not found:
            return None
        sid, _, turn = found.decode().rpartition("\n")
        return sid, int(turn)

    async def meta(self, session_id: str) -> dict[str, str]:
        fields = await self._run(self.client.hgetall(self._meta(session_id)))
        return {k.decode(): v.decode() for k, v in fields.items()}
