"""Re-drive: recorded completions scored under a live backend; the gap is zero under the checkpoint that sampled
them and shows a shifted checkpoint's gap exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.basics import tokenizer_path
from support.chat_agent import agent, run_agent
from support.proxy_harness import REPO, Mitmdump
from support.tito_commands import redrive

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    record_dir = tmp_path_factory.mktemp("rec")
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica, Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=record_dir.parent
    ) as proxy:  # fmt: skip
        run_agent(agent(proxy, "redrive-me"), 5)
    return record_dir


@pytest.mark.parametrize("shift", [0.0, 0.25])
def test_redrive_reports_the_off_policy_gap(recorded: Path, tmp_path: Path, shift: float) -> None:
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), checkpoint_shift=shift)
    with ReplicaThread(config) as newer:
        report = redrive(recorded, newer.url, tmp_path / "report.json")
        scored = [body for body in newer.received()]
    (session_file,) = list(iter_session_files(recorded))
    assert len(report["turns"]) == 5 == report["totals"]["turns"]
    assert report["totals"]["tokens"] == sum(len(t.completion_ids) for t in session_file.turns)
    for turn in report["turns"]:
        assert turn["kl_estimate"] == pytest.approx(shift)
        assert turn["mean_abs_diff"] == pytest.approx(shift) and turn["max_abs_diff"] == pytest.approx(shift)
    assert scored == [], "scoring uses native /generate, never the chat endpoint"


def test_redrive_sends_the_exact_recorded_ids(recorded: Path, tmp_path: Path) -> None:
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as newer:
        redrive(recorded, newer.url, tmp_path / "r.json")
        bodies = list(newer.backend.scored)
    (session_file,) = list(iter_session_files(recorded))
    ids = session_file.full_ids()
    assert len(bodies) == len(session_file.turns)
    for body, turn in zip(bodies, session_file.turns, strict=True):
        prompt, completion = ids[turn.turn_id]
        assert body["input_ids"] == prompt + completion and body["logprob_start_len"] == len(prompt)
        assert body["return_logprob"] is True and body["sampling_params"] == {"max_new_tokens": 0}


def test_redrive_against_a_dead_backend_is_a_clean_error(recorded: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tito_addon", "redrive", str(recorded), "--backend", "http://127.0.0.1:9"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "unreachable" in result.stderr
