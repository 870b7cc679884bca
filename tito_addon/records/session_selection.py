"""Which recorded sessions an export (or `show`, `audit`, the control API's `POST /v1/rows`) takes: named ones, the
ids of a sessions file, and every session whose id starts with a prefix.

A run's episodes share a prefix (`run-17-…`) or are listed by the driver, so naming thousands of `--session` flags is
never needed. The selection is an ordered list of ids: the named ids in the order named, then each prefix's matches
in id order, each id once; the order is the export's (groups appear in the order their first episode does), so the
same ids in the same order give the same bytes however they were selected. Nothing that selects no session passes:
an empty prefix, a prefix that matches nothing, a file that names nothing are errors, never "every session".
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tito_addon.records.record_reader import RecordError, session_parts
from tito_addon.records.trajectory_recorder import DIGESTED, SUFFIX

MAX_SESSIONS_FILE_BYTES = 64 * 1024 * 1024


def recorded_session_ids(record_dir: Path) -> list[str]:
    """The id of every session recorded in `record_dir`, sorted. A file named for its id (`<id>.jsonl`, parts
    `<id>+<writer>.jsonl`) is not opened; only a digest-named one (an id that is not a safe file name) has its first
    line read, so listing a run of thousands of sessions stays cheap."""
    if not record_dir.is_dir():
        raise RecordError(f"{record_dir} is not a directory")
    ids = []
    for name, paths in session_parts(record_dir).items():
        if not name.startswith(DIGESTED):
            ids.append(name[: -len(SUFFIX)])
            continue
        session_id = _first_session_id(paths)
        if session_id is not None:
            ids.append(session_id)
    return sorted(ids)


def _first_session_id(paths: list[Path]) -> str | None:
    for path in paths:
        with path.open("rb") as handle:
            for raw in handle:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue  # a torn line: the next one says the same id
                if isinstance(line, dict) and isinstance(line.get("session_id"), str):
                    return line["session_id"]
    return None


def read_sessions_file(path: Path) -> list[str]:
    """The ids of a sessions file: one a line, surrounding blanks stripped; blank lines and `#` comments skipped."""
    try:
        if path.stat().st_size > MAX_SESSIONS_FILE_BYTES:
            raise RecordError(f"{path} is larger than {MAX_SESSIONS_FILE_BYTES} bytes")
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordError(f"cannot read the sessions file {path}: {exc}") from exc
    ids = [line.strip() for line in text.splitlines()]
    ids = [line for line in ids if line and not line.startswith("#")]
    if not ids:
        raise RecordError(f"the sessions file {path} names no session (one id a line; blank and # lines are skipped)")
    return ids


def with_prefixes(ids: Iterable[str], prefixes: Iterable[str], named: Iterable[str]) -> list[str]:
    """`named`, then each prefix's matches among `ids` (in id order), each once. Every prefix must match."""
    ordered = sorted(ids)
    selected = list(named)
    for prefix in prefixes:
        if not prefix:
            raise RecordError("a session prefix must not be empty (leave out every selection to take every session)")
        matched = [session_id for session_id in ordered if session_id.startswith(prefix)]
        if not matched:
            raise RecordError(f"no recorded session's id starts with {prefix!r}")
        selected += matched
    return list(dict.fromkeys(selected))


def select_sessions(
    record_dir: Path,
    sessions: Iterable[str] | None = None,
    prefixes: Iterable[str] | None = None,
    sessions_file: Path | None = None,
) -> list[str] | None:
    """The ids a selection names (see the module's docstring), or None when nothing was asked: every session."""
    named = list(sessions or ())
    if sessions_file is not None:
        named += read_sessions_file(sessions_file)
    prefixes = list(prefixes or ())
    if not named and not prefixes:
        return None
    return with_prefixes(recorded_session_ids(record_dir) if prefixes else [], prefixes, named)
