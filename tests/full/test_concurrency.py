"""Concurrency through one real mitmdump: 256 named sessions at once, with retries and edits, for over 10,000 turns.

Every request carries a unique sampling seed, which the replica turns into a distinct completion, so each 200 maps
to exactly one record line. Checked: no lost update (every acknowledged turn is on disk, with the seed and prompt ids
of its own request), no duplicated turn (each session's turn ids are exactly 0..n-1, one per 200), no interleaved
line (every line is one whole record of its own session), every turn extends the turn its request's history ends
with; and after the warm-up versus after 10,000 turns, the process has no more asyncio tasks and no more file
descriptors (open record files, client or other sockets; the upstream keep-alive pool stays within the peak
concurrency).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from support.basics import tokenizer_path
from support.proxy_harness import REPO, Mitmdump, get

from tito_addon.records.record_reader import read_session_file
from tito_addon.records.trajectory_recorder import session_file_name
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

# The full tier, alone on the machine: over 10,000 turns, and the process's tasks and descriptors counted.
pytestmark = [pytest.mark.full, pytest.mark.serial]

SESSIONS = 256
TURNS = 39  # per agent after its two warm-up turns; with the retries and edits: > 10,000 turns after the warm-up
API_KEY = "sk-tito-conc-KEY-3b02"


class Agent:
    """One named session. plan: 0 plain, 1 retries at step 3, 2 edits at step 5, 3 does both."""

    def __init__(self, index: int) -> None:
        self.index, self.plan = index, index % 4
        self.session = f"conc/{index:03d}"
        self.messages: list[dict] = [
            {"role": "system", "content": "You are a terse weather bot."},
            {"role": "user", "content": f"Weather in city {index}?"},
        ]
        self.last_turn: int | None = None  # the turn whose reply the history ends with
        self.log: list[dict] = []  # per 200: turn, expected parent, seed
        self.next_seed = index * 1000

    async def ask(self, http: aiohttp.ClientSession, url: str, messages: list[dict]) -> dict:
        seed, self.next_seed = self.next_seed, self.next_seed + 1
        body = {"model": "reference-model", "messages": messages, "seed": seed, "max_tokens": 40}
        headers = {"x-session-id": self.session, "authorization": f"Bearer {API_KEY}"}
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            reply = await response.json()
            assert response.headers["x-tito-session-id"] == self.session
            turn = int(response.headers["x-tito-turn-id"])
        self.log.append({"turn": turn, "parent": self.last_turn, "seed": seed})
        return reply["choices"][0]["message"]

    async def step(self, http: aiohttp.ClientSession, url: str, step: int) -> None:
        request = list(self.messages)
        message = await self.ask(http, url, request)
        if self.plan in (1, 3) and step == 3:
            message = await self.ask(http, url, request)  # a client retry: a sibling; the agent keeps the newer
        if self.plan in (2, 3) and step == 5:
            edited = request[:-1] + [{**request[-1], "content": request[-1]["content"] + " (edited)"}]
            message = await self.ask(http, url, edited)  # the user edits the message just sent: a sibling
            request = edited
        self.messages = request + [
            {"role": "assistant", "content": message.get("content")},
            {"role": "user", "content": f"And then ({step})?"},
        ]
        self.last_turn = self.log[-1]["turn"]


async def run(url: str, agents: list[Agent], steps: range) -> None:
    connector = aiohttp.TCPConnector(limit=SESSIONS)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:

        async def one(agent: Agent) -> None:
            for step in steps:
                await agent.step(http, url, step)

        await asyncio.gather(*(one(agent) for agent in agents))


def tcp_inodes(pid: int) -> dict[str, tuple[int, int]]:
    """socket inode -> (local port, remote port) for the process's TCP sockets."""
    out = {}
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            out[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16))
    return out


def fd_census(pid: int, proxy_port: int, backend_port: int, record_dir: Path) -> Counter:
    """The process's descriptors by kind: record files, agent sockets, upstream pool sockets, everything else."""
    tcp = tcp_inodes(pid)
    census: Counter = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue  # closed while we looked
        if target.startswith(str(record_dir)):
            census["record_files"] += 1
        elif target.startswith("socket:["):
            local, remote = tcp.get(target[len("socket:[") : -1], (0, 0))
            if remote == backend_port:
                census["upstream_pool"] += 1
            elif local == proxy_port and remote != 0:
                census["agent_sockets"] += 1
            else:
                census["other"] += 1
        else:
            census["other"] += 1
    return census


