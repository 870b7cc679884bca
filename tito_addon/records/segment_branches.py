"""Segments as token sequences: what every trainer layout is cut from.

A segment's row is its leaf turn's prompt + completion exactly as recorded, with a mask that is 1 exactly on the
tokens the model sampled in each turn of the segment and the sampled tokens' log-probs at their positions (0
elsewhere). Branches that share early turns carry those turns' sampled tokens each; `masked_turns` takes a turn's
tokens out of the mask of one row (`records/rollout_groups`'s `--dedupe-shared-turns`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tito_addon.records.episode_segments import Segment, SegmentNotes, episode_segments
from tito_addon.records.record_models import RecordedImage, TurnRecord
from tito_addon.records.record_reader import SessionFile
from tito_addon.records.recorded_routes import SequenceRoutes, sequence_routes


@dataclass(frozen=True)
class Branch:
    """One segment as a row: its full ids, where the model sampled, and what the annotations say of it."""

    path: list[TurnRecord]
    ids: list[int]  # the leaf's prompt + completion
    mask: list[int]  # 1 on every sampled token of every turn of the segment
    logprobs: list[float]  # the sampled tokens' logprobs at their positions, 0 elsewhere
    # The weight version that sampled each sampled token; "" where none applies or none was reported (the mask tells
    # which): a list of strings, never of nulls alone, so JSON readers that infer types block by block (pyarrow, HF
    # datasets) see one type in every row.
    versions: list[str]
    messages: list[dict[str, Any]] | None  # None when the session was recorded without message text
    notes: SegmentNotes
    episode: str
    segment: int
    session_key: int = 0  # which session file the turns are in (turn ids are unique only within one)
    session: SessionFile | None = field(default=None, compare=False, repr=False)

    def images(self) -> list[RecordedImage]:
        """The images `ids` hold, in order, each where its run of pad ids lies in them (none: a text-only row)."""
        if self.session is None:
            return []
        return self.session.sequence_images().get(self.path[-1].turn_id, [])

    def routes(self) -> SequenceRoutes | None:
        """The MoE routes of `ids` (one row a position but the last), where the session recorded them."""
        if self.session is None or self.path[-1].routed_experts is None:
            return None
        return sequence_routes(self.session, self.path[-1].turn_id)

    @property
    def prompt_len(self) -> int:
        """The first turn's prompt: the part no turn of the segment sampled or appended."""
        return self.path[0].prompt_len

    @property
    def call(self) -> str:
        return self.path[0].call

    def turn_keys(self) -> list[tuple[int, int]]:
        """Each turn of the branch as (session file, turn id): the same turn in another branch has the same key."""
        return [(self.session_key, turn.turn_id) for turn in self.path]

    def masked_turns(self, turn_ids: set[int]) -> Branch:
        """This branch with the sampled tokens of `turn_ids` out of its mask (their log-probs stay)."""
        mask = list(self.mask)
        for turn in self.path:
            if turn.turn_id in turn_ids:
                start = turn.prompt_len
                mask[start : start + len(turn.completion_ids)] = [0] * len(turn.completion_ids)
        return dataclasses.replace(self, mask=mask)

    def masked_offpolicy(self) -> Branch:
        """This branch with the sampled tokens of other weight versions than its newest (its last versioned sampled
        token's) out of its mask; tokens whose version is unknown stay in it, as do every token's log-prob."""
        pairs = list(zip(self.mask, self.versions, strict=True))
        newest = next((version for bit, version in reversed(pairs) if bit and version), "")
        mask = [0 if bit and version and version != newest else bit for bit, version in pairs]
        return dataclasses.replace(self, mask=mask)

    def without_mask(self) -> Branch:
        """A copy that trains nothing (a group's padding row)."""
        return dataclasses.replace(self, mask=[0] * len(self.mask))


def branch_of(segment: Segment, ids: dict[int, tuple[list[int], list[int]]]) -> Branch:
    path = segment.path
    prompt, completion = ids[path[-1].turn_id]
    sequence = prompt + completion
    mask = [0] * len(sequence)
    logprobs = [0.0] * len(sequence)
    versions = [""] * len(sequence)
    messages: list[dict[str, Any]] | None = []
    for turn in path:
        start = turn.prompt_len  # the turn's completion follows its prompt in every descendant's sequence
        for offset, value in enumerate(turn.completion_logprobs):
            mask[start + offset] = 1
            logprobs[start + offset] = value
        versions[start : start + len(turn.completion_ids)] = [v or "" for v in turn.token_weight_versions()]
        if messages is not None and turn.appended_messages is not None:
            messages += turn.appended_messages + [turn.assistant_message]
        else:
            messages = None
    return Branch(
        path,
        sequence,
        mask,
        logprobs,
        versions,
        messages,
        segment.notes,
        segment.episode,
        segment.index,
        id(segment.session),
        segment.session,
    )


def branches(files: list[SessionFile]) -> list[Branch]:
    """Every segment of every episode of `files`, episode by episode, each numbered within its episode."""
    # Rebuilt first: that proves every parent recorded, before segments walk up to them.
    full = {id(session_file): session_file.full_ids() for session_file in files}
    return [branch_of(segment, full[id(segment.session)]) for segment in episode_segments(files)]
