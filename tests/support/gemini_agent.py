"""What a Gemini API agent (the google-genai SDK's user, Gemini CLI's shape) sends: its tool, its thinking config, the
function responses it answers with, and the model Gemini CLI's compression requests name."""

from __future__ import annotations

from google.genai import types

WEATHER = types.FunctionDeclaration(
    name="get_weather",
    description="Current weather for a city.",
    parameters_json_schema={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TOOLS = [types.Tool(function_declarations=[WEATHER])]
THOUGHTS = types.ThinkingConfig(include_thoughts=True)
# The model its compression requests name whatever `-m` says: their alias (chat-compression-default) resolves to it.
COMPRESSION_MODEL = "gemini-3.1-pro-preview-customtools"


def results(content: types.Content) -> types.Content:
    parts = [
        types.Part.from_function_response(name=p.function_call.name, response={"output": "Paris: 21 C, sunny"})
        for p in content.parts or []
        if p.function_call is not None
    ]
    for part, call in zip(parts, [p.function_call for p in content.parts if p.function_call], strict=True):
        part.function_response.id = call.id
    return types.Content(role="user", parts=parts)
