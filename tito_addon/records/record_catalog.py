"""A record dir at a glance: its sessions, its episodes as a rollout table, each episode's shape, and what was skipped.

What the record browser (`python -m tito_addon view`) lists. Each session is read once and kept without its ids and
message texts (a turn's tokens are read again, on demand, from its session's file), so a dir of many thousand turns
lists from memory; a session is read again only when one of its files changed (size, mtime), the way the control
API's list reads them (`FileRecords.each_session`).

The figures are the export's: episodes, segments, rewards, labels and groups as `records/rollout_groups` makes them,
sessions as `records/session_summaries` says them (the control API's list, in the same order).

Only the dir's own regular `.jsonl` files are read: a link, a folder or any other file is named under `skipped`, never
followed, and so is a session whose record cannot be read (a turn id written twice) and every torn line.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tito_addon.records.episode_segments import Segment
from tito_addon.records.image_store import STORE_DIR
from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import RecordError, SessionFile, merge_parts, session_parts
from tito_addon.records.rollout_groups import EpisodeView, auto_group_of, episode_views, prompt_ids_of
from tito_addon.records.session_reads import SessionReads
from tito_addon.records.session_summaries import listing_order, session_summary
from tito_addon.records.trajectory_recorder import SUFFIX

logger = logging.getLogger(__name__)

# What a kept turn sheds: its ids and texts are read again when a turn's tokens are asked for.
SHED: dict[str, Any] = {
    "prompt_added_ids": [],
    "completion_ids": [],
    "completion_logprobs": [],
    "appended_items": None,
    "tools": None,
}


@dataclass
class SessionDigest:
    """One session as the catalog keeps it."""

    name: str  # its base file name
    session: SessionFile  # turns without their ids (see SHED)
    summary: dict[str, Any]
    lengths: dict[int, tuple[int, int]]  # turn id -> (prompt ids it added, completion ids)
    auto_groups: dict[int, str]  # root turn id -> its episode's automatic group, were it the episode's first
    messages: dict[int, int]  # turn id -> messages it appended


@dataclass
class Skipped:
    """What the catalog did not read, and why."""

    foreign: list[str] = field(default_factory=list)  # names in the dir that are not session files
    unreadable: list[dict[str, str]] = field(default_factory=list)  # {file, error}
    torn_lines: list[dict[str, Any]] = field(default_factory=list)  # {file, lines}

    def as_json(self) -> dict[str, Any]:
        return {"foreign": self.foreign, "unreadable": self.unreadable, "torn_lines": self.torn_lines}


def digest_of(name: str, session_file: SessionFile) -> SessionDigest | None:
    summary = session_summary(session_file)
    if summary is None:
        return None
    turns = {turn.turn_id: turn for turn in session_file.turns}
    auto_groups = {
        turn.turn_id: auto_group_of(turn, prompt_ids_of(turns, turn))
        for turn in session_file.turns
        if turn.parent_turn_id is None
    }
    lengths = {t.turn_id: (len(t.prompt_added_ids), len(t.completion_ids)) for t in session_file.turns}
    messages = {t.turn_id: len(t.appended_messages or t.appended_keys or ()) for t in session_file.turns}
    kept = SessionFile(
        path=session_file.path,
        turns=[turn.model_copy(update=SHED) for turn in session_file.turns],
        closes=session_file.closes,
        skipped=session_file.skipped,
        paths=session_file.paths,
        withdrawn=session_file.withdrawn,
        annotations=session_file.annotations,
    )
    return SessionDigest(name, kept, summary, lengths, auto_groups, messages)


@dataclass
class Catalog:
    sessions: list[SessionDigest]
    episodes: list[dict[str, Any]]
    views: dict[str, EpisodeView]
    skipped: Skipped

    def session(self, session_id: str) -> SessionDigest | None:
        return next((d for d in self.sessions if d.summary["session_id"] == session_id), None)

    def session_rows(self) -> list[dict[str, Any]]:
        """The sessions as the control API lists recorded ones (`GET /v1/sessions`): same figures, same order."""
        rows = [{**d.summary, "live": False, "last_activity": d.summary["last_turn_at"]} for d in self.sessions]
        return listing_order(rows)


@dataclass(frozen=True)
class SessionRead:
    """What reading one session's parts gave: its digest (None: nothing to list, or unreadable), its torn lines, and
    why it could not be read."""

    digest: SessionDigest | None
    torn: list[dict[str, Any]]
    error: str | None = None


def read_session_parts(name: str, paths: list[Path]) -> SessionRead:
    try:
        merged = merge_parts(paths)
    except (OSError, RecordError) as exc:
        logger.warning("tito view: cannot read the record %s: %s", name, exc)
        return SessionRead(None, [], str(exc))
    return SessionRead(digest_of(name, merged), torn_lines(merged))


class RecordCatalog:
    """The catalog of one record dir, kept up to date as its files change."""

    def __init__(self, record_dir: Path) -> None:
        self.record_dir = record_dir
        self._reads = SessionReads(read_session_parts)
        self._catalog: Catalog | None = None
        self._stamps: tuple[Any, ...] | None = None

    def catalog(self) -> Catalog:
        # The cyclic collector would walk the growing heap again and again while a large dir is read (~40% of a
        # 10,000-turn dir's first list, BENCHMARKS): reading makes no cycles worth collecting meanwhile.
        paused = gc.isenabled()
        gc.disable()
        try:
            return self._catalog_now()
        finally:
            if paused:
                gc.enable()

    def _catalog_now(self) -> Catalog:
        if not self.record_dir.is_dir():
            raise RecordError(f"{self.record_dir} is not a directory")
        skipped = Skipped()
        found: dict[str, list[Path]] = {}
        for name, paths in session_parts(self.record_dir).items():
            plain = [p for p in paths if p.is_file() and not p.is_symlink()]
            skipped.foreign += [f"{p.name} (not a regular file: not read)" for p in paths if p not in plain]
            if plain:
                found[name] = plain
        for entry in sorted(self.record_dir.iterdir()):
            # Not a session file; a dot file (the proxy's signing key) and the image store are the dir's own business.
            if entry.name == STORE_DIR and entry.is_dir() and not entry.is_symlink():
                continue
            if not entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                skipped.foreign.append(entry.name + ("/" if entry.is_dir() else ""))
        reads, stamps = self._reads.refresh(found)
        if self._catalog is None or stamps != self._stamps:
            self._catalog = build_catalog([read.digest for read in reads.values() if read.digest is not None])
            self._stamps = stamps
        skipped.unreadable = [{"file": name, "error": read.error} for name, read in reads.items() if read.error]
        skipped.torn_lines = [torn for read in reads.values() for torn in read.torn]
        self._catalog.skipped = skipped
        return self._catalog


def torn_lines(session_file: SessionFile) -> list[dict[str, Any]]:
    by_part: dict[str, int] = {}
    for part, _ in session_file.skipped:
        by_part[part.name] = by_part.get(part.name, 0) + 1
    return [{"file": part, "lines": count} for part, count in by_part.items()]


def build_catalog(digests: list[SessionDigest]) -> Catalog:
    by_session = {id(d.session): d for d in digests}

    def auto_group(first: Segment) -> str:
        digest = by_session[id(first.session)]
        head = first.path[0]
        if head.turn_id in digest.auto_groups:
            return digest.auto_groups[head.turn_id]
        return "auto-unknown"  # an episode that begins mid-tree: its first prompt was not kept

    files = [d.session for d in digests if d.session.turns]
    views = episode_views(files, auto_group)
    episodes = [episode_row(view, by_session) for view in views]
    return Catalog(digests, episodes, {view.episode: view for view in views}, Skipped())


def episode_row(view: EpisodeView, by_session: dict[int, SessionDigest]) -> dict[str, Any]:
    """One line of the rollout table."""
    turns: list[TurnRecord] = []
    seen: set[tuple[int, int]] = set()
    sampled = 0
    calls: dict[str, int] = {}
    length = 0
    for segment in view.segments:
        digest = by_session[id(segment.session)]
        calls[segment.call] = calls.get(segment.call, 0) + 1
        leaf = segment.leaf
        length = max(length, leaf.prompt_len + digest.lengths[leaf.turn_id][1])
        for turn in segment.path:
            if (id(segment.session), turn.turn_id) not in seen:
                seen.add((id(segment.session), turn.turn_id))
                turns.append(turn)
                sampled += digest.lengths[turn.turn_id][1]
    closed = [by_session[id(s.session)].summary["closed"] for s in view.segments]
    return {
        "episode": view.episode,
        "sessions": view.sessions,
        "group": view.group,
        "reward": view.notes.reward,
        "labels": view.notes.labels,
        "metadata_keys": sorted(view.notes.metadata or {}),
        "segments": len(view.segments),
        "calls": calls,
        "turns": len(turns),
        "sampled_tokens": sampled,
        "length": length,
        "weight_versions": sorted({t.weight_version for t in turns if t.weight_version is not None}),
        "families": sorted({t.tokenizer.family for t in turns}),
        "models": sorted({t.model for t in turns if t.model is not None}),
        "apis": sorted({t.api for t in turns}),
        "closed": all(reason is not None for reason in closed),
        "first_at": min(t.ts for t in turns),
        "last_at": max(t.ts for t in turns),
    }


# -- the rollout table's filters and order -------------------------------------------------------------------------

SORTABLE = ("episode", "group", "reward", "segments", "turns", "sampled_tokens", "length", "first_at", "last_at")


@dataclass(frozen=True)
class EpisodeFilter:
    """What the rollout table shows: every field optional; all given must hold."""

    reward_min: float | None = None
    reward_max: float | None = None
    group: str | None = None
    label: str | None = None
    length_min: int | None = None
    length_max: int | None = None
    call: str | None = None
    weight_version: str | None = None
    family: str | None = None
    text: str | None = None  # part of the episode's or a session's name
    sort: str = "first_at"
    descending: bool = False

    def keeps(self, row: dict[str, Any]) -> bool:
        reward = row["reward"]
        if self.reward_min is not None and (reward is None or reward < self.reward_min):
            return False
        if self.reward_max is not None and (reward is None or reward > self.reward_max):
            return False
        if self.length_min is not None and row["length"] < self.length_min:
            return False
        if self.length_max is not None and row["length"] > self.length_max:
            return False
        checks = (
            (self.group, lambda v: row["group"] == v),
            (self.label, lambda v: v in row["labels"]),
            (self.call, lambda v: v in row["calls"]),
            (self.weight_version, lambda v: v in row["weight_versions"]),
            (self.family, lambda v: v in row["families"]),
            (self.text, lambda v: v in row["episode"] or any(v in s for s in row["sessions"])),
        )
        return all(value is None or test(value) for value, test in checks)

    def apply(self, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        kept = [row for row in rows if self.keeps(row)]
        # Unscored episodes sort after scored ones whichever the direction: a missing reward is not a low one.
        present = [row for row in kept if row[self.sort] is not None]
        absent = [row for row in kept if row[self.sort] is None]
        present.sort(key=lambda row: (row[self.sort], row["episode"]), reverse=self.descending)
        return present + absent


def facets(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The values each filter can take in this dir: the page offers them as choices."""
    return {
        "groups": sorted({row["group"] for row in rows}),
        "labels": sorted({label for row in rows for label in row["labels"]}),
        "calls": sorted({call for row in rows for call in row["calls"]}),
        "weight_versions": sorted({v for row in rows for v in row["weight_versions"]}),
        "families": sorted({f for row in rows for f in row["families"]}),
    }
