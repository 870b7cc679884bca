"""Recorded turns as the shared store's nodes, to put a session back into Redis from its record files."""

from __future__ import annotations

from array import array

from tito_addon.canonical_chat import ChatMessage
from tito_addon.records.record_models import TurnRecord
from tito_addon.sessions.message_keys import message_key
from tito_addon.sessions.redis_tree import StoredNode, reasoning_digest


def stored_nodes(session_id: str, turns: list[TurnRecord]) -> list[StoredNode]:
    """Nodes of recorded turns (parents first, as `read_session` orders them), keyed exactly as live commits are."""
    chains: dict[int, tuple[int, ...]] = {}
    ends: dict[int, int] = {}
    out = []
    for turn in turns:
        assistant = ChatMessage.model_validate({**turn.assistant_message, "role": "assistant"})
        if turn.appended_messages is not None:
            keys = [message_key(ChatMessage.model_validate(m)) for m in turn.appended_messages]
        else:
            keys = [bytes.fromhex(k) for k in turn.appended_keys or ()]
        keys.append(message_key(assistant))
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
