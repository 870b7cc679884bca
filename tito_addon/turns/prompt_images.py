"""The images of a turn's prompt: the spans its session's history holds and the ones the turn adds, with their bytes.

A session keeps of each image only its digest and its run of pad ids (`ImageSpan`); the bytes come with every
request, since an agent re-sends its whole history, screenshots included, and a history that matched the stored one
holds the same images (an image is part of a message's key). A backend is sent every image of the prompt on every
turn (sglang and vLLM both need them all), so a request that continues a stored turn without re-sending an image of
it (a Responses `previous_response_id`) is refused: the proxy never guesses pixels.
"""

from __future__ import annotations

from tito_addon.canonical_chat import ChatMessage
from tito_addon.chat_images import ChatImage, ImageSpan, PromptImage
from tito_addon.engine.token_engine import PromptPiece
from tito_addon.sessions.session_tree import TurnNode
from tito_addon.tito_errors import BadRequest


def added_spans(piece: PromptPiece, start: int) -> list[ImageSpan]:
    """The images a turn's prompt adds (`piece`, placed after the `start` ids of its parent's sequence)."""
    return [
        ImageSpan(
            sha256=placed.part.sha256,
            format=placed.part.format,
            width=placed.part.width,
            height=placed.part.height,
            offset=start + placed.offset,
            length=placed.length,
        )
        for placed in piece.images
    ]


def sent_images(messages: list[ChatMessage]) -> dict[str, ChatImage]:
    found: dict[str, ChatImage] = {}
    for message in messages:
        for part in message.images():
            if part.image is not None:
                found.setdefault(part.sha256, part.image)
    return found


def prompt_images(
    parent: TurnNode | None, piece: PromptPiece, messages: list[ChatMessage], most: int
) -> tuple[PromptImage, ...]:
    """Every image of a prompt (`piece` after `parent`'s sequence), in order, with its bytes from `messages`; empty for
    a text-only prompt (the common case, cheap). More than `most` is refused: each goes to the engine every turn."""
    history = parent.image_spans() if parent is not None else []
    if not history and not piece.images:
        return ()
    spans = history + added_spans(piece, parent.end_len if parent is not None else 0)
    if len(spans) > most:
        raise BadRequest(
            f"the conversation holds {len(spans)} images, over the proxy's limit of {most} (tito_images_max): each is "
            "sent to the engine on every turn; nothing was forwarded"
        )
    images = sent_images(messages)
    missing = [span.sha256 for span in spans if span.sha256 not in images]
    if missing:
        raise BadRequest(
            f"the stored history this request continues holds {len(missing)} image(s) the request does not carry "
            f"(sha256 {missing[0][:16]}…): send the whole conversation with its images; nothing was forwarded"
        )
    return tuple(PromptImage(images[span.sha256], span.offset, span.length) for span in spans)
