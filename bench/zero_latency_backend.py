"""A zero-latency sglang-shaped backend for benchmarks: answers every chat request at once with a short canned
completion, echoing the prompt ids it was given. The same server answers the addon and the plain passthrough, so
their difference is the proxy's own cost."""

from __future__ import annotations

import json

from aiohttp import web

COMPLETION = [785, 4226, 374, 220, 17, 16, 13, 151645]  # "The answer is 21." + <|im_end|>


async def chat(request: web.Request) -> web.Response:
    body = json.loads(await request.read())
    ids = body.get("input_ids") or []
    entries = [[-0.5, token, None] for token in COMPLETION]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "The answer is 21."},
        "finish_reason": "stop",
        "prompt_token_ids": ids,
        "meta_info": {"completion_tokens": len(COMPLETION), "output_token_logprobs": entries},
    }
    usage = {"prompt_tokens": len(ids), "completion_tokens": len(COMPLETION)}
    return web.json_response({"id": "bench", "object": "chat.completion", "created": 0, "model": "m",
                              "choices": [choice], "usage": usage})  # fmt: skip


def make_app() -> web.Application:
    app = web.Application(client_max_size=1024**3)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def start(port: int = 0) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(make_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, int(runner.addresses[0][1])
