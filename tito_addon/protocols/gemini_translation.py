"""Gemini's contents as canonical chat messages, one native content at a time (the rules are in `gemini_generate`).

A content's translation depends on that content and its position alone, so a request that extends one read before
(`known_requests`) reuses the earlier contents' translations (`translated_api.ItemTranslation`). A model content's
reasoning is what its thought signature seals (ours, for exactly that reasoning), else its thought parts' text.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from tito_addon.protocols.gemini_models import Content, FunctionResponse, Part
from tito_addon.protocols.translated_api import ChatTranslation, ItemTranslation
from tito_addon.protocols.turn_refs import TurnSigner

THOUGHT_PURPOSE = "gemini-thought"
# What Gemini CLI puts on a function call whose signature it lost: a placeholder, not a signature.
SKIP_SIGNATURE = "skip_thought_signature_validator"
# Keys a client wraps a function's result in (Gemini CLI `output`/`error`, the google-genai SDK `result`): a result
# that is one of them alone is its text; any other is its JSON.
RESULT_KEYS = ("output", "result", "content", "error")


def seal_signature(signer: TurnSigner, reply_id: str, reasoning: str) -> str:
    """A thought signature: the reasoning sealed for the reply, as the base64 a signature is on the wire (the
    google-genai SDK reads it as bytes and writes it back, in either alphabet)."""
    return base64.b64encode(signer.seal_text(THOUGHT_PURPOSE, reply_id, reasoning).encode("ascii")).decode("ascii")


def open_signature(signer: TurnSigner | None, signature: str) -> str | None:
    """The reasoning a thought signature of ours seals; None for any other value."""
    if signer is None:
        return None
    try:
        raw = base64.b64decode(signature.replace("-", "+").replace("_", "/") + "=" * (-len(signature) % 4),
                               validate=True)  # fmt: skip
        opened = signer.open_text(THOUGHT_PURPOSE, raw.decode("ascii"))
    except ValueError:
        return None
    return opened[1] if opened is not None else None


def response_text(response: FunctionResponse) -> str:
    """A function response as the text of a tool message."""
    value = response.response or {}
    if len(value) == 1:
        key, inner = next(iter(value.items()))
        if key in RESULT_KEYS and isinstance(inner, str):
            return inner
    return json.dumps(value, ensure_ascii=False)


def arguments_text(args: dict[str, Any] | None) -> str:
    return json.dumps(args or {}, ensure_ascii=False)


def translate_content(signer: TurnSigner | None, content: Content, where: str) -> ItemTranslation:
    translation = ContentsTranslation(signer)
    if content.role == "model":
        translation.model(0, content.parts, where)
    else:
        translation.user(0, content.parts, where)
    return ItemTranslation(tuple(translation.messages), tuple(translation.dropped), None)


class ContentsTranslation(ChatTranslation):
    """Gemini's system instruction and contents as canonical messages."""

    def system(self, item: int, parts: list[Part]) -> None:
        texts = [{"type": "text", "text": part.text} for part in parts if part.text is not None]
        if texts:
            self.add(item, {"role": "system", "content": texts})

    def user(self, item: int, parts: list[Part], where: str) -> None:
        """Function responses become tool messages, in order, then the text parts one user message (a chat
        template wants the tool results right after the call)."""
        texts: list[dict[str, str]] = []
        for position, part in enumerate(parts):
            if part.functionResponse is not None:
                response = part.functionResponse
                call_id = response.id or response.name
                self.add(item, {"role": "tool", "tool_call_id": call_id, "content": response_text(response)})
            elif part.functionCall is not None:
                self.dropped.append(f"{where}.parts.{position}: a functionCall in a user content (left out)")
            elif part.text is not None and not part.thought:
                texts.append({"type": "text", "text": part.text})
        if texts:
            self.add(item, {"role": "user", "content": texts})

    def model(self, item: int, parts: list[Part], where: str) -> None:
        thoughts: list[str] = []
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        sealed: str | None = None
        for position, part in enumerate(parts):
            signature = part.thoughtSignature
            if signature is not None and signature != SKIP_SIGNATURE and sealed is None:
                sealed = open_signature(self.signer, signature)
                if sealed is None:
                    self.dropped.append(f"{where}.parts.{position}: a thoughtSignature that is not ours (read as "
                                        "nothing)")  # fmt: skip
            if part.functionCall is not None:
                call = part.functionCall
                # A call without an id is named by its position in the message: the agent echoes the call as it
                # got it, and the id the proxy answered with is that one (`gemini_reply`).
                calls.append({"id": call.id or f"{call.name}#{len(calls)}", "type": "function",
                              "function": {"name": call.name, "arguments": arguments_text(call.args)}})  # fmt: skip
            elif part.functionResponse is not None:
                self.dropped.append(f"{where}.parts.{position}: a functionResponse in a model content (left out)")
            elif part.thought:
                thoughts.append(part.text or "")
            else:
                texts.append(part.text or "")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
        reasoning = sealed if sealed is not None else "".join(thoughts)
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        self.add(item, message)
