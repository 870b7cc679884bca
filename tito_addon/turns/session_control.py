"""What a rollout driver asks of the sessions, behind the control API: list them, fetch one's trainer rows or a batch's
as one export (`POST /v1/rows`), score and group it, wait until no turn of it is in flight, close it.

No mitmproxy here: `handle(method, path, body)` answers one control request (the proxy's `control_addon` checks the
token and the host first). Every record read runs off the event loop; what the stores say (live, in flight, last
activity) is asked of the sessions (`SessionSpace`), wherever they live. Nothing but an annotation or a close line
is ever written, and a refused request writes neither.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from tito_addon.canonical_chat import json_value_problem
from tito_addon.protocols.http_reply import HttpReply, json_reply, refusal_reply
from tito_addon.protocols.json_body import parse_json_object, validated
from tito_addon.records.record_models import MAX_METADATA_BYTES, AnnotationRecord
from tito_addon.records.record_reader import (
    RecordError,
    SessionFile,
    merge_parts,
    read_session,
    session_parts,
    session_paths,
)
from tito_addon.records.rollout_groups import GROUP_POLICIES, GroupSizeError, episode_views
from tito_addon.records.session_selection import recorded_session_ids, with_prefixes
from tito_addon.records.trainer_rows import (
    LAYOUTS,
    ROW_FILE_TYPES,
    ExportOptions,
    encode_rows,
    parse_calls,
    rows_of,
)
from tito_addon.sessions.session_ids import session_id_problem
from tito_addon.sessions.session_space import SessionStatus
from tito_addon.tito_errors import BadRequest, TitoError
from tito_addon.turns.session_records import SessionRecords

logger = logging.getLogger(__name__)

MAX_BODY = 1024 * 1024
MAX_WAIT_S = 600.0
POLL_S = 0.02
ANNOTATION_FIELDS = {"turn_id", "reward", "labels", "metadata", "group", "scope"}
ROWS_FIELDS = {"sessions", "session_prefix", "format", "to", "calls", "group_size", "group_policy",
               "dedupe_shared_turns"}  # fmt: skip
MAX_ROWS_SESSIONS = 100_000
CONTENT_TYPES = {
    "parquet": "application/vnd.apache.parquet",
    "jsonl": "application/jsonl",
    "summary": "application/json",
}


class NotFound(TitoError):
    status = 404
    error_type = "not_found"


def summary_of(recorded: SessionFile) -> dict[str, Any] | None:
    """What a record says of a session: turns, tokens, branches, the last turn's time, whether it is closed."""
    lines = [*recorded.turns, *recorded.closes, *recorded.annotations, *recorded.withdrawn]
    if not lines:
        return None
    last_turn = max((turn.ts for turn in recorded.turns), default=0.0)
    close = recorded.closes[-1] if recorded.closes and recorded.closes[-1].ts >= last_turn else None
    parents = {turn.parent_turn_id for turn in recorded.turns}
    return {
        "session_id": lines[0].session_id,
        "turns": len(recorded.turns),
        "tokens": sum(len(t.prompt_added_ids) + len(t.completion_ids) for t in recorded.turns),
        "branches": sum(1 for turn in recorded.turns if turn.turn_id not in parents),
        "last_turn_at": last_turn or None,
        "closed": close.reason if close is not None else None,
        "annotation_count": len(recorded.annotations),
    }


def annotations_of(recorded: SessionFile | None) -> dict[str, Any]:
    """What `GET /v1/sessions/{id}` says of a session's annotations: every annotation line as recorded (in the order
    written), and what they add up to as the export applies them (latest wins; see `records/episode_segments`): per
    episode, and at the top for a session of one episode (a named session's)."""
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


