"""Gemini's contents as canonical chat messages, one native content at a time (the rules are in `gemini_generate`).

A content's translation depends on that content, its position and the contents before it alone (a user content's
responses without ids take the ids of the calls before them), so a request that extends one read before
(`known_requests`) reuses the earlier contents' translations (`translated_api.ItemTranslation`). A model content's
reasoning is what its thought signature seals (ours, for exactly that reasoning), else its thought parts' text.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from tito_addon.protocols.gemini_models import Content, FunctionResponse, Part
from tito_addon.protocols.image_parts import inline_image_part
from tito_addon.protocols.translated_api import ChatTranslation, ItemTranslation
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.tito_errors import BadRequest

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


def call_id_for(reply_id: str, position: int) -> str:
    """The id of the call at `position` among a reply's calls, made from the reply's id: a client that echoes the call
    without it (pi leaves ids out for Gemini models, whose API long had none) still names it, by the signature that
    names the reply (`open_signature`) and the call's position."""
    digest = hashlib.blake2b(f"{reply_id}\0{position}".encode(), digest_size=18).digest()
    return "call_" + base64.urlsafe_b64encode(digest).decode("ascii").replace("-", "x").replace("_", "y")


def open_signature(signer: TurnSigner | None, signature: str) -> tuple[str, str] | None:
    """(reply id, reasoning) that a thought signature of ours seals; None for any other value."""
    if signer is None:
        return None
    try:
        raw = base64.b64decode(signature.replace("-", "+").replace("_", "/") + "=" * (-len(signature) % 4),
                               validate=True)  # fmt: skip
        opened = signer.open_text(THOUGHT_PURPOSE, raw.decode("ascii"))
    except ValueError:
        return None
    return opened


def response_text(response: FunctionResponse) -> str:
    """A function response as the text of a tool message."""
    value = response.response or {}
    if len(value) == 1:
        key, inner = next(iter(value.items()))
        if key in RESULT_KEYS and isinstance(inner, str):
            return inner
    return json.dumps(value, ensure_ascii=False)


def tool_content(response: FunctionResponse, where: str) -> str | list[dict[str, Any]]:
    """A function response as a tool message's content: its text, then its images (Gemini 3 `parts`) where any."""
    text = response_text(response)
    if not response.parts:
        return text
    images = [
        inline_image_part(part.inlineData.data, part.inlineData.mimeType, f"{where}.functionResponse.parts.{index}")
        for index, part in enumerate(response.parts)
    ]
    return [{"type": "text", "text": text}, *images]


def arguments_text(args: dict[str, Any] | None) -> str:
    return json.dumps(args or {}, ensure_ascii=False)


def translate_content(
    signer: TurnSigner | None, content: Content, where: str, calls: tuple[tuple[str, str], ...] = ()
) -> ItemTranslation:
    """`calls`: (id, name) of the calls of the model content before a user content, which its function responses
    without ids answer in order."""
    translation = ContentsTranslation(signer)
    if content.role == "model":
        translation.model(0, content.parts, where)
    else:
        translation.user(0, content.parts, where, calls)
    return ItemTranslation(tuple(translation.messages), tuple(translation.dropped), None)


class ContentsTranslation(ChatTranslation):
    """Gemini's system instruction and contents as canonical messages."""

    def system(self, item: int, parts: list[Part]) -> None:
        if any(part.inlineData is not None for part in parts):
            raise BadRequest("systemInstruction: an image there is not read (send it in a user content); nothing was "
                             "forwarded")  # fmt: skip
        texts = [{"type": "text", "text": part.text} for part in parts if part.text is not None]
        if texts:
            self.add(item, {"role": "system", "content": texts})

    def user(self, item: int, parts: list[Part], where: str, calls: tuple[tuple[str, str], ...] = ()) -> None:
        """Function responses become tool messages, in order, then the text parts one user message (a chat
        template wants the tool results right after the call).

        A resumed Gemini CLI session sends every function response of a content twice (it rebuilds the history
        from its session file: `[A, A]`, `[A, B, A, B]`). A response that repeats an earlier one of the same
        content exactly, id included, says nothing new and is left out (noted), so the resumed request reads as
        the one the model answered. Only an id makes two responses one call's: two equal responses without ids
        answer two calls (one function called twice alike) and both stay. A different response under an id
        already answered is refused: which result the model is to read is not the proxy's to guess.

        A response without an id (pi sends none for Gemini models) answers the call at its place among the `calls`
        before it when that call has its name, and takes its id; else it is named by its function's name."""
        texts: list[dict[str, Any]] = []
        answered: dict[str, Part] = {}
        unnamed = 0  # responses without an id so far
        for position, part in enumerate(parts):
            if part.functionResponse is not None:
                response = part.functionResponse
                if response.id is not None:
                    earlier = answered.setdefault(response.id, part)
                    if earlier is not part:
                        if earlier != part:
                            raise BadRequest(f"{where}.parts.{position}: a second, different functionResponse for "
                                             f"call id {response.id!r}; nothing was forwarded")  # fmt: skip
                        self.dropped.append(f"{where}.parts.{position}: a functionResponse repeating an earlier one "
                                            "of this content exactly (left out)")  # fmt: skip
                        continue
                call_id = response.id
                if call_id is None:
                    paired = calls[unnamed] if unnamed < len(calls) else None
                    call_id = paired[0] if paired is not None and paired[1] == response.name else response.name
                    unnamed += 1
                self.add(item, {"role": "tool", "tool_call_id": call_id, "content": tool_content(response, where)})
            elif part.functionCall is not None:
                self.dropped.append(f"{where}.parts.{position}: a functionCall in a user content (left out)")
            elif part.inlineData is not None:
                inline = part.inlineData
                texts.append(inline_image_part(inline.data, inline.mimeType, f"{where}.parts.{position}.inlineData"))
            elif part.text is not None and not part.thought:
                texts.append({"type": "text", "text": part.text})
        if texts:
            self.add(item, {"role": "user", "content": texts})

    def model(self, item: int, parts: list[Part], where: str) -> None:
        thoughts: list[str] = []
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        sealed: tuple[str, str] | None = None
        for position, part in enumerate(parts):
            signature = part.thoughtSignature
            if signature is not None and signature != SKIP_SIGNATURE and sealed is None:
                sealed = open_signature(self.signer, signature)
                if sealed is None:
                    self.dropped.append(f"{where}.parts.{position}: a thoughtSignature that is not ours (read as "
                                        "nothing)")  # fmt: skip
            if part.functionCall is not None:
                call = part.functionCall
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": arguments_text(call.args)}})  # fmt: skip
            elif part.functionResponse is not None:
                self.dropped.append(f"{where}.parts.{position}: a functionResponse in a model content (left out)")
            elif part.inlineData is not None:
                raise BadRequest(
                    f"{where}.parts.{position}: a model content cannot hold an image; nothing was forwarded"
                )
            elif part.thought:
                thoughts.append(part.text or "")
            else:
                texts.append(part.text or "")
        for position, call in enumerate(calls):
            if call["id"] is None:
                # A call without an id has the one the proxy answered it with (`gemini_reply`) when the content's
                # signature names our reply (a signature may follow the calls); else its name and position.
                name = call["function"]["name"]
                call["id"] = call_id_for(sealed[0], position) if sealed is not None else f"{name}#{position}"
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
        reasoning = sealed[1] if sealed is not None else "".join(thoughts)
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        self.add(item, message)
