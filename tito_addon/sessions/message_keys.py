"""How messages are compared, to find the stored turn a request extends.

Matching compares role, content, tool calls (id, name and parsed arguments) and, separately, reasoning:
clients drop, rename or trim reasoning when they echo an assistant message, so a side without reasoning matches,
`reasoning_content`/`reasoning` are one key and the whitespace around a reasoning is not compared (see
`reasoning_identity`). null, "" and [] are equal; whitespace is otherwise significant.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tito_addon.canonical_chat import ChatMessage, parse_arguments

# A 128-bit digest, not the text: the session tree of every live session holds one key per message, and tool
# results are often kilobytes; a recording made without message text keeps the keys (as hex) instead.
MessageKey = bytes
KEY_BYTES = 16


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _field(parts: list[bytes], text: str) -> None:
    # Length-prefixed, so no choice of texts can make two different messages feed the same bytes.
    data = text.encode("utf-8", "surrogatepass")
    parts += (b"%d:" % len(data), data)


def message_key(message: ChatMessage) -> MessageKey:
    """Identity of a message, reasoning excluded (see `reasoning_matches`): a digest of its role, text, images (by
    their bytes' digest) and tool calls (id, name, parsed arguments). Computed once per message object (they are
    frozen)."""
    # Read and written through pydantic's private dict: its attribute access costs more than a short digest.
    private = message.__pydantic_private__
    known = private.get("_key") if private is not None else None
    if known is not None:
        return known
    parts: list[bytes] = []
    _field(parts, message.role)
    _field(parts, message.text() or "")
    for index, part in enumerate(message.content if isinstance(message.content, list) else ()):
        if part.type == "image":
            # Where it sits among the parts and which image it is; a text-only message keys as it always has.
            _field(parts, f"image {index} {part.sha256}")
    for call in message.tool_calls or ():
        _field(parts, call.id or "")
        _field(parts, call.function.name)
        _field(parts, _canonical_json(parse_arguments(call.function.arguments)))
    key = hashlib.blake2b(b"".join(parts), digest_size=KEY_BYTES).digest()
    if private is not None:
        private["_key"] = key
    return key


def reasoning_identity(text: str | None) -> str:
    """What of a reasoning an echo must keep: its text without the whitespace around it. Qwen Code trims every
    thought it keeps in its history (Qwen3's reasoning comes as "\\n…\\n" between <think> and </think>), and the
    stored turn's ids, not the echo, are what the next prompt holds. A reasoning of whitespace alone stays itself,
    so it is not taken for an absent one."""
    if not text:
        return ""
    return text.strip() or text


def reasoning_matches(stored: str | None, incoming: str | None) -> bool:
    return not stored or not incoming or reasoning_identity(stored) == reasoning_identity(incoming)