class SessionControl:
    def __init__(self, sessions: Callable[[], SessionRecords | None]) -> None:
        self._sessions = sessions  # the proxy's sessions and records as configured now (None: not configured)
        # Record summaries by base file name, kept while no part of the session changed (size, mtime).
        self._summaries: dict[str, tuple[tuple[tuple[str, int, int], ...], dict[str, Any] | None]] = {}

    def sessions(self) -> SessionRecords:
        sessions = self._sessions()
        if sessions is None or sessions.recorder is None:
            raise TitoError("tito_addon is not configured (set tito_tokenizer)", status=503)
        return sessions

    async def handle(self, method: str, path: str, body: bytes) -> HttpReply:
        try:
            return await self._route(method, path, body)
        except TitoError as error:
            return refusal_reply(error)

    async def _route(self, method: str, path: str, body: bytes) -> HttpReply:
        split = urlsplit(path)
        try:
            query = {k: v[-1] for k, v in parse_qs(split.query, max_num_fields=8).items()}
        except ValueError:
            raise BadRequest("too many query parameters") from None
        parts = split.path.split("/")
        if split.path == "/v1/rows":
            return self._method(method, "POST") or await self.rows_of_sessions(body)
        if len(parts) < 3 or parts[:3] != ["", "v1", "sessions"] or len(parts) > 5:
            raise NotFound(f"no control API route {split.path!r}")
        if len(body) > MAX_BODY:
            raise TitoError(f"request body is larger than {MAX_BODY} bytes", status=413)
        action = parts[4] if len(parts) == 5 else ""
        wanted = {"": "GET", "rows": "GET", "annotations": "POST", "wait": "GET", "close": "POST"}
        if len(parts) == 3:
            return self._method(method, "GET") or await self.list_sessions(query)
        if action not in wanted or (len(parts) == 5 and not action):  # `/sessions/x/` is no route
            raise NotFound(f"no control API route {split.path!r}")
        allowed = wanted[action]
        refused = self._method(method, allowed, also="POST" if action == "wait" else None)
        if refused is not None:
            return refused
        try:
            session_id = unquote(parts[3], errors="strict")
        except UnicodeDecodeError:
            raise BadRequest("invalid session id: its percent-encoding is not UTF-8") from None
        problem = session_id_problem(session_id)
        if problem is not None:
            raise BadRequest(f"invalid session id: {problem}")
        if action == "":
            return json_reply(200, dumps(await self.summary(session_id)))
        if action == "rows":
            return await self.rows(session_id, query)
        if action == "annotations":
            return await self.annotate(session_id, body)
        if action == "wait":
            return await self.wait(session_id, query)
        return await self.close(session_id, body)

    @staticmethod
    def _method(method: str, allowed: str, also: str | None = None) -> HttpReply | None:
        if method in (allowed, also):
            return None
        error = TitoError(f"method {method} not allowed here; use {allowed}", status=405)
        reply = refusal_reply(error)
        reply.headers["allow"] = ", ".join(m for m in (allowed, also) if m)
        return reply

    # -- reading ------------------------------------------------------------------------------------------------

    def _record_dir(self) -> Path:
        recorder = self.sessions().recorder
        assert recorder is not None
        return recorder.record_dir

    async def _recorded(self, session_id: str) -> SessionFile | None:
        record_dir = self._record_dir()
        try:
            recorded = await asyncio.to_thread(read_session, record_dir, session_id)
        except (OSError, RecordError) as exc:
            raise TitoError(f"cannot read the record of session {session_id!r}: {exc}", status=409) from exc
        lines = [*recorded.turns, *recorded.closes, *recorded.annotations] if recorded is not None else []
        if any(line.session_id != session_id for line in lines):
            return None  # a file name is never a session id: only the id the lines were written for reads them
        return recorded

    def _summaries_of(self, record_dir: Path) -> list[dict[str, Any]]:
        """Summaries of every recorded session (in a worker thread), re-read only where a part changed."""
        found = session_parts(record_dir) if record_dir.is_dir() else {}
        out = []
        for name, paths in found.items():
            try:
                signature = tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in paths)
                cached = self._summaries.get(name)
                if cached is None or cached[0] != signature:
                    cached = (signature, summary_of(merge_parts(paths)))
                    self._summaries[name] = cached
            except (OSError, RecordError) as exc:
                logger.warning("tito control: cannot summarize %s: %s", name, exc)
                continue
            if cached[1] is not None:
                out.append(cached[1])
        for gone in set(self._summaries) - set(found):
            del self._summaries[gone]
        return out

    async def _live(self, limit: int) -> dict[str, dict[str, Any]]:
        """Live sessions: id -> live, last activity (and turns in flight, where the sessions count them)."""
        return {status.session_id: state_of(status) for status in await self.sessions().sessions.live(limit)}

    async def list_sessions(self, query: dict[str, str]) -> HttpReply:
        limit = bounded_int(query.get("limit", "1000"), "limit", 1, 100000)
        live_only = flag(query.get("live", "false"), "live")
        prefix = query.get("prefix", "")
        live = {sid: state for sid, state in (await self._live(limit)).items() if sid.startswith(prefix)}
        recorded = [] if live_only else await asyncio.to_thread(self._summaries_of, self._record_dir())
        recorded = [summary for summary in recorded if summary["session_id"].startswith(prefix)]
        rows: dict[str, dict[str, Any]] = {}
        for summary in recorded:
            sid = summary["session_id"]
            rows[sid] = {**summary, "live": False, "last_activity": summary["last_turn_at"], **live.get(sid, {})}
        for sid, state in live.items():
            if sid not in rows:
                rows[sid] = {"session_id": sid, "turns": None, "tokens": None, "branches": None, **state}
        ordered = sorted(rows.values(), key=lambda row: row.get("last_activity") or 0.0, reverse=True)[:limit]
        return json_reply(200, dumps({"sessions": ordered}))

    async def summary(self, session_id: str) -> dict[str, Any]:
        recorded = await self._recorded(session_id)
        summary = summary_of(recorded) if recorded is not None else None
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

    async def _state(self, session_id: str) -> dict[str, Any]:
        """Whether the session is live and how many of its turns are in flight, wherever the sessions live."""
        return state_of(await self.sessions().sessions.status(session_id))

    async def rows(self, session_id: str, query: dict[str, str]) -> HttpReply:
        layout, file_type = rows_format(query.get("format", "generic"), query.get("to", "jsonl"))
        try:
            options = ExportOptions(calls=parse_calls(query.get("calls")))
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        recorded = await self._recorded(session_id)
        if recorded is None or not recorded.turns:
            raise NotFound(f"session {session_id!r} has no recorded turns")
        return await self._rows_reply([recorded], layout, file_type, options)

    async def rows_of_sessions(self, body: bytes) -> HttpReply:
        """`POST /v1/rows`: the rows of several sessions as one export (groups contiguous, numbered across them all),
        or with `"to": "summary"` only what the export would hold: its groups and their sizes."""
        obj = checked_body(body)
        unknown = sorted(set(obj) - ROWS_FIELDS)
        if unknown:
            raise BadRequest(f"unknown field(s): {', '.join(unknown)}; allowed: {', '.join(sorted(ROWS_FIELDS))}")
        sessions, prefix = obj.get("sessions"), obj.get("session_prefix")
        if prefix is not None and (not isinstance(prefix, str) or not prefix):
            raise BadRequest("session_prefix must be a non-empty string")
        if sessions is None and prefix is None:
            raise BadRequest("name the sessions: sessions (a list of ids), session_prefix, or both")
        listed = isinstance(sessions, list) and sessions and all(isinstance(s, str) for s in sessions)
        if sessions is not None and not listed:
            raise BadRequest("sessions must be a non-empty list of session ids")
        for session_id in sessions or []:
            problem = session_id_problem(session_id)
            if problem is not None:
                raise BadRequest(f"invalid session id {session_id[:80]!r}: {problem}")
        layout, file_type = rows_format(obj.get("format", "generic"), obj.get("to", "jsonl"), summary=True)
        options = rows_options(obj)
        sessions = await self._selected(sessions or [], prefix)  # the records listed only for a valid request
        if len(sessions) > MAX_ROWS_SESSIONS:
            raise BadRequest(f"at most {MAX_ROWS_SESSIONS} sessions in one rows call")
        found = []
        for session_id in dict.fromkeys(sessions):
            recorded = await self._recorded(session_id)
            if recorded is None or not recorded.turns:
                raise NotFound(f"session {session_id!r} has no recorded turns")
            found.append(recorded)
        return await self._rows_reply(found, layout, file_type, options)

    async def _selected(self, sessions: list[str], prefix: str | None) -> list[str]:
        """The named sessions, then (in id order) every recorded session whose id starts with `prefix`."""
        if prefix is None:
            return sessions
        try:
            return with_prefixes(await asyncio.to_thread(recorded_session_ids, self._record_dir()), [prefix], sessions)
        except OSError as exc:
            raise TitoError(f"cannot list the recorded sessions: {exc}", status=409) from exc
        except RecordError as exc:  # nothing recorded, or nothing of that prefix
            raise NotFound(str(exc)) from exc

    async def _rows_reply(
        self, found: list[SessionFile], layout: str, file_type: str, options: ExportOptions
    ) -> HttpReply:
        def encode() -> tuple[dict[str, Any], bytes]:
            rows, arrangement = rows_of(found, layout, options)
            summary = arrangement.summary()
            return summary, (dumps(summary) if file_type == "summary" else encode_rows(rows, layout, file_type))

        try:
            summary, data = await asyncio.to_thread(encode)
        except GroupSizeError as exc:
            raise TitoError(str(exc), status=409) from exc
        except RecordError as exc:
            raise TitoError(f"cannot read the records: {exc}", status=409) from exc
        headers = {
            "content-type": CONTENT_TYPES[file_type],
            "x-tito-rows": str(summary["rows"]),
            "x-tito-groups": str(len(summary["groups"]) - summary["dropped_groups"]),
        }
        return HttpReply(200, headers, data)

    # -- writing ------------------------------------------------------------------------------------------------

    async def annotate(self, session_id: str, body: bytes) -> HttpReply:
        obj = checked_body(body)
        unknown = sorted(set(obj) - ANNOTATION_FIELDS)
        if unknown:
            raise BadRequest(f"unknown annotation field(s): {', '.join(unknown)}; allowed: turn_id, reward, labels, "
                             "metadata, group, scope")  # fmt: skip
        reward, turn_id, metadata = obj.get("reward"), obj.get("turn_id"), obj.get("metadata")
        if reward is not None and not finite_number(reward):
            raise BadRequest("reward must be a finite number")
        if turn_id is not None and (isinstance(turn_id, bool) or not isinstance(turn_id, int)):
            raise BadRequest("turn_id must be an integer")
        if metadata is not None and not isinstance(metadata, dict):
            raise BadRequest("metadata must be a JSON object")
        if metadata is not None and len(dumps(metadata)) > MAX_METADATA_BYTES:
            raise TitoError(f"metadata is larger than {MAX_METADATA_BYTES} bytes as JSON", status=413)
        note = validated(AnnotationRecord, {**obj, "session_id": session_id, "ts": time.time()}, "annotation")
        recorded = await self._recorded(session_id)
        if recorded is None or not recorded.turns:
            raise NotFound(f"session {session_id!r} has no recorded turns")
        if turn_id is not None and all(turn.turn_id != turn_id for turn in recorded.turns):
            raise NotFound(f"session {session_id!r} has no recorded turn {turn_id}")
        recorder = self.sessions().recorder
        assert recorder is not None
        try:
            recorder.write_annotation(note)
        except OSError as exc:
            raise TitoError(f"cannot write the annotation: {exc}", status=500) from exc
        written = note.model_dump(by_alias=True, exclude_none=True)
        return json_reply(200, dumps({"session_id": session_id, "annotation": written}))

    async def wait(self, session_id: str, query: dict[str, str]) -> HttpReply:
        timeout = bounded_float(query.get("timeout", "30"), "timeout", 0.0, MAX_WAIT_S)
        # A 404 for a session neither live nor recorded, found without reading its record (a driver waits on every
        # episode, and a long one's record is megabytes).
        if not (await self._state(session_id))["live"] and not session_paths(self._record_dir(), session_id):
            raise NotFound(f"no session {session_id!r} is live or recorded")
        started = time.monotonic()
        while True:
            in_flight = (await self._state(session_id))["in_flight"]
            waited = time.monotonic() - started
            if in_flight == 0 or waited >= timeout:
                body = {"session_id": session_id, "idle": in_flight == 0, "in_flight": in_flight, "waited_s": waited}
                return json_reply(200, dumps(body))
            await asyncio.sleep(POLL_S)

    async def close(self, session_id: str, body: bytes) -> HttpReply:
        obj = checked_body(body) if body.strip() else {}
        unknown = sorted(set(obj) - {"timeout"})
        if unknown:
            raise BadRequest(f"unknown field(s): {', '.join(unknown)}; allowed: timeout")
        timeout = bounded_float(obj.get("timeout", 30), "timeout", 0.0, MAX_WAIT_S)
        recorded = await self._recorded(session_id)
        closed_now = await self._close(session_id, time.monotonic() + timeout)
        if closed_now is None and (recorded is None or not recorded.turns):
            raise NotFound(f"no session {session_id!r} is live or recorded")
        already = closed_now is None and recorded is not None and recorded.closed_by_driver
        turns = closed_now if closed_now is not None else len(recorded.turns if recorded is not None else ())
        if not already:
            recorder = self.sessions().recorder
            assert recorder is not None
            try:
                recorder.close_session(session_id, turns, "closed")
            except OSError as exc:
                raise TitoError(f"cannot write the close line: {exc}", status=500) from exc
            logger.info("tito: session %s closed by its driver after %d turns", session_id, turns)
        body_out = {"session_id": session_id, "closed": True, "turns": turns, "already_closed": already}
        return json_reply(200, dumps(body_out))

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
                raise busy(session_id)
            await asyncio.sleep(POLL_S)


