"""The turn service's cost under the P2 load, in-process: CPU per turn here, instructions per turn under callgrind.

P2's end-to-end ratio moves by ±20 % between runs on a shared machine; instructions do not. This runs P2's agents
(`bench/concurrency.py`: 10 turns each, every turn appending the reply and a ~150-token tool result, no session ids)
against the turn service in-process, with the sglang-shaped backend in its own process, as the addon serves them.
Under callgrind, the difference of two agent counts cancels start-up (importing, loading the tokenizer):

    for n in 8 136; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        .venv/bin/python bench/turn_instructions.py --agents $n 2>&1 | grep 'I *refs'; done
    # instructions a turn = (refs at 136 - refs at 8) / (128 agents x 10 turns)

The agents' own JSON is counted too (a small, constant share); callgrind counts no kernel time (syscalls).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]
TOKENIZER = REPO.parent / "shared" / "tokenizers" / "qwen3"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=256)
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()

    from concurrency import TOOL_RESULT
    from local_servers import BackendProcess

    from tito_addon.backends.sglang_backend import SglangBackend
    from tito_addon.backends.upstream_client import UpstreamClient
    from tito_addon.engine.model_families import FAMILIES
    from tito_addon.engine.token_engine import TokenEngine
    from tito_addon.engine.tokenizer_loading import load_tokenizer
    from tito_addon.proxy.collector_tuning import tune_collector
    from tito_addon.records.records_port import FileRecords
    from tito_addon.sessions.memory_sessions import MemorySessions
    from tito_addon.turns.turn_service import TurnService

    engine = TokenEngine(load_tokenizer(str(TOKENIZER), trust_remote_code=False), FAMILIES["qwen3"],
                         append_roles=("tool", "user", "system"))  # fmt: skip
    backend = BackendProcess(0.1)
    sglang = SglangBackend(UpstreamClient(), verify_echo=False, compact_requests=engine.family.compact_requests)
    service = TurnService(engine, sglang, MemorySessions(), FileRecords(tempfile.mkdtemp(prefix="tito-instr-")))
    tune_collector(50_000)  # as the addon does (`tito_gc_threshold`)

    async def agent(index: int, turns: int) -> None:
        messages = [{"role": "system", "content": "You are a data agent."},
                    {"role": "user", "content": f"Task {index}: summarise the inventory."}]  # fmt: skip
        headers = {"content-type": "application/json", "x-agent-id": str(index)}
        for turn in range(turns):
            body = orjson.dumps({"model": "m", "messages": messages})
            reply = await service.handle("/v1/chat/completions", headers, body, backend.url)
            if reply.status != 200:
                raise RuntimeError(f"agent {index} turn {turn}: HTTP {reply.status}: {reply.body[:300]!r}")
            content = orjson.loads(reply.body)["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": content},
                         {"role": "user", "content": f"Tool says ({turn}): {TOOL_RESULT}"}]  # fmt: skip

    async def run() -> None:
        await asyncio.gather(*(agent(100_000 + i, 2) for i in range(20)))  # warm-up: caches and pools
        started = time.process_time()
        await asyncio.gather(*(agent(i, args.turns) for i in range(args.agents)))
        turns = args.agents * args.turns
        print(f"{turns} turns, {(time.process_time() - started) / turns * 1e6:.0f} us of CPU a turn (in-process)")

    try:
        asyncio.run(run())
    finally:
        backend.close()


if __name__ == "__main__":
    main()
