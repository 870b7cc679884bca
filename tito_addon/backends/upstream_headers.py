"""Which of an agent's request headers go upstream with the backend call.

Hop-by-hop and framing headers belong to the agent's own request, not to ours: a stale content-length
desynchronises the backend's keep-alive connection, and `expect` would stall for a 100 Continue. The backend
call writes its own host, framing and accept-encoding (`backend_connections.request_head`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

# Lower-case names. The turn leaves them out of the headers it hands a backend (`forwarded_headers`), and every
# request head leaves them out again, whoever the caller.
NOT_FORWARDED = frozenset(
    {
        # hop-by-hop: the agent's connection to the proxy
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
        "expect",
        # the host and the body's framing and encoding: the backend call's own (its body is not the agent's)
        "host",
        "content-length",
        "transfer-encoding",
        "content-encoding",
        "accept-encoding",
    }
)


def forwarded_headers(headers: Mapping[str, str], own: str) -> dict[str, str]:
    """The agent's headers (lower-case names) that go upstream: all but `NOT_FORWARDED` and `own`, the proxy's
    own header (the session id's)."""
    return {k: v for k, v in headers.items() if k not in NOT_FORWARDED and k != own}


#: The engine routers the proxy knows, and the header each keys a session on (lower-case), for the sticky policies
#: that keep a session's requests on one engine: vllm-router's `consistent_hash` and `sticky_least_loaded` read
#: `X-Session-ID` first (then other headers and body fields, else a hash of the whole body, which differs every turn).
#: smg (the sglang model gateway, 1.x) reads `X-SMG-Routing-Key` under its `manual` and `consistent_hashing` policies.
#: `none`: one engine, or a router the proxy sets no key for.
ROUTER_SESSION_KEYS: dict[str, str | None] = {
    "none": None,
    "vllm-router": "x-session-id",
    "smg": "x-smg-routing-key",
}


def with_router_key(headers: dict[str, str], key: str | None, session_id: str) -> dict[str, str]:
    """`headers` with the router's session key set to the proxy's session id, whatever the agent sent under it. An id
    that is not printable ASCII (a session named `/sessions/équipe/`) goes as a digest of itself: a router may refuse
    or ignore a header value of other bytes, and any value the session always sends keeps it on its engine."""
    if key is not None:
        headers[key] = session_id if _PRINTABLE.fullmatch(session_id) else router_digest(session_id)
    return headers


_PRINTABLE = re.compile(r"[\x21-\x7e][\x20-\x7e]*")


def router_digest(session_id: str) -> str:
    return "sid-" + hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]
