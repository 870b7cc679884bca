"""The answer to one Responses turn: the response object and its event stream, from canonical chunks.

Items are built as the chunks arrive (reasoning, then message text, then function calls), so a live stream, a
re-framed one and the whole response object all show the same items with the same ids; a whitespace-only text is
held back and never becomes a message item.
"""

from __future__ import annotations

import time
from typing import Any

from tito_addon.exact_json import dumps_exact
from tito_addon.protocols.agent_api import REFRAMED_STREAM_HEADERS, AgentRequest, ReplyContext, TurnOutcome
from tito_addon.protocols.compaction_items import COMPACT_ENDPOINT, COMPACTION_PURPOSE, summary_of
from tito_addon.protocols.http_reply import HttpReply
from tito_addon.protocols.translated_api import HeldDeltas, TranslatedResponder
from tito_addon.protocols.turn_refs import new_id

REASONING_PURPOSE = "responses-reasoning"


class ResponsesResponder(TranslatedResponder):
    """One turn's response object, or its event stream (live or re-framed, from canonical chunks)."""

    def __init__(self, request: AgentRequest, context: ReplyContext) -> None:
        super().__init__(request, context)
        self.echo: dict[str, Any] = request.extra["request"]
        self.namespaces: dict[str, tuple[str, str]] = request.extra["namespaces"]
        self.sealed: bool = request.extra["sealed"]
        self.created_at = int(time.time())
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items in order, as streamed so far (`open`: kind, index)
        self.calls: dict[int, int] = {}  # tool position -> output index

    # -- the response object -------------------------------------------------------------------------------------

    def adapt(self, message: dict[str, Any]) -> dict[str, Any]:
        """Whitespace-only text is never shown as a message item (so never echoed); a tool call keeps the call id
        its streamed item showed, or gets one if the backend gave none."""
        adapted = dict(message)
        content = message.get("content")
        if isinstance(content, str) and not content.strip():
            adapted["content"] = None
        calls = []
        for position, call in enumerate(message.get("tool_calls") or []):
            if position in self.calls:
                call = {**call, "id": self.items[self.calls[position]]["call_id"]}
            elif not call.get("id"):
                call = {**call, "id": new_id("call_")}
            calls.append(call)
        if calls:
            adapted["tool_calls"] = calls
        return adapted

    def response(self, status: str, outcome: TurnOutcome | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.reply_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": self.echo.get("instructions"),
            "max_output_tokens": self.echo.get("max_output_tokens"),
            "model": self.echo.get("model"),
            "output": [],
            "parallel_tool_calls": self.echo.get("parallel_tool_calls", True),
            "previous_response_id": self.echo.get("previous_response_id"),
            "reasoning": self.echo.get("reasoning") or {"effort": None, "summary": None},
            "store": self.echo.get("store", False),
            "temperature": self.echo.get("temperature"),
            "text": self.echo.get("text") or {"format": {"type": "text"}},
            "tool_choice": self.echo.get("tool_choice") or "auto",
            "tools": self.echo.get("tools") or [],
            "top_p": self.echo.get("top_p"),
            "truncation": "disabled",
            "usage": None,
            "metadata": self.echo.get("metadata") or {},
        }
        if outcome is not None:
            body["output"] = self.items
            if outcome.finish_reason == "length":
                body["status"] = "incomplete"
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            body["usage"] = {
                "input_tokens": outcome.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": outcome.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": outcome.reasoning_tokens},
                "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            }
        return body

    def reply(self, outcome: TurnOutcome) -> HttpReply:
        streamed = self.reframed(outcome)
        if self.request.stream:
            return HttpReply(200, dict(REFRAMED_STREAM_HEADERS), streamed)
        body = dumps_exact(self.response("completed", outcome), allow_nan=True)
        return HttpReply(200, {"content-type": "application/json"}, body)

    # -- streaming -----------------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + dumps_exact(payload, allow_nan=True) + b"\n\n"

    def stream_start(self) -> bytes:
        snapshot = self.response("in_progress", None)
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def _add(self, kind: str, item: dict[str, Any]) -> tuple[bytes, int]:
        out = self._close()
        self.items.append(item)
        index = len(self.items) - 1
        self.open = (kind, index)
        added = {k: v for k, v in item.items()}
        out += self._event("response.output_item.added", output_index=index, item={**added, "status": "in_progress"})
        return out, index

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        kind, index = self.open
        item = self.items[index]
        self.open = None
        out = b""
        if kind == "reasoning":
            text = item["content"][0]["text"]
            out += self._event(
                "response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text
            )
            if self.sealed:
                item["encrypted_content"] = self.context.signer.seal_text(REASONING_PURPOSE, self.reply_id, text)
        elif kind == "message":
            part = item["content"][0]
            out += self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )
            out += self._event(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
            )
        else:
            out += self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
                name=item["name"],
            )
        item["status"] = "completed"
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def reasoning_delta(self, reasoning: str) -> bytes:
        out = b""
        if self.open is None or self.open[0] != "reasoning":
            item = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": [
                {"type": "reasoning_text", "text": ""}]}  # fmt: skip
            out, _ = self._add("reasoning", item)
        index = self.open[1]  # type: ignore[index]
        self.items[index]["content"][0]["text"] += reasoning
        return out + self._event(
            "response.reasoning_text.delta",
            item_id=self.items[index]["id"],
            output_index=index,
            content_index=0,
            delta=reasoning,
        )

    def text_delta(self, text: str) -> bytes:
        out = b""
        if self.open is None or self.open[0] != "message":
            if not (self.pending_text + text).strip():
                self.pending_text += text
                return b""
            text, self.pending_text = self.pending_text + text, ""
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"id": new_id("msg_"), "type": "message", "role": "assistant", "content": []}
            added, index = self._add("message", item)
            out += added
            item["content"].append(part)
            out += self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part={**part},
            )
        index = self.open[1]  # type: ignore[index]
        item = self.items[index]
        item["content"][0]["text"] += text
        return out + self._event(
            "response.output_text.delta",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def call_delta(self, call: dict[str, Any]) -> bytes:
        out = b""
        position = int(call.get("index", 0))
        function = call.get("function") or {}
        if position not in self.calls:
            flat = function.get("name") or ""
            item: dict[str, Any] = {
                "id": new_id("fc_"), "type": "function_call", "call_id": call.get("id") or new_id("call_"),
                "name": flat, "arguments": "",
            }  # fmt: skip
            if flat in self.namespaces:
                item["namespace"], item["name"] = self.namespaces[flat]
            added, index = self._add("function_call", item)
            self.calls[position] = index
            out += added
        index = self.calls[position]
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            item = self.items[index]
            item["arguments"] += arguments
            out += self._event(
                "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=arguments
            )
        return out

    def stream_end(self, outcome: TurnOutcome, tail: list[dict[str, Any]]) -> bytes:
        out = self._close()
        return out + self._event("response.completed", response=self.response("completed", outcome))

    def stream_error(self, message: str) -> bytes:
        failed = self.response("failed", None)
        failed["error"] = {"code": "server_error", "message": f"{message}; nothing was recorded"}
        return self._event("response.failed", response=failed)


class CompactionResponder(HeldDeltas, ResponsesResponder):
    """A compaction the proxy served (`compaction_items`): one `compaction` item whose encrypted_content seals the
    summary, never the summary turn's text or reasoning as items. `/responses/compact` answers with the
    conversation's user messages and the item (`response.compaction`); a `compaction_trigger` turn with a response
    (streamed when asked) whose output is the item."""

    def __init__(self, request: AgentRequest, context: ReplyContext) -> None:
        super().__init__(request, context)
        self.endpoint = request.compacts == COMPACT_ENDPOINT
        self.item: dict[str, Any] = {"id": new_id("cmp_"), "type": "compaction", "encrypted_content": ""}

    def sealed_item(self, outcome: TurnOutcome) -> dict[str, Any]:
        summary = summary_of(outcome.message.get("content") or "")
        sealed = self.context.signer.seal_text(COMPACTION_PURPOSE, self.reply_id, summary)
        return {**self.item, "encrypted_content": sealed}

    def reply(self, outcome: TurnOutcome) -> HttpReply:
        item = self.sealed_item(outcome)
        if self.endpoint:
            usage = self.response("completed", outcome)["usage"]
            output = [*user_items(self.request.items), item]
            body = {"id": self.reply_id, "object": "response.compaction", "created_at": self.created_at}
            body |= {"output": output, "usage": usage}
            return HttpReply(200, {"content-type": "application/json"}, dumps_exact(body, allow_nan=True))
        if self.request.stream:
            return HttpReply(200, dict(REFRAMED_STREAM_HEADERS), self.reframed(outcome))
        self.items = [item]
        body = dumps_exact(self.response("completed", outcome), allow_nan=True)
        return HttpReply(200, {"content-type": "application/json"}, body)

    def started(self) -> bytes:
        if self.items:
            return b""
        self.items.append(self.item)
        return self._event("response.output_item.added", output_index=0, item={**self.item})

    def stream_end(self, outcome: TurnOutcome, tail: list[dict[str, Any]]) -> bytes:
        out = self.started()
        self.items[0] = self.sealed_item(outcome)
        out += self._event("response.output_item.done", output_index=0, item=self.items[0])
        return out + self._event("response.completed", response=self.response("completed", outcome))


def user_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What `/responses/compact` answers before its compaction item: the conversation's user messages, their text in
    parts as the API gives output messages."""
    out = []
    for item in items:
        if item.get("type", "message") != "message" or item.get("role") != "user":
            continue
        content = item.get("content")
        parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
        out.append({"type": "message", "role": "user", "content": parts})
    return out
