"""`show`'s text: a recorded session as a person reads it.

Per episode: what its annotations say of it (reward, labels, metadata keys, the group its rows get, latest written
wins, as export applies them), whether it is closed, and its segments (each one row of the export). Per turn: its
ids' lengths, then what the model did — reasoning (its length, and its text shortened), its text, each tool call with
its arguments — and under each call the tool result that answered it (a tool message the next turn appended), and
what else the turn appended (user or system messages). Every line is cut to a width unless `full`.

Linear in the session: ids are never rebuilt per turn (a 1000-turn agent session's prompts, each a list of up to its
whole context, are ~10^8 ids held at once); the chain is checked by lengths alone, so a record that cannot rebuild
fails here as `export` would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from tito_addon.records.record_models import AnnotationRecord, RecordedImage, TurnRecord
from tito_addon.records.record_reader import RecordError, SessionFile
from tito_addon.records.rollout_groups import EpisodeView, episode_views

MAX_SEGMENT_LINES = 20  # per episode, unless full: a wide tree's segments would bury its turns


def check_chain(session_file: SessionFile) -> None:
    """What `full_ids` proves of a record, by lengths alone: every parent recorded, every prompt the length its
    parent's ids and its own added ids make."""
    ends: dict[int, int] = {}
    where = session_file.path if len(session_file.paths) == 1 else f"{session_file.path} (and more parts)"
    for turn in session_file.turns:
        start = 0
        if turn.parent_turn_id is not None:
            if turn.parent_turn_id not in ends:
                raise RecordError(
                    f"{where}: turn {turn.turn_id} extends turn {turn.parent_turn_id}, which is not recorded"
                )
            start = ends[turn.parent_turn_id]
        if start + len(turn.prompt_added_ids) != turn.prompt_len:
            raise RecordError(f"{where}: turn {turn.turn_id} rebuilds to {start + len(turn.prompt_added_ids)} prompt "
                              f"ids, recorded {turn.prompt_len}")  # fmt: skip
        ends[turn.turn_id] = turn.prompt_len + len(turn.completion_ids)


def text_of(content: Any) -> str:
    """A message's text: a string, or its text parts (other parts by their type)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image":
                parts.append(f"[image {str(part.get('sha256'))[:12]} {part.get('width')}×{part.get('height')}]")
            elif isinstance(part, dict):
                text = part.get("text")
                parts.append(text if isinstance(text, str) else f"[{part.get('type', 'part')}]")
            else:
                parts.append(str(part))
        return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False)


def part_text(part: Any) -> str:
    """One content part's text (a part is a dict; a whole string or list content is read as `text_of` reads it)."""
    return text_of([part] if isinstance(part, dict) else part)


class Lines:
    """Lines cut to a width (newlines shown as ↵), or whole with their newlines kept under `full`."""

    def __init__(self, width: int, full: bool) -> None:
        self.width = max(width, 40)
        self.full = full
        self.out: list[str] = []

    def add(self, indent: int, text: str) -> None:
        pad = " " * indent
        if self.full:
            self.out.append(pad + text.replace("\n", "\n" + pad + "  "))
            return
        room = self.width - indent
        text = text.strip()
        flat = text[: room * 2].replace("\r", "").replace("\n", "↵")  # never flatten a megabyte to show 100 chars
        self.out.append(pad + (flat if len(flat) <= room and len(text) <= room * 2 else flat[: room - 1] + "…"))


def arguments_of(call: dict[str, Any]) -> tuple[str, str]:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return str(function.get("name")), arguments


def tool_results(session_file: SessionFile) -> dict[str, list[str]]:
    """tool_call_id -> the text of each tool message that answered it (a later turn's appended messages; a tree's
    branches may each answer the same call)."""
    results: dict[str, list[str]] = {}
    for turn in session_file.turns:
        for message in turn.appended_messages or ():
            call_id = message.get("tool_call_id")
            if message.get("role") == "tool" and isinstance(call_id, str):
                results.setdefault(call_id, []).append(text_of(message.get("content")))
    return results


