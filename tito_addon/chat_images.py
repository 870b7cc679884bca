"""Images in chat messages: the one entity every layer holds an image by, and the canonical part that carries it.

An agent sends an image as base64 in its own wrapping (a data URL, an Anthropic `source`, Gemini `inlineData`). Each
protocol decodes it once, here, into a `ChatImage`: the bytes as sent (never re-encoded, so the engine, the record and
the trainer all see the same pixels), their SHA-256 (an image's identity: a screenshot re-sent every turn is the same
message, and is stored once), the format sniffed from the bytes and the size it is displayed at, which decides how
many tokens it becomes. A message holds it as an `ImagePart`, whose fields are what a record line and a session key
need; the bytes ride along privately and are never dumped into a line or a log.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from tito_addon.image_headers import MEDIA_TYPES, ImageFormat, ImageUnreadable, read_image

# Past these an image is refused however it is wrapped: what the hosted APIs agents are written for accept at most
# (OpenAI 20 MB an image; Anthropic 8000 px a side), with room. The operator's own limits come on top
# (`tito_image_max_bytes`, `tito_images_max`).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_SIDE = 16384
# Qwen's smart_resize refuses an aspect ratio over 200 (its processors raise): refused here first, as a 400.
MAX_ASPECT_RATIO = 200
# Pillow, which both engines decode with, refuses an image of more pixels as a decompression bomb.
MAX_IMAGE_PIXELS = 178_956_970
_WHITESPACE = re.compile(rb"[\t\n\r ]+")
_DATA_URL = re.compile(r"^data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.IGNORECASE)


class ImageRefused(ValueError):
    """An image the proxy cannot pass on: the message says which and why, and becomes the agent's 400."""


@dataclass(frozen=True, slots=True, eq=False)
class ChatImage:
    """One image as an agent sent it. Equal images are equal by their bytes' digest."""

    data: bytes = field(repr=False)
    sha256: str
    format: ImageFormat
    width: int  # as displayed: after the EXIF orientation a decoder applies
    height: int

    @property
    def media_type(self) -> str:
        return self.format.media_type

    @property
    def file_name(self) -> str:
        """Its name in a record dir's image store: the digest and the format's extension."""
        return f"{self.sha256}.{self.format.value}"

    def base64(self) -> str:
        return base64.b64encode(self.data).decode("ascii")

    def data_url(self) -> str:
        return f"data:{self.media_type};base64,{self.base64()}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatImage) and other.sha256 == self.sha256

    def __hash__(self) -> int:
        return hash(self.sha256)


class RecentImages:
    """Images read lately, by the text they were read from (a data URL, bare base64, or a URL the fetcher read them
    from), within a budget of their bytes, the least recently used dropped first. One request reads a new image in
    more than one place: an API's translation checks it in the agent's own terms, the canonical form reads its data
    URL, the record names it by digest. Each reads the same text, so the image is decoded, checked and digested once
    (a PNG's check inflates all of its rows)."""

    def __init__(self, budget_bytes: int = 64 * 1024 * 1024) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._images: OrderedDict[str, ChatImage] = OrderedDict()

    def get(self, text: str) -> ChatImage | None:
        image = self._images.get(text)
        if image is not None:
            self._images.move_to_end(text)
        return image

    def put(self, text: str, image: ChatImage) -> ChatImage:
        """The image kept for `text`: the one already there, if any (a URL two requests fetched at once stays the
        first one's image), else `image`."""
        kept = self._images.get(text)
        if kept is not None:
            return kept
        self._images[text] = image
        self.used_bytes += len(image.data)
        while self.used_bytes > self.budget_bytes and len(self._images) > 1:
            _, dropped = self._images.popitem(last=False)
            self.used_bytes -= len(dropped.data)
        return image


RECENT_IMAGES = RecentImages()


def check_declared(declared_type: str | None) -> None:
    """A declared media type must name an image format the engines decode (the bytes say which one it is)."""
    if declared_type is not None and declared_type.strip().lower() not in MEDIA_TYPES:
        raise ImageRefused(
            f"media type {declared_type!r} is not an image the proxy passes on (use one of "
            f"{', '.join(sorted({f.media_type for f in MEDIA_TYPES.values()}))})"
        )


def image_from_bytes(data: bytes, declared_type: str | None = None) -> ChatImage:
    """The image these bytes are, or `ImageRefused`. A declared media type must name an image format the engines
    decode; the bytes decide which one it is (a client that labels a JPEG `image/png` is read as the JPEG it is)."""
    check_declared(declared_type)
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageRefused(f"an image of {len(data)} bytes is over the {MAX_IMAGE_BYTES}-byte limit")
    try:
        header = read_image(data, max_pixels=MAX_IMAGE_PIXELS)
    except ImageUnreadable as exc:
        raise ImageRefused(f"the image does not decode: {exc}") from None
    if max(header.width, header.height) > MAX_IMAGE_SIDE:
        raise ImageRefused(f"a {header.width}×{header.height} image is over the {MAX_IMAGE_SIDE}-pixel limit on a side")
    if max(header.width, header.height) > MAX_ASPECT_RATIO * min(header.width, header.height):
        raise ImageRefused(
            f"a {header.width}×{header.height} image has an aspect ratio over {MAX_ASPECT_RATIO}, which "
            "vision-language processors refuse"
        )
    return ChatImage(
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        format=header.format,
        width=header.width,
        height=header.height,
    )


