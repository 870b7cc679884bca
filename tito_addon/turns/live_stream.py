"""A turn streamed to the agent as the backend generates it; committed only when the backend finishes it.

The stream knows nothing of sessions: it is handed the commit to run on the backend's last event and the
release to run however it ends, so the turn service keeps every state change in one place.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from tito_addon.backends.backend_protocol import BackendResult, StreamEnd
from tito_addon.protocols.agent_api import Responder, TurnOutcome
from tito_addon.tito_errors import TitoError, UpstreamPassthrough

logger = logging.getLogger(__name__)


class LiveStream:
    """A turn streaming to the agent: chunks as the backend makes them, then (after the commit) the tail.

    A failure mid-stream ends it with an SSE error event and no [DONE]; closing it early (the agent went away)
    closes the upstream request. Either way nothing is recorded."""

    def __init__(
        self,
        events: AsyncIterator[dict[str, Any] | StreamEnd],
        first: dict[str, Any] | StreamEnd,
        responder: Responder,
        *,
        commit: Callable[[BackendResult], Awaitable[tuple[dict[str, Any], TurnOutcome]]],
        release: Callable[[], None],
    ) -> None:
        self.events, self.first, self.responder = events, first, responder
        self.commit, self.release = commit, release
        self.headers = {**responder.stream_headers, "x-tito-stream": "live"}
        self.metadata: dict[str, Any] = {}

    async def chunks(self) -> AsyncIterator[bytes]:
        responder = self.responder
        try:
            start = responder.stream_start()
            if start:
                yield start
            event: dict[str, Any] | StreamEnd = self.first
            while True:
                if isinstance(event, StreamEnd):
                    self.metadata, outcome = await self.commit(event.result)
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
            self.release()
