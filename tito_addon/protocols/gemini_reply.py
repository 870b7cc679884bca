"""The answer to one Gemini turn: the `GenerateContentResponse`, or its SSE stream, from canonical chunks.

Parts are reasoning (`thought: true`, shown when the request asked `includeThoughts`), then the text, then the
function calls. The first part that is not a thought carries the thought signature: the reasoning sealed with the
reply's id under the proxy's key, so an agent that drops thought parts from the history it sends back (Gemini CLI
does) still names the exact reasoning of the turn. A stream's chunks carry only new parts; a function call goes out
whole, and the last chunk carries what was held back, `finishReason` and the exact `usageMetadata`. The text is
shown without the whitespace around it (`GeminiResponder.adapt`).
"""

from __future__ import annotations

from typing import Any

from tito_addon.canonical_chat import parse_arguments
from tito_addon.exact_json import dumps_exact
from tito_addon.protocols.agent_api import REFRAMED_STREAM_HEADERS, AgentRequest, ReplyContext, TurnOutcome
from tito_addon.protocols.gemini_translation import call_id_for, seal_signature
from tito_addon.protocols.http_reply import HttpReply
from tito_addon.protocols.translated_api import TranslatedResponder

# Google's status names for the HTTP statuses this proxy answers with.
STATUS_NAMES = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 409: "ABORTED",
    410: "FAILED_PRECONDITION", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL",
    501: "UNIMPLEMENTED", 502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}  # fmt: skip


def status_name(status: int) -> str:
    return STATUS_NAMES.get(status, "INTERNAL" if status >= 500 else "FAILED_PRECONDITION")


def error_payload(status: int, message: str) -> dict[str, Any]:
    return {"error": {"code": status, "message": message, "status": status_name(status)}}


def finish_reason(outcome: TurnOutcome) -> str:
    if outcome.finish_reason == "length":
        return "MAX_TOKENS"
    if outcome.finish_reason in (None, "stop", "tool_calls"):
        return "STOP"
    if outcome.finish_reason == "content_filter":
        return "SAFETY"
    return "OTHER"


def usage_metadata(outcome: TurnOutcome) -> dict[str, int]:
    """Exact counts: the candidates' tokens are the completion's less its reasoning (`thoughtsTokenCount`)."""
    thoughts = min(outcome.reasoning_tokens, outcome.completion_tokens)
    usage = {
        "promptTokenCount": outcome.prompt_tokens,
        "candidatesTokenCount": outcome.completion_tokens - thoughts,
        "totalTokenCount": outcome.prompt_tokens + outcome.completion_tokens,
    }
    if thoughts:
        usage["thoughtsTokenCount"] = thoughts
    return usage


