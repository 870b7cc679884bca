"""A turn streamed to the agent as the backend generates it; committed only when the backend finishes it.

The stream knows nothing of sessions: it is handed the turn's run, whose commit it runs on the backend's last event
and whose claim it releases however it ends, so the turn service keeps every state change in one place (the same
steps as a whole turn's).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from tito_addon.backends.backend_protocol import StreamEnd
from tito_addon.tito_errors import TitoError, UpstreamPassthrough
from tito_addon.turns.turn_run import TurnRun

logger = logging.getLogger(__name__)


class LiveStream:
    """A turn streaming to the agent: chunks as the backend makes them, then (after the commit) the tail.

    A failure mid-stream ends it with an SSE error event and no [DONE]; closing it early (the agent went away)
    closes the upstream request. Either way nothing is recorded."""

    def __init__(
        self,
        events: AsyncIterator[dict[str, Any] | StreamEnd],
        first: dict[str, Any] | StreamEnd,
        run: TurnRun,
    ) -> None:
        self.events, self.first, self.run = events, first, run
        self.responder = run.responder
        self.headers = {**run.responder.stream_headers, "x-tito-stream": "live"}
        self.metadata: dict[str, Any] = {}

    async def aclose(self) -> None:
        """Close a stream that will never be relayed (its agent went away first): the upstream request, the claim."""
        try:
            await self.events.aclose()
        finally:
            await self.run.release()

    async def chunks(self) -> AsyncIterator[bytes]:
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
