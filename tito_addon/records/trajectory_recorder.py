"""Writes committed turns to `<record_dir>/<session file>.jsonl`, one flushed line per turn.

Each line is written with a single `os.write` on an `O_APPEND` descriptor, so concurrent sessions never
interleave inside a line and a line is in the kernel before the agent receives its answer. The descriptors of the
most recent sessions stay open (`OPEN_FILES`): an append is then an `fstat` and the write, instead of open, stat,
read, write and close. A file removed since (or replaced, or its directory removed) is opened again at its path; a
file renamed is followed, as a logger follows its file until it is told to reopen. A size other than our last line
left means another writer appended, so the last byte is checked as on a fresh open. File names are
derived from session ids so that no client-supplied id can name a path outside the record dir.

When several proxy processes share one session space, a session's turns come from several writers, possibly on
different NFS clients, where O_APPEND is not atomic. So a recorder given a writer id writes its own part of each
session, `<name>+<writer>.jsonl`, which no other process appends to; readers merge the parts (`record_reader`).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tito_addon.records.record_models import (
    ROUTES_SUFFIX,
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
OPEN_FILES = 256  # at most an eighth of the descriptors: each agent also holds two sockets of the proxy's
_APPEND_FLAGS = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def session_file_name(session_id: str) -> str:
    """A file name that is the id itself when harmless, else a digest of it; never a path. An id that looks like a
    digest name (`sid-…`) is digested too, so no id can name another session's file."""
    if _SAFE_NAME.fullmatch(session_id) and ".." not in session_id and not session_id.lower().startswith(DIGESTED):
        return f"{session_id}.jsonl"
    return f"{DIGESTED}{hashlib.sha256(session_id.encode('utf-8', 'surrogatepass')).hexdigest()[:40]}.jsonl"


def routes_file_name(jsonl_name: str) -> str:
    """The side file that keeps the MoE routes of the turns of one session file (`<name>[+writer].routes`)."""
    return jsonl_name[: -len(SUFFIX)] + ROUTES_SUFFIX


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


def _descriptor_limit() -> int:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 1024
    return soft if soft > 0 else 1 << 20  # RLIM_INFINITY is -1


@dataclass(slots=True)
class _OpenFile:
    fd: int
    end: int  # the file's size after our last line (-1: none written through this descriptor yet)


class TrajectoryRecorder:
    def __init__(self, record_dir: str | os.PathLike[str], writer: str | None = None) -> None:
        self.record_dir = Path(record_dir)
        self.writer = None if writer is None else check_writer_id(writer)
        self._checked: dict[str, Path] = {}
        self._open: OrderedDict[str, _OpenFile] = OrderedDict()  # least recently appended first
        self.open_files = min(OPEN_FILES, _descriptor_limit() // 8)

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
        data = line + b"\n"
        held = self._open.pop(session_id, None)
        size = -1
        if held is not None:
            try:
                now = os.fstat(held.fd)
                if now.st_nlink:
                    size = now.st_size
            except OSError:
                pass
            if size < 0:  # removed since (or replaced, or its directory removed): opened again at its path
                os.close(held.fd)
                held = None
        if held is None:
            fd = self._open_file(path)
            try:
                opened = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            held, size = _OpenFile(fd, -1), opened.st_size
        try:
            # Not where our last line ended (a fresh open, or another writer appended): a line torn by a crash
            # stays its own (skipped) line.
            if size and size != held.end and os.pread(held.fd, 1, size - 1) != b"\n":
                data = b"\n" + data
            written = os.write(held.fd, data)
            while written < len(data):  # only on exotic filesystems; keep the line whole
                written += os.write(held.fd, data[written:])
        except BaseException:
            os.close(held.fd)  # a descriptor whose last line may be torn is not kept
            raise
        held.end = size + len(data)
        self._open[session_id] = held
        if len(self._open) > self.open_files:
            os.close(self._open.popitem(last=False)[1].fd)

    def _open_file(self, path: Path) -> int:
        try:
            return os.open(path, _APPEND_FLAGS, 0o644)
        except FileNotFoundError:  # no record dir yet (or it was removed): made here, not checked on every line
            self.ensure_dir()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or not self._open:
                raise
            self.close()  # out of descriptors: the held files give theirs back before a turn is lost
        return os.open(path, _APPEND_FLAGS, 0o644)

    def release(self, session_id: str) -> None:
        """Close the session's file, if it is held open."""
        held = self._open.pop(session_id, None)
        if held is not None:
            os.close(held.fd)

    def close(self) -> None:
        while self._open:
            os.close(self._open.popitem()[1].fd)

    def __del__(self) -> None:
        try:
            self.close()
        except (AttributeError, OSError):
            pass

    def write_routes(self, session_id: str, data: bytes) -> tuple[str, int]:
        """A turn's MoE routes appended to this writer's side file of the session (`routes_file_name`), before its
        line: the file's name and the offset they start at. Bytes a crash leaves before their line are never read."""
        name = routes_file_name(self.path_for(session_id).name)
        path = self.record_dir / name
        fd = self._open_file(path)
        try:
            offset = os.fstat(fd).st_size
            written = os.write(fd, data)
            while written < len(data):
                written += os.write(fd, data[written:])
        finally:
            os.close(fd)
        return name, offset

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
        try:
            self._append(session_id, record.model_dump_json(by_alias=True).encode())
        finally:
            self.release(session_id)
