"""HTTP/1.1 to the backend on asyncio protocols, with one keep-alive pool per origin.

Why not a general client: under the P2 load (256 agents on one process) aiohttp's request machinery (URL objects,
header multidicts, tracing hooks, a cookie jar, timer handles per request) was about a tenth of the proxy's CPU,
more than reading the agent's request. A backend call needs much less: one request at a time per connection, a
body framed by Content-Length, chunked encoding or the connection's end, over http or https. That is all this
module speaks; anything else in an answer is a protocol error, answered like a broken connection.

A connection goes back to the pool only when its answer was read to the end and both sides keep it alive; an
exchange left early (an error, a cancelled turn, a stream closed by its reader) closes it, which is also how the
backend learns to stop generating for an agent that hung up.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from tito_addon.backends.upstream_headers import NOT_FORWARDED

MAX_HEAD_BYTES = 64 * 1024
MAX_ORIGINS = 1024
NO_BODY_STATUSES = frozenset({204, 304})

_LENGTH, _CHUNKED, _TO_CLOSE, _EMPTY = range(4)


class HttpError(Exception):
    """The connection failed or the backend broke HTTP/1.1; the message says which."""


class ConnectFailed(HttpError):
    """No connection could be opened (refused, unresolvable, TLS handshake failed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Origin:
    """Where a URL's requests go: the pool key, the Host header and the request target."""

    __slots__ = ("key", "host", "port", "tls", "host_header", "target", "headers")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConnectFailed(f"not an http(s) URL: {parts.scheme or '(no scheme)'}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        try:
            explicit = parts.port
        except ValueError as exc:
            raise ConnectFailed("the URL's port is not a number in 0-65535") from exc
        self.port = explicit or (443 if self.tls else 80)
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = shown if explicit is None else f"{shown}:{explicit}"
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.key = (self.tls, self.host, self.port)
        # Credentials in the configured URL are the operator's for this backend: they win over the agent's header.
        self.headers: dict[str, str] = {}
        if parts.username is not None or parts.password is not None:
            pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            self.headers["authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()


def request_head(
    method: str, origin: Origin, headers: Mapping[str, str], length: int | None, ours: Mapping[str, str]
) -> bytes:
    """The request's head: the agent's headers less those that belong to its own connection (`NOT_FORWARDED`) and
    those the caller or the URL sets (`ours`, `origin.headers`, lower-case names), which replace them."""
    own = {**ours, **origin.headers} if origin.headers else ours
    lines = [f"{method} {origin.target} HTTP/1.1\r\nhost: {origin.host_header}\r\n"]
    for name, value in (*((n, v) for n, v in headers.items() if n.lower() not in own), *own.items()):
        if name.lower() in NOT_FORWARDED:
            continue
        if "\n" in name or "\r" in name or "\n" in value or "\r" in value or ":" in name:
            raise HttpError(f"header {name[:60]!r} cannot be sent: it holds a line break or a colon")
        lines.append(f"{name}: {value}\r\n")
    if length is not None:
        lines.append(f"content-length: {length}\r\n")
    lines.append("accept-encoding: identity\r\n\r\n")
    # mitmproxy hands header values over decoded as UTF-8 with surrogate escapes: this gives back their bytes.
    return "".join(lines).encode("utf-8", "surrogateescape")


class _Connection(asyncio.Protocol):
    """One connection's parser: a response head, then its body as pieces for one reader."""

    def __init__(self, pool: ConnectionPool, key: tuple[bool, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._buffer = bytearray()
        self._head: asyncio.Future[tuple[int, dict[str, str]]] | None = None
        self._method = "GET"
        self._framing = _EMPTY
        self._remaining = 0  # body bytes left (Content-Length), or of the current chunk
        self._chunk_state = "size"  # size | data | data_end | trailer
        self._decompress: Any = None
        self._pieces: list[bytes] = []
        self._done = False
        self._error: HttpError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.reusable = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        if self._head is None or self._done:
            return
        if self._framing != _TO_CLOSE or not self._head.done() or exc is not None:
            self._fail(HttpError("the backend closed the connection before its answer ended"))
            return
        try:
            self._finish()  # an answer framed by the connection's end has ended
        except HttpError as error:
            self._fail(error)

    def eof_received(self) -> bool:
        return False  # close our side too: nothing more can arrive

    def data_received(self, data: bytes) -> None:
        if self._head is None or self._done or self._error is not None:
            self.reusable = False  # bytes nobody asked for: the connection is out of step
            if self.transport is not None:
                self.transport.close()
            return
        try:
            if self._head.done() and self._framing == _LENGTH and not self._buffer and len(data) <= self._remaining:
                self._remaining -= len(data)  # the common case: the body's next bytes, kept without a copy
                self._emit(data)
                if self._remaining == 0:
                    self._finish()
                return
            self._buffer += data
            self._advance()
        except HttpError as error:
            self._fail(error)

    # one exchange

    def start(self, method: str, data: list[bytes]) -> None:
        self._method = method
        self._head = asyncio.get_running_loop().create_future()
        self._framing, self._remaining, self._chunk_state = _EMPTY, 0, "size"
        self._decompress, self._pieces, self._done, self._error, self.reusable = None, [], False, None, False
        assert self.transport is not None
        self.transport.writelines(data)  # head and body without joining a copy of a ~1 MB body

    async def head(self) -> tuple[int, dict[str, str]]:
        assert self._head is not None
        return await self._head

    async def next_piece(self) -> bytes | None:
        """The body's next bytes, or None at its end."""
        while not self._pieces:
            if self._error is not None:
                raise self._error
            if self._done:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pieces = self._pieces
        self._pieces = []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def finished(self) -> bool:
        return self._done and not self._pieces

    # parsing

    def _advance(self) -> None:
        assert self._head is not None
        while not self._head.done():
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    raise HttpError("the backend's response head is larger than 64 KiB")
                return
            head = bytes(self._buffer[:end])
            del self._buffer[: end + 4]
            status, headers, keep_alive = _parse_head(head)
            if 100 <= status < 200:
                if status == 101:
                    raise HttpError("the backend switched protocols, which a backend call never asks for")
                continue  # an interim answer; the real one follows
            self._begin_body(status, headers, keep_alive)
            self._head.set_result((status, headers))
        if not self._done:
            self._read_body()

    def _begin_body(self, status: int, headers: dict[str, str], keep_alive: bool) -> None:
        coding = headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        if self._method == "HEAD" or status in NO_BODY_STATUSES:
            self._framing = _EMPTY
        elif coding:
            if [c.strip() for c in coding.split(",")] != ["chunked"]:
                raise HttpError(f"the backend used transfer-encoding {coding!r}; only chunked is read")
            self._framing = _CHUNKED
        elif length is not None:
            values = {v.strip() for v in length.split(",")}
            # ASCII digits only: str.isdigit() is also true of '²', which int() refuses.
            if len(values) != 1 or not next(iter(values)).isascii() or not next(iter(values)).isdigit():
                raise HttpError(f"the backend sent an invalid content-length {length[:40]!r}")
            self._framing, self._remaining = _LENGTH, int(next(iter(values)))
        else:
            self._framing, keep_alive = _TO_CLOSE, False
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("gzip", "x-gzip", "deflate"):
            # identity was asked for; a server that compresses anyway is still read. Deflate as zlib, like browsers.
            self._decompress = zlib.decompressobj(zlib.MAX_WBITS | 32)
        elif encoding not in ("identity", ""):
            raise HttpError(f"the backend answered in content-encoding {encoding!r}, which was not asked for")
        self.reusable = keep_alive
        if self._framing == _EMPTY or (self._framing == _LENGTH and self._remaining == 0):
            self._finish()

    def _read_body(self) -> None:
        buffer = self._buffer
        if self._framing == _LENGTH:
            take = min(len(buffer), self._remaining)
            if take:
                self._remaining -= take
                self._emit(bytes(buffer[:take]))
                del buffer[:take]
            if self._remaining == 0:
                self._finish()
        elif self._framing == _TO_CLOSE:
            if buffer:
                self._emit(bytes(buffer))
                buffer.clear()
        elif self._framing == _CHUNKED:
            self._read_chunks()
        if buffer and self._done:
            self.reusable = False  # more than the answer held: never reuse a connection out of step

    def _read_chunks(self) -> None:
        buffer = self._buffer
        while not self._done:
            if self._chunk_state == "data":
                take = min(len(buffer), self._remaining)
                if take == 0:
                    return
                self._emit(bytes(buffer[:take]))
                del buffer[:take]
                self._remaining -= take
                if self._remaining:
                    return
                self._chunk_state = "data_end"
                continue
            end = buffer.find(b"\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise HttpError("the backend sent a chunk line longer than 64 KiB")
                return
            line = bytes(buffer[:end])
            del buffer[: end + 2]
            if self._chunk_state == "data_end":
                if line:
                    raise HttpError("the backend sent a chunk longer than its declared size")
                self._chunk_state = "size"
            elif self._chunk_state == "size":
                size_text = line.split(b";", 1)[0].strip()
                # Hex digits only: int() would also take a sign, a 0x prefix and underscores ("1_0" is 16).
                if not size_text or size_text.strip(b"0123456789abcdefABCDEF"):
                    raise HttpError(f"the backend sent an invalid chunk size {size_text[:20]!r}")
                size = int(size_text, 16)
                self._chunk_state, self._remaining = ("data", size) if size else ("trailer", 0)
            elif not line:  # the empty line that ends the trailers
                self._finish()

    def _emit(self, data: bytes) -> None:
        if self._decompress is not None:
            try:
                data = self._decompress.decompress(data)
            except zlib.error as exc:
                raise HttpError(f"the backend's compressed answer is corrupt: {exc}") from None
            if not data:
                return
        self._pieces.append(data)
        self._wake()

    def _finish(self) -> None:
        if self._decompress is not None:
            rest = self._decompress.flush()
            if not self._decompress.eof:
                raise HttpError("the backend's compressed answer ends before its compressed stream does")
            if rest:
                self._pieces.append(rest)
        self._done = True
        self._wake()

    def _fail(self, error: HttpError) -> None:
        self.reusable = False
        if self._error is None and not self._done:
            self._error = error
        assert self._head is not None
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # read here so an exchange abandoned early logs no "never retrieved"
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _parse_head(head: bytes) -> tuple[int, dict[str, str], bool]:
    """Status, headers (lower-case names; repeated ones joined by ", ") and whether the answer keeps alive."""
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise HttpError(f"the backend's answer does not start with an HTTP/1 status line: {lines[0][:60]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise HttpError(f"the backend sent a malformed header line {line[:60]!r}")
        key = name.decode("latin-1").lower()
        text = value.strip().decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = "close" not in tokens and (version == b"HTTP/1.1" or "keep-alive" in tokens)
    return int(code), headers, keep_alive


class Exchange:
    """A request's answer on its connection: status and headers, then the body, read whole or piece by piece.
    Closing it returns the connection to the pool only when the answer was read to its end."""

    def __init__(self, connection: _Connection, status: int, headers: dict[str, str]) -> None:
        self._connection: _Connection | None = connection
        self.status = status
        self.headers = headers

    async def read(self) -> bytes:
        pieces = []
        while (piece := await self.next_piece()) is not None:
            pieces.append(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def next_piece(self) -> bytes | None:
        assert self._connection is not None, "the exchange is closed"
        return await self._connection.next_piece()

    async def pieces(self, idle_timeout_s: float | None) -> AsyncIterator[bytes]:
        """The body piece by piece as it arrives; TimeoutError after `idle_timeout_s` without a byte."""
        while True:
            async with asyncio.timeout(idle_timeout_s):
                piece = await self.next_piece()
            if piece is None:
                return
            yield piece

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.pool.release(connection)

    async def __aenter__(self) -> Exchange:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class ConnectionPool:
    """Keep-alive connections per origin; a request takes an idle one or opens its own."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self._idle: dict[tuple[bool, str, int], dict[_Connection, None]] = {}
        self._origins: dict[str, Origin] = {}
        self._tls = tls  # None: the system's trusted roots, made on the first https call

    async def send(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        payload: bytes | Sequence[bytes] | None,
        ours: Mapping[str, str] | None = None,
    ) -> Exchange:
        """Send a request and wait for the answer's head. HttpError (ConnectFailed when no connection opened).
        A payload in pieces is sent as they are, one after the other (no copy joins them); `ours` (lower-case
        names) replace the agent's headers of the same names."""
        origin = self._origins.get(url)
        if origin is None:
            origin = Origin(url)  # a turn's URL is its backend's: parsed once, not per call
            if len(self._origins) >= MAX_ORIGINS:
                self._origins.clear()
            self._origins[url] = origin
        pieces = [] if payload is None else [payload] if isinstance(payload, bytes) else [p for p in payload if p]
        length = None if payload is None and method == "GET" else sum(map(len, pieces))
        data = [request_head(method, origin, headers, length, ours or {}), *pieces]
        connection = self._take(origin.key) or await self._open(origin)
        try:
            connection.start(method, data)
            status, answer_headers = await connection.head()
        except BaseException:
            connection.reusable = False
            self.release(connection)
            raise
        return Exchange(connection, status, answer_headers)

    def _take(self, key: tuple[bool, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection, _ = idle.popitem()
            if not connection.lost and connection.transport is not None and not connection.transport.is_closing():
                return connection
        return None

    async def _open(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if origin.tls else None
        try:
            _, connection = await loop.create_connection(
                lambda: _Connection(self, origin.key),
                origin.host,
                origin.port,
                ssl=tls,
                server_hostname=origin.host if tls else None,
            )
        except ssl.SSLError as exc:
            raise ConnectFailed(f"TLS handshake failed: {exc.reason or exc}") from exc
        except OSError as exc:
            raise ConnectFailed(exc.strerror or str(exc) or type(exc).__name__) from exc
        return connection

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def release(self, connection: _Connection) -> None:
        transport = connection.transport
        if connection.reusable and connection.finished() and not connection.lost and transport is not None:
            if not transport.is_closing():
                self._idle.setdefault(connection.key, {})[connection] = None
                return
        if transport is not None:
            transport.close()

    def forget(self, connection: _Connection) -> None:
        idle = self._idle.get(connection.key)
        if idle is not None:
            idle.pop(connection, None)

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                if connection.transport is not None:
                    connection.transport.close()
        self._idle.clear()
