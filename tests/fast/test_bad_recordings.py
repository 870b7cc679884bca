"""Every offline subcommand answers a bad or partial recording with a clear error (exit 2), never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.proxy_harness import REPO


def turn_line(turn_id: int, parent: int | None, added: list[int], prompt_len: int) -> str:
    record = {
        "schema": "tito.turn.v1", "session_id": "broken", "turn_id": turn_id, "parent_turn_id": parent, "ts": 1.0,
        "model": "m", "backend_kind": "sglang", "sampling": {}, "chat_template_kwargs": {}, "tools_sha256": None,
        "appended_messages": [{"role": "user", "content": "hi"}], "prompt_added_ids": added,
        "prompt_segments": [], "prompt_len": prompt_len, "completion_ids": [7, 8], "completion_logprobs": [-0.1, -0.2],
        "assistant_message": {"role": "assistant", "content": "yo"}, "finish_reason": "stop",
        "tokenizer": {"name": "t", "tokenizer_sha256": "x", "template_sha256": "y", "family": "qwen3"},
    }  # fmt: skip
    return json.dumps(record)


@pytest.mark.parametrize(
    "argv",
    [
        ["show", "{dir}"],
        ["export", "{dir}", "{tmp}/out.parquet"],
        ["audit", "{dir}"],
        ["redrive", "{dir}", "--backend", "http://127.0.0.1:9"],
    ],
)
def test_a_turn_whose_parent_is_missing_is_a_clear_error(tmp_path: Path, argv: list[str]) -> None:
    record_dir = tmp_path / "rec"
    record_dir.mkdir()
    # Turn 1 says it extends turn 0, which is not in the file: the trajectory cannot be rebuilt.
    (record_dir / "broken.jsonl").write_text(turn_line(1, 0, [4, 5], 6) + "\n")
    args = [a.format(dir=record_dir, tmp=tmp_path) for a in argv]
    result = subprocess.run([sys.executable, "-m", "tito_addon", *args], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error:" in result.stderr and "turn 0" in result.stderr and "Traceback" not in result.stderr


def test_a_torn_last_line_is_skipped_and_reported(tmp_path: Path) -> None:
    record_dir = tmp_path / "rec"
    record_dir.mkdir()
    good = turn_line(0, None, [1, 2, 3], 3)
    (record_dir / "broken.jsonl").write_text(good + "\n" + good[:40])
    result = subprocess.run(
        [sys.executable, "-m", "tito_addon", "show", str(record_dir), "--json"], cwd=REPO, capture_output=True,
        text=True,
    )  # fmt: skip
    assert result.returncode == 0
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert row["prompt_ids"] == [1, 2, 3] and row["completion_ids"] == [7, 8]
    assert "skipping unreadable line 2" in result.stderr