def decode_base64(text: str | bytes) -> bytes:
    """Standard or URL-safe base64 (Google's Python SDK sends the latter), padded or not, wrapped or not."""
    raw = text.encode("ascii", "strict") if isinstance(text, str) else text
    raw = _WHITESPACE.sub(b"", raw)
    if b"-" in raw or b"_" in raw:
        raw = raw.replace(b"-", b"+").replace(b"_", b"/")
    raw += b"=" * (-len(raw) % 4)
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("the image's base64 data is not valid base64") from None


def image_from_base64(text: Any, declared_type: str | None = None) -> ChatImage:
    if not isinstance(text, str) or not text:
        raise ImageRefused("an image's data must be a non-empty base64 string")
    known = RECENT_IMAGES.get(text)
    if known is not None:
        check_declared(declared_type)
        return known
    if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 1024:
        raise ImageRefused(f"an image's base64 data of {len(text)} characters is over the {MAX_IMAGE_BYTES}-byte limit")
    try:
        data = decode_base64(text)
    except UnicodeEncodeError:
        raise ImageRefused("the image's base64 data is not valid base64") from None
    return RECENT_IMAGES.put(text, image_from_bytes(data, declared_type))


def image_from_url(url: Any) -> ChatImage:
    """An image given as a URL: only `data:` URLs are read. The proxy fetches nothing: a remote URL would make the
    recorded prompt depend on what a server answered at that moment, and the engine would fetch it again."""
    if not isinstance(url, str) or not url:
        raise ImageRefused("an image URL must be a non-empty string")
    known = RECENT_IMAGES.get(url)
    if known is not None:
        return known
    match = _DATA_URL.match(url)
    if match is None:
        scheme = url.split(":", 1)[0] if ":" in url[:16] else url[:16]
        raise ImageRefused(
            f"image URLs are read only as data: URLs (base64); the proxy fetches nothing unless tito_image_fetch is "
            f"on, so a {scheme!r} URL is refused: send the image inline"
        )
    params = [p.strip().lower() for p in match.group("params").split(";") if p.strip()]
    if "base64" not in params:
        raise ImageRefused("a data: URL image must be base64-encoded (data:<type>;base64,...)")
    declared = match.group("type").strip() or None
    return RECENT_IMAGES.put(url, image_from_base64(url[match.end() :], declared))


class ImagePart(BaseModel):
    """An image in a message's content, as the canonical chat form carries it: what identifies and places it. The
    image itself (`image`) is there when the part came from an agent; a part read back from a record has none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["image"]
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    media_type: str
    width: int = Field(ge=1)
    height: int = Field(ge=1)
    _image: ChatImage | None = PrivateAttr(default=None)

    @classmethod
    def of(cls, image: ChatImage) -> ImagePart:
        part = cls(
            type="image", sha256=image.sha256, media_type=image.media_type, width=image.width, height=image.height
        )
        part._image = image
        return part

    @property
    def image(self) -> ChatImage | None:
        return self._image

    @property
    def format(self) -> str:
        """Its format's name (the store's file extension): the media type's subtype, as `ChatImage` names it."""
        return self.media_type.split("/", 1)[1]


def image_part(part: dict[str, Any]) -> ImagePart:
    """The canonical part of an OpenAI chat `image_url` part: `{"type": "image_url", "image_url": {"url": ...}}`."""
    wrapped = part.get("image_url")
    url = wrapped.get("url") if isinstance(wrapped, dict) else wrapped
    return ImagePart.of(image_from_url(url))


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """An image's run of pad ids in a session's sequence (`offset` counts from the sequence's first id): what a turn
    and its record line keep of each image its prompt added. The bytes stay with the request that sent them and, once
    recorded, in the record dir's image store under `file_name`."""

    sha256: str
    format: str  # the file extension of its format: png, jpeg, gif, webp
    width: int
    height: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def file_name(self) -> str:
        return f"{self.sha256}.{self.format}"


@dataclass(frozen=True, slots=True)
class PromptImage:
    """An image of a prompt a backend is sent: the image itself and where its pad ids lie in the prompt."""

    image: ChatImage
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


_MEDIA_KEYS = ("media_type", "mimeType", "mime_type")


def without_image_data(value: Any) -> Any:
    """`value` (an agent's items, as its API sent them) with each inline image's bytes replaced by `sha256:<digest>`,
    for a record line: an image is kept once, in the record dir's image store, never in a line. Finds a data URL
    anywhere, and base64 `data` beside a media type (Anthropic's `source`, Gemini's `inlineData`)."""
    if isinstance(value, str):
        if value.startswith("data:") and ";base64," in value[:128]:
            return _digest_of(value, value.split(",", 1)[1])
        return value
    if isinstance(value, list):
        return [without_image_data(item) for item in value]
    if isinstance(value, dict):
        out = {key: without_image_data(item) for key, item in value.items()}
        if isinstance(value.get("data"), str) and any(isinstance(value.get(key), str) for key in _MEDIA_KEYS):
            out["data"] = _digest_of(value["data"], value["data"])
        return out
    return value


def _digest_of(text: str, payload: str) -> str:
    """The digest of the image `text` holds (`payload`: its base64): found among the images just read, as a rule."""
    known = RECENT_IMAGES.get(text)
    if known is not None:
        return "sha256:" + known.sha256
    try:
        return "sha256:" + hashlib.sha256(decode_base64(payload)).hexdigest()
    except (ImageRefused, UnicodeEncodeError):
        return "(image data left out)"