def note_text(note: AnnotationRecord) -> str:
    said = []
    if note.reward is not None:
        said.append(f"reward {note.reward:g}")
    if note.group is not None:
        said.append(f"group {note.group}")
    if note.labels:
        said.append("labels " + ", ".join(note.labels))
    if note.metadata is not None:
        said.append("metadata " + json.dumps(note.metadata, ensure_ascii=False))
    if note.scope == "segment":
        said.append("(this segment only)")
    return ", ".join(said)


def turn_spans(turn_ids: list[int]) -> str:
    """`0-3, 7`: consecutive ids as ranges."""
    spans: list[list[int]] = []
    for turn_id in turn_ids:
        if spans and turn_id == spans[-1][1] + 1:
            spans[-1][1] = turn_id
        else:
            spans.append([turn_id, turn_id])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def episode_lines(lines: Lines, view: EpisodeView, session_file: SessionFile) -> None:
    notes = view.notes
    said = [f"reward {notes.reward:g}" if notes.reward is not None else "no reward", f"group {view.group}"]
    said.append("labels " + ", ".join(notes.labels) if notes.labels else "no labels")
    if notes.metadata:
        said.append("metadata keys " + ", ".join(notes.metadata))
    last = max(turn.ts for segment in view.segments for turn in segment.path)
    closes = [close for close in session_file.closes if close.ts >= last]
    said.append(f"closed ({closes[-1].reason})" if closes else "open")
    rows = len(view.segments)
    lines.add(2, f"episode {view.episode}: {', '.join(said)}; {rows} segment{'s' * (rows != 1)} = {rows} "
                 f"row{'s' * (rows != 1)}")  # fmt: skip
    shown = view.segments if lines.full else view.segments[:MAX_SEGMENT_LINES]
    for segment in shown:
        ids = [turn.turn_id for turn in segment.path]
        scoped = segment.notes.reward is not None and segment.notes.reward != notes.reward
        extra = f", reward {segment.notes.reward:g} (scoped to it)" if scoped else ""
        lines.add(4, f"segment {segment.index}: {segment.call}, turns {turn_spans(ids)}{extra}")
    if len(view.segments) > len(shown):
        lines.add(4, f"… and {len(view.segments) - len(shown)} more segments (--full shows them)")


def turn_lines(
    lines: Lines,
    turn: TurnRecord,
    results: dict[str, list[str]],
    calls_made: set[str],
    notes: list[AnnotationRecord],
) -> None:
    message = turn.assistant_message
    text = text_of(message.get("content"))
    calls = [arguments_of(call) for call in message.get("tool_calls") or []]
    parent = "" if turn.parent_turn_id is None else f" ← {turn.parent_turn_id}"
    head = f"turn {turn.turn_id}{parent} {turn.call}: prompt {turn.prompt_len} (+{len(turn.prompt_added_ids)}), "
    head += f"completion {len(turn.completion_ids)}, {turn.finish_reason or '-'}"
    if turn.resumed:
        head += f", resumed after {len(turn.resumed.cuts)} cut(s) at {turn.resumed.cuts}"
    # Names only here: the calls with their arguments follow, one a line (a bare `Bash()` read as a call without any).
    lines.add(2, head + ("  → " + ", ".join(name for name, _ in calls) if calls else ""))
    for appended in turn.appended_messages or ():
        role = appended.get("role")
        if role == "tool" and appended.get("tool_call_id") in calls_made:
            continue  # shown under the call it answered
        parts = appended.get("content")
        parts = parts if isinstance(parts, list) and len(parts) > 1 else [parts]
        content = "\n".join(part_text(part) for part in parts)
        head = f"+ {role}" + (f" [{len(content)} chars]" if len(content) > lines.width else "")
        if len(parts) == 1:
            lines.add(6, f"{head}: {content.strip()}")
            continue
        # A message of several parts (an agent's system prompt and its reminders): each part its own line, so the
        # user's own words are not buried at the end of a cut line.
        lines.add(6, f"{head}, {len(parts)} parts:")
        for part in parts:
            said = part_text(part).strip()
            lines.add(8, (f"[{len(said)} chars] " if len(said) > lines.width else "") + said)
    if turn.appended_messages is None:
        lines.add(6, f"+ {len(turn.appended_keys or ())} messages (recorded without their text)")
    reasoning = text_of(message.get("reasoning_content"))
    if reasoning:
        lines.add(6, f"[reasoning {len(reasoning)} chars] {reasoning.strip()}")
    if text:
        lines.add(6, f"says: {text.strip()}")
    for call, (name, arguments) in zip(message.get("tool_calls") or [], calls, strict=True):
        lines.add(6, f"→ {name}({arguments})")
        answers = results.get(call.get("id")) if isinstance(call.get("id"), str) else None
        for answer in answers or ["(no result recorded: no later turn answered it)"]:
            lines.add(8, f"← {answer}")
    for note in notes:
        lines.add(6, f"note: {note_text(note)}")


