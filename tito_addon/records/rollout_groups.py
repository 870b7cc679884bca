"""How an export's rows are grouped, numbered and sized for a trainer's advantage estimator.

GRPO-style estimators compare the samples of one prompt: verl groups rows by `uid`, slime by position (each group
contiguous and `n_samples_per_prompt` long). So every row carries its episode's **group**:
- the driver's, when it gave one (an annotation's `group`: the task the episode was a sample of);
- otherwise found from the episode's first request: `auto-` and a digest of its prompt ids, model, tokenizer and
  template. Id-less GRPO siblings send identical first requests, so they share a group; an edited history or another
  template is another prompt, so another group.

Rows are ordered group by group (in the order each group first appears), each group's episodes in their order,
each episode's segments in theirs; `group_index`, `rollout_id` (the episode: slime counts the rollout once in its
loss however many rows it split into) and `index` number groups, episodes and rows across the whole export.

With a group size N (`n_samples_per_prompt`, counted in rows, as the trainers count them) a group of another size
is refused (`refuse`, the default), left out (`drop`), or, if smaller, padded to N (`pad`) with copies of its own
rows that train nothing (mask all 0, slime's `remove_sample`) and carry the group's mean reward, so the group's mean
is unchanged (its spread shrinks: N - 1 in the denominator, not n - 1).

Branches that share early turns (a tree, several samples from one point) carry those turns' sampled tokens in
each of their rows, so a trainer trains them once per branch. The arrangement counts such turns; with
`dedupe_shared_turns` a shared turn stays in the mask of its first row only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tito_addon.records.episode_segments import Segment, SegmentNotes, episode_segments, segment_notes
from tito_addon.records.record_models import CALLS, TurnRecord
from tito_addon.records.record_reader import RecordError, SessionFile
from tito_addon.records.segment_branches import Branch

GROUP_POLICIES = ("refuse", "drop", "pad")
AUTO_PREFIX = "auto-"
MAX_NAMED = 20  # sessions an error names before it says how many more


class GroupSizeError(RecordError):
    """Groups that do not have the asked size, under the `refuse` policy (or too big or unscored to pad)."""


@dataclass(frozen=True)
class PlacedRow:
    branch: Branch
    group: str
    group_index: int
    rollout_id: int
    index: int
    padded: bool = False


@dataclass
class GroupReport:
    group: str
    episodes: int
    rows: int  # its episodes' rows, padding not counted
    group_index: int | None = None  # None: left out
    padded: int = 0

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Arrangement:
    rows: list[PlacedRow]
    groups: list[GroupReport]
    shared_turns: int = 0  # sampled turns that lie in more than one row's mask before any dedupe
    deduped: bool = False

    def summary(self) -> dict[str, Any]:
        kept = [g for g in self.groups if g.group_index is not None]
        return {
            "rows": len(self.rows),
            "episodes": len({row.rollout_id for row in self.rows}),
            "groups": [g.as_json() for g in self.groups],
            "dropped_groups": len(self.groups) - len(kept),
            "shared_turns": self.shared_turns,
            "deduped_shared_turns": self.deduped,
        }


@dataclass
class _Group:
    key: str
    episodes: dict[str, list[Branch]] = field(default_factory=dict)

    @property
    def rows(self) -> list[Branch]:
        return [branch for branches in self.episodes.values() for branch in branches]


def auto_group(first: Branch) -> str:
    """The group of an episode no driver named: a digest of its first request as the model saw it."""
    return auto_group_of(first.path[0], first.ids[: first.prompt_len])


def auto_group_of(turn: TurnRecord, prompt_ids: list[int]) -> str:
    """`auto_group` from the episode's first turn and that turn's whole prompt ids."""
    digest = hashlib.sha256()
    head = [turn.model, turn.tokenizer.tokenizer_sha256, turn.tokenizer.template_sha256]
    digest.update(json.dumps(head).encode())
    digest.update(b"\0" + ",".join(map(str, prompt_ids)).encode())
    return AUTO_PREFIX + digest.hexdigest()[:16]


def group_members(group: _Group, most: int = MAX_NAMED) -> str:
    """The sessions of a group's rows (and its episodes, where they are not the sessions' own names), at most `most`
    of each: a group-size error must say which runs to look at, and a group of a million rows must not flood it."""

    def bounded(names: list[str]) -> str:
        more = len(names) - most
        return ", ".join(names[:most]) + (f" and {more} more" if more > 0 else "")

    sessions = list(dict.fromkeys(branch.path[0].session_id for branch in group.rows))
    episodes = list(group.episodes)
    said = f"sessions: {bounded(sessions)}"
    return said if episodes == sessions else f"{said}; episodes: {bounded(episodes)}"


def arrange(
    branches: Iterable[Branch],
    *,
    calls: Iterable[str] | None = None,
    group_size: int | None = None,
    policy: str = "refuse",
    dedupe_shared_turns: bool = False,
) -> Arrangement:
    """The rows of `branches` (every segment of their episodes; those of `calls` are kept) grouped, sized and
    numbered for a trainer."""
    if policy not in GROUP_POLICIES:
        raise ValueError(f"unknown group policy {policy!r}; choose one of: {', '.join(GROUP_POLICIES)}")
    if group_size is not None and group_size < 1:
        raise ValueError("the group size must be at least 1")
    wanted = set(CALLS if calls is None else calls)
    by_episode: dict[str, list[Branch]] = {}
    for branch in branches:
        by_episode.setdefault(branch.episode, []).append(branch)
    groups: dict[str, _Group] = {}
    for episode, found in by_episode.items():
        first = min(found, key=lambda b: b.segment)
        key = first.notes.group if first.notes.group is not None else auto_group(first)
        kept = [branch for branch in found if branch.call in wanted]
        if kept:
            groups.setdefault(key, _Group(key)).episodes[episode] = kept
    reports: list[GroupReport] = []
    rows: list[PlacedRow] = []
    next_rollout = next_group = 0
    for group in groups.values():
        real = group.rows
        report = GroupReport(group.key, len(group.episodes), len(real))
        reports.append(report)
        padding = _padding(group, real, report, group_size, policy)
        if padding is None:
            continue
        report.group_index, next_group = next_group, next_group + 1
        rollout_ids: dict[str, int] = {}
        for branch in real:
            if branch.episode not in rollout_ids:
                rollout_ids[branch.episode], next_rollout = next_rollout, next_rollout + 1
            rollout_id = rollout_ids[branch.episode]
            rows.append(PlacedRow(branch, group.key, report.group_index, rollout_id, len(rows)))
        for copied in padding:
            rollout_id = rollout_ids[copied.episode]  # a padding row adds nothing to its rollout's mask
            rows.append(PlacedRow(copied, group.key, report.group_index, rollout_id, len(rows), padded=True))
    arrangement = Arrangement(rows, reports, shared_turns=len(_shared(rows)))
    if dedupe_shared_turns:
        _dedupe(arrangement)
    return arrangement


def _padding(
    group: _Group, real: list[Branch], report: GroupReport, size: int | None, policy: str
) -> list[Branch] | None:
    """The padding rows the group gets ([] when it has the size), or None when it is left out."""
    if size is None or len(real) == size:
        return []
    if policy == "drop":
        return None
    if policy == "refuse" or len(real) > size:
        why = "more" if len(real) > size else "fewer"
        raise GroupSizeError(
            f"group {group.key!r} has {len(real)} rows ({len(group.episodes)} episodes; {group_members(group)}), "
            f"{why} than the group size {size}; --group-policy drop leaves such groups out"
            + (", pad fills smaller ones" if why == "fewer" else "")
        )
    rewards = [branch.notes.reward for branch in real]
    if any(reward is None for reward in rewards):
        unscored = _Group(group.key, {b.episode: [b] for b in real if b.notes.reward is None})
        raise GroupSizeError(
            f"group {group.key!r} cannot be padded to {size}: rows of it have no reward ({group_members(unscored)})"
        )
    mean = sum(r for r in rewards if r is not None) / len(rewards)
    out = []
    for k in range(size - len(real)):
        copied = real[k % len(real)].without_mask()
        notes = dataclasses.replace(copied.notes, reward=mean)
        out.append(dataclasses.replace(copied, notes=notes))
    report.padded = len(out)
    return out


def _shared(rows: list[PlacedRow]) -> set[tuple[int, int]]:
    """Turns with sampled tokens that lie in more than one real row."""
    seen: set[tuple[int, int]] = set()
    shared: set[tuple[int, int]] = set()
    for row in rows:
        if row.padded:
            continue
        for key, turn in zip(row.branch.turn_keys(), row.branch.path, strict=True):
            if not turn.completion_ids:
                continue
            (shared if key in seen else seen).add(key)
    return shared


def _dedupe(arrangement: Arrangement) -> None:
    """Each shared turn trains in its first row only."""
    claimed: set[tuple[int, int]] = set()
    for position, row in enumerate(arrangement.rows):
        if row.padded:
            continue
        keys = row.branch.turn_keys()
        again = {turn.turn_id for key, turn in zip(keys, row.branch.path, strict=True) if key in claimed}
        claimed.update(keys)
        if again:
            arrangement.rows[position] = dataclasses.replace(row, branch=row.branch.masked_turns(again))
    arrangement.deduped = True


@dataclass
class EpisodeView:
    """What a person (`show`, the audit page, `GET /v1/sessions/{id}`) is told of an episode: what its annotations
    say of it as a whole (segment-scoped notes aside), the group its rows get, and its segments (one row each)."""

    episode: str
    notes: SegmentNotes
    group: str
    segments: list[Segment]

    @property
    def sessions(self) -> list[str]:
        return list(dict.fromkeys(segment.path[0].session_id for segment in self.segments))


def episode_views(files: list[SessionFile], auto_group: Callable[[Segment], str] | None = None) -> list[EpisodeView]:
    """Every episode of `files`, as the export groups it, without rebuilding any row's ids: only each episode's first
    prompt is rebuilt (for its automatic group), so a session of thousands of turns is read in linear time.
    `auto_group`: the automatic group of an episode's first segment, where the caller knows it without the ids (the
    record browser keeps turns without their ids)."""
    by_episode: dict[str, list[Segment]] = {}
    for segment in episode_segments(files):
        by_episode.setdefault(segment.episode, []).append(segment)
    turns_of: dict[int, dict[int, TurnRecord]] = {}
    views = []
    for episode, segments in by_episode.items():
        first = segments[0]  # numbered 0: the one `arrange` takes the group of
        # No own turns: only the notes that reach the whole episode, none scoped to one of its segments.
        notes = segment_notes(Segment(first.session, []), segments)
        if notes.group is not None:
            group = notes.group
        elif auto_group is not None:
            group = auto_group(first)
        else:
            turns = turns_of.setdefault(id(first.session), {t.turn_id: t for t in first.session.turns})
            group = auto_group_of(first.path[0], prompt_ids_of(turns, first.path[0]))
        views.append(EpisodeView(episode, notes, group, segments))
    return views


def prompt_ids_of(turns: dict[int, TurnRecord], turn: TurnRecord) -> list[int]:
    """One turn's whole prompt ids, rebuilt from its ancestors' added and sampled ids."""
    chain = [turn]
    while chain[-1].parent_turn_id is not None:
        parent = turns.get(chain[-1].parent_turn_id)
        if parent is None:
            raise RecordError(
                f"turn {chain[-1].turn_id} extends turn {chain[-1].parent_turn_id}, which is not recorded"
            )
        chain.append(parent)
    ids: list[int] = []
    for node in reversed(chain[1:]):
        ids += node.prompt_added_ids
        ids += node.completion_ids
    return ids + turn.prompt_added_ids