def settle(proxy: Mitmdump, backend_port: int, record_dir: Path) -> tuple[Counter, dict]:
    """Wait until the agents' connections are gone, then count descriptors and tasks."""
    assert proxy.proc is not None
    deadline = time.monotonic() + 20
    while True:
        census = fd_census(proxy.proc.pid, proxy.port, backend_port, record_dir)
        if census["agent_sockets"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    stats = get(proxy.url + "/_probe/stats", timeout=30).json()  # the probe's own request: same in both counts
    return census, stats


def test_256_sessions_10000_turns_no_lost_duplicated_or_interleaved_turn_and_no_leak(tmp_path: Path) -> None:
    started = time.monotonic()
    record_dir = tmp_path / "rec"
    agents = [Agent(i) for i in range(SESSIONS)]
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica:
        backend_port = replica.port
        assert backend_port is not None
        with Mitmdump(
            replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
            extra_args=["-s", str(REPO / "tests" / "addons" / "stats_probe.py")],
        ) as proxy:  # fmt: skip
            asyncio.run(run(proxy.url, agents, range(0, 2)))  # warm-up: every session exists, pools are filled
            census_before, tasks_before = settle(proxy, backend_port, record_dir)
            asyncio.run(run(proxy.url, agents, range(2, 2 + TURNS)))
            census_after, tasks_after = settle(proxy, backend_port, record_dir)
            served = time.monotonic() - started
            received = {body["seed"]: body["input_ids"] for body in replica.received()}

    turns = sum(len(agent.log) for agent in agents)
    assert turns - 2 * SESSIONS >= 10_000, turns
    # Leaks: the same tasks and descriptors after 10,000 turns as after the warm-up.
    assert tasks_after["tasks"] <= tasks_before["tasks"], (tasks_before, tasks_after)
    assert census_after["agent_sockets"] == 0, census_after
    # Record files stay open for the most recent sessions (`trajectory_recorder.OPEN_FILES`): as many as before.
    assert census_after["record_files"] == census_before["record_files"] <= SESSIONS, (census_before, census_after)
    assert census_after["other"] <= census_before["other"], (census_before, census_after)
    assert census_after["upstream_pool"] <= SESSIONS, census_after  # bounded by concurrency, not by turns

    # Integrity, session by session.
    for agent in agents:
        path = record_dir / session_file_name(agent.session)
        for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
            if line.strip():
                record = json.loads(line)  # one whole JSON object per line: nothing interleaved
                assert record["session_id"] == agent.session, f"{path.name}:{number} holds another session's line"
        recorded = read_session_file(path)  # raises on a duplicated turn id
        assert recorded.skipped_lines == [] and recorded.closes[-1].reason == "shutdown"
        ids = recorded.full_ids()
        by_id = {t.turn_id: t for t in recorded.turns}
        assert sorted(by_id) == list(range(len(agent.log))), f"{agent.session}: lost or extra turns"
        for entry in agent.log:
            record = by_id[entry["turn"]]
            assert record.sampling["seed"] == entry["seed"], f"{agent.session}: turn {entry['turn']} is another's"
            assert record.parent_turn_id == entry["parent"], f"{agent.session}: turn {entry['turn']} misplaced"
            assert ids[entry["turn"]][0] == received[entry["seed"]], "recorded prompt ids differ from those sent"
    retries = sum(1 for agent in agents if agent.plan in (1, 3))
    edits = sum(1 for agent in agents if agent.plan in (2, 3))
    tasks = f"{tasks_before['tasks']} -> {tasks_after['tasks']}"
    print(f"\n{turns} turns in {SESSIONS} sessions ({retries} retries, {edits} edits) in {served:.0f}s; tasks {tasks}; "
          f"fds {dict(census_before)} -> {dict(census_after)}")  # fmt: skip
