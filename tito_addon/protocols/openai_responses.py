"""OpenAI Responses (`POST …/v1/responses`, Codex's only API, the Agents SDK's default), to and from the canonical
form.

Request -> canonical chat messages:
- `instructions` is the first system message; `developer` messages are system messages (chat templates have no
  developer role); `input` as a string is one user message; text parts of a message are joined as in chat.
- A run of assistant-side items (`reasoning`, assistant `message`, `function_call`) is one assistant message: its
  reasoning, its text, its tool calls (`call_id`, name, the arguments string). `function_call_output` is a tool
  message. Item ids the client mints (`msg_…`, `fco_…`, `rs_…`) are not part of a message, nor is the order of
  `client_metadata`'s keys or the spelling of the arguments JSON (compared as a JSON value).
- A reasoning item's text is what its `encrypted_content` seals (ours, verified: the exact text of the turn), else
  its readable content or summary; a foreign or forged `encrypted_content` is left out and the record says so.
- Function tools (flat shape) become chat functions; a `namespace` group's tools are offered as
  `namespace__name` and answered back as `name` with its `namespace`; hosted tools the backend cannot run
  (`web_search`, …) are left out of the prompt and the record says so, since a 400 would stop Codex.
- `previous_response_id` names a stored turn (the `resp_…` id we answered with): the request's items are then
  only what it appends, and the turn continues that turn's exact ids, after a restart too (the id carries its
  session, whose record is read back). `instructions` are not re-rendered then: the stored prompt already has them.

Reply: `resp_…`, with `rs_…`, `msg_…` and `fc_…` items, `status` (`incomplete` with `max_output_tokens` when the
turn was cut), exact token counts; streams are the event sequence the openai SDK and Codex accumulate.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, replace
from typing import Any

import orjson

from tito_addon.canonical_chat import ChatMessage, ChatRequest
from tito_addon.protocols.agent_api import (
    AgentRequest,
    ReplyContext,
    TranslatedApi,
    backend_extensions,
    known_block,
    with_known_chat,
)
from tito_addon.protocols.json_body import validated
from tito_addon.protocols.known_messages import DEFAULT_BUDGET_BYTES
from tito_addon.protocols.known_requests import Extension, KnownRequests
from tito_addon.protocols.openai_responses_models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MediaPart,
    MessageItem,
    RefusalPart,
    ResponsesRequest,
)
from tito_addon.protocols.openai_responses_reply import REASONING_PURPOSE, ResponsesResponder
from tito_addon.protocols.turn_refs import TurnSigner, new_id
from tito_addon.tito_errors import BadRequest, TitoError, UpstreamPassthrough

RESPONSES_PATH = re.compile(r"^(?:/sessions/(?P<sid>[^/?#]*))?(?P<prefix>(?:/[^?#]*)?)/v1/responses/?(?:\?.*)?$")
ENCRYPTED_REASONING = "reasoning.encrypted_content"
NAMESPACE_JOIN = "__"
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 409: "invalid_request_error"}
# Requests read before, each with its items' translation (`ItemsTranslation`).
KNOWN_RESPONSES_REQUESTS = KnownRequests(DEFAULT_BUDGET_BYTES, member="input")


def reply_session(reply_id: str) -> str | None:
    """The session a `resp_…` id names (None for an id that carries none or is not ours)."""
    _, _, hint = reply_id.partition(".")
    if not hint:
        return None
    try:
        return base64.urlsafe_b64decode(hint + "=" * (-len(hint) % 4)).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None


def new_reply_id(session_id: str | None) -> str:
    rid = new_id("resp_")
    if session_id is None:
        return rid
    return rid + "." + base64.urlsafe_b64encode(session_id.encode()).rstrip(b"=").decode("ascii")


def _text(parts: str | list[Any], where: str) -> str | list[dict[str, str]]:
    if isinstance(parts, str):
        return parts
    out = []
    for part in parts:
        if isinstance(part, MediaPart):
            raise BadRequest(
                f"{where} holds {part.type}: the served model family reads text only; nothing was forwarded"
            )
        out.append({"type": "text", "text": part.refusal if isinstance(part, RefusalPart) else part.text})
    return out


def _joined(parts: list[Any]) -> str:
    return "\n".join(part.text for part in parts)


class Translation:
    def __init__(self, signer: TurnSigner | None, namespaces: dict[str, tuple[str, str]]) -> None:
        self.signer = signer
        self.namespaces = namespaces
        self.messages: list[dict[str, Any]] = []
        self.item_of: list[int] = []
        self.dropped: list[str] = []
        self.assistant: dict[str, Any] | None = None  # the assistant message the current run of items builds

    def add(self, item: int, message: dict[str, Any]) -> dict[str, Any]:
        self.messages.append(message)
        self.item_of.append(item)
        return message

    def assistant_at(self, item: int) -> dict[str, Any]:
        if self.assistant is None:
            self.assistant = self.add(item, {"role": "assistant", "content": None})
        return self.assistant

    def message(self, item: int, message: MessageItem, where: str) -> None:
        content = _text(message.content, where)
        if message.role == "assistant":
            target = self.assistant_at(item)
            text = content if isinstance(content, str) else "\n".join(p["text"] for p in content)
            target["content"] = text if target["content"] is None else target["content"] + "\n" + text
            return
        self.assistant = None
        role = "system" if message.role in ("system", "developer") else "user"
        self.add(item, {"role": role, "content": content})

    def function_call(self, item: int, call: FunctionCallItem) -> None:
        name = f"{call.namespace}{NAMESPACE_JOIN}{call.name}" if call.namespace else call.name
        calls = self.assistant_at(item).setdefault("tool_calls", [])
        calls.append({"id": call.call_id, "type": "function", "function": {"name": name, "arguments": call.arguments}})

    def output(self, item: int, result: FunctionCallOutputItem, where: str) -> None:
        self.assistant = None
        content = _text(result.output, where)
        text = content if isinstance(content, str) else "\n".join(p["text"] for p in content)
        self.add(item, {"role": "tool", "tool_call_id": result.call_id, "content": text})

    def reasoning(self, item: int, reasoning: Any, where: str) -> None:
        text: str | None = None
        if reasoning.encrypted_content is not None:
            opened = self.signer.open_text(REASONING_PURPOSE, reasoning.encrypted_content) if self.signer else None
            if opened is not None:
                text = opened[1]
            else:
                self.dropped.append(f"{where}: encrypted_content that is not ours (left out of the prompt)")
        if text is None and reasoning.content:
            text = _joined(reasoning.content)
        if text is None and reasoning.summary:
            text = _joined(reasoning.summary)
        if text:
            target = self.assistant_at(item)
            target["reasoning_content"] = (target.get("reasoning_content") or "") + text


@dataclass(frozen=True, slots=True)
class ItemsTranslation:
    """What a request's input items became, kept with its bytes (see `known_requests`) so that a request extending
    it translates only its own items: the canonical messages (never changed once their run of items ended), the item
    each came from, what was left out, whether the last assistant message was still open to the next item, and the
    messages validated."""

    messages: tuple[dict[str, Any], ...]
    item_of: tuple[int, ...]
    dropped: tuple[str, ...]
    open_run: bool
    chat: tuple[ChatMessage, ...] = ()
    count: int = 0  # the input items translated


def closes_run(item: Any) -> bool:
    """Whether an item ends the run of assistant-side items before it (see `Translation`)."""
    return isinstance(item, FunctionCallOutputItem) or (isinstance(item, MessageItem) and item.role != "assistant")


def chat_tools(
    tools: list[dict[str, Any]] | None, dropped: list[str]
) -> tuple[list[dict[str, Any]] | None, dict[str, tuple[str, str]]]:
    """Function tools as chat functions (namespaced ones flattened); hosted tools are left out and noted."""
    out: list[dict[str, Any]] = []
    namespaces: dict[str, tuple[str, str]] = {}

    def function(tool: dict[str, Any], namespace: str | None) -> None:
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest("each function tool needs a name")
        flat = f"{namespace}{NAMESPACE_JOIN}{name}" if namespace else name
        if namespace:
            namespaces[flat] = (namespace, name)
        spec: dict[str, Any] = {"name": flat, "parameters": tool.get("parameters") or {"type": "object"}}
        if isinstance(tool.get("description"), str):
            spec["description"] = tool["description"]
        out.append({"type": "function", "function": spec})

    for tool in tools or []:
        if not isinstance(tool, dict):
            raise BadRequest("each tool must be an object")
        kind = tool.get("type")
        if kind == "function":
            function(tool, None)
        elif kind == "namespace":
            group = tool.get("name")
            if not isinstance(group, str) or not group:
                raise BadRequest("a namespace tool needs a name")
            for inner in tool.get("tools") or []:
                if isinstance(inner, dict) and inner.get("type", "function") == "function":
                    function(inner, group)
                else:
                    dropped.append(f"tool in namespace {group!r} that is not a function")
        else:
            dropped.append(f"tool of type {kind!r} (a hosted tool the backend cannot run)")
    return out or None, namespaces


def chat_tool_choice(choice: Any, dropped: list[str]) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    dropped.append(f"tool_choice {json.dumps(choice)[:80]} (served as auto)")
    return "auto"


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    form = (text or {}).get("format")
    if not isinstance(form, dict) or form.get("type") in (None, "text"):
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema":
        schema = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        return {"type": "json_schema", "json_schema": schema}
    raise BadRequest(f"unsupported text.format type {form.get('type')!r}")


# Items Codex sends that have no chat form here: what each is, and how to run Codex without it (Codex 0.171: a model
# name its catalog does not know, such as `-m qwen3` or `-m gpt-oss-20b`, gets ordinary function tools only).
CODEX_WITHOUT_THEM = (
    "run Codex with your server's model name (`codex exec -m qwen3 …`, or `-m gpt-oss-20b`) instead of one of its own "
    "models: it then sends ordinary function tools, which are recorded token for token"
)
UNSUPPORTED_ITEMS = {
    "additional_tools": "Codex's Responses Lite tool list (a namespace of its code-mode tools, among them the "
    "freeform JavaScript `exec`), sent for the models its catalog runs in that mode, its default models among them",
    "custom_tool_call": "a call of a freeform `custom` tool (Codex's `apply_patch` or code-mode `exec`), which this "
    "proxy never offers to the model (custom tools are left out of the prompt)",
    "custom_tool_call_output": "the result of a freeform `custom` tool call (Codex's `apply_patch` or code-mode "
    "`exec`), which this proxy never offers to the model (custom tools are left out of the prompt)",
}


def unsupported_item(raw: dict[str, Any]) -> BadRequest | None:
    """A refusal that names the first item of a kind with no chat form here and the Codex setting that avoids it."""
    items = raw.get("input")
    for position, item in enumerate(items if isinstance(items, list) else []):
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind in UNSUPPORTED_ITEMS:
            return BadRequest(
                f"invalid responses request at input.{position}: {kind!r} items are not supported: it is "
                f"{UNSUPPORTED_ITEMS[kind]}; {CODEX_WITHOUT_THEM}. Nothing was forwarded."
            )
    return None


class OpenAIResponsesApi(TranslatedApi):
    name = "openai_responses"
    signs = True  # mints values the agent echoes back (see turn_refs)
    path = RESPONSES_PATH

    def parse(self, body: bytes, action: str = "turn") -> AgentRequest:
        raw, exact, extension = KNOWN_RESPONSES_REQUESTS.read(body)
        prior: ItemsTranslation | None = extension.known.state if extension is not None else None
        request, appended, prior = self._validated(raw, prior)
        dropped: list[str] = []
        tools, namespaces = chat_tools(request.tools, dropped)
        translation = Translation(self.signer, namespaces)
        items: list[dict[str, Any]] = []
        if request.instructions is not None and request.previous_response_id is None:
            items.append({"role": "system", "content": request.instructions, "type": "instructions"})
            translation.add(0, {"role": "system", "content": request.instructions})
        elif request.instructions is not None:
            dropped.append("instructions (the stored turn's prompt already holds its own)")
        offset = len(items)
        leading = len(translation.messages)
        if isinstance(request.input, str):
            items.append({"type": "message", "role": "user", "content": request.input})
            translation.add(offset, {"role": "user", "content": request.input})
        else:
            items += raw["input"]
            start = 0
            if prior is not None:
                for message, position in zip(prior.messages, prior.item_of, strict=True):
                    translation.add(offset + position, message)
                translation.dropped += prior.dropped
                start = len(raw["input"]) - len(appended)
            for position, item in enumerate(appended, start):
                where, index = f"input.{position}", offset + position
                if isinstance(item, MessageItem):
                    translation.message(index, item, where)
                elif isinstance(item, FunctionCallItem):
                    translation.function_call(index, item)
                elif isinstance(item, FunctionCallOutputItem):
                    translation.output(index, item, where)
                else:
                    translation.reasoning(index, item, where)
        checkpoint = ItemsTranslation(
            tuple(translation.messages[leading:]),
            tuple(i - offset for i in translation.item_of[leading:]),
            tuple(translation.dropped),
            translation.assistant is not None,
        )
        dropped = translation.dropped + dropped
        if not translation.messages:
            raise BadRequest("the request has no item the model can read")
        chat_body: dict[str, Any] = {"model": request.model, "messages": translation.messages}
        if tools:
            chat_body["tools"] = tools
            choice = chat_tool_choice(request.tool_choice, dropped)
            if choice is not None:
                chat_body["tool_choice"] = choice
            if request.parallel_tool_calls is not None:
                chat_body["parallel_tool_calls"] = request.parallel_tool_calls
        if request.max_output_tokens is not None:
            chat_body["max_tokens"] = request.max_output_tokens
        for name in ("temperature", "top_p"):
            if getattr(request, name) is not None:
                chat_body[name] = getattr(request, name)
        form = response_format(request.text)
        if form is not None:
            chat_body["response_format"] = form
        chat_body.update(backend_extensions(raw))
        found = known_block(chat_body["messages"], leading, list(prior.chat) if prior else [])
        chat = with_known_chat(chat_body, found, walked=True) or validated(
            ChatRequest, chat_body, "responses request", bounded=True
        )
        if exact and isinstance(request.input, list):
            self._remember(body, raw, replace(checkpoint, chat=tuple(chat.messages[leading:])), extension)
        effort = request.reasoning.effort if request.reasoning is not None else None
        thinking = None if request.reasoning is None else effort not in ("none", "minimal")
        return AgentRequest(
            chat=chat,
            chat_body=chat_body,
            stream=bool(request.stream),
            items=items,
            item_of=translation.item_of,
            thinking=thinking,
            previous_response_id=request.previous_response_id,
            dropped=dropped,
            extra={
                "request": request.model_dump(
                    mode="json",
                    include={
                        "model", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
                        "temperature", "top_p", "reasoning", "text", "store", "previous_response_id", "metadata",
                    },
                ),
                "namespaces": namespaces,
                "sealed": ENCRYPTED_REASONING in (request.include or []),
            },
        )  # fmt: skip

    @staticmethod
    def _validated(
        raw: dict[str, Any], prior: ItemsTranslation | None
    ) -> tuple[ResponsesRequest, list[Any], ItemsTranslation | None]:
        """The request validated, the items to translate, and the earlier items' translation to take (None: all of
        them are translated). Only the items after the known ones are validated, unless they are refused, when the
        whole request is, for the same words as always; or unless the first of them would join the assistant
        message the known items left open (then the whole request is translated)."""
        items = raw.get("input")
        if prior is not None and isinstance(items, list):
            known = prior.count
            try:
                request = validated(ResponsesRequest, {**raw, "input": items[known:] or items[-1:]}, "")
            except BadRequest:
                request = None
            if request is not None and isinstance(request.input, list):
                appended = request.input if len(items) > known else []
                if not prior.open_run or not appended or closes_run(appended[0]):
                    return request, appended, prior
        try:
            request = validated(ResponsesRequest, raw, "responses request")
        except BadRequest as refused:
            raise unsupported_item(raw) or refused from None
        return request, request.input if isinstance(request.input, list) else [], None

    @staticmethod
    def _remember(body: bytes, raw: dict[str, Any], state: ItemsTranslation, extension: Extension | None) -> None:
        start = len(extension.known.raw_messages) if extension is not None else 0
        try:
            encodings = [orjson.dumps(item) for item in raw["input"][start:]]
        except (TypeError, orjson.JSONEncodeError):
            return
        KNOWN_RESPONSES_REQUESTS.remember(body, raw, replace(state, count=len(raw["input"])), encodings, extension)

    def reply_id(self, session_id: str | None = None) -> str | None:
        return new_reply_id(session_id)

    def responder(self, request: AgentRequest, context: ReplyContext) -> ResponsesResponder:
        return ResponsesResponder(request, context)

    def error_body(self, error: TitoError) -> bytes:
        return error_json(error.status, error.message)

    def passthrough_body(self, upstream: UpstreamPassthrough) -> bytes:
        return upstream.body

    def count_tokens_body(self, count: int) -> bytes:
        raise NotImplementedError("responses has no count_tokens route")


def error_json(status: int, message: str) -> bytes:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
