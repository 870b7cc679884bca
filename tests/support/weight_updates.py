"""What the weight-update tests share: an agent's turn run beside the test's trainer, and a session's recorded turns."""

from __future__ import annotations

import threading
from pathlib import Path

from tito_addon.records.record_reader import read_session


def during(fn, *args, **kwargs):
    """Run the agent's turn in a thread; the caller acts as the trainer meanwhile."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def turns(record_dir: Path, session: str) -> list:
    found = read_session(record_dir, session)
    return found.turns if found is not None else []
