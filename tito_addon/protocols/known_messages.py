"""Chat messages already validated, found again by their JSON so that a turn reads only what is new.

An agent re-sends its whole history every turn: at turn 200, 400 messages that were each validated and keyed on
an earlier turn. Validating them again (pydantic, the JSON bounds walk) and digesting them again cost ~3 ms of a
345 KiB request, three times more than parsing it. A message whose JSON encoding and parsed value both equal one
seen before is the same message: its validated model is reused (with the key computed for it then, see
`sessions.message_keys`), and only the others are checked.

The encoding (orjson, keys in the order sent) tells apart every value an accepted request can hold except a
non-finite float (encoded as null), so a hit also compares the parsed values, which tells those apart.
Entries are bounded by an estimate of their memory and dropped least recently used first: a miss only validates
again.
The cached models are shared between requests; nothing changes a ChatMessage after validation (they are frozen).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import orjson

from tito_addon.canonical_chat import ChatMessage

DEFAULT_BUDGET_BYTES = 128 * 1024 * 1024
# An entry holds its encoding, the parsed message (whose strings the model shares) and the validated model:
# measured with tracemalloc at ~9.6 KB for a 0.85 KB tool result, so twice the text plus 8 KB.
ENTRY_OVERHEAD = 8192


def footprint(encoded: bytes) -> int:
    return 2 * len(encoded) + ENTRY_OVERHEAD


class KnownMessages:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, tuple[Any, ChatMessage]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def encoding(raw: Any) -> bytes | None:
        """The lookup key of one message as parsed, or None where it has none (not an object, or not encodable)."""
        if type(raw) is not dict:
            return None
        try:
            return orjson.dumps(raw)
        except (TypeError, orjson.JSONEncodeError):
            return None  # an integer beyond 64 bits or a lone surrogate: validated the slow way

    def find(self, encoded: bytes | None, raw: Any) -> ChatMessage | None:
        if encoded is None:
            return None
        entry = self._entries.get(encoded)
        if entry is None or entry[0] != raw:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(encoded)
        return entry[1]

    def remember(self, encoded: bytes | None, raw: Any, message: ChatMessage) -> None:
        if encoded is None or footprint(encoded) > self.budget_bytes:
            return
        if self._entries.pop(encoded, None) is not None:
            self.used_bytes -= footprint(encoded)
        self._entries[encoded] = (raw, message)
        self.used_bytes += footprint(encoded)
        self._shrink()

    def resize(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._shrink()

    def _shrink(self) -> None:
        while self.used_bytes > self.budget_bytes:
            dropped, _ = self._entries.popitem(last=False)
            self.used_bytes -= footprint(dropped)
