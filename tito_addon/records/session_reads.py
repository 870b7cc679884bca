"""Sessions read once and kept while their files do not change: what every list over a record dir reads again.

A session is read again only when one of its parts changed (its size or mtime), appeared or went; a session whose
files are all gone is forgotten. The control API's list (`FileRecords.each_session`) and the record browser's catalog
(`record_catalog`) keep what they read of a dir this way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

Stamp = tuple[tuple[str, int, int], ...]


class SessionReads[T]:
    """What `read` made of each session's parts (`read(base file name, parts)`), by base file name."""

    def __init__(self, read: Callable[[str, list[Path]], T]) -> None:
        self.read = read
        self._kept: dict[str, tuple[Stamp, T]] = {}

    def refresh(self, found: dict[str, list[Path]]) -> tuple[dict[str, T], tuple[tuple[str, Stamp], ...]]:
        """For each session of `found` (`session_parts`) whose files are there: what `read` made of it, read again
        where a file changed; and every session's stamp, which changes whenever any of its files does."""
        out: dict[str, T] = {}
        stamps = []
        for name, paths in found.items():
            try:
                stamp = tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in paths)
            except OSError:
                continue  # a part removed between the listing and now: the next refresh sees what is left
            kept = self._kept.get(name)
            if kept is None or kept[0] != stamp:
                kept = self._kept[name] = (stamp, self.read(name, paths))
            out[name] = kept[1]
            stamps.append((name, stamp))
        for gone in set(self._kept) - set(found):
            del self._kept[gone]
        return out, tuple(stamps)
