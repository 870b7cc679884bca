"""Reads session files back and reconstructs every turn's full prompt ids from the parent chain.

A session may be stored in several parts, one per writer process (`<name>+<writer>.jsonl`, see
`trajectory_recorder`), plus a `<name>.jsonl` of a recorder without a writer id; `read_session` and
`iter_session_files` merge them into one `SessionFile`. A torn line (a crash mid-write) is reported in
`skipped` and skipped, never merged with the next line; a turn whose parent is missing, or a turn id that two
lines claim, makes the session unreadable as a trajectory (`RecordError`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from pydantic import ValidationError

from tito_addon.canonical_chat import ChatMessage
from tito_addon.records.record_models import (
    ANNOTATION_SCHEMA,
    CLOSE_SCHEMA,
    TURN_SCHEMA,
    WITHDRAWN_SCHEMA,
    AnnotationRecord,
    RecordedImage,
    SessionCloseRecord,
    TurnRecord,
    TurnWithdrawnRecord,
)
from tito_addon.records.trajectory_recorder import SUFFIX, WRITER_ID, WRITER_SEPARATOR, session_file_name
from tito_addon.sessions.message_keys import message_key

logger = logging.getLogger(__name__)


class RecordError(ValueError):
    """A recording that cannot be read as a consistent trajectory."""


@dataclass
class SessionFile:
    """One session, read from all of its parts. `path` is the first part (the one error messages name)."""

    path: Path
    turns: list[TurnRecord] = field(default_factory=list)
    closes: list[SessionCloseRecord] = field(default_factory=list)
    # (part, line number) of every unreadable line; each may have held a turn id that must never be reused.
    skipped: list[tuple[Path, int]] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)
    # Turns written whose commit to the shared store failed: the agent got an error, not them (left out of `turns`).
    withdrawn: list[TurnWithdrawnRecord] = field(default_factory=list)
    # Rewards, labels and metadata a driver attached (in the order written; across parts by time).
    annotations: list[AnnotationRecord] = field(default_factory=list)
    # `sequence_images`' answer and the number of turns it was worked out for.
    _images: tuple[int, dict[int, list[RecordedImage]]] | None = field(default=None, repr=False, compare=False)

    def drop_withdrawn(self) -> None:
        gone = {w.turn_id for w in self.withdrawn}
        if gone:
            self.turns = [t for t in self.turns if t.turn_id not in gone]

    @property
    def closed_by_driver(self) -> bool:
        """Whether the session's latest close is its driver's (the control API), not an idle or capacity close."""
        return bool(self.closes) and self.closes[-1].reason == "closed"

    def turns_since_driver_close(self) -> list[TurnRecord]:
        """The turns a resume puts back: those after the driver's latest close (with `tito_after_close=new` a name
        starts a new tree after it; the closed episode's turns stay recorded but nothing extends them)."""
        since = max((close.ts for close in self.closes if close.reason == "closed"), default=None)
        return self.turns if since is None else [turn for turn in self.turns if turn.ts > since]

    @property
    def highest_turn_id(self) -> int:
        """The highest turn id this session's record has used (withdrawn ones too), -1 when none."""
        return max([t.turn_id for t in self.turns] + [w.turn_id for w in self.withdrawn], default=-1)

    def __post_init__(self) -> None:
        if not self.paths:
            self.paths = [self.path]

    @property
    def skipped_lines(self) -> list[int]:
        """Line numbers of the skipped lines (in their own parts); its length counts them across parts."""
        return [number for _, number in self.skipped]

    def _where(self) -> str:
        more = len(self.paths) - 1
        return f"{self.path} (and {more} more part{'s' * (more > 1)})" if more else str(self.path)

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
        where = self._where()
        for turn in self.turns:  # a parent always precedes its children (see `merge_parts`)
            if turn.parent_turn_id is None:
                prompt = list(turn.prompt_added_ids)
            else:
                if turn.parent_turn_id not in ends:
                    raise RecordError(
                        f"{where}: turn {turn.turn_id} extends turn {turn.parent_turn_id}, which is not recorded"
                    )
                prompt = ends[turn.parent_turn_id] + turn.prompt_added_ids
            if len(prompt) != turn.prompt_len:
                raise RecordError(
                    f"{where}: turn {turn.turn_id} rebuilds to {len(prompt)} prompt ids, recorded {turn.prompt_len}"
                )
            ends[turn.turn_id] = prompt + turn.completion_ids
            out[turn.turn_id] = (prompt, list(turn.completion_ids))
        return out

    def sequence_images(self) -> dict[int, list[RecordedImage]]:
        """turn_id -> every image its prompt holds (its chain's, in order), as the lines name them; worked out once (an
        export asks for each of its rows)."""
        if self._images is None or self._images[0] != len(self.turns):
            out: dict[int, list[RecordedImage]] = {}
            for turn in self.turns:  # parents first
                inherited = out.get(turn.parent_turn_id, []) if turn.parent_turn_id is not None else []
                out[turn.turn_id] = inherited + list(turn.images or ())
            self._images = (len(self.turns), out)
        return self._images[1]