def session_text(session_file: SessionFile, width: int, full: bool) -> Iterator[str]:
    """`show`'s lines for one session."""
    check_chain(session_file)
    lines = Lines(width, full)
    closed = f", closed ({session_file.closes[-1].reason})" if session_file.closes else ""
    parts = len(session_file.paths)
    name = session_file.path.name if parts == 1 else f"{session_file.path.name} and {parts - 1} more parts"
    session_id = session_file.turns[0].session_id if session_file.turns else "(no turns)"
    yield f"session {session_id} ({name}): {len(session_file.turns)} turns{closed}"
    for view in episode_views([session_file]) if session_file.turns else ():
        episode_lines(lines, view, session_file)
    for note in session_file.annotations:
        if note.turn_id is None:
            lines.add(2, f"note: {note_text(note)}")
    yield from lines.out
    results = tool_results(session_file)
    calls_made = {c.get("id") for t in session_file.turns for c in t.assistant_message.get("tool_calls") or []}
    by_turn: dict[int, list[AnnotationRecord]] = {}
    for note in session_file.annotations:
        if note.turn_id is not None:
            by_turn.setdefault(note.turn_id, []).append(note)
    for turn in session_file.turns:
        lines.out = []
        turn_lines(lines, turn, results, calls_made, by_turn.get(turn.turn_id, []))
        yield from lines.out


def turn_json(
    turn: TurnRecord,
    ids: tuple[list[int], list[int]],
    notes: list[AnnotationRecord],
    images: list[RecordedImage] | None = None,
) -> str:
    """`show --json`'s line for one turn: its full prompt ids, the images they hold (each file in the image store and
    its run of pad ids), and the annotation lines written on it."""
    prompt, completion = ids
    row = {
        "session_id": turn.session_id,
        "turn_id": turn.turn_id,
        "parent_turn_id": turn.parent_turn_id,
        "api": turn.api,
        "reply_id": turn.reply_id,
        "episode": turn.episode_id,
        "call": turn.call,
        "follows": turn.follows.model_dump(exclude_none=True) if turn.follows else None,
        "prompt_ids": prompt,
        "completion_ids": completion,
        "completion_logprobs": turn.completion_logprobs,
        "finish_reason": turn.finish_reason,
        "weight_version": turn.weight_version,
        "weight_version_spans": turn.weight_version_spans,
        "resumed": turn.resumed.model_dump() if turn.resumed else None,
        # Where its MoE routes are kept and how far its chain's reach (`tito_routed_experts`; the rows themselves:
        # `records/recorded_routes.sequence_routes`, or an export).
        "routed_experts": turn.routed_experts.model_dump(exclude_none=True) if turn.routed_experts else None,
        "routed_experts_through": turn.routed_experts_through,
        "images": [image.model_dump() for image in images or ()],
        "annotations": [note.model_dump(by_alias=True, exclude_none=True) for note in notes],
    }
    return json.dumps(row, ensure_ascii=False)
