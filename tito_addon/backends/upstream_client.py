"""HTTP calls to the backend (aiohttp: an order of magnitude faster than httpx under concurrency).

Transport failures become explicit errors: refused or reset connections answer 502, a backend that
stalls past the timeout answers 504. The session object is created lazily inside the running event loop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson

from tito_addon.tito_errors import TitoError, UpstreamMalformed, UpstreamPassthrough, UpstreamUnavailable

logger = logging.getLogger(__name__)


class UpstreamTimeout(TitoError):
    status = 504
    error_type = "upstream_timeout"


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
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
            # trust_env stays off: the proxy's own environment must not reroute backend calls.
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=True)
        return self._session

    async def post_json(self, url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> UpstreamResponse:
        payload = dumps(body)
        return await self._request("POST", url, {**headers, "content-type": "application/json"}, payload)

    async def post_bytes(self, url: str, payload: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """A JSON body the caller already encoded (e.g. with a prompt's ids spliced in as ready text)."""
        return await self._request("POST", url, {**headers, "content-type": "application/json"}, payload)

    async def get(self, url: str, headers: Mapping[str, str]) -> UpstreamResponse:
        return await self._request("GET", url, dict(headers), None)

    async def _request(self, method: str, url: str, headers: dict[str, str], payload: bytes | None) -> UpstreamResponse:
        headers = _sendable(headers)
        shown = _without_credentials(url)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self._client().request(method, url, data=payload, headers=headers, timeout=timeout) as response:
                data = await response.read()
                return UpstreamResponse(response.status, response.headers.get("content-type"), data)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"backend did not answer within {self.timeout_s:g} s ({shown})") from exc
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnavailable(f"backend unreachable at {shown}: {exc.strerror or exc}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(f"backend connection failed ({shown}): {type(exc).__name__}") from exc

    async def sse_events(
        self, url: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> AsyncIterator[dict[str, Any]]:
        """POST, then yield each JSON `data:` event of the SSE answer until `[DONE]`.

        A non-200 answer raises UpstreamPassthrough before anything is yielded. Closing the generator closes
        the upstream connection, which is how a disconnected agent cancels its generation."""
        shown = _without_credentials(url)
        payload = dumps(body)
        send = {**_sendable(headers), "content-type": "application/json", "accept": "text/event-stream"}
        # No total limit on a stream: the limit is on silence between two reads.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s)
        try:
            async with self._client().post(url, data=payload, headers=send, timeout=timeout) as response:
                if response.status != 200:
                    data = await response.read()
                    raise UpstreamPassthrough(response.status, data, response.headers.get("content-type"))
                buffer = b""
                async for piece in response.content.iter_any():
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
            raise UpstreamTimeout(f"backend stream went silent for {self.timeout_s:g} s ({shown})") from exc
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnavailable(f"backend unreachable at {shown}: {exc.strerror or exc}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(f"backend stream failed ({shown}): {type(exc).__name__}") from exc

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


# Framing headers belong to the agent's request, not to ours: a stale content-length desynchronises the
# backend's keep-alive connection.
_FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"})


def _sendable(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _FRAMING}


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
