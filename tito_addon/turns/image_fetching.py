"""Images an agent gives by URL, fetched once by the proxy where the user allows it (`tito_image_fetch`).

By default nobody fetches them: the proxy refuses them (400), so the engine never fetches an image whose bytes the
record would not hold. With fetching allowed, the proxy fetches each http(s) URL once, checks it as any image, and
puts it inline in the request before the request is read, in each API's own inline form: from then on it is an
inline image like any other (counted, sent to the engine, kept once in the record dir). A URL is fetched once per
process: an agent re-sends its history every turn, and the same URL must stay the same image, or the stored turn
would no longer match it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson

from tito_addon.chat_images import MAX_IMAGE_BYTES, ChatImage, ImageRefused, RecentImages, image_from_bytes
from tito_addon.tito_errors import BadRequest

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 30
MAX_REDIRECTS = 3
DEFAULT_BUDGET_BYTES = 64 * 1024 * 1024


def _remote(value: Any) -> str | None:
    return value if isinstance(value, str) and value.startswith(("http://", "https://")) else None


def _slots(value: Any) -> Iterator[tuple[dict[str, Any], str, str]]:
    """Each image a request gives by URL, in each API's form: the object that holds it, the form, the URL."""
    if isinstance(value, list):
        for item in value:
            yield from _slots(item)
        return
    if not isinstance(value, dict):
        return
    kind = value.get("type")
    if kind in ("image_url", "input_image"):  # chat: {"image_url": {"url"}} or a string; Responses: a string
        wrapped = value.get("image_url")
        url = _remote(wrapped.get("url") if isinstance(wrapped, dict) else wrapped)
        if url is not None:
            yield value, "image_url", url
    source = value.get("source")
    if kind == "image" and isinstance(source, dict) and source.get("type") == "url":  # Anthropic
        url = _remote(source.get("url"))
        if url is not None:
            yield value, "source", url
    for name in ("fileData", "file_data"):  # Gemini
        data = value.get(name)
        url = _remote(data.get("fileUri", data.get("file_uri"))) if isinstance(data, dict) else None
        if url is not None:
            yield value, name, url
    for item in value.values():
        yield from _slots(item)


def _inline(holder: dict[str, Any], form: str, image: ChatImage) -> None:
    """Put `image` inline where `holder` gave it by URL, in that API's inline form."""
    if form == "image_url":
        wrapped = holder["image_url"]
        holder["image_url"] = {**wrapped, "url": image.data_url()} if isinstance(wrapped, dict) else image.data_url()
    elif form == "source":
        holder["source"] = {"type": "base64", "media_type": image.media_type, "data": image.base64()}
    else:
        del holder[form]
        holder["inlineData"] = {"mimeType": image.media_type, "data": image.base64()}


class ImageFetcher:
    """Fetches the images a request gives by URL and makes them inline; what it fetched, by URL, within a budget."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.fetched = 0  # URLs fetched (a test can tell a fetch from a hit)
        self._images = RecentImages(budget_bytes)  # by URL

    async def inlined(self, body: bytes) -> bytes:
        """`body` with every image it gives by URL inline; as it is when it gives none."""
        if b'"http' not in body:
            return body
        try:
            raw = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body  # the request's own reading says what is wrong with it
        slots = list(_slots(raw))
        if not slots:
            return body
        urls = list(dict.fromkeys(url for _, _, url in slots))
        images = dict(zip(urls, await asyncio.gather(*(self.image(url) for url in urls)), strict=True))
        for holder, form, url in slots:
            _inline(holder, form, images[url])
        return orjson.dumps(raw)

    async def image(self, url: str) -> ChatImage:
        known = self._images.get(url)
        if known is not None:
            return known
        data = await self._get(url)
        try:
            image = image_from_bytes(data)
        except ImageRefused as exc:
            raise BadRequest(f"the image at {url[:200]} cannot be passed on: {exc}; nothing was forwarded") from None
        self.fetched += 1
        return self._images.put(url, image)

    async def _get(self, url: str) -> bytes:
        """The URL's bytes: a 200 within the size limit, no credentials of the agent's sent along."""
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
        try:
            async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
                async with session.get(url, max_redirects=MAX_REDIRECTS) as response:
                    if response.status != 200:
                        raise BadRequest(f"the image at {url[:200]} answered {response.status}; nothing was forwarded")
                    data = bytearray()
                    async for chunk in response.content.iter_chunked(1 << 16):
                        data += chunk
                        if len(data) > MAX_IMAGE_BYTES:
                            break
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise BadRequest(
                f"the image at {url[:200]} could not be fetched ({type(exc).__name__}: {str(exc)[:200]}); nothing "
                "was forwarded"
            ) from None
        if len(data) > MAX_IMAGE_BYTES:
            raise BadRequest(
                f"the image at {url[:200]} is over the {MAX_IMAGE_BYTES}-byte limit; nothing was forwarded"
            )
        # (Without its query: a presigned URL carries its credentials there.)
        logger.info("tito: fetched an image of %d bytes from %s", len(data), url.split("?", 1)[0][:200])
        return bytes(data)
