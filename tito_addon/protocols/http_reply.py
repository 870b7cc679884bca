"""The HTTP reply every protocol produces: status, headers, body, and the flow metadata of a recorded turn."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]
    body: bytes
    metadata: dict[str, Any] = field(default_factory=dict)


def json_reply(status: int, body: bytes, metadata: dict[str, Any] | None = None) -> HttpReply:
    return HttpReply(status, {"content-type": "application/json"}, body, metadata or {})
