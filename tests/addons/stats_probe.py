"""A test-only mitmproxy script loaded next to tito_addon: `GET /_probe/stats` answers with the asyncio tasks alive in
the real mitmdump process (by name), so a test can look for task leaks from the outside. Nothing else is touched."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

from mitmproxy import http


class StatsProbe:
    def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.method != "GET" or flow.request.path != "/_probe/stats" or flow.response is not None:
            return
        tasks = [task for task in asyncio.all_tasks() if not task.done()]
        names = Counter(task.get_coro().__qualname__ if task.get_coro() else task.get_name() for task in tasks)
        body = json.dumps({"tasks": len(tasks), "by_coroutine": dict(names)}).encode()
        flow.response = http.Response.make(200, body, {"content-type": "application/json"})


addons = [StatsProbe()]
