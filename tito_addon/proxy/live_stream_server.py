"""A loopback-only HTTP server inside mitmdump's event loop that streams live turns to agents.

mitmproxy sends a response set by an addon in one piece, so a token-by-token stream cannot be answered from the
request hook. Instead the addon parks the turn here under an unguessable token and points the flow at this
server; with `flow.response.stream` on, mitmproxy relays the chunks as they are written. A write that fails
means the agent went away: the stream is closed, which closes the upstream request, and nothing is recorded.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tito_addon.protocols.http_reply import HttpReply, json_reply
from tito_addon.turns.live_stream import LiveStream
from tito_addon.turns.turn_service import TurnService

logger = logging.getLogger(__name__)

PATH_PREFIX = "/tito-live/"


@dataclass
class StreamJob:
    service: TurnService
    path: str
    headers: dict[str, str]
    body: bytes
    base_url: str
    # Called with the turn's flow metadata once it is committed.
    on_commit: Callable[[dict[str, Any]], None] = field(default=lambda metadata: None)
    episode: str | None = None  # the session its driver named through the proxy (`episode_naming`)


class LiveStreamServer:
    def __init__(self) -> None:
        self.jobs: dict[str, StreamJob] = {}
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._starting = asyncio.Lock()
        self.disconnects = 0

    async def ensure_started(self) -> int:
        if self.port is not None:
            return self.port
        # Streamed turns that arrive together on a fresh proxy all wait for one start: two starts at once replaced
        # each other's runner, and one read an address its site had not bound yet.
        async with self._starting:
            if self.port is None:
                app = web.Application()
                app.router.add_post(PATH_PREFIX + "{token}", self._serve)
                runner = web.AppRunner(app, access_log=None, handle_signals=False)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", 0).start()
                self._runner, self.port = runner, int(runner.addresses[0][1])
        return self.port

    def park(self, job: StreamJob) -> str:
        token = secrets.token_urlsafe(24)
        self.jobs[token] = job
        return PATH_PREFIX + token

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        job = self.jobs.pop(request.match_info["token"], None)
        if job is None:
            return _as_response(json_reply(404, b'{"error": {"message": "no such live turn"}}'))
        try:
            opened = await job.service.open_stream(job.path, job.headers, job.body, job.base_url, job.episode)
        except Exception:
            logger.exception("tito: could not open a live stream")
            return _as_response(json_reply(500, b'{"error": {"message": "internal error in tito_addon"}}'))
        if isinstance(opened, HttpReply):
            return _as_response(opened)
        return await self._relay(request, opened, job.on_commit)

    async def _relay(
        self, request: web.Request, stream: LiveStream, on_commit: Callable[[dict[str, Any]], None]
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers=stream.headers)
        chunks = stream.chunks()
        try:
            await response.prepare(request)
            async for chunk in chunks:
                if stream.metadata:
                    on_commit(stream.metadata)
                await response.write(chunk)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            # The agent (through mitmproxy) is gone: stop generating; an uncommitted turn stays unrecorded.
            self.disconnects += 1
            logger.info("tito: agent disconnected mid-stream; upstream request cancelled")
        finally:
            await _close(chunks)
        return response

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self.port = None


async def _close(chunks: Any) -> None:
    closer: Callable[[], Awaitable[None]] | None = getattr(chunks, "aclose", None)
    if closer is not None:
        await closer()


def _as_response(reply: HttpReply) -> web.Response:
    return web.Response(status=reply.status, body=reply.body, headers=reply.headers)