def read_session_file(path: Path) -> SessionFile:
    """One file, exactly as written: file order is commit order. Not a whole session if it has other parts."""
    result = SessionFile(path=path)
    with path.open("rb") as handle:
        lines = handle.read().split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)  # a third of json's time on a large dir; a line is UTF-8, never NaN
            schema = obj.get("schema") if isinstance(obj, dict) else None
            if schema == TURN_SCHEMA:
                result.turns.append(TurnRecord.model_validate(obj))
            elif schema == CLOSE_SCHEMA:
                result.closes.append(SessionCloseRecord.model_validate(obj))
            elif schema == WITHDRAWN_SCHEMA:
                result.withdrawn.append(TurnWithdrawnRecord.model_validate(obj))
            elif schema == ANNOTATION_SCHEMA:
                result.annotations.append(AnnotationRecord.model_validate(obj))
            else:
                raise ValueError(f"unknown schema {schema!r}")
        except (ValueError, ValidationError) as exc:
            # A line torn by a crash mid-write; a restarted proxy appends after it. Skipped, never merged.
            logger.warning("%s: skipping unreadable line %d: %s", path, number, str(exc)[:200])
            result.skipped.append((path, number))
    seen: set[int] = set()
    for turn in result.turns:
        if turn.turn_id in seen:
            raise RecordError(f"{path}: turn id {turn.turn_id} appears twice")
        seen.add(turn.turn_id)
    result.drop_withdrawn()
    return result


def base_name(file_name: str) -> str:
    """The session's file name a part belongs to: `s+w1.jsonl` -> `s.jsonl`; any other name is its own."""
    stem, separator, writer = file_name[: -len(SUFFIX)].partition(WRITER_SEPARATOR)
    if file_name.endswith(SUFFIX) and separator and stem and WRITER_ID.fullmatch(writer):
        return stem + SUFFIX
    return file_name


def _part_order(path: Path) -> tuple[bool, str]:
    return WRITER_SEPARATOR in path.name, path.name  # a writer-less file first, then the writers by id


def session_parts(record_dir: Path) -> dict[str, list[Path]]:
    """Base file name (`session_file_name` of the id) -> every part of that session, sorted by name."""
    parts: dict[str, list[Path]] = {}
    for path in record_dir.glob("*" + SUFFIX):
        parts.setdefault(base_name(path.name), []).append(path)
    return {name: sorted(parts[name], key=_part_order) for name in sorted(parts)}


def merge_parts(paths: list[Path]) -> SessionFile:
    """One session from all of its parts.

    A lone part keeps its file order (commit order). Across parts, turns are ordered by id: an id is allocated
    before its turn commits and a child's only after its parent committed, so a parent's id is always lower
    than its children's, whichever process wrote each."""
    parts = [read_session_file(path) for path in sorted(paths, key=_part_order)]
    if len(parts) == 1:
        return parts[0]
    merged = SessionFile(path=parts[0].path, paths=[part.path for part in parts])
    owner: dict[int, Path] = {}
    for part in parts:
        for turn in part.turns:
            if turn.turn_id in owner:
                raise RecordError(f"turn id {turn.turn_id} appears in both {owner[turn.turn_id]} and {part.path}")
            owner[turn.turn_id] = part.path
        merged.turns += part.turns
        merged.closes += part.closes
        merged.skipped += part.skipped
        merged.withdrawn += part.withdrawn
        merged.annotations += part.annotations
    merged.turns.sort(key=lambda turn: turn.turn_id)
    merged.closes.sort(key=lambda close: close.ts)  # `closes[-1]` stays the latest, as in one file
    merged.annotations.sort(key=lambda note: note.ts)  # stable: one writer's own order is kept on equal times
    return merged


def session_paths(record_dir: Path, session_id: str) -> list[Path]:
    """The files holding one session's lines (every writer's part), unread."""
    name = session_file_name(session_id)
    # The name has no glob metacharacters (`session_file_name` allows only [A-Za-z0-9._-]).
    candidates = [record_dir / name, *record_dir.glob(name[: -len(SUFFIX)] + WRITER_SEPARATOR + "*" + SUFFIX)]
    return [path for path in candidates if base_name(path.name) == name and path.is_file()]


def read_session(record_dir: Path, session_id: str) -> SessionFile | None:
    """Every part of one session merged (all writers'), or None when no part exists."""
    paths = session_paths(record_dir, session_id)
    return merge_parts(paths) if paths else None


def iter_session_files(record_dir: Path) -> Iterator[SessionFile]:
    """One merged `SessionFile` per session, sorted by file name."""
    if not record_dir.is_dir():
        raise RecordError(f"{record_dir} is not a directory")
    for paths in session_parts(record_dir).values():
        yield merge_parts(paths)


# A recorded message's image parts name their images without the bytes (those are in the image store).
RECORDED = {"recorded": True}


def recorded_segment(turn: TurnRecord) -> tuple[list[bytes], ChatMessage]:
    """The message keys a recorded turn added to its session's tree (its appended messages, then its assistant
    message, keyed as live turns are), and that assistant message."""
    assistant = ChatMessage.model_validate({**turn.assistant_message, "role": "assistant"})
    if turn.appended_messages is not None:
        keys = [message_key(ChatMessage.model_validate(m, context=RECORDED)) for m in turn.appended_messages]
    else:
        keys = [bytes.fromhex(k) for k in turn.appended_keys or ()]
    keys.append(message_key(assistant))
    return keys, assistant
