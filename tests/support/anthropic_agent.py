"""What an Anthropic Messages agent (the anthropic SDK's user, Claude Code's shape) sends: its tools, the assistant
message it echoes back and the tool results it answers with."""

from __future__ import annotations

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {
        "name": "get_time",
        "description": "Local time in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
]


def echo(message) -> dict:
    """The assistant message as the SDK user sends it back: its content blocks, verbatim."""
    return {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]}


def tool_results(message) -> dict:
    blocks = [
        {"type": "tool_result", "tool_use_id": block.id, "content": f"{block.input['city']}: 21 C, sunny"}
        for block in message.content
        if block.type == "tool_use"
    ]
    return {"role": "user", "content": blocks}
