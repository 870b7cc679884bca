"""Pydantic models of the OpenAI chat-completion shapes the addon reads and writes.

Inputs are validated strictly where the token engine depends on a field (roles, content, tool calls) and
leniently elsewhere: unknown request fields are kept and forwarded, because agents and backends use
many extensions (sglang sampling fields, `chat_template_kwargs`, ...).
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Role = Literal["system", "user", "assistant", "tool"]

MAX_SESSION_ID = 200
_ID_SEGMENTS = re.compile(r"[/\\]")


def session_id_problem(value: str) -> str | None:
    """Why a client-supplied session id is refused, or None when it is acceptable.

    Ids are never joined into a path (the recorder maps them to a safe name), but an id that looks like a path
    traversal or carries control characters is a client bug or an attack: refusing it keeps such values out of
    files, logs and `tito.sessions` altogether. Ordinary ids (unicode, spaces, `team/run-1`) stay accepted.
    """
    if not value:
        return "it is empty"
    if len(value) > MAX_SESSION_ID:
        return f"it is longer than {MAX_SESSION_ID} characters"
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in value):
        return "it contains a control character"
    if value[0] in "/\\":
        return "it starts with a path separator"
    if ".." in _ID_SEGMENTS.split(value):
        return "it contains a '..' path segment"
    return None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: str = "function"
    index: int | None = None
    function: FunctionCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a chat request, as agents send it."""

    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _reject_non_text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError("only text content parts are supported (no images, audio or files)")
        return value

    def text(self) -> str | None:
        """Content as one string: text parts are joined with newlines, as vLLM and sglang do."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content

    def reasoning_text(self) -> str | None:
        """The one logical reasoning value: `reasoning_content` and `reasoning` are two spellings of it."""
        for value in (self.reasoning_content, self.reasoning):
            if value:
                return value
        return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = None


class ChatRequest(BaseModel):
    """An agent's chat-completion request. Fields the engine does not need pass through untouched."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    n: int | None = None

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
