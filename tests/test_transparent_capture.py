"""Transparent capture: no session ids anywhere. Sessions are found from the messages alone, for many concurrent
agents with GRPO groups, retries and edits; sessions close when idle or beyond capacity."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import defaultdict
from pathlib import Path

import aiohttp
import pytest
from support.basics import TOOLS, tokenizer_path, wait_until
from support.proxy_harness import Mitmdump, post

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

MODEL = "reference-model"


@pytest.fixture(scope="module")
def replica():
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as running:
        yield running


def echo(message: dict) -> dict:
    """An agent appends only the standard fields of the reply (reasoning dropped)."""
    out = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [{k: c[k] for k in ("id", "type", "function")} for c in message["tool_calls"]]
    return out


def follow_up(message: dict, step: int) -> list[dict]:
    if message.get("tool_calls"):
        return [
            {"role": "tool", "tool_call_id": c["id"], "content": f"result {step}.{i}"}
            for i, c in enumerate(message["tool_calls"])
        ]
    return [{"role": "user", "content": f"Thanks, and the next one ({step})?"}]


class Agent:
    """A simulated agent: a base URL, a conversation, and the tree position every request should land at."""

    def __init__(self, index: int, group: int, plan: str) -> None:
        self.index, self.group, self.plan = index, group, plan
        self.messages = [
            {"role": "system", "content": "You are a weather agent."},
            {"role": "user", "content": f"Weather in city number {group}? Use the tools."},
        ]
        self.last_turn: int | None = None  # the recorded turn whose reply the history ends with
        self.log: list[dict] = []  # per request: seed, expected parent, recorded session and turn
        self.seeds = iter(range(index * 100, index * 100 + 100))

    async def ask(self, http: aiohttp.ClientSession, url: str, messages: list[dict], parent: int | None) -> dict:
        seed = next(self.seeds)
        body = {"model": MODEL, "messages": messages, "tools": TOOLS, "seed": seed}
        async with http.post(url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            reply = await response.json()
            self.log.append(
                {
                    "seed": seed,
                    "parent": parent,
                    "session": response.headers["x-tito-session-id"],
                    "turn": int(response.headers["x-tito-turn-id"]),
                }  # fmt: skip
            )
        return reply["choices"][0]["message"]

    async def run(self, http: aiohttp.ClientSession, url: str, turns: int) -> None:
        for step in range(turns):
            request = list(self.messages)
            message = await self.ask(http, url, request, self.last_turn)
            if self.plan == "retry" and step == 1:
                # Resend the same request (a client retry): a sibling of the reply just received.
                message = await self.ask(http, url, request, self.last_turn)
            self.messages += [echo(message)]
            self.last_turn = self.log[-1]["turn"]
            appended = follow_up(message, step)
            if self.plan == "edit" and step == 2:
                # Rewrite what was appended after turn 1's reply and branch from there.
                history = self.messages[: self.edit_point]
                edited = [dict(m, content=str(m["content"]) + " (edited)") for m in self.edit_appended]
                message = await self.ask(http, url, history + edited, self.edit_parent)
                self.messages = history + edited + [echo(message)]
                self.last_turn = self.log[-1]["turn"]
                appended = follow_up(message, step)
            if step == 1:
                self.edit_point, self.edit_appended, self.edit_parent = len(self.messages), appended, self.last_turn
            self.messages += appended


async def drive(url: str, agents: list[Agent], turns: int) -> None:
    connector = aiohttp.TCPConnector(limit=len(agents))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await asyncio.gather(*(agent.run(http, url, turns) for agent in agents))


def verify(agents: list[Agent], replica: ReplicaThread, record_dir: Path) -> dict:
    """Every request landed exactly where its agent's history says, with the ids the replica received."""
    received = {body["seed"]: body["input_ids"] for body in replica.received()}
    files = {f.turns[0].session_id: f for f in iter_session_files(record_dir)}
    turns_by_session = {sid: {t.turn_id: t for t in f.turns} for sid, f in files.items()}
    ids_by_session = {sid: f.full_ids() for sid, f in files.items()}
    group_sessions: dict[int, set[str]] = defaultdict(set)
    requests = 0
    for agent in agents:
        sessions = {entry["session"] for entry in agent.log}
        assert len(sessions) == 1, f"agent {agent.index} was split across sessions"
        session = sessions.pop()
        group_sessions[agent.group].add(session)
        for entry in agent.log:
            record = turns_by_session[session][entry["turn"]]
            assert record.parent_turn_id == entry["parent"], f"agent {agent.index} landed on the wrong branch"
            assert ids_by_session[session][entry["turn"]][0] == received[entry["seed"]]
            requests += 1
    # One session per GRPO group, one root per sample; no two groups share a session.
    for group, sessions in group_sessions.items():
        assert len(sessions) == 1, f"group {group} split into {len(sessions)} sessions"
    assert len({s for ss in group_sessions.values() for s in ss}) == len(group_sessions)
    recorded = sum(len(f.turns) for f in files.values())
    assert recorded == requests == len(received), "a turn was lost or duplicated"
    return {"requests": requests, "sessions": len(files)}


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


@pytest.mark.full  # 3,000 turns of 1,000 agents: a load run (make test keeps the GRPO and idle-close tests here)
def test_a_thousand_concurrent_agents_without_session_ids(replica, tmp_path: Path) -> None:
    """GRPO groups of 8, client retries and mid-session edits, all at once through one mitmdump."""
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    rng = random.Random(7)
    plans = ["plain"] * 6 + ["retry", "edit"]
    agents = [Agent(index, index // 8, rng.choice(plans)) for index in range(1000)]
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path) as proxy:
        started = time.monotonic()
        asyncio.run(drive(proxy.url, agents, 3))
        elapsed = time.monotonic() - started
    stats = verify(agents, replica, record_dir)
    assert stats["sessions"] == 125
    assert stats["requests"] == 3000 + sum(a.plan in ("retry", "edit") for a in agents)
    print(f"\n1000 agents, {stats['requests']} turns in {elapsed:.1f} s ({stats['requests'] / elapsed:.0f} turns/s)")


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