def rows_format(layout: Any, file_type: Any, *, summary: bool = False) -> tuple[str, str]:
    if layout not in LAYOUTS:
        raise BadRequest(f"unknown format {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    types = ROW_FILE_TYPES + (("summary",) if summary else ())
    if file_type not in types:
        raise BadRequest(f"unknown file type {file_type!r}; choose one of: {', '.join(types)}")
    return layout, file_type


def rows_options(obj: dict[str, Any]) -> ExportOptions:
    """The grouping a rows call asks: `calls` (a list or a comma-separated string), `group_size`, `group_policy`,
    `dedupe_shared_turns`."""
    calls = obj.get("calls")
    if isinstance(calls, list) and all(isinstance(c, str) for c in calls):
        calls = ",".join(calls)
    if calls is not None and not isinstance(calls, str):
        raise BadRequest("calls must be a list of call names or a comma-separated string")
    size, policy, dedupe = obj.get("group_size"), obj.get("group_policy", "refuse"), obj.get("dedupe_shared_turns")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 1_000_000):
        raise BadRequest("group_size must be an integer from 1 to 1000000")
    if policy not in GROUP_POLICIES:
        raise BadRequest(f"group_policy must be one of: {', '.join(GROUP_POLICIES)}")
    if dedupe is not None and not isinstance(dedupe, bool):
        raise BadRequest("dedupe_shared_turns must be true or false")
    try:
        return ExportOptions(parse_calls(calls), size, policy, bool(dedupe))
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc


