"""Builds the assistant message a streaming client ends up with from `chat.completion.chunk` deltas.

The record of a streamed turn stores this message, so it is exactly what the agent accumulated.
"""

from __future__ import annotations

from typing import Any

TEXT_KEYS = ("content", "reasoning_content", "reasoning")


class MessageAccumulator:
    def __init__(self) -> None:
        self.role = "assistant"
        self.text: dict[str, str] = {}
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None

    def add_chunk(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            for key in TEXT_KEYS:
                value = delta.get(key)
                if isinstance(value, str) and value:
                    self.text[key] = self.text.get(key, "") + value
            for call in delta.get("tool_calls") or []:
                slot = self.calls.setdefault(
                    int(call.get("index", len(self.calls))),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if call.get("id"):
                    slot["id"] = call["id"]
                function = call.get("function") or {}
                if function.get("name"):
                    slot["function"]["name"] += function["name"]
                if function.get("arguments"):
                    slot["function"]["arguments"] += function["arguments"]
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text.get("content")}
        for key in ("reasoning_content", "reasoning"):
            if key in self.text:
                message[key] = self.text[key]
        if self.calls:
            message["tool_calls"] = [self.calls[index] for index in sorted(self.calls)]
        return message


def clean_delta_chunk(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """The chunk with null-valued delta keys dropped; None when it carries nothing for the agent."""
    choices = []
    for choice in chunk.get("choices") or []:
        delta = {k: v for k, v in (choice.get("delta") or {}).items() if v is not None and v != ""}
        if not delta and not choice.get("finish_reason") and not choice.get("logprobs"):
            continue
        choices.append({**choice, "delta": delta})
    if not choices and not chunk.get("usage"):
        return None
    return {**chunk, "choices": choices}
