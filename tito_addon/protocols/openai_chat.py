"""OpenAI chat completions, the agent-facing side: its paths, its request, its SSE framing.

The request is already the canonical chat form, so parsing is validation; the reply is the backend's chat
completion. When the agent asked for `stream: true` but the turn ran non-streamed upstream, the completion is
re-framed as `chat.completion.chunk` events carrying the same message (reasoning, content, tool calls by index),
so a streaming client accumulates exactly what a non-streaming one receives.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from tito_addon.canonical_chat import ChatRequest
from tito_addon.protocols.json_body import parse_json_object
from tito_addon.tito_errors import BadRequest

# The id may be empty here so that `/sessions//v1/...` is refused as an empty id, not taken for a path prefix.
CHAT_PATH = re.compile(r"^(?:/sessions/(?P<sid>[^/?#]*))?(?P<rest>(?:/[^?#]*)?/v1/chat/completions)/?(?:\?.*)?$")

SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-tito-stream": "reframed",
}


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def is_chat_path(path: str) -> bool:
    return CHAT_PATH.match(path) is not None


def parse_body(body: bytes) -> ChatRequest:
    return parse_request(body)[0]


def parse_request(body: bytes) -> tuple[ChatRequest, dict[str, Any]]:
    """The validated request, and the JSON object it was validated from (forwarded without a re-dump)."""
    obj = parse_json_object(body)
    try:
        return ChatRequest.model_validate(obj), obj
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise BadRequest(f"invalid chat request at {where}: {first.get('msg')}") from exc
    except RecursionError as exc:
        raise BadRequest("request body is nested too deeply") from exc


def sse_from_completion(completion: dict[str, Any], *, include_usage: bool) -> bytes:
    base = {
        "id": completion.get("id"),
        "object": "chat.completion.chunk",
        "created": completion.get("created"),
        "model": completion.get("model"),
    }

    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason, **extra}
        return sse_event({**base, "choices": [choice]})

    out = []
    for choice in completion.get("choices", []):
        index = choice.get("index", 0)
        message = choice.get("message") or {}
        # content null stays null for the accumulating client (a tool-call-only turn), "" stays "".
        first_content = None if message.get("content") is None else ""
        out.append(chunk(index, {"role": "assistant", "content": first_content}))
        for key in ("reasoning_content", "reasoning"):
            if message.get(key):
                out.append(chunk(index, {key: message[key]}))
        if message.get("content"):
            out.append(chunk(index, {"content": message["content"]}))
        for position, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") or {}
            delta_call = {
                "index": position,
                "id": call.get("id"),
                "type": call.get("type", "function"),
                "function": {"name": function.get("name"), "arguments": function.get("arguments", "")},
            }
            out.append(chunk(index, {"tool_calls": [delta_call]}))
        extra = {}
        if choice.get("logprobs") is not None:
            extra["logprobs"] = choice["logprobs"]
        final = {"index": index, "delta": {}, "logprobs": None, "finish_reason": choice.get("finish_reason"), **extra}
        out.append(sse_event({**base, "choices": [final]}))
    if include_usage and completion.get("usage") is not None:
        out.append(sse_event({**base, "choices": [], "usage": completion["usage"]}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)
