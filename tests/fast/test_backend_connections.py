"""The backend HTTP/1.1 client against a server that writes exact bytes: framing, reuse, failures, cancellation.

The proxy tests drive every backend call through this client against the replicas (aiohttp servers); here the
answers are written byte by byte where HTTP lets a server choose (chunk sizes, segment boundaries, interim answers,
compression, connection closes), so each way of framing an answer is read exactly once and each break is refused.
"""

from __future__ import annotations

import asyncio
import datetime
import gzip
import ipaddress
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.basics import examples

from tito_addon.backends.backend_connections import ConnectFailed, ConnectionPool, HttpError
from tito_addon.backends.upstream_client import UpstreamClient, UpstreamTimeout
from tito_addon.tito_errors import UpstreamUnavailable

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


def send(*parts: bytes, close: bool = False, pause_s: float = 0.0) -> Answer:
    """Write `parts` as separate segments (a pause between them), then keep the connection or close it."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause_s)
        return not close

    return answer


class ScriptedServer:
    """Reads requests (head and Content-Length body) and answers each with the next scripted answer."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.url = ""
        self._handlers: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> ScriptedServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_client.set()
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                if not await self.answers.pop(0)(reader, writer):
                    return
        finally:
            writer.close()


OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"


def with_length(body: bytes, extra: bytes = b"") -> bytes:
    return OK_HEAD + extra + b"content-length: %d\r\n\r\n" % len(body) + body


def chunked(body: bytes, sizes: list[int], trailer: bytes = b"") -> bytes:
    out, at = [], 0
    for size in sizes:
        piece = body[at : at + size]
        at += len(piece)
        if piece:
            out.append(b"%x;ext=1\r\n" % len(piece) + piece + b"\r\n")
    out.append(b"%x\r\n" % len(body[at:]) + body[at:] + b"\r\n" if body[at:] else b"")
    return OK_HEAD + b"transfer-encoding: chunked\r\n\r\n" + b"".join(out) + b"0\r\n" + trailer + b"\r\n"


async def fetch(pool: ConnectionPool, url: str, payload: bytes | None = b"{}") -> tuple[int, dict[str, str], bytes]:
    async with await pool.send("POST" if payload is not None else "GET", url + "/v1/x?a=1", {}, payload) as answer:
        return answer.status, answer.headers, await answer.read()


async def test_content_length_answers_reuse_one_connection_and_the_request_is_sent_as_built() -> None:
    body = b'{"ok": true}'
    async with ScriptedServer(send(with_length(body)), send(with_length(body))) as server:
        pool = ConnectionPool()
        headers = {
            "authorization": "Bearer k", "x-session-id": "s1", "Connection": "upgrade", "Upgrade": "h2c",
            "Content-Length": "999", "Accept-Encoding": "br", "Expect": "100-continue", "Host": "agent.example",
            "content-type": "application/json",
        }  # fmt: skip
        for _ in range(2):
            async with await pool.send("POST", server.url + "/v1/chat/completions?x=1", headers, b"[1,2]") as answer:
                assert (answer.status, await answer.read()) == (200, body)
                assert answer.headers["content-type"] == "application/json"
        pool.close()
    assert server.connections == 1, "a finished keep-alive answer leaves its connection for the next request"
    host = server.url.removeprefix("http://")
    assert (
        server.requests[0]
        == (
            f"POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer k\r\nx-session-id: s1\r\n"
            "content-type: application/json\r\ncontent-length: 5\r\naccept-encoding: identity\r\n\r\n[1,2]"
        ).encode()
    )


async def test_a_body_in_pieces_is_sent_as_their_concatenation_with_its_whole_length() -> None:
    pieces = [b'{"input_ids":[', b"1,2", b"", b",3" * 5000, b"]}"]
    async with ScriptedServer(send(with_length(b"{}"))) as server:
        client = UpstreamClient()
        assert (await client.post_bytes(server.url + "/generate", pieces, {})).body == b"{}"
        await client.close()
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    assert body == b"".join(pieces) and b"content-length: %d\r\n" % len(body) in head


