"""`Records`: where the sessions' record lines go and come back from, whatever keeps them: the port the turn layer,
the control API and a flow file's replay write and read through.

Each kind of line has one writer here: a turn's line, its withdrawal (a commit the sessions refused after the line
was written), a session's close, a driver's annotation. `FileRecords` keeps them in `<record_dir>/*.jsonl` (written
by `trajectory_recorder`, read by `record_reader`); `NullRecords` keeps nothing (a turn service that records nothing:
benchmarks, and tests of what does not depend on records).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tito_addon.chat_images import ChatImage
from tito_addon.records.image_store import ImageStore
from tito_addon.records.record_models import AnnotationRecord, TurnRecord
from tito_addon.records.record_reader import (
    RecordError,
    SessionFile,
    merge_parts,
    read_session,
    session_parts,
    session_paths,
)
from tito_addon.records.session_reads import SessionReads
from tito_addon.records.session_selection import recorded_session_ids
from tito_addon.records.trajectory_recorder import TrajectoryRecorder

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Records(Protocol):
    """What is recorded of sessions, line by line. Writes raise `OSError` when the line could not be written; reads
    raise `OSError` or `RecordError`."""

    def append_turn(
        self,
        session_id: str,
        fields: dict[str, Any],
        routes: bytes | None = None,
        images: Sequence[ChatImage] = (),
    ) -> None:
        """A committed turn's line, from its fields (`TurnRecord.line_fields`, or built as those are), its MoE routes'
        rows (`fields["routed_experts"]` says their shape) and the images its prompt added (`fields["images"]` names
        them), both kept first, where the line says."""
        ...

    def append_turn_record(self, record: TurnRecord) -> None:
        """A turn's line as a model (a flow file's metadata carries whole lines)."""
        ...

    def withdraw(self, session_id: str, turn_id: int, reason: str) -> None: ...

    def close(self, session_id: str, turns: int, reason: str) -> None: ...

    def annotate(self, note: AnnotationRecord) -> None: ...

    def read(self, session_id: str) -> SessionFile | None:
        """Everything recorded of a session (all writers' parts), None when nothing is."""
        ...

    def holds(self, session_id: str) -> bool:
        """Whether anything is recorded of a session, known without reading its lines."""
        ...

    def session_ids(self) -> list[str]:
        """Every recorded session's id, in id order (`RecordError` when none is recorded)."""
        ...

    def each_session(self, digest: Callable[[SessionFile], T | None]) -> list[T]:
        """`digest` of every recorded session that gives one; a session whose record did not change since the last
        call is not read again."""
        ...


class FileRecords:
    """Record lines in `<record_dir>`, one file (or one part per writer process) a session."""

    def __init__(self, record_dir: str | Path, writer: str | None = None) -> None:
        self.lines = TrajectoryRecorder(record_dir, writer=writer)
        self.record_dir = self.lines.record_dir
        self.images = ImageStore(self.record_dir)
        # Per digest: what it gave of each session, kept while no part of the session changed.
        self._reads: dict[Callable, SessionReads[Any]] = {}

    def append_turn(
        self,
        session_id: str,
        fields: dict[str, Any],
        routes: bytes | None = None,
        images: Sequence[ChatImage] = (),
    ) -> None:
        if images:
            self.images.put(images)
        if routes:
            file, offset = self.lines.write_routes(session_id, routes)
            fields["routed_experts"] = {**fields["routed_experts"], "file": file, "offset": offset}
        self.lines.write_turn_line(session_id, fields)

    def append_turn_record(self, record: TurnRecord) -> None:
        self.lines.write_turn(record)

    def withdraw(self, session_id: str, turn_id: int, reason: str) -> None:
        self.lines.withdraw_turn(session_id, turn_id, reason)

    def close(self, session_id: str, turns: int, reason: str) -> None:
        self.lines.close_session(session_id, turns, reason)

    def annotate(self, note: AnnotationRecord) -> None:
        self.lines.write_annotation(note)

    def read(self, session_id: str) -> SessionFile | None:
        return read_session(self.record_dir, session_id)

    def holds(self, session_id: str) -> bool:
        return bool(session_paths(self.record_dir, session_id))

    def session_ids(self) -> list[str]:
        return recorded_session_ids(self.record_dir)

    def each_session(self, digest: Callable[[SessionFile], T | None]) -> list[T]:
        found = session_parts(self.record_dir) if self.record_dir.is_dir() else {}
        reads = self._reads.get(digest)
        if reads is None:
            reads = self._reads[digest] = SessionReads(partial(digest_or_none, digest))
        kept, _ = reads.refresh(found)
        return [value for value in kept.values() if value is not None]


def digest_or_none[R](digest: Callable[[SessionFile], R | None], name: str, paths: list[Path]) -> R | None:
    """`digest` of a session's merged parts; None, said once in the log, when they cannot be read (until they
    change)."""
    try:
        return digest(merge_parts(paths))
    except (OSError, RecordError) as exc:
        logger.warning("tito: cannot read the record %s: %s", name, exc)
        return None


class NullRecords:
    """Records nothing, holds nothing."""

    record_dir = None

    def append_turn(
        self,
        session_id: str,
        fields: dict[str, Any],
        routes: bytes | None = None,
        images: Sequence[ChatImage] = (),
    ) -> None:
        pass

    def append_turn_record(self, record: TurnRecord) -> None:
        pass

    def withdraw(self, session_id: str, turn_id: int, reason: str) -> None:
        pass

    def close(self, session_id: str, turns: int, reason: str) -> None:
        pass

    def annotate(self, note: AnnotationRecord) -> None:
        pass

    def read(self, session_id: str) -> SessionFile | None:
        return None

    def holds(self, session_id: str) -> bool:
        return False

    def session_ids(self) -> list[str]:
        raise RecordError("nothing is recorded (the proxy records no sessions)")

    def each_session(self, digest: Callable[[SessionFile], T | None]) -> list[T]:
        return []
