"""A transparent recording hop between the proxy and a backend: what really crossed the wire, per call."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import aiohttp
from aiohttp import web


class UpstreamTap:
    """Forwards every request to `target` unchanged and keeps (method, path, request JSON and headers, status, response
    JSON)."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.calls: list[dict[str, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def of(self, path: str) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["path"] == path]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        call: dict[str, Any] = {"method": request.method, "path": request.path, "request": _json(body), "status": None}
        call["headers"] = {k.lower(): v for k, v in request.headers.items()}
        self.calls.append(call)  # before forwarding: a call that stalls or fails is still seen
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        try:
            async with aiohttp.ClientSession() as session:
                async with session.request(
                    request.method, self.target + request.path_qs, data=body or None, headers=headers
                ) as response:
                    data = await response.read()
                    status, content_type = response.status, response.headers.get("content-type", "application/json")
        except aiohttp.ClientError:
            # The backend reset the connection: do the same to the proxy.
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=502)
        call.update(status=status, response=_json(data), response_bytes=data)
        return web.Response(status=status, body=data, headers={"content-type": content_type})

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        # A call the backend stalls on stays in flight; shutting down must not wait for it (aiohttp's default: 60 s).
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    def __enter__(self) -> UpstreamTap:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(30)


def _json(data: bytes) -> Any:
    try:
        return json.loads(data) if data else None
    except ValueError:
        return {"_raw": data.decode("utf-8", "replace")}
