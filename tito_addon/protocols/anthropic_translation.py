"""Anthropic Messages' messages as canonical chat messages, one native message at a time (the rules are in
`anthropic_messages`), and the memo that lets a turn translate only the messages its agent appended.

A native message's translation depends on that message and its position alone (the position names it in what
the record says was left out), so a request that extends one read before (`known_requests`: the same bytes up to
the end of its messages) reuses the earlier messages' translations, validated chat messages included. The one
thing that depends on the rest is which thinking signatures are checked (those of the newest assistant message
with blocks): each translation keeps its own, and the request takes the newest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tito_addon.canonical_chat import ChatMessage
from tito_addon.protocols.anthropic_models import (
    ImageBlock,
    MessageParam,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from tito_addon.protocols.known_messages import DEFAULT_BUDGET_BYTES
from tito_addon.protocols.known_requests import KnownRequests
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.tito_errors import BadRequest

BILLING_PREFIX = "x-anthropic-billing-header"
# Requests read before, each with its messages' translations (`MessageTranslation`, one per native message).
KNOWN_ANTHROPIC_REQUESTS = KnownRequests(DEFAULT_BUDGET_BYTES)


@dataclass(frozen=True, slots=True)
class MessageTranslation:
    """What one native message becomes: its canonical messages, what of it the prompt leaves out, its thinking
    signatures (None: not an assistant message with blocks, so it leaves the newest ones as they were), and the
    canonical messages validated (filled once the request's chat form is)."""

    messages: tuple[dict[str, Any], ...]
    dropped: tuple[str, ...]
    signatures: tuple[tuple[str, str, str], ...] | None
    chat: tuple[ChatMessage, ...] = ()


def translate_message(signer: TurnSigner | None, position: int, message: MessageParam) -> MessageTranslation:
    translation = Translation(signer)
    where = f"messages.{position}"
    if message.role == "system":
        content = message.content
        if not isinstance(content, str) and not all(isinstance(b, TextBlock) for b in content):
            raise BadRequest(f"{where}: a system message holds only text")
        translation.system(0, content, where)  # type: ignore[arg-type]
    elif message.role == "user":
        translation.user(0, message.content, where)
    else:
        translation.assistant(0, message.content, where)
    blocks = message.role == "assistant" and not isinstance(message.content, str)
    return MessageTranslation(
        tuple(translation.messages), tuple(translation.dropped), tuple(translation.signatures) if blocks else None
    )


def _text_of(blocks: list[TextBlock]) -> list[dict[str, str]]:
    return [{"type": "text", "text": block.text} for block in blocks]


def _no_images(blocks: list[Any], where: str) -> None:
    if any(isinstance(block, ImageBlock) for block in blocks):
        raise BadRequest(f"{where} holds an image: the served model family reads text only; nothing was forwarded")


class Translation:
    """One request's canonical messages, with the native item each came from and what the prompt leaves out."""

    def __init__(self, signer: TurnSigner | None) -> None:
        self.signer = signer
        self.messages: list[dict[str, Any]] = []
        self.item_of: list[int] = []
        self.dropped: list[str] = []
        self.signatures: list[tuple[str, str, str]] = []  # (where, signature, thinking) of the last assistant message

    def add(self, item: int, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self.item_of.append(item)

    def system(self, item: int, content: str | list[TextBlock], where: str) -> None:
        if isinstance(content, str):
            if not content.startswith(BILLING_PREFIX):
                self.add(item, {"role": "system", "content": content})
            return
        kept = [block for block in content if not block.text.startswith(BILLING_PREFIX)]
        if len(kept) < len(content):
            self.dropped.append(f"{where}: the {BILLING_PREFIX} block")
        if kept:
            self.add(item, {"role": "system", "content": _text_of(kept)})

    def user(self, item: int, content: str | list[Any], where: str) -> None:
        if isinstance(content, str):
            self.add(item, {"role": "user", "content": content})
            return
        _no_images(content, where)
        texts: list[TextBlock] = []
        for block in content:
            if isinstance(block, ToolResultBlock):
                result = block.content
                if isinstance(result, list):
                    _no_images(result, f"{where} tool_result {block.tool_use_id}")
                    result = "\n".join(part.text for part in result)
                self.add(item, {"role": "tool", "tool_call_id": block.tool_use_id, "content": result or ""})
            elif isinstance(block, TextBlock):
                texts.append(block)
            else:
                raise BadRequest(f"{where}: a user message cannot hold a {block.type} block")
        if texts:
            self.add(item, {"role": "user", "content": _text_of(texts)})

    def assistant(self, item: int, content: str | list[Any], where: str) -> None:
        if isinstance(content, str):
            self.add(item, {"role": "assistant", "content": content})
            return
        _no_images(content, where)
        self.signatures = []  # only the newest assistant message is checked: older ones were, on earlier turns
        thinking: list[str] = []
        texts: list[TextBlock] = []
        calls: list[dict[str, Any]] = []
        for block in content:
            if isinstance(block, ThinkingBlock):
                thinking.append(block.thinking)
                if block.signature and self.signer is not None:
                    self.signatures.append((where, block.signature, block.thinking))
            elif isinstance(block, RedactedThinkingBlock):
                self.dropped.append(f"{where}: a redacted_thinking block (unreadable, left out of the prompt)")
            elif isinstance(block, TextBlock):
                texts.append(block)
            elif isinstance(block, ToolUseBlock):
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": arguments_text(block.input)},
                    }
                )
            else:
                raise BadRequest(f"{where}: an assistant message cannot hold a {block.type} block")
        message: dict[str, Any] = {"role": "assistant", "content": _text_of(texts) if texts else None}
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        if calls:
            message["tool_calls"] = calls
        self.add(item, message)


def arguments_text(arguments: dict[str, Any]) -> str:
    """`input` as the JSON string a chat tool call carries (backends' chat models refuse an object there; the
    message key and the template both read it back as a value, so the spelling is not identity)."""
    return json.dumps(arguments, ensure_ascii=False)
