"""A turn's mixture-of-experts routes read back: its record chain's rows, stitched into those of its whole sequence.

Each turn keeps only the rows it asked for (`record_models.RoutedExperts`: from where its parent's chain ended), in
its session's side file; a turn's sequence routes are its ancestors' rows up to each child's start, then its own. Row
`p` is the route of position `p` of the turn's prompt + completion; a complete record holds every position but the
last (its last sampled token was never fed forward). Where a chain has a gap (a backend that answered no routes, a
side file gone), the rows stop there and the reasons are kept: nothing is invented.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tito_addon.records.record_models import RoutedExperts, TurnRecord
from tito_addon.records.record_reader import RecordError, SessionFile

_WIDEST = ("uint8", "uint16", "int32")
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@dataclass
class SequenceRoutes:
    """The routes of positions `[0, through)` of a turn's sequence (`array`: `(through, layers, topk)`), out of the
    `positions` a complete record holds; `missing` says why any are not there, and where."""

    array: np.ndarray
    positions: int
    missing: list[str] = field(default_factory=list)
    # The weight version each row was routed under, where known ("" where the backend reported none).
    versions: list[str] = field(default_factory=list)

    @property
    def through(self) -> int:
        return int(self.array.shape[0])

    @property
    def complete(self) -> bool:
        return self.through == self.positions

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.array.shape[1]), int(self.array.shape[2])


def chain_of(session: SessionFile, turn_id: int) -> list[TurnRecord]:
    """The turn and its ancestors, root first."""
    by_id = {turn.turn_id: turn for turn in session.turns}
    chain: list[TurnRecord] = []
    current = by_id.get(turn_id)
    if current is None:
        raise RecordError(f"{session.path}: no turn {turn_id}")
    while current is not None:
        chain.append(current)
        parent = current.parent_turn_id
        current = by_id.get(parent) if parent is not None else None
        if parent is not None and current is None:
            raise RecordError(f"{session.path}: turn {chain[-1].turn_id}'s parent {parent} is not recorded")
    return chain[::-1]


def kept_rows(record_dir: Path, turn_id: int, ref: RoutedExperts) -> np.ndarray:
    """A turn's own rows from its session's side file (RecordError when they are not all there)."""
    if not ref.rows:
        return np.zeros((0, ref.layers or 0, ref.topk or 0), dtype=ref.dtype or "uint8")
    if ref.file is None or ref.offset is None or ref.dtype is None or ref.layers is None or ref.topk is None:
        raise RecordError(f"turn {turn_id} names routes but not where they are kept")
    try:
        fd = os.open(record_dir / ref.file, _READ_FLAGS)
    except OSError as exc:
        raise RecordError(f"turn {turn_id}: its routes file {ref.file} cannot be read: {exc.strerror}") from None
    try:
        data = os.pread(fd, ref.nbytes, ref.offset)
    finally:
        os.close(fd)
    if len(data) != ref.nbytes:
        raise RecordError(f"turn {turn_id}: its routes file {ref.file} ends before its rows do")
    return np.frombuffer(data, dtype=ref.dtype).reshape(ref.rows, ref.layers, ref.topk)


def _joined(head: np.ndarray | None, rows: np.ndarray) -> np.ndarray:
    if head is None or not head.shape[0]:
        return rows
    dtype = max(head.dtype.name, rows.dtype.name, key=_WIDEST.index)
    return np.concatenate([head.astype(dtype, copy=False), rows.astype(dtype, copy=False)])


def sequence_routes(session: SessionFile, turn_id: int, record_dir: Path | None = None) -> SequenceRoutes | None:
    """The routes of a turn's whole sequence from its record chain; None when the turn recorded none (routes were not
    asked for). `record_dir`: where the side files are (default: the session file's directory)."""
    chain = chain_of(session, turn_id)
    leaf = chain[-1]
    if leaf.routed_experts is None:
        return None
    folder = record_dir if record_dir is not None else session.path.parent
    positions = max(leaf.prompt_len + len(leaf.completion_ids) - 1, 0)
    array: np.ndarray | None = None
    versions: list[str] = []
    missing: list[str] = []
    shape: tuple[int, int] | None = None
    for turn in chain:
        ref = turn.routed_experts
        if ref is None:
            continue
        have = 0 if array is None else int(array.shape[0])
        if ref.start > have:
            missing.append(f"positions {have} to {ref.start} (turn {turn.turn_id} asked from {ref.start})")
            break
        try:
            rows = kept_rows(folder, turn.turn_id, ref)
        except RecordError as exc:
            missing.append(str(exc))
            break
        if rows.shape[0]:
            if shape is not None and rows.shape[1:] != shape:
                raise RecordError(f"turn {turn.turn_id}'s routes are {rows.shape[1:]}, its parents' {shape}")
            shape = rows.shape[1:]
            array = _joined(None if array is None else array[: ref.start], rows)
        elif array is not None:
            array = array[: ref.start]
        versions = versions[: ref.start] + block_versions(turn, ref.start, ref.start + int(rows.shape[0]))
        if ref.missing:  # (a later turn that asks from here on covers it again)
            missing.append(f"turn {turn.turn_id}: {ref.missing}")
    if array is None:
        array = np.zeros((0, *(shape or (0, 0))), dtype="uint8")
    found = SequenceRoutes(array, positions, missing, versions)
    if found.complete:
        found.missing = []
    return found


def block_versions(turn: TurnRecord, start: int, end: int) -> list[str]:
    """The weight version each of a turn's own rows (positions `[start, end)`) was routed under: a prompt position's
    route is computed as the turn's generation begins, under the weights of its first sampled token; completion token
    j's as token j + 1 is sampled, under that token's ("" where the backend reported none)."""
    sampled = [v or "" for v in turn.token_weight_versions()]
    first = sampled[0] if sampled else ""
    prompt = turn.prompt_len
    if not sampled:
        return [""] * (end - start)
    return [first if p < prompt else sampled[min(p - prompt + 1, len(sampled) - 1)] for p in range(start, end)]


def routes_summary(session: SessionFile, turn_id: int) -> dict[str, Any] | None:
    """What a report says of a turn's sequence routes (re-drive, the drift audit): how many positions they cover of
    how many, the weight versions they were routed under (in order; a trainer replaying them under other weights
    replays another model's routing), and what is missing. None when the turn recorded none."""
    try:
        routes = sequence_routes(session, turn_id)
    except RecordError as exc:
        return {"through": 0, "positions": None, "complete": False, "weight_versions": [], "missing": [str(exc)]}
    if routes is None:
        return None
    return {
        "through": routes.through,
        "positions": routes.positions,
        "complete": routes.complete,
        "weight_versions": [v for v in dict.fromkeys(routes.versions) if v],
        "missing": routes.missing,
    }
