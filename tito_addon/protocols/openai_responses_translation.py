"""OpenAI Responses' input items as canonical chat messages (the rules are in `openai_responses`), and the reading
of them that a request extending this one takes as it was.

Unlike Anthropic's messages, items do not translate one by one: a run of assistant-side items (reasoning, an
assistant message, function calls) is one assistant message, so the reading kept is of all the items at once
(`TranslatedItems`), and an appended item that would join the message the known items left open is translated
with them (a whole read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tito_addon.canonical_chat import ChatMessage
from tito_addon.protocols.compaction_items import COMPACTION_PURPOSE
from tito_addon.protocols.image_parts import image_url_part, not_inline
from tito_addon.protocols.openai_responses_models import (
    CompactionItem,
    CompactionTriggerItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    MediaPart,
    MessageItem,
    RefusalPart,
)
from tito_addon.protocols.openai_responses_reply import REASONING_PURPOSE
from tito_addon.protocols.translated_api import ChatTranslation
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.tito_errors import BadRequest

NAMESPACE_JOIN = "__"


def _text(parts: str | list[Any], where: str) -> str | list[dict[str, Any]]:
    """Content as canonical parts: text, and images (`input_image` with a data URL; files and audio are refused)."""
    if isinstance(parts, str):
        return parts
    out: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, MediaPart):
            out.append(_image(part, where))
            continue
        out.append({"type": "text", "text": part.refusal if isinstance(part, RefusalPart) else part.text})
    return out


def _image(part: MediaPart, where: str) -> dict[str, Any]:
    if part.type != "input_image":
        raise BadRequest(f"{where} holds {part.type}: only text and images are read; nothing was forwarded")
    url = getattr(part, "image_url", None)
    if url is None:
        raise not_inline(where, "a file_id" if getattr(part, "file_id", None) else "nothing (no image_url)")
    return image_url_part(url)


def _plain(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text parts joined as one text (as an assistant message or tool output is kept); parts where images are."""
    if isinstance(content, str) or any(part["type"] != "text" for part in content):
        return content
    return "\n".join(part["text"] for part in content)


def _joined(parts: list[Any]) -> str:
    return "\n".join(part.text for part in parts)


class ResponsesTranslation(ChatTranslation):
    """Input items as canonical messages; with the request's tools as chat functions (`tools`) and the namespaced
    names they were flattened from (`namespaces`), which the reply needs."""

    def __init__(self, signer: TurnSigner | None) -> None:
        super().__init__(signer)
        self.assistant: dict[str, Any] | None = None  # the assistant message the current run of items builds
        self.tools: list[dict[str, Any]] | None = None
        self.namespaces: dict[str, tuple[str, str]] = {}
        self.trigger: tuple[int, str] | None = None  # where a compaction_trigger item stands

    def item(self, index: int, item: Any, where: str) -> None:
        if self.trigger is not None:
            raise BadRequest(f"{self.trigger[1]}: a compaction_trigger item must be the last item; nothing was "
                             "forwarded")  # fmt: skip
        if isinstance(item, MessageItem):
            self.message(index, item, where)
        elif isinstance(item, FunctionCallItem):
            self.function_call(index, item)
        elif isinstance(item, FunctionCallOutputItem):
            self.output(index, item, where)
        elif isinstance(item, CompactionItem):
            self.compaction(index, item, where)
        elif isinstance(item, CompactionTriggerItem):
            self.trigger = (index, where)
        else:
            self.reasoning(index, item, where)

    def compaction(self, item: int, compaction: CompactionItem, where: str) -> None:
        """A summary this proxy served, as the user message it stands for in the context it starts."""
        opened = self.signer.open_text(COMPACTION_PURPOSE, compaction.encrypted_content) if self.signer else None
        if opened is None:
            raise BadRequest(f"{where}: a compaction item whose encrypted_content this proxy did not mint (or not for "
                             "this text); there is no summary to read in its place; nothing was forwarded")  # fmt: skip
        reply_id, summary = opened
        self.assistant = None
        self.compaction_refs.append(reply_id)
        self.add(item, {"role": "user", "content": summary})

    def assistant_at(self, item: int) -> dict[str, Any]:
        if self.assistant is None:
            self.assistant = self.add(item, {"role": "assistant", "content": None})
        return self.assistant

    def message(self, item: int, message: MessageItem, where: str) -> None:
        content = _text(message.content, where)
        if message.role == "assistant":
            text = _plain(content)
            if not isinstance(text, str):
                raise BadRequest(f"{where}: an assistant message cannot hold an image; nothing was forwarded")
            target = self.assistant_at(item)
            target["content"] = text if target["content"] is None else target["content"] + "\n" + text
            return
        self.assistant = None
        role = "system" if message.role in ("system", "developer") else "user"
        self.add(item, {"role": role, "content": content})

    def function_call(self, item: int, call: FunctionCallItem) -> None:
        name = f"{call.namespace}{NAMESPACE_JOIN}{call.name}" if call.namespace else call.name
        calls = self.assistant_at(item).setdefault("tool_calls", [])
        calls.append({"id": call.call_id, "type": "function", "function": {"name": name, "arguments": call.arguments}})

    def output(self, item: int, result: FunctionCallOutputItem, where: str) -> None:
        self.assistant = None
        self.add(item, {"role": "tool", "tool_call_id": result.call_id, "content": _plain(_text(result.output, where))})

    def reasoning(self, item: int, reasoning: Any, where: str) -> None:
        text: str | None = None
        if reasoning.encrypted_content is not None:
            opened = self.signer.open_text(REASONING_PURPOSE, reasoning.encrypted_content) if self.signer else None
            if opened is not None:
                text = opened[1]
            else:
                self.dropped.append(f"{where}: encrypted_content that is not ours (left out of the prompt)")
        if text is None and reasoning.content:
            text = _joined(reasoning.content)
        if text is None and reasoning.summary:
            text = _joined(reasoning.summary)
        if text:
            target = self.assistant_at(item)
            target["reasoning_content"] = (target.get("reasoning_content") or "") + text


@dataclass(frozen=True, slots=True)
class TranslatedItems:
    """What a request's input items became, kept with its bytes (see `known_requests`) so that a request extending
    it translates only its own items: the canonical messages (never changed once their run of items ended), the item
    each came from, what was left out, whether the last assistant message was still open to the next item, and the
    messages validated."""

    messages: tuple[dict[str, Any], ...]
    item_of: tuple[int, ...]
    dropped: tuple[str, ...]
    open_run: bool
    chat: tuple[ChatMessage, ...] = ()


def closes_run(item: Any) -> bool:
    """Whether an item ends the run of assistant-side items before it (see `ResponsesTranslation`)."""
    if isinstance(item, FunctionCallOutputItem | CompactionItem | CompactionTriggerItem):
        return True
    return isinstance(item, MessageItem) and item.role != "assistant"
