"""What a record says of a session at a glance, and the order sessions are listed in.

One definition for every list of sessions: the control API's `GET /v1/sessions` and the record browser's sessions
table both show these figures in this order, so the two never disagree on a count or a place.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tito_addon.records.record_reader import SessionFile


def session_summary(recorded: SessionFile) -> dict[str, Any] | None:
    """What a record says of a session: turns, tokens, branches, the last turn's time, whether it is closed, how many
    turns were resumed across a weight update."""
    lines = [*recorded.turns, *recorded.closes, *recorded.annotations, *recorded.withdrawn]
    if not lines:
        return None
    last_turn = max((turn.ts for turn in recorded.turns), default=0.0)
    close = recorded.closes[-1] if recorded.closes and recorded.closes[-1].ts >= last_turn else None
    parents = {turn.parent_turn_id for turn in recorded.turns}
    return {
        "session_id": lines[0].session_id,
        "turns": len(recorded.turns),
        "tokens": sum(len(t.prompt_added_ids) + len(t.completion_ids) for t in recorded.turns),
        "branches": sum(1 for turn in recorded.turns if turn.turn_id not in parents),
        "last_turn_at": last_turn or None,
        "closed": close.reason if close is not None else None,
        "annotation_count": len(recorded.annotations),
        # Turns whose generation a weight update cut and the proxy resumed, and the engine requests all turns took.
        "resumed_turns": sum(1 for turn in recorded.turns if turn.resumed),
        "attempts": sum(turn.resumed.attempts if turn.resumed else 1 for turn in recorded.turns),
    }


def listing_order(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Most recently active first; sessions of equal activity keep the order they came in (their file names')."""
    return sorted(rows, key=lambda row: row.get("last_activity") or 0.0, reverse=True)
