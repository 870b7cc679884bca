"""Recorded turns as the nodes of their session's tree: how a session comes back from its records, into this
process's tree or into a shared store (resume after a restart), or into replay's index."""

from __future__ import annotations

from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import recorded_segment
from tito_addon.sessions.session_space import RecordedNode


def recorded_nodes(turns: list[TurnRecord]) -> list[RecordedNode]:
    """Nodes of recorded turns (parents first, as `read_session` orders them), keyed exactly as live commits are."""
    ends: dict[int, int] = {}
    out = []
    for turn in turns:
        keys, assistant = recorded_segment(turn)
        parent = turn.parent_turn_id
        ends[turn.turn_id] = (ends[parent] if parent is not None else 0) + len(keys)
        out.append(
            RecordedNode(
                message_end=ends[turn.turn_id],
                segment_keys=tuple(keys),
                reasoning=assistant.reasoning_text(),
                added_ids=turn.prompt_added_ids,
                completion_ids=turn.completion_ids,
                finish_reason=turn.finish_reason,
                tools_sha256=turn.tools_sha256,
                template_kwargs=turn.chat_template_kwargs or None,
                reply_id=turn.reply_id,
                episode=turn.episode_id,
                call=turn.call,
                turn_id=turn.turn_id,
                parent_turn_id=parent,
            )
        )
    return out