def _data(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps_exact(payload, allow_nan=True) + b"\n\n"


class GeminiResponder(TranslatedResponder):
    """One turn's response object, or its stream (live or re-framed, from canonical chunks)."""

    def __init__(self, request: AgentRequest, context: ReplyContext) -> None:
        super().__init__(request, context)
        self.model: str = request.extra["model"]
        self.include_thoughts: bool = request.extra["include_thoughts"]
        self.call_ids: dict[int, str] = {}
        # stream state: the reasoning so far, whether the signature went out, the text part held back (the last chunk
        # then carries content), and each call's pieces by position.
        self.reasoning = ""
        self.signed = False
        self.held: str | None = None
        self.calls: dict[int, dict[str, str]] = {}

    def call_id(self, position: int, given: str | None = None) -> str:
        """The id the agent sees for the call at `position`: made from the reply's id (`call_id_for`), so that it
        can be named again when the agent echoes the call without it; the recorded one on replay."""
        if position not in self.call_ids:
            replayed = given if self.context.replayed else None
            self.call_ids[position] = replayed or call_id_for(self.context.reply_id, position)
        return self.call_ids[position]

    def adapt(self, message: dict[str, Any]) -> dict[str, Any]:
        adapted = dict(message)
        calls = message.get("tool_calls")
        if calls:
            adapted["tool_calls"] = [{**call, "id": self.call_id(i, call.get("id"))} for i, call in enumerate(calls)]
        content = message.get("content")
        if isinstance(content, str):
            # Shown without the whitespace around it (a blank text not at all): Gemini CLI keeps a text trimmed in
            # its session file, so a resumed session echoes it so, and the committed message says what the agent
            # saw (Qwen3's answer starts with the "\n\n" after its reasoning). The ids keep every token.
            adapted["content"] = content.strip() or None
        return adapted

    def signature(self) -> str:
        return seal_signature(self.context.signer, self.context.reply_id, self.reasoning)

    def signed_part(self, part: dict[str, Any]) -> dict[str, Any]:
        if self.signed:
            return part
        self.signed = True
        return {**part, "thoughtSignature": self.signature()}

    def call_part(self, position: int, call: dict[str, Any]) -> dict[str, Any]:
        function = call.get("function") or {}
        arguments = parse_arguments(function.get("arguments") or "{}")
        found = {
            "id": self.call_id(position, call.get("id")),
            "name": function.get("name"),
            "args": arguments if isinstance(arguments, dict) else {},
        }
        return self.signed_part({"functionCall": found})

    def parts(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """The whole message's parts, in the order and with the signature a stream gives them."""
        self.reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        out: list[dict[str, Any]] = []
        if self.reasoning and self.include_thoughts:
            out.append({"text": self.reasoning, "thought": True})
        text = message.get("content")
        if isinstance(text, str) and text.strip():
            out.append(self.signed_part({"text": text}))
        out += [self.call_part(i, call) for i, call in enumerate(message.get("tool_calls") or [])]
        return out or [self.signed_part({"text": ""})]

    def response(self, parts: list[dict[str, Any]], outcome: TurnOutcome | None) -> dict[str, Any]:
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}}
        if outcome is not None:
            candidate["finishReason"] = finish_reason(outcome)
        candidate["index"] = 0
        if outcome is not None:
            usage = usage_metadata(outcome)
        else:
            prompt = self.context.prompt_tokens
            usage = {"promptTokenCount": prompt, "totalTokenCount": prompt}
        return {"candidates": [candidate], "usageMetadata": usage, "modelVersion": self.model,
                "responseId": self.context.reply_id}  # fmt: skip

    def reply(self, outcome: TurnOutcome) -> HttpReply:
        if self.request.stream:
            return HttpReply(200, dict(REFRAMED_STREAM_HEADERS), self.reframed(outcome))
        body = dumps_exact(self.response(self.parts(outcome.message), outcome), allow_nan=True)
        return HttpReply(200, {"content-type": "application/json"}, body)

    # -- streaming -----------------------------------------------------------------------------------------------

    def chunk(self, parts: list[dict[str, Any]], outcome: TurnOutcome | None = None) -> bytes:
        return _data(self.response(parts, outcome))

    def stream_start(self) -> bytes:
        return b""

    def reasoning_delta(self, reasoning: str) -> bytes:
        self.reasoning += reasoning
        if not self.include_thoughts:
            return b""
        return self.chunk([{"text": reasoning, "thought": True}])

    def text_delta(self, text: str) -> bytes:
        # The text as `adapt` commits it, trimmed: whitespace before the first text is dropped, whitespace after
        # the last held until text follows it (so never shown at the end).
        if self.held is None:
            text = text.lstrip()
        pending = self.pending_text + text
        shown = pending.rstrip()
        if not shown:
            self.pending_text = pending
            return b""
        self.pending_text = pending[len(shown) :]
        out = b"" if self.held is None else self.chunk([self.signed_part({"text": self.held})])
        self.held = shown
        return out

    def call_delta(self, call: dict[str, Any]) -> bytes:
        position = int(call.get("index", 0))
        function = call.get("function") or {}
        found = self.calls.setdefault(position, {"id": "", "name": "", "arguments": ""})
        if call.get("id"):
            found["id"] = call["id"]
        if function.get("name"):
            found["name"] = function["name"]
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            found["arguments"] += arguments
        return b""

    def stream_end(self, outcome: TurnOutcome, tail: list[dict[str, Any]]) -> bytes:
        parts: list[dict[str, Any]] = []
        if self.held is not None:
            parts.append(self.signed_part({"text": self.held}))
        for position in sorted(self.calls):
            found = self.calls[position]
            call = {"id": found["id"] or None, "function": {"name": found["name"], "arguments": found["arguments"]}}
            parts.append(self.call_part(position, call))
        if not parts:
            parts.append(self.signed_part({"text": ""}))
        return self.chunk(parts, outcome)

    def stream_error(self, message: str) -> bytes:
        return _data(error_payload(500, f"{message}; nothing was recorded"))
