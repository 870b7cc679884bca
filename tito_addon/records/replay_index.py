"""Offline replay: answer a chat request with the recorded assistant turn whose prompt messages it repeats.

Recorded sessions are loaded into the same session tree as live capture (so the same tolerance for echo
differences: reasoning dropped or renamed, null vs "", argument spelling). A request matches the recorded turn
whose history equals its messages exactly; among identical siblings (retries, GRPO samples) the oldest answers,
so a replay is deterministic. A miss names the closest recorded turn and the first message that differs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tito_addon.canonical_chat import ChatMessage
from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import iter_session_files
from tito_addon.records.stored_turns import recorded_turns
from tito_addon.sessions.message_keys import message_key
from tito_addon.sessions.session_tree import ChildIndex, MemoryTree


@dataclass(frozen=True)
class ReplayMiss:
    closest: TurnRecord | None
    matched_messages: int
    first_difference: dict[str, Any] | None

    def error(self) -> dict[str, Any]:
        closest = None
        if self.closest is not None:
            closest = {"session_id": self.closest.session_id, "turn_id": self.closest.turn_id}
        return {
            "error": {
                "message": "no recorded turn matches this request",
                "type": "replay_miss",
                "code": 404,
                "closest_turn": closest,
                "matched_messages": self.matched_messages,
                "first_differing_message": self.first_difference,
            }
        }


class ReplayIndex:
    def __init__(self) -> None:
        self.store = MemoryTree()
        self.records: dict[int, TurnRecord] = {}  # id(node) -> record
        self.turns = 0
        self.sessions = 0

    @classmethod
    def load(cls, record_dir: Path) -> ReplayIndex:
        index = cls()
        for session_file in iter_session_files(record_dir):
            session = index.store.new_session(None)
            nodes = index.store.put_back(session, recorded_turns(session_file.turns))
            by_id = {record.turn_id: record for record in session_file.turns}
            for turn_id, node in nodes.items():
                index.records[id(node)] = by_id[turn_id]
            index.turns += len(nodes)
            index.sessions += 1
        return index

    def answer(self, messages: list[ChatMessage]) -> TurnRecord | ReplayMiss:
        keys = [message_key(m) for m in messages]
        reasonings = [m.reasoning_text() if m.role == "assistant" else None for m in messages]
        attachment = self.store.locate(None, keys, reasonings)
        parent = attachment.parent
        start = parent.message_end if parent else 0
        siblings: ChildIndex | None
        if parent is not None:
            siblings = parent.children
        else:
            group = self.store.prompt_group("", keys)
            siblings = group.roots if group is not None else None
        wanted = tuple(keys[start:])
        candidates = []
        for table in siblings.by_length.values() if siblings else []:
            for segment, nodes in table.items():
                if segment[:-1] == wanted:
                    candidates += [n for n in nodes if n.reasoning_compatible(reasonings + [None], start)]
        if candidates:
            best = min(candidates, key=lambda node: node.turn_id)
            return self.records[id(best)]
        closest = self.records.get(id(parent)) if parent is not None else None
        difference = None
        if start < len(messages):
            difference = {"index": start, "message": messages[start].model_dump(mode="json", exclude_none=True)}
        return ReplayMiss(closest, start, difference)


def replay_completion(record: TurnRecord) -> dict[str, Any]:
    """The recorded turn as the chat completion the agent received."""
    message = dict(record.assistant_message)
    if message.get("reasoning") and message.get("reasoning_content") == message["reasoning"]:
        del message["reasoning_content"]  # the record mirrors vLLM's key; the wire had only one
    return {
        "id": f"replay-{record.session_id}-{record.turn_id}",
        "object": "chat.completion",
        "created": int(record.ts or time.time()),
        "model": record.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": record.finish_reason}],
        "usage": {
            "prompt_tokens": record.prompt_len,
            "completion_tokens": len(record.completion_ids),
            "total_tokens": record.prompt_len + len(record.completion_ids),
        },
    }