async def test_chunked_answers_split_anywhere_are_read_whole_with_extensions_and_trailers() -> None:
    body = "Zürich 東京 ".encode() * 40
    raw = chunked(body, [1, 7, 100, 3], trailer=b"x-trailer: 1\r\n")
    async with ScriptedServer(send(*(raw[i : i + 5] for i in range(0, len(raw), 5))), send(with_length(b"{}"))) as s:
        pool = ConnectionPool()
        assert await fetch(pool, s.url) == (
            200,
            {"content-type": "application/json", "transfer-encoding": "chunked"},
            body,
        )
        assert (await fetch(pool, s.url))[2] == b"{}"
        pool.close()
    assert s.connections == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.binary(max_size=600),
    sizes=st.lists(st.integers(1, 90), max_size=8),
    cuts=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    framing=st.sampled_from(["length", "chunked", "close"]),
)
def test_any_framing_cut_into_any_segments_gives_the_body(body: bytes, sizes: list[int], cuts: list[int], framing: str):
    if framing == "length":
        raw = with_length(body)
    elif framing == "chunked":
        raw = chunked(body, sizes)
    else:
        raw = OK_HEAD + b"\r\n" + body
    parts, at = [], 0
    for cut in cuts:
        parts.append(raw[at : at + cut])
        at += cut
    parts.append(raw[at:])

    async def run() -> bytes:
        async with ScriptedServer(send(*(p for p in parts if p), close=framing == "close")) as server:
            pool = ConnectionPool()
            try:
                return (await fetch(pool, server.url))[2]
            finally:
                pool.close()

    assert asyncio.run(run()) == body


async def test_an_answer_framed_by_the_connection_end_is_read_and_its_connection_not_reused() -> None:
    async with ScriptedServer(
        send(b"HTTP/1.1 200 OK\r\n\r\n", b"part one, ", b"part two", close=True), send(with_length(b"{}"))
    ) as server:
        pool = ConnectionPool()
        assert (await fetch(pool, server.url))[2] == b"part one, part two"
        assert (await fetch(pool, server.url))[2] == b"{}"
        pool.close()
    assert server.connections == 2


@pytest.mark.parametrize(
    "first",
    [
        with_length(b"{}", extra=b"Connection: close\r\n"),  # the server says it closes
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n{}",  # HTTP/1.0 without keep-alive
        with_length(b"{}") + b"HTTP/1.1 200 OK\r\n",  # more than the answer: out of step
    ],
)
async def test_a_connection_is_not_reused_when_the_answer_forbids_it(first: bytes) -> None:
    async with ScriptedServer(send(first), send(with_length(b"[]"))) as server:
        pool = ConnectionPool()
        assert (await fetch(pool, server.url))[2] == b"{}"
        assert (await fetch(pool, server.url))[2] == b"[]"
        pool.close()
    assert server.connections == 2


