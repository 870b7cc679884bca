"""The message dicts a chat template sees, made from canonical chat messages.

Templates differ in what they read (a string or parts, arguments as text or as objects, `reasoning_content` or
`reasoning`), so every render in the package goes through this one shape.
"""

from __future__ import annotations

from typing import Any

from tito_addon.canonical_chat import ChatMessage, parse_arguments


def template_message(message: ChatMessage) -> dict[str, Any]:
    """The dict a chat template sees: content as a string (as parts where it holds images, each image a bare
    `{"type": "image"}` the vision-language templates render as their placeholder), arguments parsed, reasoning under
    one key."""
    content: Any = message.text() or ""
    if isinstance(message.content, list) and message.images():
        content = [
            {"type": "text", "text": part.text} if part.type == "text" else {"type": "image"}
            for part in message.content
        ]
    rendered: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": parse_arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    reasoning = message.reasoning_text()
    if reasoning is not None and message.role == "assistant":
        rendered["reasoning_content"] = reasoning
    return rendered
