"""The OpenAI Responses request, as pydantic models: strict where the translation depends on a field (item types,
roles, call ids, argument strings), open elsewhere (unknown fields are accepted and not forwarded)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from tito_addon.canonical_chat import BoundedRequest, Number, TokenCount


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Open):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: StrictStr


class RefusalPart(_Open):
    type: Literal["refusal"]
    refusal: StrictStr


class MediaPart(_Open):
    type: Literal["input_image", "input_file", "input_audio"]


Part = Annotated[TextPart | RefusalPart | MediaPart, Field(discriminator="type")]


class MessageItem(_Open):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[Part]
    id: str | None = None


class FunctionCallItem(_Open):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1)
    arguments: StrictStr
    namespace: str | None = None
    id: str | None = None


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: StrictStr | list[Part]
    id: str | None = None


class ReasoningItem(_Open):
    type: Literal["reasoning"]
    summary: list[TextPart] = Field(default_factory=list)
    content: list[TextPart] | None = None
    # Ours carry the reasoning text (compressed); a foreign one is left out of the prompt, within reason.
    encrypted_content: Annotated[StrictStr, Field(max_length=8 * 1024 * 1024)] | None = None
    id: str | None = None


class CompactionItem(_Open):
    """A compaction this proxy served: its `encrypted_content` seals the summary (see `compaction_items`)."""

    type: Literal["compaction"]
    encrypted_content: Annotated[StrictStr, Field(min_length=1, max_length=8 * 1024 * 1024)]
    id: str | None = None


class CompactionTriggerItem(_Open):
    """The last item of a request that asks the server to compact the conversation before it."""

    type: Literal["compaction_trigger"]
    id: str | None = None


Item = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | CompactionItem | CompactionTriggerItem,
    Field(discriminator="type"),
]


class ReasoningConfig(_Open):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(BoundedRequest):
    model: str = Field(min_length=1)
    input: StrictStr | list[Item]
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: TokenCount | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    reasoning: ReasoningConfig | None = None
    text: dict[str, Any] | None = None
    store: StrictBool | None = None
    include: list[StrictStr] | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=1024)
    stream: StrictBool | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _easy_messages(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("input"), list):
            # An item may leave out `type`: {role, content} is a message (the API's "easy input message").
            value = dict(value)
            value["input"] = [
                {**item, "type": "message"}
                if isinstance(item, dict) and "type" not in item and "role" in item
                else item
                for item in value["input"]
            ]
        return value


def _typed(item: Any) -> Any:
    if isinstance(item, dict) and "type" not in item and "role" in item:
        return {**item, "type": "message"}
    return item
