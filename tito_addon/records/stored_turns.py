"""Recorded turns as the shared store's nodes, to put a session back into Redis from its record files."""

from __future__ import annotations

from array import array

from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import recorded_segment
from tito_addon.sessions.redis_tree import StoredNode, reasoning_digest


def stored_nodes(session_id: str, turns: list[TurnRecord]) -> list[StoredNode]:
    """Nodes of recorded turns (parents first, as `read_session` orders them), keyed exactly as live commits are."""
    chains: dict[int, tuple[int, ...]] = {}
    ends: dict[int, int] = {}
    out = []
    for turn in turns:
        keys, assistant = recorded_segment(turn)
        parent = turn.parent_turn_id
        chain = (*chains[parent], parent) if parent is not None else ()
        chains[turn.turn_id] = chain
        ends[turn.turn_id] = (ends[parent] if parent is not None else 0) + len(keys)
        out.append(
            StoredNode(
                session_id=session_id,
                turn_id=turn.turn_id,
                parent_turn_id=parent,
                message_end=ends[turn.turn_id],
                segment_keys=tuple(keys),
                reasoning=reasoning_digest(assistant.reasoning_text()) or None,
                added_ids=array("I", turn.prompt_added_ids),
                completion_ids=array("I", turn.completion_ids),
                finish_reason=turn.finish_reason,
                tools_sha256=turn.tools_sha256,
                template_kwargs=turn.chat_template_kwargs or None,
                reply_id=turn.reply_id,
                chain=chain,
            )
        )
    return out
