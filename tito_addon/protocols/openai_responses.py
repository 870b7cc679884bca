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
from typing import Any

from tito_addon.canonical_chat import ChatMessage
from tito_addon.protocols.agent_api import AgentRequest, ReplyContext
from tito_addon.protocols.openai_responses_models import ResponsesRequest
from tito_addon.protocols.openai_responses_reply import CompactionResponder, ResponsesResponder
from tito_addon.protocols.openai_responses_translation import (
    NAMESPACE_JOIN,
    ResponsesTranslation,
    TranslatedItems,
    closes_run,
)
from tito_addon.protocols.translated_api import TranslatedApi, TranslatedResponder
from tito_addon.protocols.turn_refs import new_id
from tito_addon.tito_errors import BadRequest, TitoError, UpstreamPassthrough

RESPONSES_PATH = re.compile(
    r"^(?:/sessions/(?P<sid>[^/?#]*))?(?P<prefix>(?:/[^?#]*)?)/v1/responses(?P<compact>/compact)?/?(?:\?.*)?$"
)
ENCRYPTED_REASONING = "reasoning.encrypted_content"
RESPONSES_ERROR_TYPES = {
    400: "invalid_request_error", 404: "invalid_request_error", 409: "invalid_request_error",
    410: "invalid_request_error",
}  # fmt: skip
# The request's fields a response object echoes back.
ECHOED_FIELDS = set(
    "model instructions tools tool_choice parallel_tool_calls max_output_tokens temperature top_p reasoning text "
    "store previous_response_id metadata".split()
)
INSTRUCTIONS_NOTE = "instructions (the stored turn's prompt already holds its own)"


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


def responses_tools(
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


def responses_tool_choice(choice: Any, dropped: list[str]) -> Any:
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


class OpenAIResponsesApi(TranslatedApi[ResponsesTranslation]):
    name = "openai_responses"
    path = RESPONSES_PATH
    request_model = ResponsesRequest
    member = "input"
    noun = "responses request"
    item_noun = "item"
    sampling = {"max_tokens": "max_output_tokens", "temperature": "temperature", "top_p": "top_p"}
    responder_type = ResponsesResponder

    def refusal(self, raw: dict[str, Any], refused: BadRequest) -> BadRequest:
        return unsupported_item(raw) or refused

    def continues(self, prior: TranslatedItems, appended: list[Any]) -> bool:
        return not prior.open_run or not appended or closes_run(appended[0])

    def begin(
        self, request: ResponsesRequest, raw: dict[str, Any]
    ) -> tuple[ResponsesTranslation, list[dict[str, Any]]]:
        translation = ResponsesTranslation(self.signer)
        translation.tools, translation.namespaces = responses_tools(request.tools, translation.notes)
        items: list[dict[str, Any]] = []
        if request.instructions is not None and request.previous_response_id is None:
            items.append({"role": "system", "content": request.instructions, "type": "instructions"})
            translation.add(0, {"role": "system", "content": request.instructions})
        elif request.instructions is not None:
            translation.notes.append(INSTRUCTIONS_NOTE)
        if isinstance(request.input, str):
            items.append({"type": "message", "role": "user", "content": request.input})
            translation.add(len(items) - 1, {"role": "user", "content": request.input})
        return translation, items

    def translate_item(self, translation: ResponsesTranslation, index: int, item: Any, where: str) -> None:
        translation.item(index, item, where)

    def resume(self, translation: ResponsesTranslation, prior: TranslatedItems, offset: int) -> list[ChatMessage]:
        translation.messages += prior.messages
        translation.item_of += [offset + position for position in prior.item_of]
        translation.dropped += prior.dropped
        return list(prior.chat)

    def reading(
        self, translation: ResponsesTranslation, chat: list[ChatMessage], leading: int, offset: int
    ) -> tuple[TranslatedItems, None]:
        return TranslatedItems(
            tuple(translation.messages[leading:]),
            tuple(i - offset for i in translation.item_of[leading:]),
            tuple(translation.dropped),
            translation.assistant is not None,
            tuple(chat),
        ), None

    def close(self, translation: ResponsesTranslation) -> None:
        if translation.trigger is not None and translation.compacts is None:
            self.serve_compaction(translation, translation.trigger[0], "compaction_trigger")

    def responder(self, request: AgentRequest, context: ReplyContext) -> TranslatedResponder:
        if request.compacts is not None:
            return CompactionResponder(request, context)
        return super().responder(request, context)

    def fill(
        self, request: ResponsesRequest, translation: ResponsesTranslation, chat_body: dict[str, Any]
    ) -> dict[str, Any]:
        tools, namespaces = translation.tools, translation.namespaces
        if tools:
            chat_body["tools"] = tools
            choice = responses_tool_choice(request.tool_choice, translation.notes)
            if choice is not None:
                chat_body["tool_choice"] = choice
            if request.parallel_tool_calls is not None:
                chat_body["parallel_tool_calls"] = request.parallel_tool_calls
        self.copy_sampling(request, chat_body)
        form = response_format(request.text)
        if form is not None:
            chat_body["response_format"] = form
        return {
            "request": request.model_dump(mode="json", include=ECHOED_FIELDS),
            "namespaces": namespaces,
            "sealed": ENCRYPTED_REASONING in (request.include or []),
        }

    def thinking(self, request: ResponsesRequest) -> bool | None:
        if request.reasoning is None:
            return None
        return request.reasoning.effort not in ("none", "minimal")

    def previous_reply(self, request: ResponsesRequest) -> str | None:
        return request.previous_response_id

    def reply_id(self, session_id: str | None = None) -> str | None:
        return new_reply_id(session_id)

    def error_status(self, error: TitoError) -> int:
        # Codex, this API's agent, retries every status but 400, 401, 429 and 5xx (`stream_max_retries` times) and
        # reads no `x-should-retry`: a final refusal is a 400 here, its `code` saying which (as OpenAI answers a
        # `previous_response_id` it cannot use).
        return 400 if error.final and 400 < error.status < 500 and error.status != 401 else error.status

    def error_body(self, error: TitoError) -> bytes:
        status = self.error_status(error)
        kind = RESPONSES_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        code = error.error_type if status != error.status else None
        return json.dumps({"error": {"message": error.message, "type": kind, "param": None, "code": code}}).encode()

    @staticmethod
    def error_json(status: int, message: str) -> bytes:
        kind = RESPONSES_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()

    def passthrough_body(self, upstream: UpstreamPassthrough) -> bytes:
        return upstream.body

    def count_tokens_body(self, count: int) -> bytes:
        raise NotImplementedError("responses has no count_tokens route")
