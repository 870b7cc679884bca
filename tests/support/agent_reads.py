"""What an agent API makes of a request body, as one comparable value (or the refusal's words): for the tests
that hold a read from remembered requests equal to a whole read."""

from __future__ import annotations

from typing import Any

from tito_addon.sessions.message_keys import message_key
from tito_addon.tito_errors import BadRequest


def agent_read(api: Any, data: bytes) -> tuple | str:
    try:
        request = api.parse(data)
    except BadRequest as exc:
        return str(exc)
    return (
        request.chat.model_dump(), request.chat_body, request.items, request.item_of, request.dropped,
        request.thinking, request.stream, request.extra, [message_key(m) for m in request.chat.messages],
    )  # fmt: skip
