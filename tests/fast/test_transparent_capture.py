"""Transparent capture: no session ids anywhere. Sessions are found from the messages alone, for many concurrent
agents with GRPO groups, retries and edits; sessions close when idle or beyond capacity."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from support.basics import tokenizer_path, wait_until
from support.proxy_harness import Mitmdump, post
from support.transparent_agents import MODEL, Agent, drive, echo, verify

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread


@pytest.fixture(scope="module")
def replica():
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as running:
        yield running


def test_grpo_group_samples_are_branches_of_one_session(replica, tmp_path: Path) -> None:
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    agents = [Agent(index, 0, "plain") for index in range(16)]
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path) as proxy:
        asyncio.run(drive(proxy.url, agents, 3))
    stats = verify(agents, replica, record_dir)
    assert stats == {"requests": 48, "sessions": 1}
    (session_file,) = list(iter_session_files(record_dir))
    roots = [t for t in session_file.turns if t.parent_turn_id is None]
    assert len(roots) == 16 and len({tuple(t.completion_ids) for t in roots}) == 16


def test_sessions_close_when_idle_or_beyond_capacity_but_never_in_flight(tmp_path: Path) -> None:
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), latency_s=1.5)
    record_dir = tmp_path / "rec"
    with (
        ReplicaThread(config) as slow,
        Mitmdump(
            slow.url,
            tokenizer=tokenizer_path("qwen3"),
            record_dir=record_dir,
            cwd=tmp_path,
            options={"tito_max_sessions": "1", "tito_session_idle_timeout": "4"},
        ) as proxy,
    ):

        def ask(session: str) -> int:
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Hi from {session}"}]}
            return post(proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": session}).status_code

        assert ask("a") == 200
        # Extend "a" slowly while "b" and "c" arrive: "a" is in flight and must not be evicted.
        a_history = [{"role": "user", "content": "Hi from a"}]
        first = json.loads((record_dir / "a.jsonl").read_text().splitlines()[0])["assistant_message"]
        follow = {"model": MODEL, "messages": a_history + [echo(first), {"role": "user", "content": "More?"}]}
        result: list[int] = []
        slow_turn = threading.Thread(
            target=lambda: result.append(
                post(proxy.url + "/v1/chat/completions", json=follow, headers={"x-session-id": "a"}).status_code
            )
        )
        slow_turn.start()
        assert wait_until(lambda: len(slow.received()) == 2), "a's second turn reached the backend"
        assert ask("b") == 200  # capacity 1: "a" is busy, so nothing can be evicted yet
        slow_turn.join()
        assert result == [200]
        assert ask("c") == 200
        # "a" was protected while in flight: its close line comes after its second turn, not before.
        a_lines = [json.loads(line) for line in (record_dir / "a.jsonl").read_text().splitlines()]
        assert [line.get("turn_id", line.get("reason")) for line in a_lines] == [0, 1, "evicted"]
        assert json.loads((record_dir / "b.jsonl").read_text().splitlines()[-1])["reason"] == "evicted"
        # The idle timeout (4 s) plus at most one sweep interval (1 s, a quarter of it), awaited with room for a
        # loaded machine: "c" closes as idle, and no other reason comes first.
        wait_until(lambda: len((record_dir / "c.jsonl").read_text().splitlines()) == 2, timeout=4 + 30)
        closes = {p.stem: json.loads(p.read_text().splitlines()[-1]).get("reason") for p in record_dir.glob("*.jsonl")}
        assert closes["c"] == "idle"
    # Shutdown closes whatever is still live; every file ends with exactly one close line per close.
    for path in record_dir.glob("*.jsonl"):
        assert json.loads(path.read_text().splitlines()[-1])["schema"] == "tito.session_close.v1"
