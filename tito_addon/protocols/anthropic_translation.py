"""Anthropic Messages' messages as canonical chat messages, one native message at a time (the rules are in
`anthropic_messages`).

A native message's translation depends on that message and its position alone (the position names it in what
the record says was left out), so a request that extends one read before (`known_requests`: the same bytes up to
the end of its messages) reuses the earlier messages' translations (`translated_api.ItemTranslation`), validated
chat messages included. The one thing that depends on the rest is which thinking signatures are checked (those of
the newest assistant message with blocks): each translation keeps its own, and the request takes the newest.
"""

from __future__ import annotations

import json
from typing import Any

from tito_addon.protocols.anthropic_models import (
    CompactionBlock,
    ImageBlock,
    MessageParam,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from tito_addon.protocols.compaction_items import COMPACTION_PURPOSE
from tito_addon.protocols.image_parts import image_url_part, inline_image_part, not_inline
from tito_addon.protocols.translated_api import ChatTranslation, ItemTranslation
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.tito_errors import BadRequest

BILLING_PREFIX = "x-anthropic-billing-header"


def translate_message(signer: TurnSigner | None, message: MessageParam, where: str) -> ItemTranslation:
    translation = MessagesTranslation(signer)
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
    compaction = translation.compaction_refs[-1] if translation.compaction_refs else None
    return ItemTranslation(
        tuple(translation.messages),
        tuple(translation.dropped),
        tuple(translation.signatures) if blocks else None,
        compaction=compaction,
    )


def _text_of(blocks: list[TextBlock]) -> list[dict[str, str]]:
    return [{"type": "text", "text": block.text} for block in blocks]


def image_part(block: ImageBlock, where: str) -> dict[str, Any]:
    """An image block (`source`: base64 only) as the canonical image part."""
    source = block.source
    kind = source.get("type")
    if kind == "base64":
        return inline_image_part(source.get("data"), source.get("media_type"), where)
    if kind == "url":
        return image_url_part(source.get("url"))  # refused by the canonical form, in its words
    raise not_inline(where, f"a {kind!r} source")


def _parts(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Text and image blocks, in order, as canonical parts."""
    parts = []
    for block in blocks:
        if isinstance(block, ImageBlock):
            parts.append(image_part(block, where))
        else:
            parts.append({"type": "text", "text": block.text})
    return parts


class MessagesTranslation(ChatTranslation):
    """Anthropic Messages' system prompt and messages as canonical messages; `signatures`: (where, signature,
    thinking) of the newest assistant message with blocks."""

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

    def blocks(self, item: int, role: str, content: str | list[Any], where: str) -> list[Any] | None:
        """A message's blocks (None: a plain string, added as the message it is)."""
        if isinstance(content, str):
            self.add(item, {"role": role, "content": content})
            return None
        return content

    def compaction_summary(self, block: CompactionBlock, where: str) -> str:
        """The reply a compaction block's summary came from, once its seal holds for its text; the summary is then
        this message's first (a user message: what the model reads it as)."""
        opened = self.signer.open_text(COMPACTION_PURPOSE, block.encrypted_content) if self.signer else None
        if opened is None or (block.content is not None and block.content != opened[1]):
            problem = "whose encrypted_content this proxy did not mint (or not for its content)"
            raise BadRequest(f"{where}: a compaction block {problem}; there is no summary to read in its place")
        self.add(0, {"role": "user", "content": opened[1]})
        return opened[0]

    def user(self, item: int, content: str | list[Any], where: str) -> None:
        """Tool results (an image in one stays in its tool message), then the text and images, in order."""
        shown: list[Any] = []
        for block in self.blocks(item, "user", content, where) or []:
            if isinstance(block, ToolResultBlock):
                result: Any = block.content
                if isinstance(result, list) and any(isinstance(part, ImageBlock) for part in result):
                    result = _parts(result, f"{where} tool_result {block.tool_use_id}")
                elif isinstance(result, list):
                    result = "\n".join(part.text for part in result)
                self.add(item, {"role": "tool", "tool_call_id": block.tool_use_id, "content": result or ""})
            elif isinstance(block, TextBlock | ImageBlock):
                shown.append(block)
            else:
                raise BadRequest(f"{where}: a user message cannot hold a {block.type} block")
        if shown:
            self.add(item, {"role": "user", "content": _parts(shown, where)})

    def assistant(self, item: int, content: str | list[Any], where: str) -> None:
        blocks = self.blocks(item, "assistant", content, where)
        if blocks is None:
            return
        self.signatures = []  # only the newest assistant message is checked: older ones were, on earlier turns
        thinking: list[str] = []
        texts: list[TextBlock] = []
        calls: list[dict[str, Any]] = []
        for block in blocks:
            if isinstance(block, CompactionBlock):
                # The summary this proxy served starts the context over: what came before it is dropped (by the
                # API, see `TranslatedApi.parse`; in this message, here).
                self.messages.clear()
                self.item_of.clear()
                self.compaction_refs.append(self.compaction_summary(block, where))
                thinking, texts, calls = [], [], []
                continue
            if isinstance(block, ThinkingBlock):
                thinking.append(block.thinking)
                if block.signature and self.signer is not None:
                    self.signatures.append((where, block.signature, block.thinking))
            elif isinstance(block, RedactedThinkingBlock):
                self.dropped.append(f"{where}: a redacted_thinking block (unreadable, left out of the prompt)")
            elif isinstance(block, TextBlock):
                texts.append(block)
            elif isinstance(block, ImageBlock):
                raise BadRequest(f"{where}: an assistant message cannot hold an image; nothing was forwarded")
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
        if self.compaction_refs and not (thinking or texts or calls):
            return  # the message held the compaction block alone: the summary is all of it
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
