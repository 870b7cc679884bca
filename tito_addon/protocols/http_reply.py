"""The HTTP reply every protocol produces: status, headers, body, and the flow metadata of a recorded turn."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tito_addon.tito_errors import TitoError


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]
    body: bytes
    metadata: dict[str, Any] = field(default_factory=dict)


def json_reply(status: int, body: bytes, metadata: dict[str, Any] | None = None) -> HttpReply:
    return HttpReply(status, {"content-type": "application/json"}, body, metadata or {})


def refusal_reply(error: TitoError) -> HttpReply:
    """A refusal outside any agent API's shape (before a route is known): its status, its headers, the generic body."""
    return HttpReply(error.status, error.headers(), error.body())
