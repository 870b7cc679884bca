"""A turn's prompt ids in the two forms backends take: a list, and the JSON array text sent upstream.

At turn 200 of a tool-heavy session a prompt holds ~150k ids. Rebuilding that list from the session tree
and encoding it to JSON every turn was most of the proxy's per-turn cost, and it grew with the history.
The JSON text of a committed turn's prompt + completion is therefore kept, within a byte budget, so the
next turn's prompt is that text plus the encoding of only the ids it appends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Protocol

import orjson


class StoredTurn(Hashable, Protocol):
    """What a prompt needs of the stored turn it extends (a session-tree node): its whole ids and their count.

    A protocol rather than the node's class, so the engine does not depend on the session tree."""

    @property
    def end_len(self) -> int: ...

    def full_ids(self) -> list[int]: ...


def ids_json(ids: Sequence[int]) -> bytes:
    """`1,2,3`: the inside of a JSON array of ids, ready to splice."""
    return orjson.dumps(ids if isinstance(ids, list) else list(ids))[1:-1]


# A prompt's text is kept as pieces (one per turn) so that no turn copies the whole history to extend it or to
# send it; past this many pieces they are joined into one, so a turn copies its history once in this many turns.
MAX_PIECES = 32

JsonPieces = tuple[bytes, ...]


def extended(pieces: JsonPieces, ids: Sequence[int]) -> JsonPieces:
    """`pieces` with `ids` appended. Pieces concatenate, without a separator, to the inside of a JSON array (each
    piece after the first starts with its comma)."""
    text = ids_json(ids)
    if not text:
        return pieces
    pieces = (*pieces, b"," + text) if pieces else (text,)
    return (b"".join(pieces),) if len(pieces) > MAX_PIECES else pieces


class EncodedPrefixes:
    """JSON text of recently committed turns' whole ids (prompt + completion), least recently used first out.

    Only an acceleration: a miss re-encodes from the tree, so the budget bounds memory, never correctness. Each
    entry counts its whole text, though it shares most pieces with its parent's: the budget is an upper bound.
    """

    def __init__(self, budget_bytes: int = 256 * 1024 * 1024) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[StoredTurn, tuple[JsonPieces, int]] = OrderedDict()

    def get(self, node: StoredTurn) -> JsonPieces | None:
        data = self._entries.get(node)
        if data is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(node)
        return data[0]

    def resize(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._shrink()

    def _shrink(self) -> None:
        while self.used_bytes > self.budget_bytes:
            _, (_, size) = self._entries.popitem(last=False)
            self.used_bytes -= size

    def put(self, node: StoredTurn, pieces: JsonPieces) -> None:
        size = sum(map(len, pieces))
        if size > self.budget_bytes:
            return
        old = self._entries.pop(node, None)
        if old is not None:
            self.used_bytes -= old[1]
        self._entries[node] = (pieces, size)
        self.used_bytes += size
        self._shrink()

    def __len__(self) -> int:
        return len(self._entries)


class PromptIds:
    """The prompt of one turn: its parent's whole ids (None for a first turn) followed by the ids it adds.

    The list and the JSON text are each built at most once, and only if a backend asks for them."""

    __slots__ = ("parent", "added", "_prefixes", "_ids", "_pieces", "_len")

    def __init__(self, parent: StoredTurn | None, added: list[int], prefixes: EncodedPrefixes | None = None) -> None:
        self.parent = parent
        self.added = added
        self._prefixes = prefixes
        self._ids: list[int] | None = None
        self._pieces: JsonPieces | None = None
        self._len = (parent.end_len if parent is not None else 0) + len(added)

    @classmethod
    def of(cls, ids: list[int]) -> PromptIds:
        return cls(None, ids)

    def __len__(self) -> int:
        return self._len

    @property
    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = self.parent.full_ids() + self.added if self.parent is not None else list(self.added)
        return self._ids

    @property
    def json(self) -> bytes:
        """`1,2,3`: the ids as the inside of a JSON array."""
        return b"".join(self.json_pieces)

    @property
    def json_pieces(self) -> JsonPieces:
        """`json` in pieces, to be sent without joining them (see `extended`)."""
        if self._pieces is None:
            prefix: JsonPieces = ()
            if self.parent is not None:
                cached = self._prefixes.get(self.parent) if self._prefixes is not None else None
                prefix = cached if cached is not None else extended((), self.parent.full_ids())
            self._pieces = extended(prefix, self.added)
        return self._pieces

    def remember(self, node: StoredTurn, completion_ids: Sequence[int]) -> None:
        """After `node` (this prompt's turn) is committed: keep its whole ids' text for the turn that extends it,
        if this prompt was encoded at all (backends that take a list never pay for the text)."""
        if self._prefixes is not None and self._pieces is not None:
            self._prefixes.put(node, extended(self._pieces, completion_ids))
