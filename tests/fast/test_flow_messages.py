"""mitmproxy's messages read and built in one pass (`tito_addon/proxy/flow_messages.py`): the agent's headers equal
mitmproxy's own `dict(headers.items())` for any fields (repeated names in any case, non-UTF-8 bytes, empty values),
and a reply's response is byte for byte what `Response.make` gives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.net.http.http1 import assemble_response
from support.basics import examples

from tito_addon.protocols.http_reply import HttpReply
from tito_addon.proxy.flow_messages import folded_headers, reply_response

NAMES = [b"Content-Type", b"content-type", b"CONTENT-TYPE", b"X-Session", b"x-session", b"Authorization",
         b"\xc3\x84-b", b"\xc3\xa4-b", b"\xff-z", b"Host"]  # fmt: skip
VALUES = st.binary(max_size=6) | st.sampled_from([b"", b"a, b", b"\xc3\xa9", b"\xff\xfe"])


@settings(max_examples=examples(400), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(NAMES), VALUES), max_size=8))
def test_equals_mitmproxy_items(fields: list[tuple[bytes, bytes]]) -> None:
    headers = http.Headers(tuple(fields))
    folded = folded_headers(headers)
    ascii_lower = {name: name.encode("utf-8", "surrogateescape").lower().decode("utf-8", "surrogateescape")
                   for name in headers}  # fmt: skip
    expected = {ascii_lower[name]: value for name, value in headers.items()}
    assert folded == expected
    assert list(folded) == list(expected)  # each name once, lower-cased, in order of first appearance


def test_repeated_name_is_joined_under_its_lower_cased_name() -> None:
    headers = http.Headers([(b"X-Session", b"a"), (b"content-type", b"application/json"), (b"x-session", b"b")])
    assert folded_headers(headers) == {"x-session": "a, b", "content-type": "application/json"}


REPLIES = [
    HttpReply(200, {"content-type": "application/json"}, b'{"id": "chatcmpl-1", "choices": []}'),
    HttpReply(200, {"content-type": "text/event-stream", "cache-control": "no-cache"}, b"data: [DONE]\n\n"),
    HttpReply(400, {"content-type": "application/json"}, b'{"error": {"message": "bad"}}'),
    HttpReply(502, {"Content-Type": "application/json; charset=utf-8", "x-note": "caf\u00e9"}, b"{}"),
    HttpReply(599, {}, b""),  # a status with no reason phrase
    HttpReply(200, {"content-type": "application/json"}, "\u00e9\u4e2d".encode() * 1000),
    # What `Response.make` itself handles: left to it.
    HttpReply(200, {"content-type": "application/json", "Content-Length": "999"}, b"{}"),
    HttpReply(200, {"content-encoding": "gzip"}, b"{}"),
    HttpReply(200, {"Transfer-Encoding": "chunked"}, b"{}"),
]


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: f"{r.status}-{'-'.join(r.headers)}")
def test_reply_response_is_what_make_gives(reply: HttpReply) -> None:
    built = reply_response(reply)
    made = http.Response.make(reply.status, reply.body, reply.headers)
    assert built.headers.fields == made.headers.fields
    assert (built.http_version, built.status_code, built.reason) == (made.http_version, made.status_code, made.reason)
    assert built.raw_content == made.raw_content and built.trailers is made.trailers is None
    assert assemble_response(built) == assemble_response(made)
