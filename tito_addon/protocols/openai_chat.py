"""Re-frames a completed chat completion as an SSE stream of `chat.completion.chunk` events.

Used when the agent asked for `stream: true` but the turn ran non-streamed upstream: the chunks carry the
same message (reasoning, content, tool calls by index), so a streaming client accumulates exactly what a
non-streaming one receives.
"""

from __future__ import annotations

import json
from typing import Any

SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-tito-stream": "reframed",
}


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def sse_from_completion(completion: dict[str, Any], *, include_usage: bool) -> bytes:
    base = {
        "id": completion.get("id"),
        "object": "chat.completion.chunk",
        "created": completion.get("created"),
        "model": completion.get("model"),
    }

    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason, **extra}
        return _event({**base, "choices": [choice]})

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
        out.append(_event({**base, "choices": [final]}))
    if include_usage and completion.get("usage") is not None:
        out.append(_event({**base, "choices": [], "usage": completion["usage"]}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)
