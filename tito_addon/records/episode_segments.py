"""Recorded turns as the segments of their episodes: what a trainer takes as the rows of one rollout.

A segment is a run of turns of one kind of call (`main`, `compaction`, `subagent`, `side`) in which each prompt
extends the last: it starts at a root of a session's tree, or where a turn's call differs from its parent's (a
compaction request extends the main history, but what it samples is a summary, not the main thread's next step), and
each of its branches is a segment of its own. An episode's segments may lie in several sessions (an automatic
session starts at each root the proxy linked by content), and are numbered in the order their first turns were
committed.

Annotations reach every segment of their episode: a reward, labels or metadata on the session or on any of the
episode's turns, unless the annotation is scoped to its segment (`scope: "segment"`: it reaches the segments whose
own turns hold it). Of the rewards that reach a segment, the latest written wins, and one scoped to the segment wins
over the episode's; labels are gathered in the order written, metadata merged key by key (later wins). A group is
always the episode's (the latest written wins; see `records/rollout_groups`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tito_addon.records.record_models import CALLS, AnnotationRecord, TurnRecord
from tito_addon.records.record_reader import SessionFile


@dataclass
class SegmentNotes:
    reward: float | None = None
    labels: list[str] = field(default_factory=list)
    metadata: dict[str, Any] | None = None
    group: str | None = None


@dataclass
class Segment:
    """One segment: its turns (first to last), the session file they are in, its episode and its order there."""

    session: SessionFile
    path: list[TurnRecord]
    episode: str = ""
    index: int = 0
    notes: SegmentNotes = field(default_factory=SegmentNotes)

    @property
    def call(self) -> str:
        return self.path[0].call

    @property
    def leaf(self) -> TurnRecord:
        return self.path[-1]


def session_segments(session_file: SessionFile) -> list[Segment]:
    """Every segment of one session's tree (each branch of a run its own), in the order their leaves were
    recorded."""
    turns = {t.turn_id: t for t in session_file.turns}
    continued: set[int] = set()  # turns whose run goes on in a child of the same call
    for turn in session_file.turns:
        parent = turns.get(turn.parent_turn_id) if turn.parent_turn_id is not None else None
        if parent is not None and parent.call == turn.call:
            continued.add(parent.turn_id)
    out = []
    for leaf in session_file.turns:
        if leaf.turn_id in continued:
            continue
        path = [leaf]
        while path[-1].parent_turn_id is not None:
            parent = turns[path[-1].parent_turn_id]
            if parent.call != path[-1].call:
                break
            path.append(parent)
        out.append(Segment(session_file, path[::-1]))
    return out


def episode_segments(files: Iterable[SessionFile], calls: Iterable[str] | None = None) -> list[Segment]:
    """The segments of every episode of `files`, episode by episode (in the order of the files they first appear
    in), each numbered within its episode in the order their first turns were recorded, and annotated; only those
    of `calls` (None: all) are returned, numbered as among all."""
    by_episode: dict[str, list[Segment]] = {}  # in the order of `files`, where each episode first appears
    for session_file in files:
        for segment in session_segments(session_file):
            segment.episode = segment.path[0].episode_id
            by_episode.setdefault(segment.episode, []).append(segment)
    wanted = set(CALLS if calls is None else calls)
    out: list[Segment] = []
    for segments in by_episode.values():
        segments.sort(key=_order)
        for index, segment in enumerate(segments):
            segment.index = index
            segment.notes = segment_notes(segment, segments)
        out += [segment for segment in segments if segment.call in wanted]
    return out


def _order(segment: Segment) -> tuple[float, str, int, int]:
    first = segment.path[0]
    return (first.ts, first.session_id, first.turn_id, segment.leaf.turn_id)


def segment_notes(segment: Segment, episode: list[Segment]) -> SegmentNotes:
    """What the annotations of the episode's sessions say of one of its segments (see the module's docstring)."""
    episode_turns = {(id(s.session), t.turn_id) for s in episode for t in s.path}
    own = {t.turn_id for t in segment.path}
    sessions = {id(s.session): s.session for s in episode}
    general: list[AnnotationRecord] = []  # the session's, and the episode's turns' unless scoped to their segment
    scoped: list[AnnotationRecord] = []  # scoped to this segment
    for key, session_file in sessions.items():
        for note in session_file.annotations:
            if note.turn_id is None:
                general.append(note)
            elif note.scope == "segment":
                if session_file is segment.session and note.turn_id in own:
                    scoped.append(note)
            elif (key, note.turn_id) in episode_turns:
                general.append(note)
    notes = SegmentNotes()
    for note in sorted(general, key=lambda n: n.ts) + sorted(scoped, key=lambda n: n.ts):
        if note.reward is not None:
            notes.reward = note.reward
        for label in note.labels or ():
            if label not in notes.labels:
                notes.labels.append(label)
        if note.metadata is not None:
            notes.metadata = {**(notes.metadata or {}), **note.metadata}
        if note.group is not None:
            notes.group = note.group
    return notes
