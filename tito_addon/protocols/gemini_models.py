"""The Gemini API request (`generateContent`, `streamGenerateContent`, `countTokens`), as pydantic models: strict
where the translation depends on a field (roles, which kind of part, call names, argument objects, the sampling
numbers), open elsewhere (unknown fields are accepted and not forwarded). Field names are the API's camelCase."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from tito_addon.canonical_chat import BoundedRequest, Number, Seed, TokenCount

# What a thought signature may weigh: ours seal the reasoning (compressed); a foreign one is read as nothing.
MAX_SIGNATURE = 8 * 1024 * 1024


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", lambda m: "_" + m.group(1).lower(), name)


class ProtoNames:
    """Google's JSON parser takes a field by its proto name as well as its camelCase one (the google-genai SDK sends
    `thinkingConfig: {include_thoughts: true}`): the proto name is read as the camelCase field; both at once are
    refused, as a duplicate field."""

    @model_validator(mode="before")
    @classmethod
    def _proto_names(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        names = _PROTO_NAMES.get(cls)  # type: ignore[call-overload]
        if names is None:
            fields = cls.model_fields  # type: ignore[attr-defined]
            names = _PROTO_NAMES[cls] = {_snake(n): n for n in fields if _snake(n) != n}  # type: ignore[index]
        if not any(key in names for key in value):
            return value
        out: dict[str, Any] = {}
        for key, item in value.items():
            name = names.get(key, key)
            if name in out:
                raise ValueError(f"{key} and {name} are one field, given twice")
            out[name] = item
        return out


_PROTO_NAMES: dict[type, dict[str, str]] = {}


class _Open(ProtoNames, BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Open):
    id: Annotated[StrictStr, Field(max_length=256)] | None = None
    name: StrictStr = Field(min_length=1)
    args: dict[str, Any] | None = None


# A part's members that are media by reference or hosted-tool output: nothing the proxy can read, so each is refused.
MEDIA_MEMBERS = ("fileData", "executableCode", "codeExecutionResult", "videoMetadata")
KINDS = ("text", "functionCall", "functionResponse", "inlineData")


class InlineData(_Open):
    """An image inline: its media type and base64 bytes (standard or URL-safe)."""

    mimeType: StrictStr  # noqa: N815
    data: StrictStr


def _media_refused(value: dict[str, Any]) -> None:
    given = {name for name in value if value[name] is not None}
    media = [name for name in MEDIA_MEMBERS if name in given or _snake(name) in given]
    if media:
        reason = "given by reference (send it inline)" if media[0] == "fileData" else "not read by the proxy"
        raise ValueError(f"a {media[0]} part: {reason}; nothing was forwarded")


class FunctionResponsePart(_Open):
    """A part of a function response (Gemini 3's multimodal results): an image inline."""

    inlineData: InlineData  # noqa: N815

    @model_validator(mode="before")
    @classmethod
    def _inline_only(cls, value: Any) -> Any:
        if isinstance(value, dict):
            _media_refused(value)
        return value


class FunctionResponse(_Open):
    id: Annotated[StrictStr, Field(max_length=256)] | None = None
    name: StrictStr = Field(min_length=1)
    response: dict[str, Any] | None = None
    parts: list[FunctionResponsePart] | None = None


class Part(_Open):
    """One part: exactly one of text, functionCall, functionResponse or inlineData (other media refused by name)."""

    text: StrictStr | None = None
    thought: StrictBool | None = None
    thoughtSignature: Annotated[StrictStr, Field(max_length=MAX_SIGNATURE)] | None = None  # noqa: N815
    functionCall: FunctionCall | None = None  # noqa: N815
    functionResponse: FunctionResponse | None = None  # noqa: N815
    inlineData: InlineData | None = None  # noqa: N815

    @model_validator(mode="before")
    @classmethod
    def _one_kind(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        _media_refused(value)
        given = {name for name in value if value[name] is not None}
        kinds = [n for n in KINDS if n in given or _snake(n) in given]
        if len(kinds) != 1:
            raise ValueError("a part holds exactly one of text, functionCall, functionResponse or inlineData")
        return value


class Content(_Open):
    # The API lets a single-turn request leave the role out (a user's); `function` is the older name of the role
    # that carries function responses.
    role: Literal["user", "model", "function"] | None = None
    parts: list[Part] = Field(min_length=1)


class SystemInstruction(_Open):
    role: StrictStr | None = None
    parts: list[Part] = Field(min_length=1)


class FunctionDeclaration(_Open):
    name: StrictStr = Field(min_length=1, max_length=256)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    parametersJsonSchema: dict[str, Any] | None = None  # noqa: N815


class Tool(_Open):
    functionDeclarations: list[FunctionDeclaration] | None = None  # noqa: N815


class FunctionCallingConfig(_Open):
    mode: Literal["AUTO", "ANY", "NONE", "VALIDATED", "MODE_UNSPECIFIED"] | None = None
    allowedFunctionNames: list[StrictStr] | None = None  # noqa: N815


class ToolConfig(_Open):
    functionCallingConfig: FunctionCallingConfig | None = None  # noqa: N815


class ThinkingConfig(_Open):
    includeThoughts: StrictBool | None = None  # noqa: N815
    thinkingBudget: StrictInt | None = None  # noqa: N815
    thinkingLevel: StrictStr | None = None  # noqa: N815


class GenerationConfig(_Open):
    temperature: Number | None = None
    topP: Number | None = None  # noqa: N815
    topK: Annotated[Number, Field(ge=0)] | None = None  # noqa: N815
    maxOutputTokens: TokenCount | None = None  # noqa: N815
    stopSequences: list[StrictStr] | None = None  # noqa: N815
    candidateCount: StrictInt | None = None  # noqa: N815
    seed: Seed | None = None
    presencePenalty: Number | None = None  # noqa: N815
    frequencyPenalty: Number | None = None  # noqa: N815
    responseMimeType: StrictStr | None = None  # noqa: N815
    responseSchema: dict[str, Any] | None = None  # noqa: N815
    responseJsonSchema: Any = None  # noqa: N815
    responseModalities: list[StrictStr] | None = None  # noqa: N815
    thinkingConfig: ThinkingConfig | None = None  # noqa: N815

    @model_validator(mode="after")
    def _one_candidate(self) -> GenerationConfig:
        if self.candidateCount is not None and self.candidateCount != 1:
            raise ValueError("candidateCount must be 1: each sample is its own request, so each can be its own branch")
        if self.responseModalities is not None and any(m.upper() != "TEXT" for m in self.responseModalities):
            raise ValueError("responseModalities: the served model family answers TEXT only")
        return self


class GenerateContentRequest(ProtoNames, BoundedRequest):
    contents: list[Content] = Field(min_length=1)
    systemInstruction: SystemInstruction | None = None  # noqa: N815
    tools: list[Tool] | None = None
    toolConfig: ToolConfig | None = None  # noqa: N815
    generationConfig: GenerationConfig | None = None  # noqa: N815
    safetySettings: list[Any] | None = None  # noqa: N815
    cachedContent: StrictStr | None = None  # noqa: N815
    model: StrictStr | None = None  # countTokens' generateContentRequest names it; the path's wins
