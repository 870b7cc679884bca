"""Anthropic Messages (`POST …/v1/messages`, Claude Code's only API), translated to and from the canonical form.

Request -> canonical chat messages:
- `system` (a string or text blocks) is the first system message; a block that starts with
  `x-anthropic-billing-header` is vendor billing metadata, not conversation, and is dropped as vLLM's own
  `/v1/messages` drops it, so the model sees what it would see there. `role: "system"` entries inside `messages`
  (Claude Code's environment block) stay system messages in place.
- A user message's `tool_result` blocks become tool messages, in order (string, text or image blocks; `is_error`
  is not rendered, as in vLLM), then its text and image blocks one user message. A lone text block and a plain
  string are the same message; `cache_control` markers are not part of a message. An image is taken inline only
  (`source.type: "base64"`; a URL or a file is a 400), and only by a vision-language model family.
- An assistant message: `thinking` blocks are its reasoning, text blocks its content, `tool_use` blocks its tool
  calls (id, name, `input` as the arguments object). `redacted_thinking` cannot be read: it is left out of the
  prompt and the record says so. An image there is a 400: the API has none in assistant messages.
- Identity (what must repeat for a request to extend a stored turn) is therefore role, text, tool-call id, name
  and arguments as a JSON value, tool-result id and text, each image's bytes; reasoning follows the session tree's
  reasoning rule.

Reply: `msg_…` id, blocks thinking (with our signature), text, tool_use (`toolu_…` ids, minted here and committed
with the turn, so the echoed history matches), `stop_reason` from the finish reason and the matched stop
sequence, exact token counts. Streams are the event sequence the anthropic SDK accumulates, with `event:` lines.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tito_addon.canonical_chat import parse_arguments
from tito_addon.exact_json import dumps_exact
from tito_addon.protocols.agent_api import REFRAMED_STREAM_HEADERS, AgentRequest, ReplyContext, TurnOutcome
from tito_addon.protocols.anthropic_models import MessageParam, MessagesRequest, ToolChoice, ToolParam
from tito_addon.protocols.anthropic_translation import MessagesTranslation, translate_message
from tito_addon.protocols.compaction_items import COMPACT_EDIT, COMPACTION_PURPOSE, SERVED_COMPACTION_PROMPT, summary_of
from tito_addon.protocols.http_reply import HttpReply
from tito_addon.protocols.translated_api import (
    HeldDeltas,
    ItemTranslation,
    TranslatedApi,
    TranslatedResponder,
    passthrough_message,
)
from tito_addon.protocols.turn_refs import new_id
from tito_addon.tito_errors import BadRequest, UpstreamPassthrough

MESSAGES_PATH = re.compile(
    r"^(?:/sessions/(?P<sid>[^/?#]*))?(?P<prefix>(?:/[^?#]*)?)/v1/messages(?P<count>/count_tokens)?/?(?:\?.*)?$"
)
THINKING_PURPOSE = "anthropic-thinking"
MESSAGES_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    409: "invalid_request_error", 410: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error", 529: "overloaded_error",
}  # fmt: skip


def messages_tools(tools: list[ToolParam] | None, dropped: list[str]) -> list[dict[str, Any]] | None:
    """Client tools as chat functions; server tools the backend cannot run (web search, ...) are left out."""
    out = []
    for tool in tools or []:
        if tool.type not in (None, "custom"):
            dropped.append(f"tool {tool.name!r} of type {tool.type!r} (a server tool the backend cannot run)")
            continue
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out or None


def messages_tool_choice(choice: ToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + dumps_exact(payload, allow_nan=True) + b"\n\n"


class AnthropicResponder(TranslatedResponder):
    """Answers one turn: the message object, or its event stream (live or re-framed, from canonical chunks)."""

    def __init__(self, request: AgentRequest, context: ReplyContext) -> None:
        super().__init__(request, context)
        self.model = request.extra["model"]
        self.stop_sequences: list[str] = request.extra["stop_sequences"]
        self.tool_ids: dict[int, str] = {}
        # stream state (`open`: the open block's kind and tool index): its index, and the open thinking's reasoning
        self.index = -1
        self.reasoning = ""

    def tool_id(self, position: int, given: str | None = None) -> str:
        """The id the agent sees for the tool call at `position`: ours (`toolu_…`), or the recorded one on replay."""
        if position not in self.tool_ids:
            keep = given and (self.context.replayed or given.startswith("toolu_"))
            self.tool_ids[position] = given if keep else new_id("toolu_")  # type: ignore[assignment]
        return self.tool_ids[position]

    def signature(self, reasoning: str) -> str:
        return self.context.signer.sign_text(THINKING_PURPOSE, self.context.reply_id, reasoning)

    def adapt(self, message: dict[str, Any]) -> dict[str, Any]:
        adapted = dict(message)
        calls = message.get("tool_calls")
        if calls:
            adapted["tool_calls"] = [{**call, "id": self.tool_id(i, call.get("id"))} for i, call in enumerate(calls)]
        content = message.get("content")
        if isinstance(content, str) and not content.strip():
            # A text block must hold non-whitespace text, so the agent never sees (or echoes) this one; the
            # committed message says what the agent saw. The ids are the model's, whatever the text.
            adapted["content"] = None
        return adapted

    def stop(self, outcome: TurnOutcome) -> tuple[str, str | None]:
        if outcome.finish_reason == "tool_calls" or (
            outcome.message.get("tool_calls") and outcome.finish_reason == "stop"
        ):
            return "tool_use", None
        if outcome.finish_reason == "length":
            return "max_tokens", None
        if outcome.matched_stop is not None and outcome.matched_stop in self.stop_sequences:
            return "stop_sequence", outcome.matched_stop
        return "end_turn", None

    def usage(self, outcome: TurnOutcome) -> dict[str, int]:
        return {"input_tokens": outcome.prompt_tokens, "output_tokens": outcome.completion_tokens}

    def content(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": self.signature(reasoning)})
        if message.get("content"):
            blocks.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            arguments = parse_arguments(function.get("arguments") or "{}")
            blocks.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": function.get("name"),
                    "input": arguments if isinstance(arguments, dict) else {},
                }
            )
        return blocks or [{"type": "text", "text": ""}]

    def reply(self, outcome: TurnOutcome) -> HttpReply:
        if self.request.stream:
            return HttpReply(200, dict(REFRAMED_STREAM_HEADERS), self.reframed(outcome))
        stop_reason, stop_sequence = self.stop(outcome)
        payload = {
            "id": self.context.reply_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content(outcome.message),
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self.usage(outcome),
        }
        return HttpReply(200, {"content-type": "application/json"}, dumps_exact(payload, allow_nan=True))

    # -- streaming -----------------------------------------------------------------------------------------------

    def stream_start(self) -> bytes:
        message = {
            "id": self.context.reply_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.context.prompt_tokens, "output_tokens": 0},
        }
        return _event("message_start", {"type": "message_start", "message": message}) + _event("ping", {"type": "ping"})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open[0] == "thinking":
            delta = {"type": "signature_delta", "signature": self.signature(self.reasoning)}
            out += _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
        self.open = None
        return out + _event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _open(self, kind: str, position: int, block: dict[str, Any]) -> bytes:
        if self.open == (kind, position):
            return b""
        out = self._close()
        self.open = (kind, position)
        self.index += 1
        self.reasoning = ""
        return out + _event(
            "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}
        )

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def reasoning_delta(self, reasoning: str) -> bytes:
        out = self._open("thinking", 0, {"type": "thinking", "thinking": ""})
        self.reasoning += reasoning
        return out + self._delta({"type": "thinking_delta", "thinking": reasoning})

    def text_delta(self, text: str) -> bytes:
        if self.open != ("text", 0) and not (self.pending_text + text).strip():
            self.pending_text += text
            return b""
        text, self.pending_text = self.pending_text + text, ""
        out = self._open("text", 0, {"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def call_delta(self, call: dict[str, Any]) -> bytes:
        position = int(call.get("index", 0))
        function = call.get("function") or {}
        block = {
            "type": "tool_use",
            "id": self.tool_id(position, call.get("id")),
            "name": function.get("name") or "",
            "input": {},
        }
        out = self._open("tool_use", position, block)
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            out += self._delta({"type": "input_json_delta", "partial_json": arguments})
        return out

    def stream_end(self, outcome: TurnOutcome, tail: list[dict[str, Any]]) -> bytes:
        stop_reason, stop_sequence = self.stop(outcome)
        delta = {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}}
        delta["usage"] = self.usage(outcome)
        return self._close() + _event("message_delta", delta) + _event("message_stop", {"type": "message_stop"})

    def stream_error(self, message: str) -> bytes:
        error = {"type": "api_error", "message": f"{message}; nothing was recorded"}
        return _event("error", {"type": "error", "error": error})


class CompactionBlockResponder(HeldDeltas, AnthropicResponder):
    """A compaction this proxy served for `compact_20260112` (`compaction_items`): one `compaction` block holding the
    summary, sealed in its `encrypted_content`, and `stop_reason: "compaction"` (the agent sends the block back to
    go on); never the summary turn's own text or thinking as blocks."""

    def block(self, outcome: TurnOutcome) -> dict[str, Any]:
        summary = summary_of(outcome.message.get("content") or "")
        sealed = self.context.signer.seal_text(COMPACTION_PURPOSE, self.context.reply_id, summary)
        return {"type": "compaction", "content": summary, "encrypted_content": sealed}

    def stop(self, outcome: TurnOutcome) -> tuple[str, str | None]:
        return "compaction", None

    def reply(self, outcome: TurnOutcome) -> HttpReply:
        if self.request.stream:
            return HttpReply(200, dict(REFRAMED_STREAM_HEADERS), self.reframed(outcome))
        payload = {"id": self.context.reply_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [self.block(outcome)], "stop_reason": "compaction", "stop_sequence": None,
                   "usage": self.usage(outcome)}  # fmt: skip
        return HttpReply(200, {"content-type": "application/json"}, dumps_exact(payload, allow_nan=True))

    def started(self) -> bytes:
        return self._open("compaction", 0, {"type": "compaction", "content": None})

    def stream_end(self, outcome: TurnOutcome, tail: list[dict[str, Any]]) -> bytes:
        out = self.started() + self._delta({**self.block(outcome), "type": "compaction_delta"})
        return out + super().stream_end(outcome, tail)


