"""The example rollout driver (examples/rollout_driver.py) at small scale: 4 tasks x 2 samples, 8 concurrent episodes
of an unmodified openai-python agent through a real mitmdump in regular mode, named by proxy auth, scored, grouped by
task, closed, and their rows written by one rows call to one Parquet file that `datasets` loads; every row is the
episode's recorded ids, exactly, and each task's rows are one group, together, numbered across the file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import datasets
from conftest import tokenizer_path
from proxy_harness import REPO, Mitmdump

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

TOKEN = "driver-token-0123456789abcdef"
TASKS, SAMPLES = 4, 2
EPISODES = TASKS * SAMPLES


def test_the_example_driver_writes_one_trainer_file(tmp_path: Path) -> None:
    record_dir, out = tmp_path / "rec", tmp_path / "rollouts.parquet"
    with (
        ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica,
        Mitmdump(
            "",
            tokenizer=tokenizer_path("qwen3"),
            record_dir=record_dir,
            cwd=tmp_path,
            mode="regular",
            options={"tito_control_token": TOKEN},
        ) as proxy,  # fmt: skip
    ):
        driver = subprocess.run(
            [
                sys.executable, str(REPO / "examples" / "rollout_driver.py"), "--proxy", proxy.url, "--token", TOKEN,
                "--base-url", replica.url + "/v1", "--tasks", str(TASKS), "--samples", str(SAMPLES),
                "--concurrency", "4", "--prefix", "ep", "--out", str(out),
            ],
            cwd=tmp_path, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert driver.returncode == 0, driver.stderr[-3000:]
        generated = {tuple(g["completion_ids"]) for g in replica.generated()}
    assert f"{EPISODES} episodes" in driver.stdout and f"{EPISODES} rows in {TASKS} groups" in driver.stdout

    rows = datasets.Dataset.from_parquet(str(out)).to_list()
    sessions = {f.turns[0].session_id: f for f in iter_session_files(record_dir)}
    assert sorted(sessions) == [f"ep-{i:04d}" for i in range(EPISODES)], "one session per episode, by its name"
    assert sorted(row["session_id"] for row in rows) == sorted(sessions), "one branch per episode"
    # One rows call for all episodes: each task a group of SAMPLES rows, together, numbered across the file.
    assert [row["session_id"] for row in rows] == [f"ep-{i:04d}" for i in range(EPISODES)]
    assert [row["group"] for row in rows] == [f"task-{i // SAMPLES}" for i in range(EPISODES)]
    assert [row["group_index"] for row in rows] == [i // SAMPLES for i in range(EPISODES)]
    assert [row["rollout_id"] for row in rows] == [row["index"] for row in rows] == list(range(EPISODES))
    for row in rows:
        recorded = sessions[row["session_id"]]
        assert [c.reason for c in recorded.closes] == ["closed"], "the driver closed every episode"
        (path,) = list(recorded.branches())
        prompt, completion = recorded.full_ids()[path[-1].turn_id]
        assert row["input_ids"] == prompt + completion
        sampled = [i for i, m in enumerate(row["loss_mask"]) if m]
        assert len(sampled) == sum(len(t.completion_ids) for t in path)
        for turn in path:
            assert tuple(turn.completion_ids) in generated, "every sampled span is what the backend generated"
            span = row["input_ids"][turn.prompt_len : turn.prompt_len + len(turn.completion_ids)]
            assert span == list(turn.completion_ids)
            assert row["rollout_logprobs"][turn.prompt_len : turn.prompt_len + len(turn.completion_ids)] == list(
                turn.completion_logprobs
            )
        metadata = json.loads(row["metadata"])
        # The rule (examples/rollout_driver.py `score`), applied to what the agent reported.
        expected = 1.0 if metadata["tool_calls"] and metadata["finish_reason"] == "stop" else 0.5
        expected = 0.0 if metadata["finish_reason"] != "stop" or metadata["tool_errors"] else expected
        assert row["reward"] == expected and row["labels"]
