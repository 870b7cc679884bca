"""Rows a trainer trains on as they are: each episode's GRPO group (the driver's, or found from identical first
requests), groups contiguous and numbered across the export, one rollout id per episode, group sizes refused, dropped
or padded, shared turns counted and optionally trained once, and verl's dataset rows; through the export command,
on sessions recorded from a real tokenizer and the sglang replica."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.basics import REPO
from support.recorded_sessions import record_episodes

from tito_addon.records.episode_segments import episode_segments
from tito_addon.records.record_models import AnnotationRecord
from tito_addon.records.record_reader import iter_session_files, read_session
from tito_addon.records.rollout_groups import AUTO_PREFIX, GroupSizeError, PlacedRow
from tito_addon.records.segment_branches import branch_of
from tito_addon.records.trainer_rows import ExportOptions, rows_of, verl_row

#: session -> (first request, driver's group or None, reward)
EPISODES = {
    "a0": ("Weather in Paris?", "task-a", 1.0),
    "b0": ("Weather in Lima?", "task-b", 1.0),
    "a1": ("Weather in Paris?", "task-a", 0.0),
    "c0": ("Is it warm in Oslo?", None, 0.25),
    "a2": ("Weather in Paris?", "task-a", 0.5),
    "c1": ("Is it warm in Oslo?", None, 0.75),
    "b1": ("Weather in Lima?", "task-b", 1.0),
    "d0": ("How is Rome?", None, None),
}


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory) -> Path:
    """The 8 episodes above (one session each, written in that order, annotated) and session `s`, the tree of
    test_trainer_export (branches [0, 1, 3], [0, 1, 2, 4] and an edited root [5]), rewarded 0.5."""
    out = tmp_path_factory.mktemp("groups")
    recorder = record_episodes(out, EPISODES, tree=True)
    recorder.write_annotation(AnnotationRecord(session_id="s", ts=time.time(), reward=0.5))
    return out


def files_of(record_dir: Path, sessions: list[str]):
    return [read_session(record_dir, s) for s in sessions]


def run_export(record_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tito_addon", "export", str(record_dir), str(out), *args],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip


def test_groups_are_contiguous_and_numbered_across_the_export(record_dir: Path) -> None:
    order = [*EPISODES, "s"]
    rows, arrangement = rows_of(files_of(record_dir, order), "verl")
    groups = [row["group"] for row in rows]
    # Each group's rows together, groups in the order each first appears, episodes in theirs.
    assert [g for k, g in enumerate(groups) if k == 0 or groups[k - 1] != g] == list(dict.fromkeys(groups))
    assert [row["session_id"] for row in rows][:7] == ["a0", "a1", "a2", "b0", "b1", "c0", "c1"]
    by_session = {}
    for row in rows:
        by_session.setdefault(row["session_id"], []).append(row)
    assert {s: r[0]["group"] for s, r in by_session.items() if s[0] in "ab"} == {
        "a0": "task-a", "a1": "task-a", "a2": "task-a", "b0": "task-b", "b1": "task-b"
    }  # fmt: skip
    # Id-less siblings (identical first requests) share a group; another first request is another group.
    auto = {s: by_session[s][0]["group"] for s in ("c0", "c1", "d0", "s")}
    assert all(g.startswith(AUTO_PREFIX) for g in auto.values())
    assert auto["c0"] == auto["c1"] and len({auto["c0"], auto["d0"], auto["s"]}) == 3
    for row in rows:
        assert row["uid"] == row["group"]
    assert [row["index"] for row in rows] == list(range(len(rows)))
    group_index = [row["group_index"] for row in rows]
    assert group_index == sorted(group_index) and set(group_index) == set(range(5))
    # One rollout id per episode, on every row of it (session s: three segments, one episode).
    rollout = {s: {r["rollout_id"] for r in found} for s, found in by_session.items()}
    assert all(len(ids) == 1 for ids in rollout.values()) and len(by_session["s"]) == 3
    assert sorted(next(iter(ids)) for ids in rollout.values()) == list(range(len(order)))
    summary = arrangement.summary()
    sizes = {g["group"]: (g["episodes"], g["rows"]) for g in summary["groups"]}
    assert sizes["task-a"] == (3, 3) and sizes["task-b"] == (2, 2) and sizes[auto["c0"]] == (2, 2)
    assert sizes[auto["s"]] == (1, 3) and summary["rows"] == len(rows) and summary["episodes"] == len(order)


def test_the_automatic_group_is_the_first_request_as_the_model_saw_it(record_dir: Path) -> None:
    files = files_of(record_dir, ["c0", "c1", "d0"])
    rows, _ = rows_of(files, "generic")
    for session_file in files:
        segment = episode_segments([session_file])[0]
        prompt = session_file.full_ids()[segment.path[0].turn_id][0]
        row = next(r for r in rows if r["session_id"] == session_file.turns[0].session_id)
        assert row["input_ids"][: len(prompt)] == prompt
    first_prompts = {r["session_id"]: r["input_ids"][: files[0].turns[0].prompt_len] for r in rows}
    assert first_prompts["c0"] == first_prompts["c1"] != first_prompts["d0"]
    groups = {r["session_id"]: r["group"] for r in rows}
    assert groups["c0"] == groups["c1"] != groups["d0"]
    # A driver's group overrides it: the same record under a group given later is in that group.
    again, _ = rows_of(files_of(record_dir, ["a0"]), "generic")
    assert again[0]["group"] == "task-a"


def test_a_group_of_another_size_is_refused_dropped_or_padded(record_dir: Path, tmp_path: Path) -> None:
    sessions = ["a0", "a1", "a2", "b0", "b1"]
    files = files_of(record_dir, sessions)
    refused = "'task-b' has 2 rows \\(2 episodes; sessions: b0, b1\\), fewer than the group size 3"  # who to look at
    with pytest.raises(GroupSizeError, match=refused):
        rows_of(files, "slime", ExportOptions(group_size=3))
    rows, arrangement = rows_of(files, "slime", ExportOptions(group_size=3, group_policy="drop"))
    assert [r["session_id"] for r in rows] == ["a0", "a1", "a2"] and arrangement.summary()["dropped_groups"] == 1
    assert [r["index"] for r in rows] == [0, 1, 2] and [r["rollout_id"] for r in rows] == [0, 1, 2]
    rows, arrangement = rows_of(files, "slime", ExportOptions(group_size=3, group_policy="pad"))
    b = [r for r in rows if r["group"] == "task-b"]
    assert [r["padded"] for r in b] == [False, False, True] and [r["group_index"] for r in rows] == [0] * 3 + [1] * 3
    pad = b[-1]
    assert pad["tokens"] == b[0]["tokens"] and set(pad["loss_mask"]) == {0}, "a padding row trains nothing"
    assert pad["reward"] == statistics.mean(r["reward"] for r in b[:2]) and pad["rollout_id"] == b[0]["rollout_id"]
    assert [r["index"] for r in rows] == list(range(6))
    bigger = rows_of(files, "slime", ExportOptions(group_size=2, group_policy="drop"))[0]
    assert {r["group"] for r in bigger} == {"task-b"}
    with pytest.raises(GroupSizeError, match="more than the group size 2"):
        rows_of(files, "slime", ExportOptions(group_size=2, group_policy="pad"))
    with pytest.raises(GroupSizeError, match="cannot be padded to 2: rows of it have no reward \\(sessions: d0\\)"):
        rows_of(files_of(record_dir, ["d0"]), "verl", ExportOptions(group_size=2, group_policy="pad"))
    # The export command says the same, and writes nothing when it refuses.
    chosen = [arg for s in sessions for arg in ("--session", s)]
    refused = run_export(record_dir, tmp_path / "r.parquet", *chosen, "--format", "slime", "--group-size", "3")
    assert refused.returncode == 2 and "'task-b' has 2 rows" in refused.stderr
    assert not (tmp_path / "r.parquet").exists()
    drop = ["--group-size", "3", "--group-policy", "drop"]
    dropped = run_export(record_dir, tmp_path / "d.jsonl", *chosen, "--format", "verl", "--to", "jsonl", *drop)
    assert dropped.returncode == 0, dropped.stderr
    assert "3 episodes in 1 groups of 3 rows; 1 groups of another size left out" in dropped.stdout
    summary = tmp_path / "groups.json"
    assert run_export(record_dir, tmp_path / "p.jsonl", *chosen, "--to", "jsonl", *drop[:2], "--group-policy", "pad",
                      "--summary", str(summary)).returncode == 0  # fmt: skip
    groups = json.loads(summary.read_text())["groups"]
    assert [(g["group"], g["episodes"], g["rows"], g["padded"], g["group_index"]) for g in groups] == [
        ("task-a", 3, 3, 0, 0), ("task-b", 2, 2, 1, 1)
    ]  # fmt: skip
    assert [json.loads(line)["uid"] for line in (tmp_path / "d.jsonl").read_text().splitlines()] == ["task-a"] * 3


def test_shared_turns_are_counted_and_trained_once_on_request(record_dir: Path, tmp_path: Path) -> None:
    files = files_of(record_dir, ["s"])
    plain, arrangement = rows_of(files, "generic")
    assert arrangement.shared_turns == 2  # turns 0 and 1 lie in the branches ending at 3 and at 4
    deduped, again = rows_of(files, "generic", ExportOptions(dedupe_shared_turns=True))
    assert again.deduped and again.shared_turns == 2
    turns = {t.turn_id: t for t in files[0].turns}
    owners: dict[int, int] = {}
    for k, (before, after) in enumerate(zip(plain, deduped, strict=True)):
        assert before["input_ids"] == after["input_ids"] and before["rollout_logprobs"] == after["rollout_logprobs"]
        for turn_id in before["turn_ids"]:
            turn = turns[turn_id]
            span = slice(turn.prompt_len, turn.prompt_len + len(turn.completion_ids))
            assert set(before["loss_mask"][span]) == {1}
            if turn_id in owners:
                assert set(after["loss_mask"][span]) == {0}, "trained in its first row only"
            else:
                owners[turn_id] = k
                assert set(after["loss_mask"][span]) == {1}
    # Every sampled turn of the session trains exactly once.
    assert sum(sum(r["loss_mask"]) for r in deduped) == sum(len(t.completion_ids) for t in files[0].turns)
    assert sum(sum(r["loss_mask"]) for r in plain) > sum(sum(r["loss_mask"]) for r in deduped)
    said = run_export(record_dir, tmp_path / "s.parquet", "--session", "s")
    assert "2 sampled turns lie in more than one row: trained once per row holding them" in said.stdout
    said = run_export(record_dir, tmp_path / "s.parquet", "--session", "s", "--dedupe-shared-turns")
    assert "2 sampled turns lie in more than one row: trained in their first row only" in said.stdout


def test_a_row_without_response_tokens_gets_no_misplaced_reward(record_dir: Path) -> None:
    session_file = read_session(record_dir, "a0")
    segment = episode_segments([session_file])[0]
    first = segment.path[0]
    empty = first.model_copy(update={"completion_ids": [], "completion_logprobs": []})
    segment.path = [empty]
    prompt = session_file.full_ids()[first.turn_id][0]
    branch = branch_of(segment, {first.turn_id: (prompt, [])})
    row = verl_row(PlacedRow(branch, "g", 0, 0, 0))
    assert row["responses"] == [] and row["rm_scores"] == [] and row["reward_score"] == 1.0
    full = verl_row(PlacedRow(branch_of(episode_segments([session_file])[0], session_file.full_ids()), "g", 0, 0, 0))
    assert len(full["rm_scores"]) == len(full["responses"]) and full["rm_scores"][-1] == 1.0


def test_verl_dataset_rows_are_each_groups_first_request(record_dir: Path, tmp_path: Path) -> None:
    import datasets

    out = tmp_path / "prompts.parquet"
    args = [a for s in ("a0", "a1", "b0", "c0", "c1") for a in ("--session", s)]
    result = run_export(record_dir, out, *args, "--format", "verl-dataset")
    assert result.returncode == 0, result.stderr
    assert f"3 groups from 5 sessions written to {out} (verl-dataset, parquet)" in result.stdout
    rows = datasets.Dataset.from_parquet(str(out)).to_list()
    assert [r["extra_info"]["group"] for r in rows][:2] == ["task-a", "task-b"]
    assert [r["prompt"] for r in rows] == [
        [{"role": "user", "content": "Weather in Paris?"}],
        [{"role": "user", "content": "Weather in Lima?"}],
        [{"role": "user", "content": "Is it warm in Oslo?"}],
    ]
    recorded = {f.turns[0].session_id: f for f in iter_session_files(record_dir)}
    for row, session in zip(rows, ("a0", "b0", "c0"), strict=True):
        first = recorded[session].turns[0]
        assert json.loads(row["extra_info"]["messages_json"]) == first.appended_messages
        assert json.loads(row["extra_info"]["tools_json"]) == first.tools
        assert row["data_source"] == "tito" and row["reward_model"]["style"] == "rule"
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2]
    assert [r["extra_info"]["episodes"] for r in rows] == [2, 1, 2]
    assert rows[2]["extra_info"]["reward_mean"] == 0.5


def test_slime_rollout_files_say_where_torch_is_needed(record_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    try:
        import torch  # noqa: F401

        pytest.skip("this environment has torch: trainer_checks/test_trainer_loaders.py checks the files it writes")
    except ImportError:
        pass
    result = run_export(record_dir, tmp_path / "pt", "--session", "a0", "--format", "slime", "--to", "pt")
    assert result.returncode == 2 and "torch" in result.stderr and "slime_rollouts" in result.stderr
    wrong = run_export(record_dir, tmp_path / "pt", "--format", "verl", "--to", "pt")
    assert wrong.returncode == 2 and "only with --format slime" in wrong.stderr
