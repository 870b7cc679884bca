"""A fleet of real proxies behind a real HAProxy (round-robin, no stickiness), loaded by 256 openai-SDK agents of 10
turns each (GRPO groups of 8, retries, edits, tool results), checked against what the backend received and what
is on disk.

Configurations: `memory-1` (one mitmdump, the default in-memory session store) and `redis-3` (three mitmdumps
sharing one real redis-server through `tito_session_store=redis://…`); with `redis-3` also a proxy SIGKILLed mid-run
(and restarted later), and Redis stopped for a few seconds mid-run.

Checked for every request that got a 200: the prompt ids the backend received extend exactly the prompt ids and
completion ids of the turn the agent continued (its own sample, never a sibling's); the turn is on disk exactly
once (by request id, and by session and turn id across every writer's file), with the parent the agent continued;
no turn is lost and none is extra; automatic sessions: one per GRPO group, its 8 samples sibling roots; named: one
per agent.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.basics import tokenizer_path
from support.fleet_agents import GROUP, FleetRun

from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import read_session_file
from tito_addon.records.trajectory_recorder import session_file_name
from tito_addon.replicas.fleet import ProxyFleet, RedisServer

AGENTS = int(os.environ.get("TITO_FLEET_AGENTS", "256"))
TURNS = int(os.environ.get("TITO_FLEET_TURNS", "10"))
HAPROXY = shutil.which("haproxy")
if HAPROXY is None and os.environ.get("TITO_HAPROXY_REQUIRED") == "1":
    raise RuntimeError("haproxy is required here (CI installs Debian's haproxy)")

# The full tier, alone on the machine: three proxies, HAProxy, Redis and 256 agents load both cores for minutes.
pytestmark = [
    pytest.mark.full,
    pytest.mark.serial,
    pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed"),
]


@dataclass(frozen=True)
class FleetConfig:
    name: str
    proxies: int
    redis: bool


MEMORY_1 = FleetConfig("memory-1", 1, False)
REDIS_3 = FleetConfig("redis-3", 3, True)
CONFIGS = [pytest.param(MEMORY_1, id="memory-1"), pytest.param(REDIS_3, id="redis-3")]


@pytest.fixture(scope="module")
def redis(redis_server):
    return redis_server


def make_fleet(config: FleetConfig, replica, tmp_path: Path, request) -> ProxyFleet:
    """The fleet of `config` in front of `replica` (reset), not started: `with` starts and stops it."""
    options = {}
    if config.redis:
        options["tito_session_store"] = request.getfixturevalue("redis").url
    replica.backend.reset()
    return ProxyFleet(
        replica.url, config.proxies, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec",
        workdir=tmp_path, options=options,
    )  # fmt: skip


# ------------------------------------------------------------------ what is on disk


@dataclass
class OnDisk:
    turns: dict[tuple[str, int], TurnRecord] = field(default_factory=dict)
    by_request: dict[str, list[TurnRecord]] = field(default_factory=lambda: defaultdict(list))
    skipped_lines: dict[str, list[int]] = field(default_factory=dict)
    duplicates: list[tuple[str, int]] = field(default_factory=list)
    withdrawn: set[tuple[str, int]] = field(default_factory=set)
    broken: list[str] = field(default_factory=list)  # turns whose prompt cannot be rebuilt from their parents
    prompts: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    files: int = 0


def read_records(record_dir: Path) -> OnDisk:
    """Every turn in every file of the directory (one file per session, or per session and writer: `<name>+<writer>
    .jsonl`), read file by file (so a turn in two files is caught) and merged by session, less the turns a
    withdrawal line takes back; each turn's full prompt rebuilt along its parent chain across files."""
    disk = OnDisk()
    for path in sorted(record_dir.glob("*.jsonl")):
        disk.files += 1
        recorded = read_session_file(path)  # withdrawn turns are left out by the reader itself
        disk.withdrawn |= {(w.session_id, w.turn_id) for w in recorded.withdrawn}
        if recorded.skipped_lines:
            disk.skipped_lines[path.name] = recorded.skipped_lines
        for turn in recorded.turns:
            base = path.name.split("+", 1)[0].removesuffix(".jsonl")
            assert base == session_file_name(turn.session_id).removesuffix(".jsonl"), (
                f"{path.name} holds a turn of session {turn.session_id!r}"
            )
            key = (turn.session_id, turn.turn_id)
            if key in disk.turns:
                disk.duplicates.append(key)
            disk.turns[key] = turn
    for key in disk.withdrawn:
        disk.turns.pop(key, None)
    for turn in disk.turns.values():
        disk.by_request[turn.request_id or ""].append(turn)

    def prompt(key: tuple[str, int]) -> list[int] | None:
        if key not in disk.prompts:
            turn = disk.turns[key]
            ids: list[int] | None = None
            if turn.parent_turn_id is None:
                ids = list(turn.prompt_added_ids)
            else:
                parent = (turn.session_id, turn.parent_turn_id)
                before = prompt(parent) if parent in disk.turns else None
                if before is None:
                    gone = "withdrawn" if parent in disk.withdrawn else "not on disk"
                    disk.broken.append(f"turn {key} extends {parent}, which is {gone}")
                else:
                    ids = before + disk.turns[parent].completion_ids + turn.prompt_added_ids
            if ids is not None and len(ids) != turn.prompt_len:
                disk.broken.append(f"turn {key} rebuilds to {len(ids)} ids, recorded {turn.prompt_len}")
                ids = None
            disk.prompts[key] = ids  # type: ignore[assignment]
        return disk.prompts[key]

    for key in sorted(disk.turns):
        prompt(key)
    return disk


