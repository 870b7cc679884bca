"""The Anthropic Messages request, as pydantic models: strict where the translation depends on a field (roles,
block types, tool ids, arguments objects), open elsewhere (unknown fields are accepted and not forwarded)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from tito_addon.canonical_chat import BoundedRequest, Number, TokenCount


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: dict[str, Any]


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: StrictStr
    # Ours are short; a foreign one (another server's) is kept as plain text, within reason.
    signature: Annotated[StrictStr, Field(max_length=65536)] | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: StrictBool | None = None


class CompactionBlock(_Block):
    """A compaction this proxy served (`compaction_items`): its summary, sealed in `encrypted_content`."""

    type: Literal["compaction"]
    content: str | None = None
    encrypted_content: Annotated[str, Field(max_length=8 * 1024 * 1024)] | None = None


ContentBlock = Annotated[
    TextBlock | ImageBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock | CompactionBlock,
    Field(discriminator="type"),
]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs a name")
        return self


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[StrictInt, Field(ge=0)] | None = None


class MessagesRequest(BoundedRequest):
    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    max_tokens: TokenCount | None = None  # required for a turn, optional for count_tokens
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    thinking: ThinkingConfig | None = None
    metadata: dict[str, Any] | None = None
    stream: StrictBool | None = None
    context_management: dict[str, Any] | None = None