def compact_edit(context_management: Any) -> tuple[int, str] | None:
    """(trigger, instruction) of a `compact_20260112` edit: compact once the prompt holds `trigger` tokens (150000
    unless given), with the edit's `instructions` in place of ours. Only `pause_after_compaction: true` is served: the
    compaction block is the whole answer, and the agent's next request goes on from it."""
    edits = context_management.get("edits") if isinstance(context_management, dict) else None
    for edit in edits if isinstance(edits, list) else []:
        if not isinstance(edit, dict) or edit.get("type") != COMPACT_EDIT:
            continue
        trigger = edit.get("trigger") or {"type": "input_tokens", "value": 150_000}
        value = trigger.get("value") if isinstance(trigger, dict) else None
        if (
            not isinstance(trigger, dict)
            or trigger.get("type") != "input_tokens"
            or type(value) is not int
            or value < 1
        ):
            raise BadRequest(f"context_management: a {COMPACT_EDIT} trigger is {{type: input_tokens, value: N >= 1}}")
        if edit.get("pause_after_compaction") is not True:
            raise BadRequest(
                f"context_management: {COMPACT_EDIT} is served with pause_after_compaction: true only (the compaction "
                "block is then the whole answer, and the next request goes on from it); nothing was forwarded"
            )
        instructions = edit.get("instructions")
        if instructions is not None and (not isinstance(instructions, str) or not instructions.strip()):
            raise BadRequest(f"context_management: a {COMPACT_EDIT} edit's instructions are a non-empty string")
        return value, instructions or SERVED_COMPACTION_PROMPT
    return None


