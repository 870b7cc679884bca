"""What a rollout driver asks of the sessions: list them, export one's or a batch's trainer rows, score and group one,
wait until no turn of it is in flight, close it. The use cases only; the HTTP routes that reach them are the proxy's
(`proxy/control_routes`).

Every record read runs off the event loop; what the stores say (live, in flight, last activity) is asked of the
sessions (`SessionSpace`), wherever they live. Nothing but an annotation or a close line is ever written, and a refused
request writes neither.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tito_addon.records.record_models import AnnotationRecord
from tito_addon.records.record_reader import RecordError, SessionFile
from tito_addon.records.rollout_groups import GroupSizeError, episode_views
from tito_addon.records.session_selection import with_prefixes
from tito_addon.records.session_summaries import listing_order, session_summary
from tito_addon.records.trainer_rows import ExportOptions, encode_rows, rows_of
from tito_addon.sessions.session_space import SessionStatus
from tito_addon.tito_errors import TitoError
from tito_addon.turns.session_records import SessionRecords

logger = logging.getLogger(__name__)

MAX_WAIT_S = 600.0
POLL_S = 0.02
MAX_ROWS_SESSIONS = 100_000


class NotFound(TitoError):
    status = 404
    error_type = "not_found"


@dataclass(frozen=True)
class RowsExport:
    """Trainer rows as one file (or only what it would hold: `file_type == "summary"`), with what it holds."""

    summary: dict[str, Any]
    data: bytes | None  # None: the summary is the answer


def annotations_of(recorded: SessionFile | None) -> dict[str, Any]:
    """What a session's annotations are: every annotation line as recorded (in the order written), and what they add
    up to as the export applies them (latest wins; see `records/episode_segments`): per episode, and at the top for a
    session of one episode (a named session's)."""
    views = episode_views([recorded]) if recorded is not None and recorded.turns else []
    episodes = [{"episode": v.episode, "reward": v.notes.reward, "labels": v.notes.labels, "metadata": v.notes.metadata,
                 "group": v.group, "segments": len(v.segments)} for v in views]  # fmt: skip
    one = episodes[0] if len(episodes) == 1 else {}
    lines = recorded.annotations if recorded is not None else []
    return {
        "annotations": [note.model_dump(by_alias=True, exclude_none=True) for note in lines],
        **{key: one.get(key) for key in ("reward", "labels", "metadata", "group")},
        "episodes": episodes,
    }


def state_of(status: SessionStatus) -> dict[str, Any]:
    """What is said of a session's state: whether it is live, its turns in flight and last activity where the sessions
    know them."""
    fields = {"live": status.live, "in_flight": status.in_flight, "last_activity": status.last_activity}
    return {key: value for key, value in fields.items() if value is not None}


class SessionControl:
    def __init__(self, sessions: Callable[[], SessionRecords | None]) -> None:
        self._sessions = sessions  # the proxy's sessions and records as configured now (None: not configured)

    def sessions(self) -> SessionRecords:
        sessions = self._sessions()
        if sessions is None:
            raise TitoError("tito_addon is not configured (set tito_tokenizer)", status=503)
        return sessions

    # -- reading ------------------------------------------------------------------------------------------------

    async def _recorded(self, session_id: str) -> SessionFile | None:
        records = self.sessions().records
        try:
            recorded = await asyncio.to_thread(records.read, session_id)
        except (OSError, RecordError) as exc:
            raise TitoError(f"cannot read the record of session {session_id!r}: {exc}", status=409) from exc
        lines = [*recorded.turns, *recorded.closes, *recorded.annotations] if recorded is not None else []
        if any(line.session_id != session_id for line in lines):
            return None  # a file name is never a session id: only the id the lines were written for reads them
        return recorded

    async def _with_turns(self, session_id: str) -> SessionFile:
        recorded = await self._recorded(session_id)
        if recorded is None or not recorded.turns:
            raise NotFound(f"session {session_id!r} has no recorded turns")
        return recorded

    async def _state(self, session_id: str) -> dict[str, Any]:
        """Whether the session is live and how many of its turns are in flight, wherever the sessions live."""
        return state_of(await self.sessions().sessions.status(session_id))

    async def list_sessions(self, *, limit: int, live_only: bool, prefix: str) -> list[dict[str, Any]]:
        """The most recently active sessions, live or recorded, whose ids start with `prefix`."""
        sessions = self.sessions()
        live = {s.session_id: state_of(s) for s in await sessions.sessions.live(limit)}
        live = {sid: state for sid, state in live.items() if sid.startswith(prefix)}
        recorded = [] if live_only else await asyncio.to_thread(sessions.records.each_session, session_summary)
        rows: dict[str, dict[str, Any]] = {}
        for summary in recorded:
            sid = summary["session_id"]
            if sid.startswith(prefix):
                rows[sid] = {**summary, "live": False, "last_activity": summary["last_turn_at"], **live.get(sid, {})}
        for sid, state in live.items():
            if sid not in rows:
                rows[sid] = {"session_id": sid, "turns": None, "tokens": None, "branches": None, **state}
        return listing_order(rows.values())[:limit]

    async def summary(self, session_id: str) -> dict[str, Any]:
        recorded = await self._recorded(session_id)
        summary = session_summary(recorded) if recorded is not None else None
        state = await self._state(session_id)
        if summary is None and not state["live"]:
            raise NotFound(f"no session {session_id!r} is live or recorded")
        base = summary or {"session_id": session_id, "turns": 0, "tokens": 0, "branches": 0, "closed": None,
                           "annotation_count": 0}  # fmt: skip
        try:
            notes = await asyncio.to_thread(annotations_of, recorded)
        except RecordError as exc:
            raise TitoError(f"cannot read the record of session {session_id!r}: {exc}", status=409) from exc
        return {**base, **notes, "last_activity": base.get("last_turn_at"), **state}

    async def rows(
        self, sessions: list[str], prefix: str | None, layout: str, file_type: str, options: ExportOptions
    ) -> RowsExport:
        """The rows of the named sessions, then of every recorded session whose id starts with `prefix`, as one
        export (groups contiguous, numbered across them all), or with `file_type` "summary" only its groups."""
        selected = await self._selected(sessions, prefix)  # the records listed only for a valid request
        if len(selected) > MAX_ROWS_SESSIONS:
            raise TitoError(f"at most {MAX_ROWS_SESSIONS} sessions in one rows call", status=400)
        found = [await self._with_turns(session_id) for session_id in dict.fromkeys(selected)]

        def encode() -> RowsExport:
            rows, arrangement = rows_of(found, layout, options)
            summary = arrangement.summary()
            return RowsExport(summary, None if file_type == "summary" else encode_rows(rows, layout, file_type))

        try:
            return await asyncio.to_thread(encode)
        except GroupSizeError as exc:
            raise TitoError(str(exc), status=409) from exc
        except RecordError as exc:
            raise TitoError(f"cannot read the records: {exc}", status=409) from exc

    async def _selected(self, sessions: list[str], prefix: str | None) -> list[str]:
        if prefix is None:
            return sessions
        records = self.sessions().records
        try:
            return with_prefixes(await asyncio.to_thread(records.session_ids), [prefix], sessions)
        except OSError as exc:
            raise TitoError(f"cannot list the recorded sessions: {exc}", status=409) from exc
        except RecordError as exc:  # nothing recorded, or nothing of that prefix
            raise NotFound(str(exc)) from exc

    # -- writing ------------------------------------------------------------------------------------------------

    async def annotate(self, note: AnnotationRecord) -> AnnotationRecord:
        session_id, turn_id = note.session_id, note.turn_id
        recorded = await self._with_turns(session_id)
        if turn_id is not None and all(turn.turn_id != turn_id for turn in recorded.turns):
            raise NotFound(f"session {session_id!r} has no recorded turn {turn_id}")
        try:
            self.sessions().records.annotate(note)
        except OSError as exc:
            raise TitoError(f"cannot write the annotation: {exc}", status=500) from exc
        return note

    async def wait(self, session_id: str, timeout: float) -> dict[str, Any]:
        # A 404 for a session neither live nor recorded, found without reading its record (a driver waits on every
        # episode, and a long one's record is megabytes).
        if not (await self._state(session_id))["live"] and not self.sessions().records.holds(session_id):
            raise NotFound(f"no session {session_id!r} is live or recorded")
        started = time.monotonic()
        while True:
            in_flight = (await self._state(session_id))["in_flight"]
            waited = time.monotonic() - started
            if in_flight == 0 or waited >= timeout:
                return {"session_id": session_id, "idle": in_flight == 0, "in_flight": in_flight, "waited_s": waited}
            await asyncio.sleep(POLL_S)

    async def close(self, session_id: str, timeout: float) -> dict[str, Any]:
        recorded = await self._recorded(session_id)
        closed_now = await self._close(session_id, time.monotonic() + timeout)
        if closed_now is None and (recorded is None or not recorded.turns):
            raise NotFound(f"no session {session_id!r} is live or recorded")
        already = closed_now is None and recorded is not None and recorded.closed_by_driver
        turns = closed_now if closed_now is not None else len(recorded.turns if recorded is not None else ())
        if not already:
            try:
                self.sessions().records.close(session_id, turns, "closed")
            except OSError as exc:
                raise TitoError(f"cannot write the close line: {exc}", status=500) from exc
            logger.info("tito: session %s closed by its driver after %d turns", session_id, turns)
        return {"session_id": session_id, "closed": True, "turns": turns, "already_closed": already}

    async def _close(self, session_id: str, deadline: float) -> int | None:
        """Close the live session once no turn of it is in flight: its turns, or None when it was not live."""
        sessions = self.sessions().sessions
        while True:
            status, turns = await sessions.close_by_driver(session_id)
            if status == "closed":
                return turns
            if status != "busy":
                return None
            if time.monotonic() >= deadline:
                raise TitoError(f"a turn of session {session_id!r} is still in flight; nothing was closed", status=409)
            await asyncio.sleep(POLL_S)
