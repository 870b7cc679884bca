"""A turn as its record line says it: the one place a record line becomes the turn its session's tree holds, for a turn
just written (its commit) and for one read back (resume after a restart, into this process's tree or a shared store;
replay's index)."""

from __future__ import annotations

from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import recorded_segment
from tito_addon.sessions.message_keys import MessageKey
from tito_addon.sessions.turn_entity import LINE_FIELDS, RecordedTurn, Turn


def turn_of(line: TurnRecord, message_end: int, segment_keys: tuple[MessageKey, ...], reasoning: str | None) -> Turn:
    """The turn a record line describes, its segment's place and keys and its answer's reasoning given (a live commit
    has them at hand; a recorded turn's come from its messages, `recorded_turns`)."""
    return Turn(message_end, segment_keys, reasoning, **{name: getattr(line, name) for name in LINE_FIELDS})


def recorded_turns(lines: list[TurnRecord]) -> list[RecordedTurn]:
    """The turns of record lines (parents first, as `read_session` orders them), keyed exactly as live commits are."""
    ends: dict[int, int] = {}
    out = []
    for line in lines:
        keys, assistant = recorded_segment(line)
        parent = line.parent_turn_id
        ends[line.turn_id] = (ends[parent] if parent is not None else 0) + len(keys)
        turn = turn_of(line, ends[line.turn_id], tuple(keys), assistant.reasoning_text())
        out.append(RecordedTurn(line.turn_id, parent, turn))
    return out
