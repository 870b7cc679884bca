"""The sessions a subcommand reads, as its command line names them: `--session ID`, `--session-prefix P` (both
repeatable) and `--sessions-file FILE`, or one record file; `show`, `export`, `audit` and `redrive` share them."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

from tito_addon.records.record_reader import (
    RecordError,
    SessionFile,
    base_name,
    iter_session_files,
    merge_parts,
    read_session,
    session_parts,
)


def shown_sessions(path: Path, session_ids: list[str] | None) -> Iterator[SessionFile]:
    """What `show` reads: every session of a record dir, the named ones (whole ids), or the session of one record
    file (with its other writers' parts beside it, without which its turns may not rebuild)."""
    if path.is_file():
        if session_ids is not None:
            raise RecordError("--session names sessions of a record dir; a record file is already one session")
        yield merge_parts(session_parts(path.parent).get(base_name(path.name), [path]))
        return
    if session_ids is None:
        yield from iter_session_files(path)
        return
    if not path.is_dir():
        raise RecordError(f"{path} is not a directory")
    for session_id in dict.fromkeys(session_ids):
        session_file = read_session(path, session_id)
        if session_file is None:
            raise RecordError(f"no session {session_id!r} in {path}")
        yield session_file


def add_selection(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--session", action="append", metavar="ID", help=f"{what} this session, its whole id (repeatable)"
    )
    parser.add_argument(
        "--session-prefix",
        action="append",
        metavar="P",
        help=f"{what} every session whose id starts with P, in id order (repeatable)",
    )
    parser.add_argument(
        "--sessions-file",
        type=Path,
        metavar="FILE",
        help=f"{what} the sessions named in FILE: one id a line, blank and # lines skipped",
    )


def selection(args: argparse.Namespace) -> list[str] | None:
    """The ids `--session`, `--sessions-file` and `--session-prefix` name, or None (every session)."""
    from tito_addon.records.session_selection import select_sessions

    if args.record_dir.is_file():
        asked = args.session or args.session_prefix or args.sessions_file
        return [] if asked else None  # `shown_sessions` refuses a selection on one file
    return select_sessions(args.record_dir, args.session, args.session_prefix, args.sessions_file)
