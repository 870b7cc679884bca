"""What a driver's annotations say about one branch of a session: its reward, labels and metadata.

Annotations target the session (`turn_id` null) or one turn. A branch (root-to-leaf path) takes:
- reward: the latest reward on the deepest turn of the branch that has one (a GRPO group's samples are sibling
  branches of one automatic session, each scored on its own leaf); else the session's latest reward; else null;
- labels: the session's, then each turn's from root to leaf, in the order written, without repeats;
- metadata: the session's, then each turn's from root to leaf, merged key by key (later wins).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tito_addon.records.record_models import AnnotationRecord


@dataclass
class BranchNotes:
    reward: float | None = None
    labels: list[str] = field(default_factory=list)
    metadata: dict[str, Any] | None = None


def branch_notes(annotations: list[AnnotationRecord], turn_ids: Iterable[int]) -> BranchNotes:
    """The annotations that apply to a branch whose turns (root first) are `turn_ids`."""
    notes = BranchNotes()
    if not annotations:
        return notes
    by_target: dict[int | None, list[AnnotationRecord]] = {}
    for note in annotations:  # already in the order written
        by_target.setdefault(note.turn_id, []).append(note)
    targets: list[int | None] = [None, *turn_ids]
    for target in targets:
        for note in by_target.get(target, ()):
            if note.reward is not None:
                notes.reward = note.reward  # deeper targets come later, so the most specific wins
            for label in note.labels or ():
                if label not in notes.labels:
                    notes.labels.append(label)
            if note.metadata is not None:
                notes.metadata = {**(notes.metadata or {}), **note.metadata}
    return notes
