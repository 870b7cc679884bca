"""The example rollout driver (examples/rollout_driver.py) at small scale: 4 tasks x 2 samples, 8 concurrent episodes
of an unmodified openai-python agent through a real mitmdump in regular mode, named by proxy auth, scored, grouped by
task, closed, and their rows written by one rows call to one Parquet file that `datasets` loads; every row is the
episode's recorded ids, exactly, and each task's rows are one group, together, numbered across the file.

Then what makes it safe for a newcomer: run twice (an explicit --prefix already used is refused before any agent
runs, the first run's records and rows byte-identical after; a default fresh prefix runs beside them), tasks of one's
own with a reward command (its rewards in the rows, the zero-variance warning, a garbage reward failing only its
episode), and the preflight refusals (a wrong token, no control API, no proxy, Claude Code's key prefix) with a
failed agent's own error text."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import datasets
import pytest
from support.basics import tokenizer_path
from support.proxy_harness import REPO, Mitmdump

from tito_addon.client import TitoClient
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
        # The default reward (examples/episode_rewards.py `tool_use`), applied to what the agent reported.
        expected = 1.0 if metadata["tool_calls"] and metadata["finish_reason"] == "stop" else 0.5
        expected = 0.0 if metadata["finish_reason"] != "stop" or metadata["tool_errors"] else expected
        assert row["reward"] == expected and row["labels"]


# ---------------------------------------------------------------------------------------------- run twice, preflight


def drive(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TITO_CONTROL_TOKEN"}
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "rollout_driver.py"), *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def regular_proxy(tmp_path: Path, **options: str) -> Mitmdump:
    return Mitmdump("", tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path, mode="regular",
                    options={"tito_control_token": TOKEN, **options})  # fmt: skip


def files_of(record_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(record_dir)): p.read_bytes() for p in sorted(record_dir.rglob("*")) if p.is_file()}


@pytest.mark.full  # three driver runs (12 s here): `make test` keeps the first test and the preflight's
def test_a_second_run_never_touches_the_first_runs_episodes(tmp_path: Path) -> None:
    """Same explicit --prefix twice: the second run is refused before any agent starts, naming the taken sessions,
    and the first run's records (rewards, labels, closes) and rows are byte-identical after it; then a run with the
    default fresh prefix succeeds beside them and leaves them byte-identical too. (About 15 s.)"""
    record_dir = tmp_path / "rec"
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica, regular_proxy(tmp_path) as proxy:
        common = ["--proxy", proxy.url, "--token", TOKEN, "--base-url", replica.url + "/v1", "--tasks", "2"]
        first = drive(*common, "--prefix", "same", "--out", str(tmp_path / "first.parquet"), cwd=tmp_path)
        assert first.returncode == 0, first.stderr[-3000:]
        names = [f"same-{i:04d}" for i in range(4)]
        with TitoClient(proxy.url, TOKEN) as tito:
            info = tito.info()
            rows_before = tito.export_rows(names, to="parquet", format="generic")
        assert info == {"version": metadata.version("tito_addon"), "session_api_key_prefix": None,
                        "after_close": "refuse", "proxy_auth_password_required": False, "backend_kind": "sglang",
                        "model_family": "qwen3", "tokenizer": tokenizer_path("qwen3")}  # fmt: skip
        records_before, generated = files_of(record_dir), len(replica.generated())

        started = time.monotonic()
        second = drive(*common, "--prefix", "same", "--out", str(tmp_path / "second.parquet"), cwd=tmp_path)
        assert second.returncode == 2, second.stderr[-3000:]
        assert "4 of this run's 4 episode names are already sessions" in second.stderr, second.stderr
        assert all(name in second.stderr for name in names) and "--prefix" in second.stderr
        assert "Traceback" not in second.stderr and time.monotonic() - started < 20
        assert len(replica.generated()) == generated, "no agent ran"
        assert not (tmp_path / "second.parquet").exists(), "nothing written"
        assert files_of(record_dir) == records_before, "the first run's records are byte-identical"

        fresh = drive(*common, "--out", str(tmp_path / "fresh.parquet"), cwd=tmp_path)
        assert fresh.returncode == 0, fresh.stderr[-3000:]
        (prefix,) = re.findall(r"^run prefix: (run-\d{8}-\d{6}-[0-9a-f]{4})$", fresh.stdout, re.M)
        with TitoClient(proxy.url, TOKEN) as tito:
            rows_after = tito.export_rows(names, to="parquet", format="generic")
    after = files_of(record_dir)
    assert {k: after[k] for k in records_before} == records_before, "still byte-identical after a fresh run"
    assert rows_after == rows_before
    fresh_rows = datasets.Dataset.from_parquet(str(tmp_path / "fresh.parquet")).to_list()
    assert [r["session_id"] for r in fresh_rows] == [f"{prefix}-{i:04d}" for i in range(4)]
    first_rows = datasets.Dataset.from_parquet(str(tmp_path / "first.parquet")).to_list()
    assert [r["session_id"] for r in first_rows] == names and all(r["reward"] is not None for r in first_rows)


SCORER = """import json, sys
episode = json.load(sys.stdin)
mode = sys.argv[1]
if mode == "garbage" and episode["episode"].endswith("1"):
    print("not a number")