def state_of(status: SessionStatus) -> dict[str, Any]:
    """What the control API says of a session's state: whether it is live, its turns in flight and last activity
    where the sessions know them."""
    fields = {"live": status.live, "in_flight": status.in_flight, "last_activity": status.last_activity}
    return {key: value for key, value in fields.items() if value is not None}


def checked_body(body: bytes) -> dict[str, Any]:
    """A control request's JSON object, held to the agent APIs' rules: strict JSON, at most 100 levels deep, finite
    numbers, valid Unicode."""
    obj = parse_json_object(body)
    problem = json_value_problem(obj)
    if problem is not None:
        raise BadRequest(f"request body refused: {problem}")
    return obj


def finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer of hundreds of digits
        return False


def busy(session_id: str) -> TitoError:
    return TitoError(f"a turn of session {session_id!r} is still in flight; nothing was closed", status=409)


def dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False).encode()


def bounded_int(value: str, name: str, low: int, high: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise BadRequest(f"{name} must be an integer") from None
    if not low <= number <= high:
        raise BadRequest(f"{name} must be between {low} and {high}")
    return number


def bounded_float(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool):
        raise BadRequest(f"{name} must be a number of seconds")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise BadRequest(f"{name} must be a number of seconds") from None
    if not math.isfinite(number) or not low <= number <= high:
        raise BadRequest(f"{name} must be between {low:g} and {high:g} seconds")
    return number


def flag(value: str, name: str) -> bool:
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no", ""):
        return False
    raise BadRequest(f"{name} must be true or false")
