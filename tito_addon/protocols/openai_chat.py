"""OpenAI chat completions, the agent-facing side: its paths, its request, its SSE framing.

The request is already the canonical chat form, so parsing is validation; the reply is the backend's chat
completion. When the agent asked for `stream: true` but the turn ran non-streamed upstream, the completion is
re-framed as `chat.completion.chunk` events carrying the same message (reasoning, content, tool calls by index),
so a streaming client accumulates exactly what a non-streaming one receives.
"""

from __future__ import annotations

import re
from typing import Any

from tito_addon.canonical_chat import ChatMessage, ChatRequest
from tito_addon.exact_json import dumps_exact
from tito_addon.protocols.agent_api import (
    EVENT_STREAM_HEADERS,
    REFRAMED_STREAM_HEADERS,
    AgentRequest,
    ReplyContext,
    Route,
    TurnOutcome,
    with_known_chat,
)
from tito_addon.protocols.http_reply import HttpReply
from tito_addon.protocols.json_body import validated
from tito_addon.protocols.known_messages import DEFAULT_BUDGET_BYTES, KnownMessages
from tito_addon.protocols.known_requests import KnownRequests
from tito_addon.tito_errors import TitoError, UpstreamPassthrough

DECLARED_FIELDS = tuple(name for name in ChatRequest.model_fields if name != "messages")
# The id may be empty here so that `/sessions//v1/...` is refused as an empty id, not taken for a path prefix.
CHAT_PATH = re.compile(r"^(?:/sessions/(?P<sid>[^/?#]*))?(?P<rest>(?:/[^?#]*)?/v1/chat/completions)/?(?:\?.*)?$")


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps_exact(payload, allow_nan=True) + b"\n\n"


def is_chat_path(path: str) -> bool:
    return CHAT_PATH.match(path) is not None


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


class ChatCompletionsApi:
    """`POST …/v1/chat/completions`: the canonical form itself, answered with the backend's own completion."""

    name = "chat"
    signs = False  # mints values the agent echoes back (see turn_refs)

    def __init__(self, memo_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        # The messages of this process's recent requests, validated: an agent's next request re-sends them.
        self.known_messages = KnownMessages(memo_bytes)
        # Their bodies: the next request begins with the previous one's bytes, which need no parse.
        self.known_requests = KnownRequests(memo_bytes)

    @property
    def memos(self) -> tuple[KnownMessages | KnownRequests, ...]:
        return (self.known_messages, self.known_requests)

    def resize_memos(self, budget_bytes: int) -> None:
        for memo in self.memos:
            memo.resize(budget_bytes)

    def route(self, path: str) -> Route | None:
        match = CHAT_PATH.match(path)
        if match is None:
            return None
        return Route(self, "turn", match.group("sid"), match.group("rest"))

    def parse_request(self, body: bytes) -> tuple[ChatRequest, dict[str, Any]]:
        """The validated request, and the JSON object it was validated from (forwarded without a re-dump)."""
        obj, style, extension = self.known_requests.read(body)
        prior: tuple[ChatMessage, ...] = extension.known.state if extension is not None else ()
        raw_messages = obj.get("messages")
        if type(raw_messages) is not list or not raw_messages:
            return validated(ChatRequest, obj, "chat request"), obj
        new = raw_messages[len(prior) :]
        memo = self.known_messages
        encodings = [memo.encoding(raw) for raw in new]
        found = [*prior, *(memo.find(encoded, raw) for encoded, raw in zip(encodings, new, strict=True))]
        rest_walked = extension is not None and extension.only_appended_new
        request = with_known_chat(obj, found, walked=False, rest_walked=rest_walked) or validated(
            ChatRequest, obj, "chat request"
        )
        appended = request.messages[len(prior) :]
        for encoded, raw, known, message in zip(encodings, new, found[len(prior) :], appended, strict=True):
            if known is None:
                memo.remember(encoded, raw, message)
        if style is not None:
            state = tuple(request.messages)
            self.known_requests.remember(body, obj, state, style, extension, lambda n: state[:n], compact=encodings)
        return request, obj

    def parse(self, body: bytes, action: str = "turn", route: Route | None = None) -> AgentRequest:
        request, raw = self.parse_request(body)
        # The agent's object as sent (dumping 400 validated messages back cost ~1 ms a turn at turn 200), with
        # the fields the model declares in their validated form, so "false" never reads as true downstream.
        chat_body = dict(raw)
        declared = {name for name in DECLARED_FIELDS if name in chat_body}
        if declared:
            chat_body.update(request.model_dump(mode="json", include=declared, by_alias=True))
        return AgentRequest(chat=request, chat_body=chat_body, stream=bool(request.stream))

    def reply_id(self, session_id: str | None = None) -> str | None:
        return None

    def responder(self, request: AgentRequest, context: ReplyContext) -> ChatResponder:
        return ChatResponder(request.chat)

    def error_status(self, error: TitoError) -> int:
        return error.status

    def error_body(self, error: TitoError) -> bytes:
        return error.body()

    def passthrough_body(self, upstream: UpstreamPassthrough) -> bytes:
        return upstream.body

    def count_tokens_body(self, count: int) -> bytes:
        raise NotImplementedError("chat completions has no count_tokens route")


class ChatResponder:
    stream_headers = EVENT_STREAM_HEADERS
    reply_id = None

    def __init__(self, request: ChatRequest) -> None:
        self.request = request

    def adapt(self, message: dict[str, Any]) -> dict[str, Any]:
        return message

    def reply(self, outcome: TurnOutcome) -> HttpReply:
        if self.request.stream:
            include_usage = bool(self.request.stream_options and self.request.stream_options.include_usage)
            return HttpReply(
                200, dict(REFRAMED_STREAM_HEADERS), sse_from_completion(outcome.agent_body, include_usage=include_usage)
            )
        content = outcome.agent_bytes
        if content is None:
            content = dumps_exact(outcome.agent_body, allow_nan=True)
        return HttpReply(200, {"content-type": "application/json"}, content)

    def stream_start(self) -> bytes:
        return b""

    def stream_chunk(self, chunk: dict[str, Any]) -> bytes:
        return sse_event(chunk)

    def stream_end(self, outcome: TurnOutcome, tail: list[dict[str, Any]]) -> bytes:
        return b"".join(sse_event(chunk) for chunk in tail) + b"data: [DONE]\n\n"

    def stream_error(self, message: str) -> bytes:
        return sse_event({"error": {"message": f"{message}; nothing was recorded", "type": "tito_stream_error"}})
