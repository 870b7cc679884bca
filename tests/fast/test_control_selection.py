"""The control API at the scale of a run, through a real mitmdump and `TitoClient`: the listing filtered by an id
prefix, `POST /v1/rows` selecting by `session_prefix` (the bytes `export --session-prefix` writes), a group-size
refusal naming the session, and `GET /v1/sessions/{id}` giving the annotation lines themselves and what they add up
to (the listing keeps only their count, under another name)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.basics import tokenizer_path
from support.proxy_harness import REPO, Mitmdump
from support.recorded_run import EPISODES, record_run

from tito_addon.client import TitoClient, TitoControlError
from tito_addon.records.record_reader import read_session

TOKEN = "control-token-0123456789abcdef"


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    record_dir = record_run(tmp_path_factory.mktemp("run"))  # four `run7-` episodes and a stray one
    cwd = tmp_path_factory.mktemp("proxy")
    with Mitmdump("", tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=cwd, mode="regular",
                  options={"tito_control_token": TOKEN}) as proxy:  # fmt: skip
        with TitoClient(proxy.url, TOKEN) as tito:
            yield tito, record_dir


def test_the_listing_takes_a_prefix_and_counts_annotations_by_their_own_name(control) -> None:
    tito, _ = control
    listed = {row["session_id"]: row for row in tito.sessions(prefix="run7-")}
    assert set(listed) == {s for s in EPISODES if s.startswith("run7-")}
    assert {s: row["annotation_count"] for s, row in listed.items()} == {
        "run7-a0": 2, "run7-a1": 1, "run7-b0": 1, "run7-b1": 1
    }  # fmt: skip
    assert all("annotations" not in row for row in listed.values())
    assert [row["session_id"] for row in tito.sessions(prefix="stray")] == ["stray-1"]
    assert tito.sessions(prefix="run9-") == []
    assert len(tito.sessions()) == len(EPISODES)


def test_get_session_gives_the_annotation_lines_and_what_they_add_up_to(control) -> None:
    tito, record_dir = control
    one = tito.session("run7-a0")
    recorded = read_session(record_dir, "run7-a0")
    assert recorded is not None
    assert one["annotations"] == [n.model_dump(by_alias=True, exclude_none=True) for n in recorded.annotations]
    assert [n.get("turn_id") for n in one["annotations"]] == [None, 1] and one["annotation_count"] == 2
    assert (one["reward"], one["labels"], one["group"], one["metadata"]) == (1.0, ["scored", "checked"], "paris",
                                                                             {"seed": 3})  # fmt: skip
    assert one["episodes"] == [{"episode": "run7-a0", "reward": 1.0, "labels": ["scored", "checked"],
                                "metadata": {"seed": 3}, "group": "paris", "segments": 1}]  # fmt: skip
    stray = tito.session("stray-1")
    assert stray["reward"] is None and stray["group"].startswith("auto-") and stray["labels"] == ["scored"]


def export_bytes(record_dir: Path, out: Path, *args: str) -> bytes:
    argv = [sys.executable, "-m", "tito_addon", "export", str(record_dir), str(out), "--format", "verl", *args]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return out.read_bytes()


def test_rows_by_prefix_are_the_exports_bytes(control, tmp_path: Path) -> None:
    tito, record_dir = control
    run = sorted(s for s in EPISODES if s.startswith("run7-"))
    fetched = tito.export_rows(session_prefix="run7-", format="verl", to="parquet", group_size=2)
    assert fetched == export_bytes(record_dir, tmp_path / "p.parquet", "--session-prefix", "run7-", "--group-size", "2")
    assert fetched == tito.export_rows(run, format="verl", to="parquet", group_size=2)
    # Named sessions first, then the prefix's others in id order, each once.
    mixed = tito.export_rows(["run7-b0", "run7-a1"], session_prefix="run7-", format="verl", to="summary")
    assert [g["group"] for g in mixed["groups"]] == ["lima", "paris"] and mixed["episodes"] == 4


def test_a_bad_or_empty_rows_selection_is_refused(control) -> None:
    tito, _ = control
    with pytest.raises(TitoControlError) as stray:
        tito.export_rows(session_prefix="stray", format="verl", group_size=2)
    assert stray.value.status == 409 and "sessions: stray-1" in stray.value.message
    with pytest.raises(TitoControlError) as none:
        tito.export_rows(session_prefix="run9-")
    assert none.value.status == 404 and "'run9-'" in none.value.message
    with pytest.raises(TitoControlError) as empty:
        tito.export_rows(session_prefix="")
    assert empty.value.status == 400
    with pytest.raises(TitoControlError) as neither:
        tito.export_rows()
    assert neither.value.status == 400 and "session_prefix" in neither.value.message
