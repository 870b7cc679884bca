"""A loopback-only HTTP server inside mitmdump's event loop that relays live turns to agents.

mitmproxy sends a response set by an addon in one piece, so a token-by-token stream cannot be answered from the
request hook. The turn service opens the stream in that hook (the request read once, sent on to the backend); the
addon parks it here under an unguessable token and points the flow at this server, with an empty body; with
`flow.response.stream` on, mitmproxy relays the chunks as they are written. The backend's prefill runs while
mitmproxy connects here; a turn that fails before its first chunk is answered whole, with the reply the turn service
made. This server only pipes: a write that fails means the agent went away, and the stream is closed, which closes
the upstream request, and nothing is recorded. A parked stream whose flow never arrives (its agent left before
mitmproxy connected here) is closed after `PARKED_S`, or at once when the flow errs.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tito_addon.protocols.http_reply import json_reply
from tito_addon.turns.live_stream import LiveStream

logger = logging.getLogger(__name__)

PATH_PREFIX = "/tito-live/"
PARKED_S = 30.0  # how long an opened stream waits for its flow to reach this server


@dataclass
class Parked:
    stream: LiveStream
    # Called with the turn's flow metadata once it is committed.
    on_commit: Callable[[dict[str, Any]], None]
    expiry: asyncio.TimerHandle | None = None


class LiveStreamServer:
    def __init__(self) -> None:
        self.jobs: dict[str, Parked] = {}
        # The relays under way, by token: a flow that errs (its agent left) stops its relay at once, even while the
        # backend's first chunk is still to come.
        self._relays: dict[str, asyncio.Task[Any]] = {}
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._starting = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()
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
                # Every streamed turn in flight connects here at once: aiohttp's backlog of 128 would drop some.
                await web.TCPSite(runner, "127.0.0.1", 0, backlog=2048).start()
                self._runner, self.port = runner, int(runner.addresses[0][1])
        return self.port

    def park(self, stream: LiveStream, on_commit: Callable[[dict[str, Any]], None]) -> str:
        """Hold an open stream for its flow: the path that flow asks this server for."""
        token = secrets.token_urlsafe(24)
        parked = Parked(stream, on_commit)
        parked.expiry = asyncio.get_running_loop().call_later(PARKED_S, self.abandon, PATH_PREFIX + token)
        self.jobs[token] = parked
        return PATH_PREFIX + token

    def abandon(self, path: str) -> None:
        """The flow of a stream erred, or never arrived: close the stream, parked or being relayed."""
        token = path.removeprefix(PATH_PREFIX)
        parked = self.jobs.pop(token, None)
        if parked is None:
            relay = self._relays.pop(token, None)
            if relay is not None:
                self.disconnects += 1
                relay.cancel()  # its own close runs as the cancel unwinds it
            return
        if parked.expiry is not None:
            parked.expiry.cancel()
        self.disconnects += 1
        task = asyncio.get_running_loop().create_task(parked.stream.aclose(), name="tito-close-parked")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        parked = self.jobs.pop(request.match_info["token"], None)
        if parked is None:
            reply = json_reply(404, b'{"error": {"message": "no such live turn"}}')
            return web.Response(status=reply.status, body=reply.body, headers=reply.headers)
        if parked.expiry is not None:
            parked.expiry.cancel()
        token = request.match_info["token"]
        relay = asyncio.current_task()
        if relay is not None:
            self._relays[token] = relay
        try:
            return await self._relay(request, parked.stream, parked.on_commit)
        finally:
            self._relays.pop(token, None)

    async def _relay(
        self, request: web.Request, stream: LiveStream, on_commit: Callable[[dict[str, Any]], None]
    ) -> web.StreamResponse:
        try:
            failure = await stream.opened()
        except BaseException:
            await stream.aclose()
            raise
        if failure is not None:
            return web.Response(status=failure.status, body=failure.body, headers=failure.headers)
        response = web.StreamResponse(status=200, headers=stream.headers)
        chunks = stream.chunks()
        batches = ready_batches(chunks)
        try:
            await response.prepare(request)
            async for batch in batches:
                if stream.metadata:
                    on_commit(stream.metadata)
                await response.write(batch)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            # The agent (through mitmproxy) is gone: stop generating; an uncommitted turn stays unrecorded.
            self.disconnects += 1
            logger.info("tito: agent disconnected mid-stream; upstream request cancelled")
        finally:
            await batches.aclose()
            await _close(chunks)
            await stream.aclose()  # a relay that failed before its first chunk never ran the chunks' own close
        return response

    async def stop(self) -> None:
        for path in [PATH_PREFIX + token for token in self.jobs]:
            self.abandon(path)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self.port = None


async def ready_batches(chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """The chunks joined as they are ready together: a chunk is held only while the next one comes without waiting
    (the rest of an upstream read), so a token is never delayed, and mitmproxy relays one HTTP chunk, not a dozen,
    for what the backend sent at once (each costs it a pass through its layers)."""
    held: list[bytes] = []
    following: asyncio.Future[bytes] | None = None
    try:
        while True:
            following = asyncio.ensure_future(anext(chunks))
            if held and not following.done():
                await asyncio.sleep(0)  # one step for the next chunk: done, unless it waits for the backend
                if not following.done():
                    yield b"".join(held)
                    held.clear()
            try:
                held.append(await following)
            except StopAsyncIteration:
                break
        if held:
            yield b"".join(held)
    finally:
        # Closed early (the agent went away): the pull in flight stops before the chunks are closed.
        if following is not None and not following.done():
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)


async def _close(chunks: Any) -> None:
    closer: Callable[[], Awaitable[None]] | None = getattr(chunks, "aclose", None)
    if closer is not None:
        await closer()
