"""Between mitmproxy's messages and the turn service's plain values, on the path of every turn.

mitmproxy's general conveniences cost more than a turn's own work here: `Headers.items()` scans every field again
for each name, and `Response.make` type-checks a response built empty and then sets its body through the
content-encoding machinery (together ~0.1 ms a turn on a 2-core machine, ~3 % of the addon's CPU under many
agents). These give the same values in one pass.
"""

from __future__ import annotations

import time

from mitmproxy import http
from mitmproxy.net.http import status_codes

from tito_addon.protocols.http_reply import HttpReply

# Headers that make `Response.make` do more than append a content-length: such a reply is left to it.
_MAKE_HANDLES = frozenset({"content-encoding", "transfer-encoding", "content-length"})


def folded_headers(headers: http.Headers) -> dict[str, str]:
    """`dict(headers.items())` with lower-case names, the one normalisation a turn's headers get: names match as
    mitmproxy matches them (bytes, ASCII case folded), and a repeated one's values are joined with ", " in the order
    of their fields, as `Headers.__getitem__` folds them."""
    folded: dict[str, str] = {}
    for raw_name, raw_value in headers.fields:
        value = raw_value.decode("utf-8", "surrogateescape")
        name = raw_name.lower().decode("utf-8", "surrogateescape")
        known = folded.get(name)
        folded[name] = value if known is None else known + ", " + value
    return folded


def reply_response(reply: HttpReply) -> http.Response:
    """`http.Response.make(reply.status, reply.body, reply.headers)`, built whole: the same status line, header
    fields in the same order (the reply's, then content-length) and body."""
    if any(name.lower() in _MAKE_HANDLES for name in reply.headers):
        return http.Response.make(reply.status, reply.body, reply.headers)
    fields = [(name.encode("utf-8", "surrogateescape"), value.encode("utf-8", "surrogateescape"))
              for name, value in reply.headers.items()]  # fmt: skip
    fields.append((b"content-length", str(len(reply.body)).encode()))
    reason = status_codes.RESPONSES.get(reply.status, "").encode()
    now = time.time()
    return http.Response(b"HTTP/1.1", reply.status, reason, http.Headers(fields), reply.body, None, now, now)
