"""A zero-latency sglang-shaped backend for benchmarks: answers every chat request at once with a short canned
completion. Like sglang (0.5.13+) it echoes the prompt ids only when asked (`return_prompt_token_ids`) and
reports its version on /server_info. It parses and encodes with orjson, so its own share of a turn stays
small; the same server answers the addon and the plain passthrough, so their difference is the proxy's cost.
An optional latency (P2) is slept before answering.

`parse="sglang"` reads the body as a real sglang server does instead: Starlette's `request.json()` (the standard
library's JSON) and then pydantic validation into a chat request model (messages, input_ids as `list[int]`,
tools...), so that the cost of the wire format itself (the prompt as ~1 MB of ids, the conversation beside it) shows.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict

COMPLETION = [785, 4226, 374, 220, 17, 16, 13, 151645]  # "The answer is 21." + <|im_end|>


class SglangMessage(BaseModel):
    """The fields of sglang's chat message models that a tool-using agent's messages fill."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None


class SglangChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    messages: list[SglangMessage]
    model: str | None = None
    input_ids: list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    logprobs: bool = False
    stream: bool = False


def make_app(latency_s: float = 0.0, parse: str = "orjson") -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        raw = await request.read()
        if parse == "sglang":
            body = json.loads(raw)
            SglangChatRequest.model_validate(body)
        else:
            body = orjson.loads(raw)
        ids = body.get("input_ids") or []
        if latency_s:
            await asyncio.sleep(latency_s)
        entries = [[-0.5, token, None] for token in COMPLETION]
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": "The answer is 21."},
            "finish_reason": "stop",
            "meta_info": {"prompt_tokens": len(ids), "completion_tokens": len(COMPLETION),
                          "output_token_logprobs": entries},
        }  # fmt: skip
        if body.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = ids
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(COMPLETION)}
        out = {"id": "bench", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice],
               "usage": usage}  # fmt: skip
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.23"})

    app = web.Application(client_max_size=1024**3)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/server_info", server_info)
    return app


async def start(port: int = 0, latency_s: float = 0.0, parse: str = "orjson") -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(make_app(latency_s, parse), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, int(runner.addresses[0][1])


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds to wait before answering")
    args = parser.parse_args()

    async def serve() -> None:
        _, port = await start(args.port, args.latency)
        print(f"listening http://127.0.0.1:{port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
