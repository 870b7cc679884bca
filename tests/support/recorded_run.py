"""A run's worth of sessions (`recorded_sessions.record_episodes`): a run `run7-` of two tasks, a stray session of
another run, and a later turn-level note; looked at and exported as a run by the run-selection tests."""

from __future__ import annotations

import time
from pathlib import Path

from tito_addon.records.record_models import AnnotationRecord

from .recorded_sessions import record_episodes

#: session -> (first request, group, reward): a run `run7-` of two tasks, a stray session of another run.
EPISODES = {
    "run7-b1": ("Weather in Lima?", "lima", 0.5),
    "run7-a0": ("Weather in Paris?", "paris", 1.0),
    "run7-a1": ("Weather in Paris?", "paris", 0.0),
    "run7-b0": ("Weather in Lima?", "lima", 0.25),
    "stray-1": ("And how is the weather in Rome today, please?", None, None),
}


def record_run(out: Path) -> Path:
    recorder = record_episodes(out, EPISODES)
    # A later, turn-level note: its labels join the episode's, its metadata is the episode's.
    recorder.write_annotation(
        AnnotationRecord(session_id="run7-a0", turn_id=1, ts=time.time(), labels=["checked"], metadata={"seed": 3})
    )
    return out
