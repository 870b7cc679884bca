"""A turn streamed to the agent as the backend generates it; committed only when the backend finishes it.

The stream knows nothing of sessions: it is handed the turn's run, whose commit it runs on the backend's last event
and whose claim it releases however it ends, so the turn service keeps every state change in one place (the same
steps as a whole turn's).

It opens while the shell connects the agent to it: the backend's first event is pulled from the moment the stream is
made, so the request is on its way to the backend (and the backend at its prefill) while mitmproxy makes its second
exchange, with the relay. A failure before that first event is answered as a whole turn's would be (`opened`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from tito_addon.backends.backend_protocol import StreamEnd
from tito_addon.protocols.http_reply import HttpReply
from tito_addon.tito_errors import TitoError, UpstreamMalformed, UpstreamPassthrough
from tito_addon.turns.turn_run import TurnRun

logger = logging.getLogger(__name__)


class LiveStream:
    """A turn streaming to the agent: chunks as the backend makes them, then (after the commit) the tail.

    A failure mid-stream ends it with an SSE error event and no [DONE]; closing it early (the agent went away)
    closes the upstream request. Either way nothing is recorded."""

    def __init__(
        self,
        events: AsyncIterator[dict[str, Any] | StreamEnd],
        run: TurnRun,
        failure_reply: Callable[[BaseException], HttpReply],
    ) -> None:
        """`failure_reply`: the whole reply, in the agent's API, of a turn that failed before its first event."""
        self.events, self.run = events, run
        self.responder = run.responder
        self.headers = {**run.responder.stream_headers, "x-tito-stream": "live"}
        self.metadata: dict[str, Any] = {}
        self._failure_reply = failure_reply
        self._first: asyncio.Future[dict[str, Any] | StreamEnd] = asyncio.ensure_future(anext(events))
        self.first: dict[str, Any] | StreamEnd | None = None

    async def opened(self) -> HttpReply | None:
        """None once the backend's first event is in; else the reply to a failure before it (the stream closed,
        nothing recorded), the same as a whole turn's."""
        try:
            self.first = await self._first
            return None
        except StopAsyncIteration:
            failure: Exception = UpstreamMalformed("backend stream ended before its first chunk")
        except Exception as exc:  # noqa: BLE001 - every failure becomes the API's own error reply
            failure = exc
        await self.aclose()
        return self._failure_reply(failure)

    async def aclose(self) -> None:
        """Close a stream that will never be relayed (its agent went away first): the upstream request, the claim."""
        try:
            if not self._first.done():
                self._first.cancel()
            # (An outcome no one will read is taken here, so asyncio does not report it as never retrieved.)
            await asyncio.gather(self._first, return_exceptions=True)
            await self.events.aclose()
        finally:
            await self.run.release()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The agent's stream, once `opened` said it is."""
        assert self.first is not None
        responder = self.responder
        try:
            start = responder.stream_start()
            if start:
                yield start
            event: dict[str, Any] | StreamEnd = self.first
            while True:
                if isinstance(event, StreamEnd):
                    self.metadata, outcome = await self.run.finish(event.result)
                    yield responder.stream_end(outcome, event.tail)
                    return
                data = responder.stream_chunk(event)
                if data:
                    yield data
                event = await anext(self.events)
        except (TitoError, UpstreamPassthrough) as error:
            message = error.message if isinstance(error, TitoError) else f"backend answered {error.status}"
            logger.warning("turn stream failed: %s", message)
            yield responder.stream_error(message)
        finally:
            await self.events.aclose()
            await self.run.release()
