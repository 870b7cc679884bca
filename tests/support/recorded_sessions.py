"""Sessions recorded in process, for the export and trainer tests: the turn service (the real qwen3 engine, the
sglang backend, memory sessions, file records) over the sglang replica, driven turn by turn; `weather_tree` is one
session of chained turns, a retry and an edited first request, `record_episodes` a set of annotated episodes."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from tito_addon.backends.expert_routes import RouteShape, RoutesWanted
from tito_addon.backends.sglang_backend import SglangBackend
from tito_addon.backends.upstream_client import UpstreamClient
from tito_addon.records.record_models import AnnotationRecord
from tito_addon.records.records_port import FileRecords
from tito_addon.records.trajectory_recorder import TrajectoryRecorder
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.sessions.memory_sessions import MemorySessions
from tito_addon.turns.turn_service import TurnService

from .basics import TOOLS, cached_engine, tokenizer_path


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


async def weather_tree(service: TurnService, url: str, before_step=lambda step: None) -> None:
    """Session `s`: 4 chained turns, a retry of the third (a sibling branch) and an edited first request (a new
    root); `before_step(step)` runs before each of the 4 steps."""
    messages: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
    for step in range(4):
        before_step(step)
        message = await run_turn(service, url, "s", messages)
        if step == 2:
            await run_turn(service, url, "s", messages)  # a retry: a sibling branch
        messages.append(echo(message))
        if message.get("tool_calls"):
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": "21C"} for c in message["tool_calls"]]
        else:
            messages.append({"role": "user", "content": f"And then {step}?"})
    await run_turn(service, url, "s", [{"role": "user", "content": "Weather in Rome?"}])


async def episode(service: TurnService, url: str, session: str, first: str) -> None:
    """Two turns: the first request, then the tool results or a follow-up the agent appends."""
    messages: list[dict] = [{"role": "user", "content": first}]
    message = await run_turn(service, url, session, messages)
    messages.append(echo(message))
    calls = message.get("tool_calls") or []
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": "21C"} for c in calls]
    if not calls:
        messages.append({"role": "user", "content": "Thanks."})
    await run_turn(service, url, session, messages)


#: The MoE shape `record_episodes(..., routes=True)` records: layers, top-k, experts (`replicas/expert_routing`).
ROUTES_SHAPE = (3, 2, 8)


def record_episodes(out: Path, episodes: dict, tree: bool = False, routes: bool = False) -> TrajectoryRecorder:
    """Record `episodes` (session -> first request, group, reward) into `out`, one session each, in that order, then
    annotate each with its group, reward and a label; `tree`: also session `s`, `weather_tree`'s; `routes`: with the
    MoE routes of a replica started with --enable-return-routed-experts (`ROUTES_SHAPE`)."""
    recorder = TrajectoryRecorder(out)
    layers, topk, experts = ROUTES_SHAPE
    wanted = RoutesWanted(RouteShape(layers, topk)) if routes else None
    moe = {"routed_experts": True, "moe_layers": layers, "moe_topk": topk, "moe_experts": experts} if routes else {}

    async def run(url: str) -> None:
        client = UpstreamClient()
        service = TurnService(
            cached_engine("qwen3"), SglangBackend(client), MemorySessions(), FileRecords(out), routed_experts=wanted
        )
        for session, (first, _, _) in episodes.items():
            await episode(service, url, session, first)
        if tree:
            await weather_tree(service, url)
        await client.close()

    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"), **moe)) as replica:
        asyncio.run(run(replica.url))
    for session, (_, group, reward) in episodes.items():
        fields = {"reward": reward, "group": group, "labels": ["scored"]}
        recorder.write_annotation(AnnotationRecord(session_id=session, ts=time.time(), **fields))
    return recorder
