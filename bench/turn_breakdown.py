"""In-process, at turns 2/50/100/200 of the P1 session: what preparing the next turn costs (its first preparation,
as the proxy prepares it, median over the turn and the two either side of it; no state changes), and how much of
it is reading the agent's request (UTF-8, JSON, validation, message keys) right after its previous request was
read, against the floor of only parsing that request with the fastest JSON parser in the venv (orjson).

Run on any checkout, so that `run_all.py --before REV` measures the old code on the same requests:

    .venv/bin/python bench/turn_breakdown.py [--repo PATH] [--turns 200]   # prints JSON
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

from p1_session import CHECKPOINTS, agent_body, conversation

BENCH = Path(__file__).resolve().parent


def median_ms(fn, n: int = 15) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def breakdown(turns: int, tokenizer: str) -> dict:
    import orjson
    from agent_apis import fresh_memos
    from zero_latency_backend import start as start_backend

    from tito_addon.backends.sglang_backend import SglangBackend
    from tito_addon.backends.upstream_client import UpstreamClient
    from tito_addon.engine.model_families import FAMILIES
    from tito_addon.engine.token_engine import TokenEngine
    from tito_addon.engine.tokenizer_loading import load_tokenizer
    from tito_addon.protocols import openai_chat
    from tito_addon.records.records_port import NullRecords
    from tito_addon.sessions.message_keys import message_key
    from tito_addon.turns.turn_service import TurnService

    try:
        from tito_addon.sessions.memory_sessions import MemorySessions as sessions_class
    except ImportError:  # an older checkout: the turn service took this process's tree itself
        from tito_addon.sessions.session_tree import SessionStore as sessions_class

    bodies = [agent_body({"model": "m", "messages": m}) for m in conversation(turns)]
    engine = TokenEngine(load_tokenizer(tokenizer, trust_remote_code=False), FAMILIES["qwen3"],
                         append_roles=("tool", "user", "system"))  # fmt: skip
    headers = {"x-session-id": "breakdown"}
    chat = openai_chat.ChatCompletionsApi()
    # (an older checkout reads with a module function over the module's memos)
    parse_request = getattr(chat, "parse_request", None) or openai_chat.parse_request

    def read(body: bytes) -> None:
        request, _ = parse_request(body)
        [message_key(m) for m in request.messages]

    def read_after(previous: bytes, body: bytes) -> float:
        """Reading `body` as a proxy does right after the agent's previous request: what that one held is known."""
        times = []
        for _ in range(15):
            fresh_memos(chat)  # (each repetition would otherwise find `body` itself, as a retry)
            read(previous)
            started = time.perf_counter()
            read(body)
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e3

    async def run() -> dict:
        runner, port = await start_backend()
        base = f"http://127.0.0.1:{port}"
        client = UpstreamClient()
        service = TurnService(engine, SglangBackend(client), sessions_class(), NullRecords())
        out: dict = {}
        prepared: dict[int, list[float]] = {}
        try:
            for index, body in enumerate(bodies):
                turn = index + 1
                near = [c for c in CHECKPOINTS if abs(c - turn) <= 2]
                if near:  # a turn's first preparation, as the proxy prepares it (a second one would be a retry)
                    started = time.perf_counter()
                    preparing = service.prepare("/v1/chat/completions", headers, body, base)
                    if inspect.isawaitable(preparing):  # async since the sessions' interface (issue 29)
                        await preparing
                    prepared.setdefault(near[0], []).append(time.perf_counter() - started)
                reply = await service.handle("/v1/chat/completions", headers, body, base)
                assert reply.status == 200, reply.body[:200]
            for turn in CHECKPOINTS:
                if turn > len(bodies):
                    continue
                body = bodies[turn - 1]
                out[turn] = {
                    "request_kib": len(body) / 1024,
                    "prepare_ms": statistics.median(prepared[turn]) * 1e3,
                    "read_request_ms": read_after(bodies[turn - 2], body),
                    "orjson_floor_ms": median_ms(lambda b=body: orjson.loads(b)),
                }
        finally:
            await client.close()
            await runner.cleanup()
        return out

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repo", type=Path, default=BENCH.parent)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--tokenizer", default=str(BENCH.parents[1] / "shared" / "tokenizers" / "qwen3"))
    args = parser.parse_args()
    sys.path[:0] = [str(args.repo.resolve()), str(BENCH)]
    print(json.dumps(breakdown(args.turns, args.tokenizer)))


if __name__ == "__main__":
    main()