async def test_interim_answers_are_skipped_and_no_body_statuses_end_at_their_head() -> None:
    async with ScriptedServer(
        send(b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: x\r\n\r\n" + with_length(b"{}")),
        send(b"HTTP/1.1 204 No Content\r\ncontent-length: 7\r\n\r\n"),
        send(with_length(b"[]")),
    ) as server:
        pool = ConnectionPool()
        assert await fetch(pool, server.url) == (
            200,
            {"content-type": "application/json", "content-length": "2"},
            b"{}",
        )
        assert (await fetch(pool, server.url))[::2] == (204, b"")
        assert (await fetch(pool, server.url))[2] == b"[]"
        pool.close()
    assert server.connections == 1


async def test_a_compressed_answer_is_decoded_though_identity_was_asked_for() -> None:
    body = b'{"text": "' + b"abc" * 2000 + b'"}'
    packed = gzip.compress(body)
    async with ScriptedServer(
        send(with_length(packed, extra=b"content-encoding: gzip\r\n")),
        send(chunked(packed, [10, 10, 200], trailer=b"").replace(OK_HEAD, OK_HEAD + b"Content-Encoding: GZIP\r\n")),
    ) as server:
        pool = ConnectionPool()
        assert (await fetch(pool, server.url))[2] == body
        assert (await fetch(pool, server.url))[2] == body
        pool.close()


@pytest.mark.parametrize(
    ("answer", "needle"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\n bad: folded\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2, 3\r\n\r\n{}", "content-length"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: -2\r\n\r\n{}", "content-length"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n", "transfer-encoding"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-1\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}}\r\n0\r\n\r\n", "longer than its declared"),
        (b"HTTP/1.1 200 OK\r\ncontent-encoding: br\r\ncontent-length: 2\r\n\r\n{}", "content-encoding"),
        (b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 4\r\n\r\nnope", "corrupt"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "switched protocols"),
        (b"HTTP/1.1 200 OK\r\nx: " + b"a" * 70_000, "64 KiB"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}", "closed the connection before"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab", "closed the connection before"),
        (b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\n\r\n" + gzip.compress(b"{}" * 50, mtime=0)[:-8], "ends before"),
        (b"", "closed the connection before"),
    ],
)
async def test_broken_answers_are_refused_with_what_broke(answer: bytes, needle: str) -> None:
    async with ScriptedServer(send(answer, close=True)) as server:
        pool = ConnectionPool()
        with pytest.raises(HttpError, match=needle):
            await fetch(pool, server.url)
        pool.close()


async def test_a_refused_connection_is_a_connect_failure() -> None:
    with pytest.raises(ConnectFailed):
        await ConnectionPool().send("GET", "http://127.0.0.1:9/", {}, None)
    with pytest.raises(ConnectFailed, match="not an http"):
        await ConnectionPool().send("GET", "ftp://127.0.0.1/", {}, None)


async def test_a_header_that_would_split_the_request_is_never_sent() -> None:
    async with ScriptedServer() as server:
        with pytest.raises(HttpError, match="line break"):
            await ConnectionPool().send("POST", server.url, {"x-a": "1\r\nx-injected: 2"}, b"{}")
    assert server.connections == 0


async def test_a_cancelled_request_closes_its_connection_so_the_backend_stops() -> None:
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if await reader.read() == b"":  # what a server sees of a client that hung up
            server.closed_by_client.set()
        return False

    async with ScriptedServer(never, send(with_length(b"{}"))) as server:
        pool = ConnectionPool()
        waiting = asyncio.ensure_future(fetch(pool, server.url))
        while not server.requests:
            await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(server.closed_by_client.wait(), 5)
        assert (await fetch(pool, server.url))[2] == b"{}"
        pool.close()
    assert server.connections == 2


async def test_a_stream_arrives_piece_by_piece_and_one_left_early_is_closed() -> None:
    release = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(OK_HEAD + b"transfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        return True

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(OK_HEAD + b"transfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await reader.read()  # then nothing until the client goes
        return False

    async with ScriptedServer(stream, stream, send(with_length(b"{}")), silent) as server:
        pool = ConnectionPool()
        async with await pool.send("POST", server.url, {}, b"{}") as answer:
            pieces = answer.pieces(5)
            assert await anext(pieces) == b"first"  # before the server has written the rest
            release.set()
            assert [p async for p in pieces] == [b"second"]
        release.clear()
        async with await pool.send("POST", server.url, {}, b"{}") as answer:
            assert await anext(answer.pieces(5)) == b"first"
        # Left mid-stream, its connection is not taken again (it would wait forever behind the unread stream).
        assert (await asyncio.wait_for(fetch(pool, server.url), 5))[2] == b"{}"
        release.set()
        async with await pool.send("POST", server.url, {}, b"{}") as answer:
            got = []
            with pytest.raises(TimeoutError):
                async for piece in answer.pieces(0.2):
                    got.append(piece)
            assert got == [b"first"]
        pool.close()
    assert server.connections == 2  # the one left mid-stream closed; the next two shared a new one


async def test_an_idle_connection_the_server_closed_is_not_taken_again() -> None:
    async with ScriptedServer(send(with_length(b"{}"), close=True), send(with_length(b"[]"))) as server:
        pool = ConnectionPool()
        assert (await fetch(pool, server.url))[2] == b"{}"  # kept alive by its head, then closed by the server
        await asyncio.sleep(0.1)
        assert (await fetch(pool, server.url))[2] == b"[]"
        pool.close()
    assert server.connections == 2


async def test_credentials_in_the_backend_url_win_over_the_agents_authorization() -> None:
    async with ScriptedServer(send(with_length(b"{}"))) as server:
        url = server.url.replace("http://", "http://op%40x:s%3Ac@")
        client = UpstreamClient()
        response = await client.post_bytes(url + "/v1/x", b"{}", {"Authorization": "Bearer agent", "Content-Type": "a"})
        await client.close()
    assert response.status == 200
    head = server.requests[0].decode()
    assert "authorization: Basic b3BAeDpzOmM=\r\n" in head and "Bearer" not in head  # base64 of "op@x:s:c"
    assert head.lower().count("content-type") == 1 and "content-type: application/json\r\n" in head


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


async def test_https_backends_are_verified_and_spoken_to_over_tls(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(with_length(b"{}"))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_tls)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/models"
    try:
        with pytest.raises(ConnectFailed, match="TLS"):
            await ConnectionPool().send("GET", url, {}, None)  # an unknown issuer is refused
        trusting = ssl.create_default_context(cafile=str(cert))
        async with await ConnectionPool(tls=trusting).send("GET", url, {}, None) as answer:
            assert (answer.status, await answer.read()) == (200, b"{}")
    finally:
        server.close()
    assert seen[-1].startswith(b"GET /v1/models HTTP/1.1\r\n") and b"content-length" not in seen[-1]


async def test_the_upstream_client_names_each_failure_as_the_agent_sees_it() -> None:
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(30)
        return True

    async with ScriptedServer(never, send(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{}", close=True)) as server:
        client = UpstreamClient(timeout_s=0.3)
        with pytest.raises(UpstreamTimeout, match="did not answer within 0.3 s"):
            await client.post_bytes(server.url + "/v1/chat/completions", b"{}", {})
        with pytest.raises(UpstreamUnavailable, match="backend connection failed .*closed the connection before"):
            await client.post_bytes(server.url + "/v1/chat/completions", b"{}", {})
        await client.close()
    with pytest.raises(UpstreamUnavailable, match="unreachable at http://127.0.0.1:9/x"):
        await UpstreamClient().get("http://user:secret@127.0.0.1:9/x", {})


class _QuietTransport(asyncio.Transport):
    """What the parser writes to and closes: nothing (the answer is fed to it directly)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def writelines(self, data: object) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class _NoPool:
    def forget(self, connection: object) -> None:
        pass


@settings(max_examples=examples(400), deadline=None)
@given(
    body=st.binary(max_size=300),
    sizes=st.lists(st.integers(1, 60), max_size=6),
    framing=st.sampled_from(["length", "chunked", "close", "gzip"]),
    edits=st.lists(
        st.tuples(
            st.sampled_from(["flip", "insert", "delete", "cut"]),
            st.integers(0, 10_000),
            st.binary(min_size=1, max_size=4),
        ),
        min_size=1,
        max_size=4,
    ),  # fmt: skip
    cuts=st.lists(st.integers(1, 50), max_size=20),
)
def test_a_mangled_answer_is_read_or_refused_as_an_http_error_and_never_hangs(
    body: bytes, sizes: list[int], framing: str, edits: list[tuple[str, int, bytes]], cuts: list[int]
) -> None:
    """The hostile suite's treatment for what a backend answers: a valid answer with bytes flipped, inserted, dropped or
    cut short, delivered in any segments, then the connection's end. The parser either reads an answer or fails with an
    HttpError (which the proxy answers 502); no other exception escapes it, and it never waits for bytes that the end
    of the connection says will not come."""
    from tito_addon.backends.backend_connections import _Connection

    if framing == "length":
        raw = with_length(body)
    elif framing == "chunked":
        raw = chunked(body, sizes)
    elif framing == "gzip":
        packed = gzip.compress(body)
        raw = b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s" % (len(packed), packed)
    else:
        raw = OK_HEAD + b"\r\n" + body
    mangled = bytearray(raw)
    for kind, at, data in edits:
        at %= len(mangled) + 1
        if kind == "flip" and at < len(mangled):
            mangled[at] ^= data[0] or 1
        elif kind == "insert":
            mangled[at:at] = data
        elif kind == "delete":
            del mangled[at : at + len(data)]
        else:
            del mangled[at:]

    async def run() -> tuple[bool, HttpError | None, bytes]:
        connection = _Connection(_NoPool(), (False, "backend", 80))  # type: ignore[arg-type]
        connection.connection_made(_QuietTransport())
        connection.start("POST", [])
        at = 0
        for cut in [*cuts, len(mangled)]:
            if at >= len(mangled):
                break
            connection.data_received(bytes(mangled[at : at + cut]))
            at += cut
        connection.connection_lost(None)
        read = b""
        if connection._head is not None and connection._head.done() and connection._head.exception() is None:
            try:
                while (piece := await asyncio.wait_for(connection.next_piece(), 1)) is not None:
                    read += piece
            except HttpError as error:
                return connection._done, error, read
        return connection._done, connection._error, read

    done, error, read = asyncio.run(run())
    event("refused" if error is not None else "read")
    assert done or error is not None, "after the connection's end the answer is either read or refused"
    assert error is None or isinstance(error, HttpError)
    if bytes(mangled) == raw:
        assert done and error is None and read == body


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: \xb22\r\n\r\nab",  # '²2': str.isdigit() says yes, int() says no
        b"HTTP/1.1 200 OK\r\ncontent-length: \xd9\xa1\r\n\r\na",  # Arabic-Indic digits
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1_0\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n",  # int() takes _
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n+2\r\nxx\r\n0\r\n\r\n",
    ],
    ids=["superscript-length", "arabic-length", "underscore-chunk", "signed-chunk"],
)
def test_lengths_that_python_would_read_but_http_does_not_are_refused(raw: bytes) -> None:
    """Found by the mangled-answer sweep: a content-length or chunk size is ASCII (hex) digits and nothing else."""
    from tito_addon.backends.backend_connections import _Connection

    async def run() -> HttpError | None:
        connection = _Connection(_NoPool(), (False, "backend", 80))  # type: ignore[arg-type]
        connection.connection_made(_QuietTransport())
        connection.start("POST", [])
        connection.data_received(raw)
        if connection._head is not None and connection._head.done() and connection._head.exception() is None:
            try:
                while await asyncio.wait_for(connection.next_piece(), 1) is not None:
                    pass
            except HttpError as error:
                return error
        return connection._error

    error = asyncio.run(run())
    assert isinstance(error, HttpError) and "invalid" in str(error)
