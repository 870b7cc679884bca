"""P6: one streamed turn against the same turn not streamed, at histories of 1k, 20k and 100k tokens.

The backend layer in-process (what the proxy runs for a turn once it has the prompt ids), against the vLLM and
sglang replicas, through a tap that counts the calls and request bytes each turn sends to the backend. The
replicas generate at 100 tokens/s (vLLM; its streaming derender takes 5 ms a call) and answer ~480 tokens.
"before" is vLLM's streamed turn as it was: one derender call per generate chunk, each with the whole prompt
and conversation; "after" merges chunks into calls that grow geometrically and sends derender a seed of the
prompt and no messages (`backends/parser_inputs.py`), as the non-streamed turn now does too.

    .venv/bin/python bench/run_all.py --only p6
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from p1_session import TOOL_RESULT  # noqa: E402

from tito_addon.backends.backend_protocol import BackendTurn, StreamEnd  # noqa: E402
from tito_addon.backends.sglang_backend import SglangBackend  # noqa: E402
from tito_addon.backends.upstream_client import UpstreamClient  # noqa: E402
from tito_addon.backends.vllm_backend import VllmBackend  # noqa: E402
from tito_addon.canonical_chat import ChatRequest  # noqa: E402
from tito_addon.engine.model_families import FAMILIES  # noqa: E402
from tito_addon.engine.prompt_ids import PromptIds  # noqa: E402
from tito_addon.engine.token_engine import TokenEngine  # noqa: E402
from tito_addon.engine.tokenizer_loading import load_tokenizer  # noqa: E402
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread  # noqa: E402
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread  # noqa: E402

HISTORIES = (1_000, 20_000, 100_000)
MODEL = "tiny-qwen3"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


class ByteTap:
    """A loopback forwarder that counts, per path, the calls and request bytes that pass to the backend."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.app = web.Application(client_max_size=1024**3)
        self.app.router.add_route("*", "/{tail:.*}", self.forward)

    async def start(self) -> str:
        self.session = ClientSession(timeout=ClientTimeout(total=600))
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        await self.session.close()
        await self.runner.cleanup()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "POST":
            self.calls[request.path] += 1
            self.bytes[request.path] += len(body)
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with self.session.request(request.method, self.target + request.path_qs, data=body,
                                        headers=headers) as upstream:  # fmt: skip
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            async for piece in upstream.content.iter_any():
                await response.write(piece)
            await response.write_eof()
            return response


def history(engine: TokenEngine, tokens: int) -> tuple[list[dict[str, Any]], list[int]]:
    """A tool-using conversation of about `tokens` prompt tokens, ending with a tool result (an answer turn)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a data agent."},
        {"role": "user", "content": "Weather in Paris, and the sensor table?"},
    ]
    per_round = 790  # an assistant line and a ~500-token tool result, with their framing
    for turn in range(max(1, tokens // per_round)):
        messages += [
            {"role": "assistant", "content": f"Reading batch {turn}."},
            {"role": "tool", "tool_call_id": f"c{turn}", "content": f"{turn}: {TOOL_RESULT}"},
        ]
    request = ChatRequest.model_validate({"model": MODEL, "messages": messages, "tools": TOOLS})
    return messages, engine.first_turn(request.messages, request.tools, {}).ids


async def one_turn(backend: Any, turn: BackendTurn, streamed: bool) -> dict[str, float]:
    started = time.perf_counter()
    if not streamed:
        result = await backend.run_turn(turn)
        done = time.perf_counter() - started
        return {"first_ms": done * 1e3, "last_ms": done * 1e3, "completion_tokens": len(result.completion_ids)}
    first = None
    tokens = 0
    async for event in backend.stream_turn(turn):
        if isinstance(event, StreamEnd):
            tokens = len(event.result.completion_ids)
        elif first is None:
            first = time.perf_counter() - started
    done = time.perf_counter() - started
    return {"first_ms": (first or done) * 1e3, "last_ms": done * 1e3, "completion_tokens": tokens}


async def measure(kind: str, replica_url: str, engine: TokenEngine, repeats: int) -> dict[str, Any]:
    tap = ByteTap(replica_url)
    url = await tap.start()
    client = UpstreamClient()
    modes: dict[str, tuple[Any, bool]]
    if kind == "vllm":
        modes = {
            "non-streamed before": (VllmBackend(client, merge_stream_chunks=True, compact_requests=False), False),
            "streamed before": (VllmBackend(client, merge_stream_chunks=False, compact_requests=False), True),
            "non-streamed": (VllmBackend(client, merge_stream_chunks=True, compact_requests=True), False),
            "streamed": (VllmBackend(client, merge_stream_chunks=True, compact_requests=True), True),
        }
    else:
        modes = {"non-streamed": (SglangBackend(client), False), "streamed": (SglangBackend(client), True)}
    out: dict[str, Any] = {}
    try:
        for tokens in HISTORIES:
            messages, prompt = history(engine, tokens)
            row: dict[str, Any] = {"prompt_tokens": len(prompt)}
            for name, (backend, streamed) in modes.items():
                body = {"model": MODEL, "messages": messages, "tools": TOOLS, "stream": streamed, "logprobs": True}
                turn = BackendTurn(url, "/v1/chat/completions", body, PromptIds.of(prompt), {}, engine.stop_texts,
                                   engine.special_ids)  # fmt: skip
                runs = []
                for _ in range(repeats):
                    tap.reset()
                    timing = await one_turn(backend, turn, streamed)
                    timing["calls"] = sum(tap.calls.values())
                    timing["bytes"] = sum(tap.bytes.values())
                    timing["derender_calls"] = tap.calls["/v1/chat/completions/derender"]
                    runs.append(timing)
                row[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            base = row["non-streamed"]["bytes"]
            row["streamed_over_non_streamed_bytes"] = row["streamed"]["bytes"] / base
            if kind == "vllm":
                row["streamed_before_over_non_streamed_bytes"] = row["streamed before"]["bytes"] / base
            out[str(tokens)] = row
            print(f"p6 {kind} {tokens}: {row}", flush=True)
    finally:
        await client.close()
        await tap.stop()
    return out


def p6(tokenizer: str, repeats: int = 3) -> dict[str, Any]:
    engine = TokenEngine(load_tokenizer(tokenizer, trust_remote_code=False), FAMILIES["qwen3"],
                         append_roles=("tool", "user"))  # fmt: skip
    result: dict[str, Any] = {}
    vllm = VllmReplicaConfig(tokenizer=tokenizer, max_model_len=250_000, stream_delay_s=0.01,
                             derender_delay_s=0.005, answer_sentences=34)  # fmt: skip
    with VllmReplicaThread(vllm) as replica:
        result["vllm"] = asyncio.run(measure("vllm", replica.url, engine, repeats))
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer, answer_sentences=34)) as replica:
        result["sglang"] = asyncio.run(measure("sglang", replica.url, engine, repeats))
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(p6(str(REPO.parent / "shared" / "tokenizers" / "qwen3"), repeats=1), indent=1))
