"""Export for trainers: one row per branch, loaded back through `datasets`; the loss mask covers exactly the
sampled tokens, whose decoded spans give back every recorded assistant turn."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.basics import REPO, cached_engine, tokenizer_path
from support.recorded_sessions import weather_tree

from tito_addon.backends.sglang_backend import SglangBackend
from tito_addon.backends.upstream_client import UpstreamClient
from tito_addon.records.record_models import AnnotationRecord
from tito_addon.records.record_reader import read_session, read_session_file
from tito_addon.records.records_port import FileRecords
from tito_addon.records.trainer_rows import encode_rows, schema, session_rows
from tito_addon.records.trajectory_recorder import TrajectoryRecorder
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.sessions.memory_sessions import MemorySessions
from tito_addon.turns.turn_service import TurnService


@pytest.fixture(scope="module")
def recordings(tmp_path_factory) -> Path:
    """A session with 4 chained turns, a retried turn (a second branch) and an edited first request (a third)."""
    record_dir = tmp_path_factory.mktemp("rec")

    async def session(url: str) -> None:
        client = UpstreamClient()
        service = TurnService(cached_engine("qwen3"), SglangBackend(client), MemorySessions(), FileRecords(record_dir))
        await weather_tree(service, url)
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
    assert "3 segments from 1 sessions" in result.stdout
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
        spans = sampled_spans(row["input_ids"], row["loss_mask"])
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


# ---------------------------------------------------------------------------------------------------------------
# Layouts (generic, verl, slime), annotations, weight versions, --session, --to.

LAYOUT_NAMES = ("generic", "verl", "slime")


@pytest.fixture(scope="module")
def annotated(tmp_path_factory) -> Path:
    """Session `s`: the same tree as `recordings` (branches [0, 1, 3], [0, 1, 2, 4] and [5]; 3 and 2 are a retry's
    siblings), each step served by other weights (v0..v3), and annotated; session `t`: one turn cut off by max_tokens
    under weights v9, not annotated."""
    record_dir = tmp_path_factory.mktemp("annotated")
    recorder = TrajectoryRecorder(record_dir)

    async def session(url: str, replica: ReplicaThread) -> None:
        client = UpstreamClient()
        service = TurnService(cached_engine("qwen3"), SglangBackend(client), MemorySessions(), FileRecords(record_dir))
        await weather_tree(service, url, lambda step: setattr(replica.backend.config, "weight_version", f"v{step}"))
        replica.backend.config.weight_version = "v9"
        body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 5}
        reply = await service.handle("/v1/chat/completions", {"x-session-id": "t"}, json.dumps(body).encode(), url)
        assert reply.status == 200 and json.loads(reply.body)["choices"][0]["finish_reason"] == "length"
        await client.close()

    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica:
        asyncio.run(session(replica.url, replica))
    recorded = read_session(record_dir, "s")
    assert [[t.turn_id for t in path] for path in recorded.branches()] == [[0, 1, 3], [0, 1, 2, 4], [5]]
    notes = [
        (None, {"reward": 0.5, "labels": ["x"], "metadata": {"task": "weather", "k": 1}}),
        (0, {"reward": 0.25}),
        (1, {"labels": ["mid", "x"], "metadata": {"k": 2}}),
        (3, {"reward": 1.0, "labels": ["retry"]}),
        (2, {"reward": 0.0}),
        (2, {"reward": -1.0}),  # the latest on a turn wins
        (5, {"metadata": {"city": "Rome"}}),
    ]
    for turn_id, note in notes:
        recorder.write_annotation(AnnotationRecord(session_id="s", turn_id=turn_id, ts=time.time(), **note))
    return record_dir


#: What the annotations above say about each segment of `s` (leaf turn -> reward, labels, metadata), worked out by
#: hand: one episode, so every note reaches every segment, the latest reward winning.
EPISODE_NOTES = (-1.0, ["x", "mid", "retry"], {"task": "weather", "k": 2, "city": "Rome"})
EXPECTED_NOTES = {3: EPISODE_NOTES, 4: EPISODE_NOTES, 5: EPISODE_NOTES}
EXPECTED_WEIGHTS = {3: ["v0", "v1", "v2"], 4: ["v0", "v1", "v2", "v3"], 5: ["v3"]}


def run_export(record_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tito_addon", "export", str(record_dir), str(out), *args],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip


def load_rows(out: Path, file_type: str, tmp_path: Path) -> list[dict]:
    datasets = pytest.importorskip("datasets")
    loader = "parquet" if file_type == "parquet" else "json"
    cache = str(tmp_path / "hf-cache")
    return list(datasets.load_dataset(loader, data_files=str(out), split="train", cache_dir=cache))


def sampled_spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    spans, current = [], []
    for token, bit in zip(ids, mask, strict=True):
        if bit:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


def check_versions(versions: list[str], mask: list[int], path: list) -> None:
    """Each sampled token carries the version its turn recorded for it ("" where none was), every other token ""."""
    assert len(versions) == len(mask)
    assert [v for v, bit in zip(versions, mask, strict=True) if bit] == [
        v or "" for t in path for v in t.token_weight_versions()
    ]
    assert all(v == "" for v, bit in zip(versions, mask, strict=True) if not bit)


def check_sampled(ids: list[int], mask: list[int], logprobs: list[float], path: list) -> None:
    """The mask covers exactly the branch's sampled tokens, whose spans (decoded too) are its assistant turns, and
    the logprobs hold the recorded values there and 0 everywhere else."""
    tok = cached_engine("qwen3").tokenizer
    assert len(mask) == len(logprobs) == len(ids)
    assert set(mask) <= {0, 1}
    assert sum(mask) == sum(len(t.completion_ids) for t in path)
    spans = sampled_spans(ids, mask)
    assert spans == [t.completion_ids for t in path]
    assert [tok.decode(span) for span in spans] == [tok.decode(t.completion_ids) for t in path]
    recorded = [value for t in path for value in t.completion_logprobs]
    assert [lp for lp, bit in zip(logprobs, mask, strict=True) if bit] == recorded
    assert all(lp == 0 for lp, bit in zip(logprobs, mask, strict=True) if not bit)
    assert all(lp != 0 for lp, bit in zip(logprobs, mask, strict=True) if bit)  # the replica's logprobs are < 0


def check_row(row: dict, layout: str, record_dir: Path) -> None:
    recorded = read_session(record_dir, row["session_id"])
    turns = {t.turn_id: t for t in recorded.turns}
    path = [turns[t] for t in row["turn_ids"]]
    assert path[-1].turn_id == row["leaf_turn_id"] and path[0].parent_turn_id is None
    prompt, completion = recorded.full_ids()[row["leaf_turn_id"]]
    full = prompt + completion
    first_prompt = recorded.full_ids()[path[0].turn_id][0]
    if layout == "generic":
        assert row["input_ids"] == full
        check_sampled(row["input_ids"], row["loss_mask"], row["rollout_logprobs"], path)
        check_versions(row["rollout_weight_versions"], row["loss_mask"], path)
        assert row["finish_reasons"] == [t.finish_reason for t in path]
    elif layout == "verl":
        assert row["prompts"] == first_prompt
        assert row["prompts"] + row["responses"] == full == row["input_ids"]
        assert len(row["response_mask"]) == len(row["rollout_log_probs"]) == len(row["responses"])
        check_sampled(row["responses"], row["response_mask"], row["rollout_log_probs"], path)
        check_versions(row["rollout_weight_versions"], row["response_mask"], path)
        assert row["response_mask"][: len(path[0].completion_ids)] == [1] * len(path[0].completion_ids)
        assert row["uid"] == row["group"]  # the GRPO group (records/rollout_groups)
        assert row["reward_score"] == row["reward"]
        if row["reward"] is None:
            assert row["rm_scores"] is None
        else:
            assert len(row["rm_scores"]) == len(row["responses"])
            assert row["rm_scores"][-1] == row["reward"] and not any(row["rm_scores"][:-1])
        appended = sum(1 for t in path[1:] if t.appended_messages)
        assert row["__num_turns__"] == 1 + len(path) + appended
    else:
        tok = cached_engine("qwen3").tokenizer
        assert row["tokens"] == full
        cut = len(row["tokens"]) - row["response_length"]
        assert cut == len(first_prompt) and row["response_length"] > 0
        assert len(row["loss_mask"]) == len(row["rollout_log_probs"]) == row["response_length"]
        check_sampled(row["tokens"][cut:], row["loss_mask"], row["rollout_log_probs"], path)
        assert row["prompt"] == tok.decode(row["tokens"][:cut], skip_special_tokens=False)
        assert row["response"] == tok.decode(row["tokens"][cut:], skip_special_tokens=False)
        assert tok.encode(row["prompt"], add_special_tokens=False) == first_prompt  # the templated prompt text
        assert row["status"] == ("truncated" if path[-1].finish_reason == "length" else "completed")
    assert row["weight_versions"] == [t.weight_version for t in path]


@pytest.mark.parametrize("file_type", ["parquet", "jsonl"])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_each_layout_loads_and_its_token_arithmetic_holds(
    annotated: Path, tmp_path: Path, layout: str, file_type: str
) -> None:
    out = tmp_path / f"rows.{file_type}"
    result = run_export(annotated, out, "--format", layout, "--to", file_type)
    assert result.returncode == 0, result.stderr
    assert f"4 segments from 2 sessions written to {out} ({layout}, {file_type})" in result.stdout
    rows = load_rows(out, file_type, tmp_path)
    assert [(r["session_id"], r["leaf_turn_id"]) for r in rows] == [("s", 3), ("s", 4), ("s", 5), ("t", 0)]
    for row in rows:
        check_row(row, layout, annotated)
    if layout == "slime":  # one group per session, samples numbered across the export
        assert [(r["group_index"], r["index"]) for r in rows] == [(0, 0), (0, 1), (0, 2), (1, 3)]
        assert rows[-1]["status"] == "truncated"
    if file_type == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(out)
        assert table.schema.equals(schema(layout)) and table.num_rows == 4
        assert table.to_pylist() == [dict(r) for r in rows]


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_annotations_and_weight_versions_reach_every_row(annotated: Path, tmp_path: Path, layout: str) -> None:
    out = tmp_path / "rows.parquet"
    assert run_export(annotated, out, "--format", layout).returncode == 0
    rows = {(r["session_id"], r["leaf_turn_id"]): r for r in load_rows(out, "parquet", tmp_path)}
    for leaf, (reward, labels, metadata) in EXPECTED_NOTES.items():
        row = rows["s", leaf]
        assert (row["reward"], row["labels"], json.loads(row["metadata"])) == (reward, labels, metadata), leaf
        assert row["weight_versions"] == EXPECTED_WEIGHTS[leaf]
    lone = rows["t", 0]
    assert (lone["reward"], lone["labels"], lone["metadata"], lone["weight_versions"]) == (None, [], None, ["v9"])
    if layout == "verl":
        assert lone["rm_scores"] is None and rows["s", 4]["rm_scores"][-1] == -1.0


@pytest.mark.parametrize("file_type", ["parquet", "jsonl"])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_one_session_exports_exactly_what_the_control_api_encodes(
    annotated: Path, tmp_path: Path, layout: str, file_type: str
) -> None:
    for session in ("s", "t"):
        out = tmp_path / f"{session}.{file_type}"
        result = run_export(annotated, out, "--session", session, "--format", layout, "--to", file_type)
        assert result.returncode == 0, result.stderr
        assert "segments from 1 sessions" in result.stdout
        expected = encode_rows(session_rows(read_session(annotated, session), layout), layout, file_type)
        assert out.read_bytes() == expected
        again = tmp_path / f"again.{file_type}"
        assert run_export(annotated, again, "--session", session, "--format", layout, "--to", file_type).returncode == 0
        assert again.read_bytes() == expected  # deterministic: no timestamps, one schema
    rows = load_rows(tmp_path / f"t.{file_type}", file_type, tmp_path)
    assert [(r["session_id"], r["leaf_turn_id"]) for r in rows] == [("t", 0)]


def test_session_filter_takes_several_and_refuses_an_unknown_one(annotated: Path, tmp_path: Path) -> None:
    out = tmp_path / "two.jsonl"
    result = run_export(annotated, out, "--session", "t", "--session", "s", "--session", "t", "--to", "jsonl")
    assert result.returncode == 0 and "4 segments from 2 sessions" in result.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["session_id"], r["leaf_turn_id"]) for r in rows] == [("t", 0), ("s", 3), ("s", 4), ("s", 5)]
    missing = run_export(annotated, tmp_path / "none.parquet", "--session", "nobody")
    assert missing.returncode == 2 and "no session 'nobody'" in missing.stderr


def test_generic_format_names_keep_their_file_types(annotated: Path, tmp_path: Path) -> None:
    """`--format parquet|jsonl` is the generic layout, as before layouts existed; `--to` may not contradict it."""
    for file_type in ("parquet", "jsonl"):
        legacy, explicit = tmp_path / f"legacy.{file_type}", tmp_path / f"explicit.{file_type}"
        assert run_export(annotated, legacy, "--format", file_type).returncode == 0
        assert run_export(annotated, explicit, "--format", "generic", "--to", file_type).returncode == 0
        assert legacy.read_bytes() == explicit.read_bytes()
    default = tmp_path / "default.out"
    assert run_export(annotated, default).returncode == 0
    assert default.read_bytes() == (tmp_path / "legacy.parquet").read_bytes()
    clash = run_export(annotated, tmp_path / "x", "--format", "jsonl", "--to", "parquet")
    assert clash.returncode == 2 and "cannot be written as parquet" in clash.stderr
