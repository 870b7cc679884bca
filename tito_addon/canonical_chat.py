"""The canonical chat form: the request, messages and assistant message every layer speaks.

It is the OpenAI chat-completion shape, because that is what the backends take upstream (sglang and vLLM read
an OpenAI chat body alongside the prompt ids) and what the token engine renders; every agent-facing protocol is
translated into it. It lives at the ground, beside the errors, so that the engine, the session tree, the records
and the backends can all use it without importing a protocol.

Inputs are validated strictly where the token engine depends on a field (roles, content, tool calls) and
leniently elsewhere: unknown request fields are kept and forwarded, because agents and backends use
many extensions (sglang sampling fields, `chat_template_kwargs`, ...). The typed fields are strict (no
`"stream": "yes"`, no `"n": "1"`) and the whole body is bounded (nesting, non-finite numbers, lone surrogates),
so what reaches a backend is always a request the backend's own parser would accept as JSON.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tito_addon.chat_images import ImagePart, ImageRefused, image_part

Role = Literal["system", "user", "assistant", "tool"]

#: JSON nesting a request may use; real ones (messages -> tool call -> arguments, tool schemas) stay far below.
MAX_JSON_DEPTH = 100
Number = StrictInt | StrictFloat
TokenCount = Annotated[StrictInt, Field(ge=1, le=2**31 - 1)]
Seed = Annotated[StrictInt, Field(ge=-(2**63), le=2**64 - 1)]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    id: str | None = None
    type: str = "function"
    index: int | None = None
    function: FunctionCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["text"]
    text: str


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One message of a chat request, as agents send it. Frozen: a validated message is shared by every later
    request that re-sends it (`protocols/known_messages.py`)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    # The message's session key once computed (`sessions.message_keys.message_key`): a message is keyed once,
    # however many later turns re-send it.
    _key: bytes | None = PrivateAttr(default=None)

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> ChatMessage:
        copy = super().model_copy(update=update, deep=deep)
        if update:
            copy._key = None  # another message: keyed anew
        return copy

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, value: Any, info: ValidationInfo) -> Any:
        """Text parts, and images as OpenAI chat sends them (`image_url`, decoded here once). An `image` part that
        names an image without its bytes is a record's, read back: an agent's image must carry its data."""
        if not isinstance(value, list):
            return value
        parts = []
        for part in value:
            if isinstance(part, TextPart | ImagePart):
                parts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append(part)
            elif kind == "image_url":
                try:
                    parts.append(image_part(part))
                except ImageRefused as exc:
                    raise ValueError(str(exc)) from None
            elif kind == "image" and info.context and info.context.get("recorded"):
                parts.append(part)
            else:
                raise ValueError(
                    f"content part of type {kind!r} is not supported: text and images (image_url with a data: URL) "
                    "are; audio and files are not"
                )
        return parts

    def images(self) -> list[ImagePart]:
        """Its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part for part in self.content if part.type == "image"]

    def text(self) -> str | None:
        """Content as one string: text parts are joined with newlines, as vLLM and sglang do."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content if part.type == "text")
        return self.content

    def reasoning_text(self) -> str | None:
        """The one logical reasoning value: `reasoning_content` and `reasoning` are two spellings of it."""
        for value in (self.reasoning_content, self.reasoning):
            if value:
                return value
        return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = None


def json_value_problem(value: Any) -> str | None:
    """Why a parsed JSON body cannot be forwarded, or None: too deep, a non-finite number (`1e400` parses to
    inf), or a string with a lone surrogate (`"\\ud800"`), which no UTF-8 encoder will write."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if depth > MAX_JSON_DEPTH:
                return f"it is nested deeper than {MAX_JSON_DEPTH} levels"
            for key, child in item.items():
                if isinstance(key, str) and not key.isascii() and _has_surrogate(key):
                    return "a key is not valid Unicode (lone surrogate)"
                stack.append((child, depth + 1))
        elif isinstance(item, list):
            if depth > MAX_JSON_DEPTH:
                return f"it is nested deeper than {MAX_JSON_DEPTH} levels"
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                return "a number is not finite"
        elif isinstance(item, str) and not item.isascii() and _has_surrogate(item):
            return "a string is not valid Unicode (lone surrogate)"
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class BoundedRequest(BaseModel):
    """A request body that can be forwarded as JSON: refused when too deep, non-finite or not valid Unicode."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _bounded_json(cls, value: Any, info: ValidationInfo) -> Any:
        if info.context and info.context.get("bounded"):
            return value  # built from values that were checked already (a translated request): walk it once only
        problem = json_value_problem(value)
        if problem is not None:
            raise ValueError(f"request body cannot be forwarded: {problem}")
        return value


class ChatRequest(BoundedRequest):
    """An agent's chat-completion request. Fields the engine does not need pass through untouched."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    n: StrictInt | None = None
    # Typed so that a wrong type is our 400, not a request the backend has to refuse; values pass through as sent.
    temperature: Number | None = None
    top_p: Number | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    seed: Seed | None = None

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("n must be 1: each sample is its own request, so each can be its own branch")
        return value

    @field_validator("tools")
    @classmethod
    def _tools_are_functions(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in value or []:
            function = tool.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError("each tool must be {type: 'function', function: {name, ...}}")
        return value


class AssistantMessage(BaseModel):
    """The assistant message a backend returned (sglang or vLLM dialect)."""

    model_config = ConfigDict(extra="allow")

    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None

    def has_output(self) -> bool:
        return bool(self.content) or bool(self.tool_calls) or bool(self.reasoning_content or self.reasoning)


def parse_arguments(arguments: str | dict[str, Any]) -> Any:
    """Tool-call arguments as a JSON value; a string that is not JSON stays a string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