elif mode == "same":
    print(0.5)
else:
    labels = ["truth=" + str(episode["ground_truth"]), "group=" + episode["group"], "exit=" + str(episode["exit_code"])]
    print(json.dumps({"reward": int(episode["episode"][-1]) / 4, "labels": labels}))
"""


@pytest.mark.full  # three driver runs (16 s here)
def test_tasks_file_and_reward_command_and_the_zero_variance_warning(tmp_path: Path) -> None:
    """A task file's tasks are the groups, the reward command's rewards and labels are the rows'; equal rewards in
    every group print the zero-variance warning, varied ones do not; a command printing garbage gives its episode no
    reward, says why, exits 1 and still writes the good groups. (About 15 s.)"""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "alpha", "prompt": "Weather in Paris?", "ground_truth": "Paris", "metadata": {"k": 1}}\n'
                     '{"prompt": "Is it warm in Lima?", "ground_truth": 7}\n')  # fmt: skip
    scorer = tmp_path / "score.py"
    scorer.write_text(SCORER)
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica, regular_proxy(tmp_path) as proxy:
        common = ["--proxy", proxy.url, "--token", TOKEN, "--base-url", replica.url + "/v1", "--tasks-file",
                  str(tasks)]  # fmt: skip
        runs = {}
        for mode in ("vary", "same", "garbage"):
            command = f"{shlex.quote(sys.executable)} {shlex.quote(str(scorer))} {mode}"
            runs[mode] = drive(*common, "--reward-command", command, "--prefix", mode, "--out",
                               str(tmp_path / f"{mode}.parquet"), cwd=tmp_path)  # fmt: skip

    assert runs["vary"].returncode == 0, runs["vary"].stderr[-3000:]
    assert "WARNING" not in runs["vary"].stderr, runs["vary"].stderr
    rows = datasets.Dataset.from_parquet(str(tmp_path / "vary.parquet")).to_list()
    assert [r["session_id"] for r in rows] == [f"vary-{i:04d}" for i in range(4)]
    assert [r["group"] for r in rows] == ["alpha", "alpha", "task-1", "task-1"]
    assert [r["reward"] for r in rows] == [0.0, 0.25, 0.5, 0.75], "the command's rewards"
    truths = ["truth=Paris"] * 2 + ["truth=7"] * 2
    assert [r["labels"] for r in rows] == [
        [t, f"group={r['group']}", "exit=0"] for t, r in zip(truths, rows, strict=True)
    ]
    assert json.loads(rows[0]["metadata"])["task_metadata"] == {"k": 1}

    assert runs["same"].returncode == 0, runs["same"].stderr[-3000:]
    assert "WARNING: every group's rewards are equal" in runs["same"].stderr and "train nothing" in runs["same"].stderr
    same = datasets.Dataset.from_parquet(str(tmp_path / "same.parquet")).to_list()
    assert [r["reward"] for r in same] == [0.5] * 4

    garbage = runs["garbage"]
    assert garbage.returncode == 1, garbage.stderr[-3000:]
    assert "garbage-0001: failed: reward failed" in garbage.stderr and "'not a number'" in garbage.stderr
    assert "Traceback" not in garbage.stderr
    kept = datasets.Dataset.from_parquet(str(tmp_path / "garbage.parquet")).to_list()
    # The failed episode leaves its group short: left out (--group-policy drop), the other written.
    assert [r["session_id"] for r in kept] == ["garbage-0002", "garbage-0003"] and "1 groups left out" in garbage.stdout


def test_preflight_refuses_a_wrong_token_an_unserved_control_api_and_an_unreachable_proxy(tmp_path: Path) -> None:
    """Each refused in seconds, exit 2, with the setting to fix named, no traceback, no agent run. (About 10 s.)"""
    with (
        ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica,
        regular_proxy(tmp_path) as proxy,
        Mitmdump("", tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "off", cwd=tmp_path,
                 mode="regular") as no_control,
    ):  # fmt: skip
        common = ["--base-url", replica.url + "/v1", "--prefix", "ep", "--out", str(tmp_path / "out.parquet")]
        started = time.monotonic()
        wrong = drive("--proxy", proxy.url, "--token", "wrong-token-0123456789", *common, cwd=tmp_path)
        elapsed = time.monotonic() - started
        unserved = drive("--proxy", no_control.url, "--token", TOKEN, *common, cwd=tmp_path)
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]  # bound, never listening: a refused connection
            unreachable = drive("--proxy", f"http://127.0.0.1:{port}", "--token", TOKEN, *common, cwd=tmp_path)
        assert replica.generated() == [], "no agent ran"
    for result in (wrong, unserved, unreachable):
        assert result.returncode == 2, result.stderr[-3000:]
        assert "Traceback" not in result.stderr and result.stdout == "", result.stderr
    assert elapsed < 15
    assert "tito_control_token" in wrong.stderr and "--token or $TITO_CONTROL_TOKEN" in wrong.stderr, wrong.stderr
    assert "401" in wrong.stderr
    assert "does not serve the control API" in unserved.stderr and "tito_control_token" in unserved.stderr
    assert f"cannot reach the proxy at http://127.0.0.1:{port} (--proxy)" in unreachable.stderr, unreachable.stderr
    assert not (tmp_path / "out.parquet").exists() and not list((tmp_path / "rec").glob("*.jsonl"))


STAND_IN_CLAUDE = """import json, pathlib, sys
pathlib.Path(sys.argv[1]).write_text(" ".join(sys.argv[2:]))
print(json.dumps({"type": "system", "subtype": "init"}))
print(json.dumps({"type": "result", "subtype": "success", "is_error": True,
                  "result": "API Error: 400 the stand-in's own error text"}))
