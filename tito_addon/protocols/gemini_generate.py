"""The Gemini API (`POST …/v1beta/models/{model}:generateContent`, `:streamGenerateContent`, `:countTokens`; also
`v1`), Gemini CLI's only API, translated to and from the canonical form.

The model and whether to stream are the path's: `{model}` is any name (Gemini CLI sends side calls under aliases
such as `flash-lite`), recorded as asked and served by the backend's model; `streamGenerateContent` streams (SSE
`data:` events whatever `alt` says, no `[DONE]`).

Request -> canonical chat messages:
- `systemInstruction`'s text parts are the first system message.
- A user content's `functionResponse` parts become tool messages, in order (a `response` that is one `output`,
  `result`, `content` or `error` string alone is that text, any other its JSON), then its text parts one user
  message. `role: "function"` (the older name) is a user content. A response without an id takes the id of the
  call at its place in the model content before it, when that call has its name. A response repeating an earlier
  one of its content exactly, id included (a resumed Gemini CLI session sends each twice), is left out and noted; a
  different response under an id already answered is refused (400).
- A model content: thought parts (`thought: true`) are its reasoning, other text parts its content (joined as they
  were streamed), `functionCall` parts its tool calls (id, name, `args` as the arguments object; a call without an
  id, as pi echoes them, gets back the one the proxy gave it, made from the reply id its content's signature names,
  else it is named `NAME#POSITION`). A `thoughtSignature` this proxy minted (on any part: clients move them) seals
  the turn's exact reasoning, which is then the message's reasoning even when the client dropped the thought parts;
  Gemini CLI's placeholder `skip_thought_signature_validator` is no signature, and a foreign one is read as nothing
  (the record says so), never a failure.
- Media parts (`inlineData`, `fileData`) and hosted-tool output are refused (400): no served model family reads
  them. Function declarations become chat functions (`parametersJsonSchema` as it is, `parameters`' OpenAPI types
  lowercased into JSON Schema); hosted tools (`googleSearch`, `codeExecution`, …) are left out and noted.
- `generationConfig`: `temperature`, `topP`, `topK`, `maxOutputTokens`, `stopSequences`, `seed` and the penalties as
  the chat fields; `responseMimeType: application/json` with `responseJsonSchema` (or `responseSchema`) as the
  backend's structured output; `candidateCount` 1 only; `thinkingConfig` as the family's thinking switch
  (`thinkingBudget: 0` off, another budget or a level on). `toolConfig.functionCallingConfig` modes as tool choice.

Reply: `gemini_reply`. Errors are Google's shape, `{"error": {code, message, status}}`.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

import orjson

from tito_addon.protocols.agent_api import AgentRequest, Route
from tito_addon.protocols.gemini_models import (
    Content,
    FunctionCallingConfig,
    GenerateContentRequest,
    GenerationConfig,
    Tool,
)
from tito_addon.protocols.gemini_reply import GeminiResponder, error_payload
from tito_addon.protocols.gemini_translation import ContentsTranslation, translate_content
from tito_addon.protocols.json_body import parse_json_object
from tito_addon.protocols.translated_api import ItemTranslation, TranslatedApi, passthrough_message
from tito_addon.protocols.turn_refs import new_id
from tito_addon.tito_errors import BadRequest, UpstreamPassthrough

GEMINI_PATH = re.compile(
    r"^(?:/sessions/(?P<sid>[^/?#]*))?(?P<prefix>(?:/[^?#]*)?)/(?:v1beta|v1alpha|v1)/models/(?P<model>[^/:?#]+)"
    r":(?P<method>generateContent|streamGenerateContent|countTokens)/?(?:\?.*)?$"
)
SAMPLING = {"temperature": "temperature", "top_p": "topP", "top_k": "topK", "max_tokens": "maxOutputTokens",
            "seed": "seed", "presence_penalty": "presencePenalty", "frequency_penalty": "frequencyPenalty"}  # fmt: skip


def json_schema(schema: Any) -> Any:
    """A function declaration's `parameters` (an OpenAPI subset with upper-case type names, as the google-genai SDK
    writes them) as the JSON Schema a chat template shows."""
    if isinstance(schema, list):
        return [json_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            out[key] = value.lower()
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: json_schema(inner) for name, inner in value.items()}
        elif key in ("items", "anyOf", "oneOf", "allOf", "prefixItems", "additionalProperties"):
            out[key] = json_schema(value)
        else:
            out[key] = value
    return out


def gemini_tools(tools: list[Tool] | None, dropped: list[str]) -> list[dict[str, Any]] | None:
    """Function declarations as chat functions; hosted tools the backend cannot run are left out and noted."""
    out = []
    for position, tool in enumerate(tools or []):
        for declaration in tool.functionDeclarations or []:
            schema = declaration.parametersJsonSchema
            if schema is None:
                schema = json_schema(declaration.parameters) if declaration.parameters is not None else None
            function: dict[str, Any] = {"name": declaration.name, "parameters": schema or {"type": "object"}}
            if declaration.description is not None:
                function["description"] = declaration.description
            out.append({"type": "function", "function": function})
        hosted = [name for name in tool.model_extra or {} if name != "functionDeclarations"]
        for name in hosted:
            dropped.append(f"tools.{position}.{name} (a hosted tool the backend cannot run)")
    return out or None


def tool_choice(config: FunctionCallingConfig | None, dropped: list[str]) -> Any:
    if config is None or config.mode in (None, "AUTO", "VALIDATED", "MODE_UNSPECIFIED"):
        return None
    if config.mode == "NONE":
        return "none"
    allowed = config.allowedFunctionNames or []
    if len(allowed) == 1:
        return {"type": "function", "function": {"name": allowed[0]}}
    if allowed:
        dropped.append("toolConfig.functionCallingConfig.allowedFunctionNames (served as: any of the tools)")
    return "required"


def response_format(config: GenerationConfig) -> dict[str, Any] | None:
    kind = (config.responseMimeType or "text/plain").lower()
    if kind == "text/plain":
        return None
    if kind != "application/json":
        raise BadRequest(f"generationConfig.responseMimeType {config.responseMimeType!r} is not served (text/plain "
                         "or application/json); nothing was forwarded")  # fmt: skip
    schema = config.responseJsonSchema
    if schema is None and config.responseSchema is not None:
        schema = json_schema(config.responseSchema)
    if schema is None:
        return {"type": "json_object"}
    if not isinstance(schema, dict):
        raise BadRequest("generationConfig.responseJsonSchema must be a JSON Schema object; nothing was forwarded")
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


class GeminiApi(TranslatedApi[ContentsTranslation]):
    name = "gemini"
    path = GEMINI_PATH
    request_model = GenerateContentRequest
    member = "contents"
    noun = "generateContent request"
    item_noun = "content"
    responder_type = GeminiResponder

    def route(self, path: str) -> Route | None:
        match = self.path.match(path)
        if match is None:
            return None
        method = match.group("method")
        action = "count_tokens" if method == "countTokens" else "turn"
        model = unquote(match.group("model"))
        chat_path = match.group("prefix") + "/v1/chat/completions"
        return Route(self, action, match.group("sid"), chat_path, model=model, stream=method == "streamGenerateContent")

    def parse(self, body: bytes, action: str = "turn", route: Route | None = None) -> AgentRequest:
        if action == "count_tokens":
            # countTokens takes the contents alone, or a whole request wrapped in `generateContentRequest`.
            raw = parse_json_object(body)
            inner = raw.get("generateContentRequest")
            if inner is not None:
                if not isinstance(inner, dict) or len(raw) != 1:
                    raise BadRequest("invalid countTokens request: generateContentRequest is an object, alone")
                body = orjson.dumps(inner)
        return super().parse(body, action, route)

    def model_name(self, request: GenerateContentRequest, route: Route | None) -> str | None:
        if route is not None and route.model:
            return route.model
        return request.model.removeprefix("models/") if request.model else None

    def streams(self, request: GenerateContentRequest, route: Route | None) -> bool:
        return route is not None and route.stream

    def check(self, request: GenerateContentRequest, action: str) -> None:
        if request.cachedContent is not None:
            raise BadRequest("cachedContent names a cache this proxy does not hold: send the contents; nothing was "
                             "forwarded")  # fmt: skip

    def begin(
        self, request: GenerateContentRequest, raw: dict[str, Any]
    ) -> tuple[ContentsTranslation, list[dict[str, Any]]]:
        translation = ContentsTranslation(self.signer)
        if request.systemInstruction is None:
            return translation, []
        translation.system(0, request.systemInstruction.parts)
        return translation, [{"role": "system", "parts": raw["systemInstruction"].get("parts")}]

    def translate_one(self, item: Content, where: str) -> ItemTranslation:
        return translate_content(self.signer, item, where)

    def translate_item(self, translation: ContentsTranslation, index: int, item: Content, where: str) -> None:
        # A user content's responses without ids answer the calls of the model content before it (the last message
        # so far): the same for every request that holds both, so the reading kept for this one stays true.
        last = translation.messages[-1] if translation.messages and item.role != "model" else {}
        calls = tuple((c["id"], c["function"]["name"]) for c in last.get("tool_calls") or ())
        translation.take(index, (translate_content(self.signer, item, where, calls),))

    def fill(
        self, request: GenerateContentRequest, translation: ContentsTranslation, chat_body: dict[str, Any]
    ) -> dict[str, Any]:
        tools = gemini_tools(request.tools, translation.notes)
        config = request.toolConfig.functionCallingConfig if request.toolConfig is not None else None
        if tools:
            chat_body["tools"] = tools
            choice = tool_choice(config, translation.notes)
            if choice is not None:
                chat_body["tool_choice"] = choice
        generation = request.generationConfig or GenerationConfig()
        for chat_name, name in SAMPLING.items():
            value = getattr(generation, name)
            if value is not None:
                chat_body[chat_name] = value
        if generation.stopSequences:
            chat_body["stop"] = list(generation.stopSequences)
        form = response_format(generation)
        if form is not None:
            chat_body["response_format"] = form
        thinking = generation.thinkingConfig
        include = bool(thinking is not None and thinking.includeThoughts)
        return {"model": chat_body.get("model") or "", "include_thoughts": include}

    def thinking(self, request: GenerateContentRequest) -> bool | None:
        config = request.generationConfig.thinkingConfig if request.generationConfig is not None else None
        if config is None:
            return None
        if config.thinkingBudget is not None:
            return config.thinkingBudget != 0
        return True if config.thinkingLevel is not None else None

    def reply_id(self, session_id: str | None = None) -> str | None:
        return new_id("")

    @staticmethod
    def error_json(status: int, message: str) -> bytes:
        return json.dumps(error_payload(status, message), ensure_ascii=False).encode()

    def passthrough_body(self, upstream: UpstreamPassthrough) -> bytes:
        return self.error_json(upstream.status, passthrough_message(upstream))

    def count_tokens_body(self, count: int) -> bytes:
        return json.dumps({"totalTokens": count, "promptTokensDetails": [{"modality": "TEXT", "tokenCount": count}]}
                          ).encode()  # fmt: skip
