"""A mitmdump script for `bench/hook_floor.py`: answers every request itself from the `request` hook, as the addon
does, at once (TITO_FLOOR_MODE=sync) or after waiting as long as the P2 backend would (async); no upstream call."""

from __future__ import annotations

import asyncio
import os

from mitmproxy import http

MODE = os.environ.get("TITO_FLOOR_MODE", "sync")
ANSWER = (
    b'{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":'
    b'"assistant","content":"Checked the inventory; 3 items need attention."},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)


class StubAnswer:
    async def request(self, flow: http.HTTPFlow) -> None:
        if MODE == "async":
            await asyncio.sleep(0.1)
        flow.response = http.Response.make(200, ANSWER, {"content-type": "application/json"})


addons = [StubAnswer()]