def all_lines_parse(record_dir: Path) -> list[str]:
    """Lines that are not one whole JSON object (a torn or interleaved write)."""
    bad = []
    for path in sorted(record_dir.glob("*.jsonl")):
        for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
            if line.strip():
                try:
                    assert isinstance(json.loads(line), dict)
                except (ValueError, AssertionError):
                    bad.append(f"{path.name}:{number}")
    return bad


# ------------------------------------------------------------------ the checks


def same_tokens(disk: OnDisk, a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Two turns of one session with the same prompt and completion ids."""
    if a[0] != b[0] or a not in disk.turns or b not in disk.turns:
        return False
    return disk.prompts[a] == disk.prompts[b] and disk.turns[a].completion_ids == disk.turns[b].completion_ids


def check_fleet_run(run: FleetRun, replica, record_dir: Path, *, automatic: bool, chaos: bool = False) -> dict:
    """Every check of a finished run. `chaos`: a proxy died or the store went away mid-run, so a turn may be on disk
    that no agent got a 200 for (committed, then the answer was lost and the request retried): allowed, but only
    as an extra record of a request the agent did send, never in an agent's chain."""
    received: dict[str, list[list[int]]] = defaultdict(list)
    backend = replica.backend
    with backend._lock:
        bodies, headers = list(backend.received), list(backend.received_headers)
        generated = list(backend.generated)
    assert len(bodies) == len(headers)
    for body, head in zip(bodies, headers, strict=True):
        lowered = {k.lower(): v for k, v in head.items()}
        received[lowered.get("x-request-id", "")].append(body["input_ids"])
    completions: dict[tuple[int, ...], list[list[int]]] = defaultdict(list)
    for gen in generated:
        completions[tuple(gen["prompt_ids"])].append(gen["completion_ids"])

    disk = read_records(record_dir)
    assert not disk.duplicates, f"turns on disk twice: {disk.duplicates[:10]}"
    assert not disk.broken, f"{len(disk.broken)} turns are not trajectories:\n" + "\n".join(disk.broken[:20])
    if not chaos:
        assert not disk.skipped_lines, disk.skipped_lines

    ok = [x for x in run.exchanges if x.status == 200]
    assert all(x.status == 200 for x in run.exchanges), Counter(x.status for x in run.exchanges)
    for agent in run.agents:
        assert len(agent.used_chain()) == run.turns, f"{agent.name} did not finish"

    failures: list[str] = []
    for x in ok:
        if x.session_id is None or x.turn_id is None:
            failures.append(f"{x.request_id}: no x-tito-session-id / x-tito-turn-id")
            continue
        record = disk.turns.get(x.key)
        if record is None:
            failures.append(f"{x.agent} {x.kind}: turn {x.key} got a 200 but is not on disk")
            continue
        if record.request_id != x.request_id:
            failures.append(f"{x.key} is request {record.request_id}, the agent's was {x.request_id}")
        if not chaos and len(disk.by_request[x.request_id]) != 1:
            failures.append(f"request {x.request_id} is on disk {len(disk.by_request[x.request_id])} times")
        if record.ambiguous_parent and not chaos:
            failures.append(f"{x.key}: ambiguous parent")
        sent = received.get(x.request_id, [])
        if not sent or (not chaos and len(sent) != 1):
            failures.append(f"request {x.request_id} reached the backend {len(sent)} times")
            continue
        prompt = disk.prompts[x.key]
        if prompt not in sent:
            failures.append(f"{x.key}: the recorded prompt is not what the backend received")
            continue
        if record.completion_ids not in completions.get(tuple(prompt), []):
            failures.append(f"{x.key}: the recorded completion is not what the backend generated for that prompt")
        parent = x.parent
        if parent is None:
            if record.parent_turn_id is not None:
                failures.append(f"{x.key}: a first request recorded under turn {record.parent_turn_id}")
            continue
        recorded_parent = (record.session_id, record.parent_turn_id)
        if (
            chaos
            and record.ambiguous_parent
            and recorded_parent != parent.key
            and same_tokens(disk, recorded_parent, parent.key)
        ):
            # A retry of a request whose answer was lost (a killed proxy) resends the same body: the backend samples
            # the same completion again, and the follow-up cannot tell the two identical siblings apart. It is
            # placed under the first, flagged ambiguous: the same tokens, so the same trajectory.
            pass
        elif recorded_parent != parent.key:
            failures.append(f"{x.key}: recorded under {(record.session_id, record.parent_turn_id)}, "
                            f"the agent continued {parent.key}")  # fmt: skip
            continue
        # The backend got exactly its own sample's prompt and completion, then the new messages.
        before = disk.prompts[parent.key] + disk.turns[parent.key].completion_ids
        if not (len(prompt) > len(before) and prompt[: len(before)] == before):
            failures.append(f"{x.key}: the prompt sent does not extend {parent.key}'s prompt and completion")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])

    # No lost turn, no extra turn: the records are exactly the 200s (plus, under chaos, committed-but-lost ones).
    acknowledged = {x.key for x in ok}
    extra = set(disk.turns) - acknowledged
    if chaos:
        ours = {x.request_id for x in run.exchanges}
        strangers = [k for k in extra if disk.turns[k].request_id not in ours]
        assert not strangers, f"turns on disk that no agent sent: {strangers[:10]}"
    else:
        assert not extra, f"{len(extra)} turns on disk that no agent got a 200 for: {sorted(extra)[:10]}"

    # Sessions.
    first_session = {agent.name: agent.exchanges[0].session_id for agent in run.agents}
    for agent in run.agents:
        assert {x.session_id for x in agent.exchanges} == {first_session[agent.name]}, f"{agent.name} changed session"
    sessions_on_disk = {session for session, _ in disk.turns}
    if automatic:
        groups: dict[int, set[str | None]] = defaultdict(set)
        for agent in run.agents:
            groups[agent.group].add(first_session[agent.name])
        assert all(len(s) == 1 for s in groups.values()), {g: s for g, s in groups.items() if len(s) != 1}
        group_sessions = {next(iter(s)) for s in groups.values()}
        assert len(group_sessions) == len(groups) == -(-len(run.agents) // GROUP), "two groups share a session"
        assert sessions_on_disk == group_sessions
        for agent in run.agents:  # the group's samples: sibling roots of its session
            roots = [x for x in agent.exchanges if x.parent is None]
            assert roots and all(disk.turns[x.key].parent_turn_id is None for x in roots)
    else:
        assert first_session == {agent.name: agent.name for agent in run.agents}
        assert sessions_on_disk == set(first_session.values())
    return {"turns": len(ok), "sessions": len(sessions_on_disk), "files": disk.files, "wall_s": round(run.wall_s, 1),
            "statuses": dict(run.status_counts)}  # fmt: skip


def report(name: str, config: FleetConfig, summary: dict, elapsed: float) -> None:
    print(f"\n{name}[{config.name}]: {summary['turns']} turns of {AGENTS} agents x {TURNS} steps in "
          f"{summary['sessions']} sessions ({summary['files']} files), agents ran {summary['wall_s']}s, test "
          f"{elapsed:.1f}s; statuses {summary['statuses']}")  # fmt: skip


# ------------------------------------------------------------------ the tests


@pytest.mark.parametrize("config", CONFIGS)
def test_fleet_automatic_sessions(config: FleetConfig, replica, tmp_path: Path, request) -> None:
    started = time.monotonic()
    with make_fleet(config, replica, tmp_path, request) as fleet:
        run = asyncio.run(FleetRun(fleet.url + "/v1", AGENTS, TURNS).run())
    summary = check_fleet_run(run, replica, fleet.record_dir, automatic=True)
    assert summary["turns"] == run.total_requests()
    report("automatic", config, summary, time.monotonic() - started)


@pytest.mark.parametrize("config", CONFIGS)
def test_fleet_named_sessions(config: FleetConfig, replica, tmp_path: Path, request) -> None:
    started = time.monotonic()
    with make_fleet(config, replica, tmp_path, request) as fleet:
        run = asyncio.run(FleetRun(fleet.url + "/v1", AGENTS, TURNS, named=True).run())
    summary = check_fleet_run(run, replica, fleet.record_dir, automatic=False)
    assert summary["turns"] == run.total_requests()
    report("named", config, summary, time.monotonic() - started)


@pytest.mark.parametrize("named", [False, True], ids=["automatic", "named"])
def test_fleet_survives_a_killed_proxy(named: bool, replica, tmp_path: Path, request) -> None:
    started = time.monotonic()
    with make_fleet(REDIS_3, replica, tmp_path, request) as fleet:
        run = FleetRun(fleet.url + "/v1", AGENTS, TURNS, named=named, max_retries=0)  # our loop counts failures
        events: list[str] = []

        async def chaos(run: FleetRun) -> None:
            total = run.total_requests()
            await run.wait_completed(total // 4)
            await asyncio.to_thread(fleet.kill, 1)
            events.append(f"killed proxy 1 at {run.completed}/{total}")
            await asyncio.sleep(3)
            await asyncio.to_thread(fleet.restart, 1)
            events.append(f"restarted proxy 1 at {run.completed}/{total}")

        asyncio.run(run.run(chaos))
    assert len(events) == 2, events
    failed = run.connection_errors + sum(n for status, n in run.status_counts.items() if status >= 500)
    assert failed >= 1, "the kill hit no request in flight: it did not happen mid-turn"
    summary = check_fleet_run(run, replica, fleet.record_dir, automatic=not named, chaos=True)
    events.append(f"{failed} requests failed and were retried")
    report(f"killed proxy ({', '.join(events)})", REDIS_3, summary, time.monotonic() - started)


@pytest.mark.parametrize("named", [False, True], ids=["automatic", "named"])
def test_fleet_survives_redis_stopping(named: bool, replica, tmp_path: Path, request) -> None:
    started = time.monotonic()
    redis: RedisServer = request.getfixturevalue("redis")
    with make_fleet(REDIS_3, replica, tmp_path, request) as fleet:
        # Our own retry loop (no SDK retries) sees, and counts, every 503.
        run = FleetRun(fleet.url + "/v1", AGENTS, TURNS, named=named, max_retries=0)
        events: list[str] = []

        async def chaos(run: FleetRun) -> None:
            total = run.total_requests()
            await run.wait_completed(total // 3)
            await asyncio.to_thread(redis.stop)
            events.append(f"stopped Redis at {run.completed}/{total}")
            await asyncio.sleep(3)
            await asyncio.to_thread(redis.start)
            events.append(f"started Redis at {run.completed}/{total}")

        try:
            asyncio.run(run.run(chaos))
        finally:
            if not redis.running:
                redis.start()
    assert len(events) == 2, events
    assert run.status_counts[503] >= 1, f"no 503 while Redis was down: {dict(run.status_counts)}"
    bodies = [body for x in run.exchanges for status, body in x.error_bodies if status == 503]
    assert bodies
    for body in bodies:
        error = json.loads(body)  # a JSON error, not HAProxy's HTML page: the proxies stayed up
        assert "store" in json.dumps(error).lower(), body
    assert all_lines_parse(fleet.record_dir) == [], "a record line was half-written"
    summary = check_fleet_run(run, replica, fleet.record_dir, automatic=not named, chaos=True)
    assert not read_records(fleet.record_dir).skipped_lines
    report(f"Redis stopped ({', '.join(events)})", REDIS_3, summary, time.monotonic() - started)
