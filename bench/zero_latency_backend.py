"""A zero-latency sglang-shaped backend for benchmarks: answers every chat request at once with a short canned
completion. Like sglang (0.5.13+) it echoes the prompt ids only when asked (`return_prompt_token_ids`) and
reports its version on /server_info. It parses and encodes with orjson, so its own share of a turn stays
small; the same server answers the addon and the plain passthrough, so their difference is the proxy's cost.
An optional latency (P2) is slept before answering.

`reply`: what it answers, the canned text by default or a tool call (a Claude-Code-shaped session's turn), whole or
streamed as sglang 0.5.20+ streams (chunks with their logprobs, the `sglext` ids block, usage, `[DONE]`).
`last_ids_body` holds the bytes of the last request that carried `input_ids`, so that a benchmark can send the very
body the addon sent through plain mitmdump.

`parse="sglang"` reads the body as a real sglang server does instead: Starlette's `request.json()` (the standard
library's JSON) and then pydantic validation into a chat request model (messages, input_ids as `list[int]`,
tools...), so that the cost of the wire format itself (the prompt as ~1 MB of ids, the conversation beside it) shows.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict

COMPLETION = [785, 4226, 374, 220, 17, 16, 13, 151645]  # "The answer is 21." + <|im_end|>


@dataclass(frozen=True)
class Reply:
    """One canned completion: its ids (qwen3's), its text and, for a tool call, the call sglang parses from it."""

    ids: list[int] = field(default_factory=lambda: list(COMPLETION))
    content: str | None = "The answer is 21."
    tool_call: dict[str, Any] | None = None  # {"id", "name", "arguments"}: the id gets the request's number

    def numbered(self, number: int) -> Reply:
        if not self.tool_call:
            return self
        return Reply(self.ids, self.content, {**self.tool_call, "id": f"{self.tool_call['id']}{number}"})

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_call else "stop"

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_call:
            call = self.tool_call
            message["tool_calls"] = [{"id": call["id"], "type": "function", "index": 0,
                                      "function": {"name": call["name"], "arguments": call["arguments"]}}]  # fmt: skip
        return message


LAST_IDS_BODY = web.AppKey("last_ids_body", list)


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def _stream(reply: Reply, ids: list[int], echo: bool) -> bytes:
    """The whole event stream at once: a zero-latency server has nothing to wait for between chunks."""
    head = {"id": "bench", "object": "chat.completion.chunk", "created": 0, "model": "m"}

    def chunk(delta: dict[str, Any], tokens: range, finish: str | None = None) -> bytes:
        entries = [{"token": "t", "logprob": -0.5, "bytes": [116], "top_logprobs": []} for _ in tokens]
        choice = {"index": 0, "delta": delta, "logprobs": {"content": entries} if entries else None,
                  "finish_reason": finish}  # fmt: skip
        return _sse({**head, "choices": [choice]})

    half = len(reply.ids) // 2
    out = [chunk({"role": "assistant", "content": ""}, range(0))]
    if reply.tool_call:
        call = reply.tool_call
        start = {"index": 0, "id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": ""}}
        out.append(chunk({"tool_calls": [start]}, range(half)))
        out.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": call["arguments"]}}]},
                         range(half, len(reply.ids) - 1)))  # fmt: skip
    else:
        out.append(chunk({"content": reply.content}, range(len(reply.ids) - 1)))
    out.append(chunk({}, range(1), reply.finish_reason))
    sglext: dict[str, Any] = {"output_ids": [reply.ids]}
    if echo:  # as sglang, only when asked
        sglext["input_ids"] = ids
    out.append(_sse({**head, "choices": [], "sglext": sglext}))
    usage = {"prompt_tokens": len(ids), "completion_tokens": len(reply.ids), "total_tokens": len(ids) + len(reply.ids)}
    out.append(_sse({**head, "choices": [], "usage": usage}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


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


def make_app(latency_s: float = 0.0, parse: str = "orjson", reply: Reply | None = None) -> web.Application:
    reply = reply or Reply()
    captured = [b""]  # (a list: an app's state may not change once it runs)
    served = [0]

    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if parse == "sglang":
            body = json.loads(raw)
            SglangChatRequest.model_validate(body)
        else:
            body = orjson.loads(raw)
        ids = body.get("input_ids") or []
        if ids:
            captured[0] = raw
        if latency_s:
            await asyncio.sleep(latency_s)
        served[0] += 1
        answer = reply.numbered(served[0])  # a tool call's id is new each time, as a model's are
        if body.get("stream"):
            echo = bool(body.get("return_input_ids_in_sglext"))
            return web.Response(body=_stream(answer, ids, echo), content_type="text/event-stream")
        entries = [[-0.5, token, None] for token in reply.ids]
        choice = {
            "index": 0,
            "message": answer.message(),
            "finish_reason": answer.finish_reason,
            "meta_info": {"prompt_tokens": len(ids), "completion_tokens": len(reply.ids),
                          "output_token_logprobs": entries},
        }  # fmt: skip
        if body.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = ids
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(reply.ids)}
        out = {"id": "bench", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice],
               "usage": usage}  # fmt: skip
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.23"})

    app = web.Application(client_max_size=1024**3)
    app[LAST_IDS_BODY] = captured
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/server_info", server_info)
    return app


async def start(
    port: int = 0, latency_s: float = 0.0, parse: str = "orjson", reply: Reply | None = None
) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(make_app(latency_s, parse, reply), access_log=None)
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
