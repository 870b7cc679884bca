"""Agent requests already read, found again by their bytes, so that a turn parses only what its agent appended.

An agent's next request is its previous one with messages appended: at turn 200 the first ~340 KiB of a 345 KiB
body are bytes this process parsed and validated one turn ago. When a body begins with the bytes of a request read
before, up to the end of that request's last message, and the next byte continues the messages array, the new body
is read as: the members and messages of the known request, then a parse of only what follows. That is exactly what
parsing the whole body gives, because a JSON parse of a prefix is determined by its bytes; one `startswith` (a
memcmp) proves the prefix.

Only bodies that one `JsonStyle` writes back exactly from their object are remembered (`json_body.read_json_object`:
compact as orjson and Node write, or spaced as Python's `json.dumps` does for requests and aiohttp), so a member's
bytes are its own encoding in that style and the end of the messages is computed, not searched. The rest of a hit is
held to the same standard: the appended part must be exactly what the known request's style writes for what it
parsed to (no duplicate key, no inexact number) and may not repeat a member sent before the messages, or the whole
body is parsed the strict way and refused as it always was.

Finding the known request costs no parse either: each is indexed by the 64 bytes before the last multiple of 4 KiB
at or under its end, and a body looks up those offsets from its end down. Requests under 8 KiB are parsed whole:
that costs microseconds, and many agents' short requests share their bytes where they would be indexed.
A request is also known up to the end of each of its two messages before the last (an agent may rewrite its last
message on the next turn: Claude Code moves its `cache_control` marker to the newest block). Each protocol keeps its
own reading of the known messages with them (`state`: chat's validated messages, Anthropic's translations, ...).
Entries are bounded by an estimate of their memory, least recently used first; a request that a later one extended
goes to the cold end, so one agent's long session keeps its newest request rather than all its old ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from tito_addon.protocols.json_body import COMPACT, JsonStyle, read_json_object

STEP = 4096
ANCHOR = 64
MAX_CANDIDATES = 48  # requests whose bytes agree at one offset (same task, same tools): each costs a failed memcmp
# Below this a whole parse costs microseconds, and many agents' short requests look alike where they are indexed.
MIN_PREFIX = 8192
CUTS = 2  # how many of a request's last messages may change on its agent's next turn and still leave a prefix
ENTRY_OVERHEAD = 1024  # the entry, its index slot and its tuples' headers


@dataclass(slots=True, eq=False)
class KnownRequest:
    prefix: memoryview  # the body up to the end of its last message (or of one before it)
    # The body from the `]` that closes its messages, and the members that follow, as parsed: a later body that ends
    # with the same bytes (the system prompt and tools sent again) is read without parsing them again.
    tail: memoryview
    after: dict[str, Any]
    style: JsonStyle  # how its client writes JSON: what it appends next is read in the same style
    before: dict[str, Any]  # the members sent before the messages, as parsed
    raw_messages: tuple[Any, ...]
    state: Any  # what the protocol keeps of reading these messages (for chat: each one validated)
    anchor: tuple[int, bytes]
    weight: int  # 3: its bytes, and the parsed and validated messages they became; 1: a cut, sharing those
    # The entries of one body (the whole and its cuts), flagged once a later request extended one of them: those
    # make room first where an index slot is full.
    group: list[bool]

    @property
    def footprint(self) -> int:
        """An estimate of the memory it keeps alive: the whole body its prefix views (each entry counts it, so a body
        is freed within the budget whichever of its entries goes last), and the messages read from the prefix."""
        body = len(self.prefix.obj)  # type: ignore[arg-type]
        return body + (self.weight - 1) * len(self.prefix) + 32 * len(self.raw_messages) + ENTRY_OVERHEAD


@dataclass(slots=True)
class Extension:
    known: KnownRequest
    obj: dict[str, Any]  # the whole request, as parsing all of it gives
    appended: list[Any]  # the raw messages after the known ones
    # Every member but the appended messages is the known request's own, values and all: its JSON bounds were
    # checked when that request was read, so only the appended messages' are still to check.
    only_appended_new: bool = False


def anchor_of(body: bytes, end: int) -> tuple[int, bytes]:
    at = end // STEP * STEP
    if at < ANCHOR:
        at = ANCHOR
    return at, body[at - ANCHOR : at]


def opening_of(member: str, style: JsonStyle) -> bytes:
    """The bytes that open the array `member` in `style`: `"messages":[` or `"messages": [`."""
    return orjson.dumps(member) + style.key_separator + b"["


def messages_end(
    body: bytes, member: str, style: JsonStyle, before: dict[str, Any], encodings: list[bytes]
) -> int | None:
    """Where the messages array of an exact body closes (its `]`), from the encodings of what precedes it."""
    written = style.dumps(before)
    if written is None:
        return None
    opening = opening_of(member, style)
    start = len(written) - 1 + (len(style.item_separator) if before else 0) + len(opening)
    end = start + sum(map(len, encodings)) + max(len(encodings) - 1, 0) * len(style.item_separator)
    if body[start - len(opening) : start] != opening or body[end : end + 1] != b"]":
        return None
    return end


class KnownRequests:
    def __init__(self, budget_bytes: int, min_prefix: int = MIN_PREFIX, member: str = "messages") -> None:
        """`member`: the request's array of messages (`input` for OpenAI Responses)."""
        self.budget_bytes = budget_bytes
        self.member = member
        self.min_prefix = max(min_prefix, 2 * ANCHOR)
        self.used_bytes = 0
        self.hits = 0
        self._entries: OrderedDict[int, KnownRequest] = OrderedDict()
        self._index: dict[tuple[int, bytes], list[KnownRequest]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def read(self, body: bytes) -> tuple[dict[str, Any], JsonStyle | None, Extension | None]:
        """`body`'s JSON object, the style that writes it back exactly (None: none does, and it is not remembered),
        and the known request it extends (None: it was parsed whole, by `json_body`'s rules)."""
        extension = self.extend(body)
        if extension is not None:
            return extension.obj, extension.known.style, extension
        obj, style = read_json_object(body)
        return obj, style, None

    def extend(self, body: bytes) -> Extension | None:
        """`body` read as a known request plus what follows it, or None (then parse it all)."""
        if not self._entries or len(body) < self.min_prefix + 2:
            return None
        for at in (*range((len(body) - 2) // STEP * STEP, 0, -STEP), ANCHOR):
            candidates = self._index.get((at, body[at - ANCHOR : at]))
            if candidates:
                extension = self._longest(body, candidates)
                if extension is not None:
                    return extension
        return None

    def _longest(self, body: bytes, candidates: list[KnownRequest]) -> Extension | None:
        """The longest of `candidates` that `body` extends, read as such; None if none is, or if what follows it is
        not what the fast path may read (the strict parse decides)."""
        best: KnownRequest | None = None
        for known in candidates:
            end = len(known.prefix)
            if best is not None and end <= len(best.prefix):
                continue
            if body[end : end + 1] in (b",", b"]") and body.startswith(known.prefix):
                best = known
        if best is None:
            return None
        extension = _read_rest(body, best, self.member)
        if extension is not None:
            self.hits += 1
            self._entries.move_to_end(id(best), last=not extension.appended)
            if extension.appended:
                best.group[0] = True
        return extension

    def remember(
        self,
        body: bytes,
        obj: dict[str, Any],
        state: Any,
        style: JsonStyle,
        extended: Extension | None,
        cut: Callable[[int], Any] | None = None,
        compact: list[bytes | None] | None = None,
    ) -> None:
        """Keep a body that `style` writes back exactly, read as `obj`, with the protocol's `state` of reading its
        messages. `compact`: the protocol's own orjson encodings of the messages after the `extended` known
        request's (all of them when there was none), taken as they are where the body is compact.

        `cut(n)`: the state of reading the first n messages, where the protocol can give it: the body is then also
        known up to the end of each of the two messages before the last, since an agent may change its last message
        on the next turn (Claude Code moves its `cache_control` marker to the newest block every request)."""
        raw_messages = obj[self.member]
        new = raw_messages[len(extended.known.raw_messages) :] if extended is not None else raw_messages
        encodings = compact if compact is not None and style is COMPACT else [style.dumps(m) for m in new]
        if len(encodings) != len(new) or any(encoded is None for encoded in encodings):
            return
        if extended is None:
            before: dict[str, Any] = {}
            for name, value in obj.items():
                if name == self.member:
                    break
                before[name] = value
            end = messages_end(body, self.member, style, before, encodings)  # type: ignore[arg-type]
            if end is None:
                return
        elif not encodings:
            return  # the known request again (a retry, another sample): it is remembered already
        else:
            before = extended.known.before
            separators = len(encodings) * len(style.item_separator)
            end = len(extended.known.prefix) + sum(map(len, encodings)) + separators  # type: ignore[arg-type]
        if end < self.min_prefix or body[end : end + 1] != b"]":
            return
        view = memoryview(body)
        group = [False]
        names = list(obj)
        after = {name: obj[name] for name in names[names.index(self.member) + 1 :]}
        tail = view[end:]
        whole = KnownRequest(
            view[:end], tail, after, style, before, tuple(raw_messages), state, anchor_of(body, end), 3, group
        )
        self._add(whole)
        if cut is None:
            return
        count = len(raw_messages)
        separator = style.item_separator
        for encoded in reversed(encodings[-CUTS:]):
            end -= len(encoded) + len(separator)  # type: ignore[arg-type]
            count -= 1
            if count < 1 or end < self.min_prefix or body[end : end + len(separator)] != separator:
                break
            shorter = tuple(raw_messages[:count])
            self._add(
                KnownRequest(
                    view[:end], tail, after, style, before, shorter, cut(count), anchor_of(body, end), 1, group
                )
            )

    def _add(self, known: KnownRequest) -> None:
        if known.footprint > self.budget_bytes:
            return
        self._entries[id(known)] = known
        bucket = self._index.setdefault(known.anchor, [])
        bucket.append(known)
        if len(bucket) > MAX_CANDIDATES:
            self._forget(next((k for k in bucket if k.group[0]), bucket[0]))
        self.used_bytes += known.footprint
        self._shrink()

    def resize(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._shrink()

    def _shrink(self) -> None:
        while self.used_bytes > self.budget_bytes and self._entries:
            self._forget(next(iter(self._entries.values())))

    def _forget(self, known: KnownRequest) -> None:
        if self._entries.pop(id(known), None) is None:
            return
        self.used_bytes -= known.footprint
        bucket = self._index[known.anchor]
        bucket.remove(known)
        if not bucket:
            del self._index[known.anchor]


def _read_rest(body: bytes, known: KnownRequest, member: str) -> Extension | None:
    end = len(known.prefix)
    separator = known.style.item_separator
    comma = body[end] == 0x2C
    if comma and body[end : end + len(separator)] != separator:
        return None
    if len(body) - len(known.tail) >= end and body.endswith(known.tail):
        same_tail = _read_appended(body, known, member, comma)
        if same_tail is not None:
            return same_tail
    # A message, or `]`, then the members after the messages, read as one object in the known request's style.
    text = b"{" + opening_of(member, known.style) + (body[end + len(separator) :] if comma else body[end:])
    try:
        tail = orjson.loads(text)
    except Exception:  # whatever orjson refuses, the strict parse of the whole body decides
        return None
    if type(tail) is not dict or known.style.dumps(tail) != text:
        return None
    appended = tail[member]
    if comma and not appended:
        return None  # `},]`: the comma promised a message (the strict parse refuses the trailing comma)
    obj = dict(known.before)
    obj[member] = [*known.raw_messages, *appended]
    for name, value in tail.items():
        if name in obj:
            if name == member:
                continue
            return None  # a member sent twice: the strict parse refuses it
        obj[name] = value
    return Extension(known, obj, appended)


def _read_appended(body: bytes, known: KnownRequest, member: str, comma: bool) -> Extension | None:
    """`body` read as the known request with messages appended, where it ends with that request's own tail: what
    comes between is then a list of messages in its style, and the body is that style's writing of the object
    these make, which is what parsing all of it gives. None: read it the general way."""
    end, stop = len(known.prefix), len(body) - len(known.tail)
    appended: Any = []
    if comma:
        text = b"[" + body[end + len(known.style.item_separator) : stop] + b"]"
        try:
            appended = orjson.loads(text)
        except Exception:  # whatever orjson refuses, the general way decides
            return None
        if type(appended) is not list or not appended or known.style.dumps(appended) != text:
            return None
    elif stop != end:
        return None
    obj = dict(known.before)
    obj[member] = [*known.raw_messages, *appended]
    obj.update(known.after)
    return Extension(known, obj, appended, only_appended_new=True)
