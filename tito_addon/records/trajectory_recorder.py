"""Writes committed turns to `<record_dir>/<session file>.jsonl`, one flushed line per turn.

Each line is written with a single `os.write` on an `O_APPEND` descriptor, so concurrent sessions never
interleave inside a line and a line is in the kernel before the agent receives its answer. File names are
derived from session ids so that no client-supplied id can name a path outside the record dir.

When several proxy processes share one session space, a session's turns come from several writers, possibly on
different NFS clients, where O_APPEND is not atomic. So a recorder given a writer id writes its own part of each
session, `<name>+<writer>.jsonl`, which no other process appends to; readers merge the parts (`record_reader`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from tito_addon.records.record_models import (
    AnnotationRecord,
    SessionCloseRecord,
    TurnRecord,
    TurnWithdrawnRecord,
    dump_line,
)

logger = logging.getLogger(__name__)

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
# No `.` (so no `..`, no second suffix) and no `+`: `<name>+<writer>.jsonl` splits at its only `+`.
WRITER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
WRITER_SEPARATOR = "+"
SUFFIX = ".jsonl"
DIGESTED = "sid-"
_APPEND_FLAGS = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def session_file_name(session_id: str) -> str:
    """A file name that is the id itself when harmless, else a digest of it; never a path. An id that looks like a
    digest name (`sid-…`) is digested too, so no id can name another session's file."""
    if _SAFE_NAME.fullmatch(session_id) and ".." not in session_id and not session_id.lower().startswith(DIGESTED):
        return f"{session_id}.jsonl"
    return f"{DIGESTED}{hashlib.sha256(session_id.encode('utf-8', 'surrogatepass')).hexdigest()[:40]}.jsonl"


def check_writer_id(writer: str) -> str:
    if not isinstance(writer, str) or not WRITER_ID.fullmatch(writer):
        raise ValueError(f"writer id {writer!r} must match {WRITER_ID.pattern}")
    return writer


def writer_file_name(session_id: str, writer: str | None) -> str:
    """The file one writer appends a session's lines to; `session_file_name` when there is no writer id."""
    name = session_file_name(session_id)
    if writer is None:
        return name
    return name[: -len(SUFFIX)] + WRITER_SEPARATOR + check_writer_id(writer) + SUFFIX


def default_writer_id() -> str:
    """`<host>-<pid>-<random>`: unique among live processes on a shared filesystem. The random part because
    containers on different hosts often share a host name and a pid (1), and a restarted process may get a
    recycled pid; a new part per process start costs only a file."""
    host = re.sub(r"[^A-Za-z0-9_-]+", "-", socket.gethostname()).lstrip("-_")[:40].rstrip("-_") or "host"
    return check_writer_id(f"{host}-{os.getpid()}-{secrets.token_hex(3)}")


class TrajectoryRecorder:
    def __init__(self, record_dir: str | os.PathLike[str], writer: str | None = None) -> None:
        self.record_dir = Path(record_dir)
        self.writer = None if writer is None else check_writer_id(writer)
        self._checked: dict[str, Path] = {}

    def ensure_dir(self) -> None:
        self.record_dir.mkdir(parents=True, exist_ok=True)

    def path_for(self, session_id: str) -> Path:
        """This writer's own file for the session (other writers' parts: `record_reader.read_session`)."""
        path = self._checked.get(session_id)
        if path is not None:
            return path
        path = self.record_dir / writer_file_name(session_id, self.writer)
        # Belt and braces: the name above cannot contain a separator, but never trust it blindly. Checked once
        # per session (resolving costs a syscall per path component); O_NOFOLLOW guards every open.
        if path.resolve().parent != self.record_dir.resolve():
            raise ValueError("session file would leave the record dir")
        if len(self._checked) >= 65536:
            self._checked.clear()
        self._checked[session_id] = path
        return path

    def _append(self, session_id: str, line: bytes) -> None:
        path = self.path_for(session_id)
        try:
            fd = os.open(path, _APPEND_FLAGS, 0o644)
        except FileNotFoundError:  # no record dir yet (or it was removed): made here, not checked on every line
            self.ensure_dir()
            fd = os.open(path, _APPEND_FLAGS, 0o644)
        try:
            data = line + b"\n"
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # a line torn by a crash stays its own (skipped) line
            written = os.write(fd, data)
            while written < len(data):  # only on exotic filesystems; keep the line whole
                written += os.write(fd, data[written:])
        finally:
            os.close(fd)

    def write_turn(self, record: TurnRecord) -> None:
        self._append(record.session_id, record.dump_line())

    def write_turn_line(self, session_id: str, fields: dict[str, Any]) -> None:
        """A turn's line from its fields (`TurnRecord.line_fields`, or built as those are by `turns.turn_record`)."""
        self._append(session_id, dump_line(fields))

    def withdraw_turn(self, session_id: str, turn_id: int, reason: str) -> None:
        record = TurnWithdrawnRecord(session_id=session_id, turn_id=turn_id, reason=reason, ts=time.time())
        self._append(session_id, record.model_dump_json(by_alias=True).encode())

    def write_annotation(self, record: AnnotationRecord) -> None:
        self._append(record.session_id, record.model_dump_json(by_alias=True, exclude_none=True).encode())

    def close_session(self, session_id: str, turns: int, reason: str) -> None:
        record = SessionCloseRecord(session_id=session_id, turns=turns, reason=reason, ts=time.time())
        self._append(session_id, record.model_dump_json(by_alias=True).encode())
