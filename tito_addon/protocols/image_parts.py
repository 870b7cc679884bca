"""Each agent API's image, as the canonical chat form's image part: an OpenAI `image_url` part with a data URL.

The canonical form is the chat-completions shape, which vLLM's render also reads, so an image becomes the part that
form has for it; the canonical validation then decodes it once (`chat_images`) and refuses what the engine could not
read. Only inline images are taken: a URL or a file id would make the prompt depend on a fetch the proxy does not make
(and the engine would make again), so each is a 400 that says to send the image inline.
"""

from __future__ import annotations

from typing import Any

from tito_addon.chat_images import RECENT_IMAGES, ImageRefused, image_from_base64
from tito_addon.tito_errors import BadRequest

#: Google's Python SDK writes URL-safe base64; engines read the standard alphabet (vLLM's data URLs are decoded with
#: `validate=True`), so the two characters that differ are turned into the standard ones.
_STANDARD = str.maketrans("-_", "+/")


def image_url_part(url: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def inline_image_part(data: Any, media_type: Any, where: str) -> dict[str, Any]:
    """Base64 bytes and their media type (Anthropic `source`, Gemini `inlineData`) as a data URL part, refused here
    in the agent's own terms (`where`) when the engine could not read it."""
    if not isinstance(media_type, str) or not media_type:
        raise BadRequest(f"{where}: an image needs its media type; nothing was forwarded")
    try:
        image = image_from_base64(data, media_type)
    except ImageRefused as exc:
        raise BadRequest(f"{where}: {exc}; nothing was forwarded") from None
    assert isinstance(data, str)
    if "-" in data or "_" in data:
        data = data.translate(_STANDARD)
    url = f"data:{media_type};base64,{data}"
    RECENT_IMAGES.put(url, image)  # the canonical form reads this URL next: the image, read once
    return image_url_part(url)


def not_inline(where: str, what: str) -> BadRequest:
    return BadRequest(
        f"{where}: an image given by {what} cannot be read (the proxy fetches nothing and keeps no files): send it "
        "inline as base64; nothing was forwarded"
    )
