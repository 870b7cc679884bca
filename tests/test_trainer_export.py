"""Export for trainers: one row per branch, loaded back through `datasets`; the loss mask covers exactly the
sampled tokens, whose decoded spans give back every recorded assistant turn."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TOOLS, cached_engine, tokenizer_path

from tito_addon.backends.sglang_backend import SglangBackend
from tito_addon.backends.upstream_client import UpstreamClient
from tito_addon.records.record_reader import read_session_file
from tito_addon.records.trajectory_recorder import TrajectoryRecorder
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.sessions.session_tree import SessionStore
from tito_addon.turns.turn_service import TurnService

REPO = Path(__file__).resolve().parents[1]


async def run_turn(service: TurnService, url: str, session: str, messages: list[dict]) -> dict:
    body = json.dumps({"model": "m", "messages": messages, "tools": TOOLS}).encode()
    reply = await service.handle("/v1/chat/completions", {"x-session-id": session}, body, url)
    assert reply.status == 200, reply.body
    return json.loads(reply.body)["choices"][0]["message"]


def echo(message: dict) -> dict:
    out = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [{k: c[k] for k in ("id", "type", "function")} for c in message["tool_calls"]]
    return out


@pytest.fixture(scope="module")
def recordings(tmp_path_factory) -> Path:
    """A session with 4 chained turns, a retried turn (a second branch) and an edited first request (a third)."""
    record_dir = tmp_path_factory.mktemp("rec")

    async def session(url: str) -> None:
        client = UpstreamClient()
        service = TurnService(
            cached_engine("qwen3"), SglangBackend(client), SessionStore(), TrajectoryRecorder(record_dir)
        )
        messages: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
        for step in range(4):
            message = await run_turn(service, url, "s", messages)
            if step == 2:
                await run_turn(service, url, "s", messages)  # a retry: a sibling branch
            messages.append(echo(message))
            if message.get("tool_calls"):
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": "21C"} for c in message["tool_calls"]]
            else:
                messages.append({"role": "user", "content": f"And then {step}?"})
        await run_turn(service, url, "s", [{"role": "user", "content": "Weather in Rome?"}])
        await client.close()

    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica:
        asyncio.run(session(replica.url))
    return record_dir


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_export_round_trips_through_datasets(recordings: Path, tmp_path: Path, fmt: str) -> None:
    datasets = pytest.importorskip("datasets")
    out = tmp_path / f"branches.{fmt}"
    result = subprocess.run(
        [sys.executable, "-m", "tito_addon", "export", str(recordings), str(out), "--format", fmt],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "3 branches from 1 sessions" in result.stdout
    loader = "parquet" if fmt == "parquet" else "json"
    rows = list(datasets.load_dataset(loader, data_files=str(out), split="train"))
    assert len(rows) == 3
    recorded = read_session_file(recordings / "s.jsonl")
    turns = {t.turn_id: t for t in recorded.turns}
    ids = recorded.full_ids()
    tok = cached_engine("qwen3").tokenizer
    for row in rows:
        path = [turns[t] for t in row["turn_ids"]]
        assert row["input_ids"] == ids[row["leaf_turn_id"]][0] + ids[row["leaf_turn_id"]][1]
        assert len(row["loss_mask"]) == len(row["rollout_logprobs"]) == len(row["input_ids"])
        # Nothing outside the sampled tokens is masked in...
        assert sum(row["loss_mask"]) == sum(len(t.completion_ids) for t in path)
        # ...and the masked spans, decoded, give back every recorded assistant turn of the branch.
        spans, current = [], []
        for token, bit in zip(row["input_ids"], row["loss_mask"], strict=True):
            if bit:
                current.append(token)
            elif current:
                spans.append(current)
                current = []
        if current:
            spans.append(current)
        assert [tok.decode(span) for span in spans] == [tok.decode(t.completion_ids) for t in path]
        assert spans == [t.completion_ids for t in path]
        sampled = [lp for lp, bit in zip(row["rollout_logprobs"], row["loss_mask"], strict=True) if bit]
        assert sampled == [lp for t in path for lp in t.completion_logprobs]
        assert all(lp == 0 for lp, bit in zip(row["rollout_logprobs"], row["loss_mask"], strict=True) if not bit)
        messages = json.loads(row["messages"])
        assert messages[-1] == path[-1].assistant_message and messages[0]["role"] == "user"
        assert row["finish_reasons"] == [t.finish_reason for t in path]
        assert row["tokenizer_sha256"] == path[0].tokenizer.tokenizer_sha256
    assert sorted(len(r["turn_ids"]) for r in rows) == [1, 3, 4]


def test_export_refuses_a_bad_record_dir(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tito_addon", "export", str(tmp_path / "missing"), str(tmp_path / "o.parquet")],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2 and "not a directory" in result.stderr