sys.exit(1)
"""


def test_claude_code_preflight_checks_the_key_prefix_and_a_failed_agent_says_why(tmp_path: Path) -> None:
    """--agent claude-code with a stand-in CLI: a --key-prefix that is not the proxy's is refused before it starts;
    with the right one, its failure is printed with its own error text, and its episode (no turn recorded, so no
    session) is said to have none, not annotated, and the run exits 1 with nothing written. (About 8 s.)"""
    stand_in, ran = tmp_path / "claude.py", tmp_path / "ran.txt"
    stand_in.write_text(STAND_IN_CLAUDE)
    with (
        ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica,
        Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path,
                 options={"tito_control_token": TOKEN, "tito_session_api_key_prefix": "sk-other-",
                          "tito_proxy_auth_password": "never-shown-password"}) as proxy,
    ):  # fmt: skip
        with TitoClient(proxy.url, TOKEN) as tito:
            info = tito.info()
        common = ["--proxy", proxy.url, "--token", TOKEN, "--agent", "claude-code", "--claude",
                  f"{shlex.quote(sys.executable)} {shlex.quote(str(stand_in))} {shlex.quote(str(ran))}", "--tasks",
                  "1", "--samples", "1", "--prefix", "cc", "--out", str(tmp_path / "out.parquet")]  # fmt: skip
        mismatch = drive(*common, cwd=tmp_path)
        assert not ran.exists(), "refused before any agent started"
        failing = drive(*common, "--key-prefix", "sk-other-", "--model", "qwen3-test", cwd=tmp_path)
        assert replica.generated() == []
    assert info["session_api_key_prefix"] == "sk-other-" and info["proxy_auth_password_required"] is True
    assert "never-shown-password" not in json.dumps(info)
    assert mismatch.returncode == 2 and "Traceback" not in mismatch.stderr, mismatch.stderr
    assert "'sk-other-' (tito_session_api_key_prefix)" in mismatch.stderr
    assert "'sk-tito-' (--key-prefix)" in mismatch.stderr, mismatch.stderr
    assert failing.returncode == 1, failing.stderr[-3000:]
    assert "--model qwen3-test" in ran.read_text(), "the agent got --model"
    assert "cc-0000: failed: exit 1: API Error: 400 the stand-in's own error text" in failing.stderr, failing.stderr
    assert "no turn was recorded, so it has no session" in failing.stderr and "Traceback" not in failing.stderr
    assert "nothing written" in failing.stdout and not (tmp_path / "out.parquet").exists()
