"""Simulated agents that send no session id, for the transparent-capture tests: each a conversation with a plan
(plain, a client retry, an edit of what it appended), driven concurrently through a proxy, and the check that every
request landed exactly where its agent's history says, with the ids the replica received."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import aiohttp

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaThread

from .basics import TOOLS

MODEL = "reference-model"


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
