"""Client-supplied session ids: which are accepted, which are refused and why.

A session id comes from a header or a `/sessions/{id}/` path and ends up in file names, logs and
`tito.sessions`, so it is checked once, where the request enters, before anything is looked up.
"""

from __future__ import annotations

import re
import secrets
import time
import unicodedata

MAX_SESSION_ID = 200
_ID_SEGMENTS = re.compile(r"[/\\]")
# Controls (C0, DEL, C1 incl. NEL), surrogates (undecodable header bytes) and the Unicode line/paragraph separators:
# anything that could split a log line or smuggle a header.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})


def session_id_problem(value: str) -> str | None:
    """Why a client-supplied session id is refused, or None when it is acceptable.

    Ids are never joined into a path (the recorder maps them to a safe name), but an id that looks like a path
    traversal or carries control characters is a client bug or an attack: refusing it keeps such values out of
    files, logs and `tito.sessions` altogether. Ordinary ids (unicode, spaces, `team/run-1`) stay accepted.
    """
    if not value:
        return "it is empty"
    if len(value) > MAX_SESSION_ID:
        return f"it is longer than {MAX_SESSION_ID} characters"
    if any(unicodedata.category(c) in _REFUSED_CATEGORIES for c in value):
        return "it contains a control character, a line separator or bytes that are not UTF-8"
    if value[0] in "/\\":
        return "it starts with a path separator"
    if ".." in _ID_SEGMENTS.split(value):
        return "it contains a '..' path segment"
    return None


def automatic_session_id() -> str:
    """A new automatic session's id: 32 hex characters, the first 14 its creation time in µs, so every proxy that
    sees two sessions orders them the same way (the older wins a tie), the rest random."""
    return f"{time.time_ns() // 1000:014x}{secrets.token_hex(9)}"
