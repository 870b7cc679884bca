"""HTTP calls to the backend, on this package's own keep-alive connections (`backend_connections`).

Transport failures become explicit errors: refused or reset connections answer 502, a backend that
stalls past the timeout answers 504. Where failover is on (`engine_failover`), a call a dead engine broke is sent
again first, to the router after a backoff or to the session's next engine of a fixed list.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson

from tito_addon.backends.backend_connections import ConnectFailed, ConnectionPool, HttpError
from tito_addon.backends.engine_failover import RETRIED_STATUSES, EngineList, FailoverLog, FailoverPolicy
from tito_addon.tito_errors import TitoError, UpstreamMalformed, UpstreamPassthrough, UpstreamUnavailable

logger = logging.getLogger(__name__)


class UpstreamTimeout(TitoError):
    status = 504
    error_type = "upstream_timeout"


class StreamCut(UpstreamUnavailable):
    """A stream broke after some of its events arrived: sending the request again would sample anew, so the caller
    decides (vLLM's generate goes on from the tokens it has)."""


@dataclass(frozen=True)
class UpstreamResponse:
    status: int
    content_type: str | None
    body: bytes

    def json(self) -> Any:
        return loads(self.body)


class UpstreamClient:
    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self.failover = FailoverPolicy()
        # With a fixed engine list: calls addressed to its first URL go to a live engine (a turn's: its session's).
        self.engines: EngineList | None = None
        # The proxy's own environment (HTTP_PROXY and the like) never reroutes a backend call.
        self._pool = ConnectionPool()

    def _unlogged(self) -> FailoverLog:
        """The log of a call no turn logs (a facts probe): a fixed list's engines in one order for every such call."""
        return FailoverLog.for_session(self.engines, "")

    async def post_json(
        self, url: str, body: Mapping[str, Any], headers: Mapping[str, str], log: FailoverLog | None = None
    ) -> UpstreamResponse:
        return await self._request("POST", url, headers, dumps(body), _JSON, log)

    async def post_bytes(
        self,
        url: str,
        payload: bytes | Sequence[bytes],
        headers: Mapping[str, str],
        log: FailoverLog | None = None,
    ) -> UpstreamResponse:
        """A JSON body the caller already encoded, whole or in pieces that are sent one after the other (e.g. with
        a prompt's ids spliced in as ready text)."""
        return await self._request("POST", url, headers, payload, _JSON, log)

    async def get(self, url: str, headers: Mapping[str, str], log: FailoverLog | None = None) -> UpstreamResponse:
        return await self._request("GET", url, headers, None, {}, log)

    async def _request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        payload: bytes | Sequence[bytes] | None,
        ours: Mapping[str, str],
        log: FailoverLog | None,
    ) -> UpstreamResponse:
        """One call, sent again while the failover policy allows when a dead engine broke it (`engine_failover`):
        then the last answer, or the last error."""
        log = log if log is not None else self._unlogged()
        retry = 0
        while True:
            target = log.url(url)
            try:
                try:
                    async with asyncio.timeout(self.timeout_s):
                        async with await self._pool.send(method, target, headers, payload, ours) as exchange:
                            data = await exchange.read()
                            response = UpstreamResponse(exchange.status, exchange.headers.get("content-type"), data)
                except TimeoutError as exc:
                    shown = _without_credentials(target)
                    raise UpstreamTimeout(f"backend did not answer within {self.timeout_s:g} s ({shown})") from exc
                except HttpError as exc:
                    raise _unavailable(exc, target) from exc
            except UpstreamUnavailable as exc:
                if retry >= self.failover.retries:
                    raise
                failure = exc.message
            else:
                if response.status not in RETRIED_STATUSES or retry >= self.failover.retries:
                    if response.status not in RETRIED_STATUSES:
                        log.answered()
                    return response
                failure = f"{_without_credentials(target)} answered {response.status}"
            await self.fail_over(log, failure, retry)
            retry += 1

    async def fail_over(self, log: FailoverLog, failure: str, retry: int) -> None:
        """Before call `retry` + 1 of a broken call: noted in the turn's log, then the next engine of a list at once,
        or the same URL (a router) after the backoff."""
        moved = log.failed(failure)
        logger.warning(
            "tito: %s; sending the call again (%d of %d)%s",
            failure,
            retry + 1,
            self.failover.retries,
            f" to {log.engine}" if moved else f" in {self.failover.backoff(retry):g} s",
        )
        if not moved:
            await asyncio.sleep(self.failover.backoff(retry))

    async def sse_events(
        self,
        url: str,
        body: Mapping[str, Any] | bytes | Sequence[bytes],
        headers: Mapping[str, str],
        log: FailoverLog | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """POST, then yield each JSON `data:` event of the SSE answer until `[DONE]`. `body`: an object, or its JSON
        already encoded, whole or in pieces (as `post_bytes` sends them).

        A non-200 answer raises UpstreamPassthrough before anything is yielded. A stream a dead engine broke before
        its first event is asked for again as the failover policy allows; one broken later raises StreamCut. Closing
        the generator closes the upstream connection, which is how a disconnected agent cancels its generation."""
        log = log if log is not None else self._unlogged()
        payload = dumps(body) if isinstance(body, Mapping) else body
        retry = 0
        while True:
            target = log.url(url)
            events = self._events_once(target, payload, headers)
            yielded = False
            try:
                async for event in events:
                    yielded = True
                    yield event
                log.answered()
                return
            except UpstreamUnavailable as exc:
                if yielded:
                    raise StreamCut(f"{exc.message} after the stream began") from exc
                if retry >= self.failover.retries:
                    raise
                failure = exc.message
            except UpstreamPassthrough as exc:
                if exc.status not in RETRIED_STATUSES or retry >= self.failover.retries:
                    raise
                failure = f"{_without_credentials(target)} answered {exc.status}"
            finally:
                await events.aclose()
            await self.fail_over(log, failure, retry)
            retry += 1

    async def _events_once(
        self, url: str, payload: bytes | Sequence[bytes], headers: Mapping[str, str]
    ) -> AsyncGenerator[dict[str, Any]]:
        try:
            # No total limit on a stream: the limit is on silence (until the head, then between two reads).
            async with asyncio.timeout(self.timeout_s):
                exchange = await self._pool.send("POST", url, headers, payload, _JSON_STREAM)
            async with exchange:
                if exchange.status != 200:
                    async with asyncio.timeout(self.timeout_s):
                        data = await exchange.read()
                    raise UpstreamPassthrough(exchange.status, data, exchange.headers.get("content-type"))
                buffer = b""
                async for piece in exchange.pieces(self.timeout_s):
                    buffer += piece
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        event = _sse_data(line)
                        if event is _DONE:
                            return
                        if event is not None:
                            yield event
                event = _sse_data(buffer)
                if event is not None and event is not _DONE:
                    yield event
        except TimeoutError as exc:
            shown = _without_credentials(url)
            raise UpstreamTimeout(f"backend stream went silent for {self.timeout_s:g} s ({shown})") from exc
        except HttpError as exc:
            raise _unavailable(exc, url, "stream") from exc

    async def close(self) -> None:
        self._pool.close()


# Our body is JSON whatever the agent's was: these replace the agent's headers, however it spelled the names.
_JSON = {"content-type": "application/json"}
_JSON_STREAM = {**_JSON, "accept": "text/event-stream"}


def _unavailable(error: HttpError, url: str, what: str = "connection") -> UpstreamUnavailable:
    shown = _without_credentials(url)
    if isinstance(error, ConnectFailed):
        return UpstreamUnavailable(f"backend unreachable at {shown}: {error.reason}")
    return UpstreamUnavailable(f"backend {what} failed ({shown}): {error}")


def dumps(value: Any) -> bytes:
    """Request bodies carry the whole prompt as ids every turn: orjson encodes them ~10x faster than json."""
    try:
        return orjson.dumps(value)
    except TypeError:  # e.g. an integer beyond 64 bits that an agent passed through
        return json.dumps(value, ensure_ascii=False, allow_nan=False).encode()


def loads(data: bytes | str) -> Any:
    """Fast path for the echoed ids; json for what orjson refuses (NaN, which some backends send)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


_DONE: Any = object()


def _sse_data(line: bytes) -> Any:
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[len(b"data:") :].strip()
    if data == b"[DONE]":
        return _DONE
    try:
        event = loads(data)
    except ValueError as exc:
        raise UpstreamMalformed("backend streamed an event that is not JSON") from exc
    if not isinstance(event, dict):
        raise UpstreamMalformed("backend streamed an event that is not a JSON object")
    return event


def _without_credentials(url: str) -> str:
    """A URL fit for an error message or a log: user:password@ removed."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))
