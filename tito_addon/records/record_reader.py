"""Reads session files back and reconstructs every turn's full prompt ids from the parent chain.

A torn line (a crash mid-write) is reported in `skipped_lines` and skipped, never merged with the next
line; a turn whose parent is missing makes the file unreadable as a trajectory (`RecordError`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from tito_addon.canonical_chat import ChatMessage
from tito_addon.records.record_models import CLOSE_SCHEMA, TURN_SCHEMA, SessionCloseRecord, TurnRecord
from tito_addon.sessions.message_keys import message_key
from tito_addon.sessions.session_tree import Session, SessionStore, TurnNode

logger = logging.getLogger(__name__)


class RecordError(ValueError):
    """A recording that cannot be read as a consistent trajectory."""


@dataclass
class SessionFile:
    path: Path
    turns: list[TurnRecord] = field(default_factory=list)
    closes: list[SessionCloseRecord] = field(default_factory=list)
    skipped_lines: list[int] = field(default_factory=list)

    def branches(self) -> Iterator[list[TurnRecord]]:
        """Every root-to-leaf path of the session's tree, in the order the leaves were recorded."""
        turns = {t.turn_id: t for t in self.turns}
        parents = {t.parent_turn_id for t in self.turns if t.parent_turn_id is not None}
        for leaf in self.turns:
            if leaf.turn_id in parents:
                continue
            path: list[TurnRecord] = []
            node: TurnRecord | None = leaf
            while node is not None:
                path.append(node)
                node = turns.get(node.parent_turn_id) if node.parent_turn_id is not None else None
            yield path[::-1]

    def full_ids(self) -> dict[int, tuple[list[int], list[int]]]:
        """turn_id -> (prompt ids, completion ids), rebuilt from each turn's added ids."""
        ends: dict[int, list[int]] = {}
        out: dict[int, tuple[list[int], list[int]]] = {}
        for turn in self.turns:  # file order is commit order, so a parent always precedes its children
            if turn.parent_turn_id is None:
                prompt = list(turn.prompt_added_ids)
            else:
                if turn.parent_turn_id not in ends:
                    raise RecordError(
                        f"{self.path}: turn {turn.turn_id} extends turn {turn.parent_turn_id}, which is not recorded"
                    )
                prompt = ends[turn.parent_turn_id] + turn.prompt_added_ids
            if len(prompt) != turn.prompt_len:
                raise RecordError(
                    f"{self.path}: turn {turn.turn_id} rebuilds to {len(prompt)} prompt ids, recorded {turn.prompt_len}"
                )
            ends[turn.turn_id] = prompt + turn.completion_ids
            out[turn.turn_id] = (prompt, list(turn.completion_ids))
        return out


def read_session_file(path: Path) -> SessionFile:
    result = SessionFile(path=path)
    with path.open("rb") as handle:
        lines = handle.read().split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            schema = obj.get("schema") if isinstance(obj, dict) else None
            if schema == TURN_SCHEMA:
                result.turns.append(TurnRecord.model_validate(obj))
            elif schema == CLOSE_SCHEMA:
                result.closes.append(SessionCloseRecord.model_validate(obj))
            else:
                raise ValueError(f"unknown schema {schema!r}")
        except (ValueError, ValidationError) as exc:
            # A line torn by a crash mid-write; a restarted proxy appends after it. Skipped, never merged.
            logger.warning("%s: skipping unreadable line %d: %s", path, number, str(exc)[:200])
            result.skipped_lines.append(number)
    seen: set[int] = set()
    for turn in result.turns:
        if turn.turn_id in seen:
            raise RecordError(f"{path}: turn id {turn.turn_id} appears twice")
        seen.add(turn.turn_id)
    return result


def iter_session_files(record_dir: Path) -> Iterator[SessionFile]:
    if not record_dir.is_dir():
        raise RecordError(f"{record_dir} is not a directory")
    for path in sorted(record_dir.glob("*.jsonl")):
        yield read_session_file(path)


def rebuild_session(store: SessionStore, session: Session, turns: list[TurnRecord]) -> dict[int, TurnNode]:
    """Put recorded turns back into a session tree (resume after a restart, offline replay)."""
    nodes: dict[int, TurnNode] = {}
    for turn in turns:
        parent = nodes[turn.parent_turn_id] if turn.parent_turn_id is not None else None
        assistant = ChatMessage.model_validate({**turn.assistant_message, "role": "assistant"})
        if turn.appended_messages is not None:
            appended = [ChatMessage.model_validate(m) for m in turn.appended_messages]
            keys = [message_key(m) for m in appended]
        else:
            keys = [bytes.fromhex(k) for k in turn.appended_keys or ()]
        keys.append(message_key(assistant))
        nodes[turn.turn_id] = store.commit(
            session,
            parent,
            (parent.message_end if parent else 0) + len(keys),
            tuple(keys),
            (None,) * (len(keys) - 1) + (assistant.reasoning_text(),),
            turn.prompt_added_ids,
            turn.completion_ids,
            turn.finish_reason,
            turn.tools_sha256,
            turn_id=turn.turn_id,
            template_kwargs=turn.chat_template_kwargs,
            reply_id=turn.reply_id,
        )
    return nodes
