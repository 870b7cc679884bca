"""The example rollout driver (examples/rollout_driver.py), what makes it safe for a newcomer, three driver runs each
(the full tier): run twice (an explicit --prefix already used is refused before any agent runs, the first run's
records and rows byte-identical after; a default fresh prefix runs beside them), and tasks of one's own with a reward
command (its rewards in the rows, the zero-variance warning, a garbage reward failing only its episode). The first
run and the preflight refusals are test_example_driver.py's, in `make test`."""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from importlib import metadata
from pathlib import Path

import datasets
import pytest
from support.basics import tokenizer_path
from support.example_driver import TOKEN, drive, regular_proxy

from tito_addon.client import TitoClient
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread


def files_of(record_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(record_dir)): p.read_bytes() for p in sorted(record_dir.rglob("*")) if p.is_file()}


@pytest.mark.full  # three driver runs (12 s here): `make test` keeps test_example_driver.py's
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
                        "model_family": "qwen3", "tokenizer": tokenizer_path("qwen3"),
                        "generations_cut": {"resuming": 0, "resumed": 0, "cuts": 0},
                        "turns_in_flight": {"count": 0, "oldest_s": None}, "router": "none",
                        "engines": None}  # fmt: skip
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
