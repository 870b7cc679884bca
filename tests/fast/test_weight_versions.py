"""The backend's weight version of each turn: the openai SDK -> a real mitmdump -> a replica whose weights change
between (and, on vLLM, during) turns; recorded on the turn's line and exported one entry per turn of a branch.

Where each backend reports it: sglang's `meta_info.weight_version` (a whole chat completion; the live sglext stream
of 0.5.20+ carries none, as sglang's stream chunks declare no `metadata`, so a turn streamed live records none, while
0.5.13's streams are re-framed from a whole turn and keep it); vLLM 0.32's `weight_versions` spans on the generate
choice (streamed: the final chunk); vLLM 0.24 reports none.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import openai
import pytest
from support.basics import tokenizer_path
from support.chat_agent import take_turn
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import read_session
from tito_addon.records.trainer_rows import session_rows
from tito_addon.records.trajectory_recorder import session_file_name
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

BACKENDS = ["sglang-0.5.23", "sglang-0.5.13", "vllm-0.32.0", "vllm-0.24.0"]


class Stack:
    def __init__(self, name: str, replica, proxy: Mitmdump, record_dir: Path) -> None:
        self.kind, self.version = name.split("-")
        self.replica, self.proxy, self.record_dir = replica, proxy, record_dir
        self.model = "tiny-qwen3" if self.kind == "vllm" else "reference-model"

    def reports(self, stream: bool) -> bool:
        """Whether a turn on this backend can record a weight version at all."""
        if self.kind == "vllm":
            return self.version == "0.32.0"
        return not stream or self.version == "0.5.13"  # a live sglang stream has none; a re-framed one keeps it

    def set_weights(self, version: str, previous: str | None = None) -> None:
        config = self.replica.backend.config
        config.weight_version = version
        if self.kind == "vllm":
            config.previous_weight_version = previous

    def client(self, session: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.proxy.url + "/v1", api_key="k", default_headers={"x-session-id": session}, max_retries=0
        )


@pytest.fixture(scope="module", params=BACKENDS)
def stack(request, tmp_path_factory):
    kind, version = request.param.split("-")
    record_dir = tmp_path_factory.mktemp(f"rec-{request.param}")
    if kind == "vllm":
        replica = VllmReplicaThread(VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), version=version))
        options = {"tito_backend_kind": "vllm", "tito_upstream_timeout": "5"}
    else:
        replica = ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"), version=version))
        options = {"tito_upstream_timeout": "5"}
    settings = {"tokenizer": tokenizer_path("qwen3"), "record_dir": record_dir, "options": options}
    with replica, Mitmdump(replica.url, cwd=record_dir.parent, **settings) as proxy:
        yield Stack(request.param, replica, proxy, record_dir)


def converse(stack: Stack, session: str, versions: list[str], *, stream: bool, previous: str | None = None) -> None:
    """One chained conversation, turn i sampled under `versions[i]` (updated from `previous` mid-turn on vLLM)."""
    client = stack.client(session)
    messages: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
    try:
        for turn, version in enumerate(versions):
            stack.set_weights(version, previous)
            take_turn(client, messages, model=stack.model, stream=stream, follow_up=f"And then, round {turn}?")
    finally:
        stack.set_weights("default")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_each_turn_records_the_weights_that_sampled_it(stack: Stack, stream: bool) -> None:
    session = f"w-{uuid.uuid4().hex[:8]}"
    versions = ["w1", "w2", "w3"]
    converse(stack, session, versions, stream=stream)
    recorded = read_session(stack.record_dir, session)
    assert recorded is not None and [t.parent_turn_id for t in recorded.turns] == [None, 0, 1]
    expected = versions if stack.reports(stream) else [None] * len(versions)
    assert [t.weight_version for t in recorded.turns] == expected
    assert all(t.weight_version_spans is None for t in recorded.turns)  # no update during a turn
    # Left off a line while unknown, like the other optional fields.
    lines = [json.loads(line) for line in (stack.record_dir / session_file_name(session)).read_text().splitlines()]
    assert [line.get("weight_version") for line in lines] == expected
    assert all(("weight_version" in line) == (value is not None) for line, value in zip(lines, expected, strict=True))
    assert not any("weight_version_spans" in line for line in lines)
    # Exported one entry per turn of the branch, in every layout.
    for layout in ("generic", "verl", "slime"):
        (row,) = session_rows(recorded, layout)
        assert row["weight_versions"] == expected and row["turn_ids"] == [0, 1, 2]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_weight_update_during_a_turn_records_its_spans(stack: Stack, stream: bool) -> None:
    if stack.kind != "vllm" or not stack.reports(stream):
        pytest.skip("only vLLM 0.32+ reports weight version spans")
    session = f"spans-{uuid.uuid4().hex[:8]}"
    converse(stack, session, ["w5", "w6"], stream=stream, previous="w4")
    recorded = read_session(stack.record_dir, session)
    assert recorded is not None and len(recorded.turns) == 2
    for turn, version in zip(recorded.turns, ["w5", "w6"], strict=True):
        n = len(turn.completion_ids)
        assert n >= 2
        assert turn.weight_version == version  # the weights that sampled the turn's last token
        assert turn.weight_version_spans == [
            {"version": "w4", "start": 0, "end": n // 2},
            {"version": version, "start": n // 2, "end": n},
        ]
    (row,) = session_rows(recorded, "verl")
    assert row["weight_versions"] == ["w5", "w6"]