class AnthropicMessagesApi(TranslatedApi[MessagesTranslation]):
    name = "anthropic_messages"
    path = MESSAGES_PATH
    request_model = MessagesRequest
    noun = "messages request"
    sampling = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
    responder_type = AnthropicResponder

    def check(self, request: MessagesRequest, action: str) -> None:
        if action == "turn" and request.max_tokens is None:
            raise BadRequest("invalid messages request at max_tokens: Field required")

    def begin(self, request: MessagesRequest, raw: dict[str, Any]) -> tuple[MessagesTranslation, list[dict[str, Any]]]:
        translation = MessagesTranslation(self.signer)
        if request.system is None:
            return translation, []
        translation.system(0, request.system, "system")
        return translation, [{"role": "system", "content": raw["system"]}]

    def translate_one(self, item: MessageParam, where: str) -> ItemTranslation:
        return translate_message(self.signer, item, where)

    def close(self, translation: MessagesTranslation) -> None:
        for where, signature, text in translation.signatures:
            if self.signer is not None and self.signer.verify_text(THINKING_PURPOSE, signature, text) is None:
                translation.dropped.append(f"{where}: a thinking signature that is not ours (read as plain text)")

    def fill(
        self, request: MessagesRequest, translation: MessagesTranslation, chat_body: dict[str, Any]
    ) -> dict[str, Any]:
        tools = messages_tools(request.tools, translation.notes)
        if tools:
            chat_body["tools"] = tools
        choice = messages_tool_choice(request.tool_choice)
        if choice is not None and tools:
            chat_body["tool_choice"] = choice
        if request.tool_choice is not None and request.tool_choice.disable_parallel_tool_use is not None:
            chat_body["parallel_tool_calls"] = not request.tool_choice.disable_parallel_tool_use
        self.copy_sampling(request, chat_body)
        if request.stop_sequences:
            chat_body["stop"] = list(request.stop_sequences)
        translation.compact_when = compact_edit(request.context_management)
        return {"model": request.model, "stop_sequences": request.stop_sequences or []}

    def thinking(self, request: MessagesRequest) -> bool | None:
        return None if request.thinking is None else request.thinking.type != "disabled"

    def responder(self, request: AgentRequest, context: ReplyContext) -> TranslatedResponder:
        if request.compacts is not None:
            return CompactionBlockResponder(request, context)
        return super().responder(request, context)

    def reply_id(self, session_id: str | None = None) -> str | None:
        return new_id("msg_")

    @staticmethod
    def error_json(status: int, message: str) -> bytes:
        kind = MESSAGES_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return json.dumps({"type": "error", "error": {"type": kind, "message": message}}, ensure_ascii=False).encode()

    def passthrough_body(self, upstream: UpstreamPassthrough) -> bytes:
        return self.error_json(upstream.status, passthrough_message(upstream))

    def count_tokens_body(self, count: int) -> bytes:
        return json.dumps({"input_tokens": count}).encode()
