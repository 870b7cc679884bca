"""The example rollout driver (examples/rollout_driver.py) at small scale: 4 tasks x 2 samples, 8 concurrent episodes
of an unmodified openai-python agent through a real mitmdump in regular mode, named by proxy auth, scored, grouped by
task, closed, and their rows written by one rows call to one Parquet file that `datasets` loads; every row is the
episode's recorded ids, exactly, and each task's rows are one group, together, numbered across the file.

Then the preflight refusals (a wrong token, no control API, no proxy, Claude Code's key prefix) with a failed agent's
own error text. Running it twice and tasks of one's own with a reward command, three driver runs each, are the full
tier's (test_example_driver_runs.py)."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import datasets
from support.basics import tokenizer_path
from support.example_driver import TOKEN, drive, regular_proxy
from support.proxy_harness import REPO, Mitmdump

from tito_addon.client import TitoClient
from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

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


# ------------------------------------------------------------------------------------------------------------ preflight


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
