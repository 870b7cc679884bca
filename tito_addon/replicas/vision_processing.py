"""Images as the engines read them, for both replicas: decoded by PIL (sglang's and vLLM's loaders use it, EXIF
orientation applied as transformers' `load_image` does), counted by transformers' own PIL image processor for the
Qwen2-VL line (`Qwen2VLImageProcessorPil`, what both engines call for Qwen2.5-VL and Qwen3-VL) at each model's
`preprocessor_config.json` bounds, and shown to the scripted model as a short description in place of its pads, so
what a replica answers depends on which image it was given. PIL and the processor are imported only when a replica
serves a vision-language model.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
from dataclasses import dataclass
from typing import Any

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
#: The one-placeholder form a chat template writes, and the expanded runs in decoded text.
PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
EXPANDED_RUN = re.compile(r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>")
#: Each model's preprocessor_config.json: size bounds (pixels), patch and merge sizes.
PREPROCESSORS: dict[str, dict[str, Any]] = {
    "qwen2.5-vl": {"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "patch_size": 14, "merge_size": 2},
    "qwen3-vl": {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "merge_size": 2},
}
_DATA_URL = re.compile(r"^data:(?P<type>[^;,]*)(?:;[^;,]*)*;base64,", re.IGNORECASE)


class ImageLoadError(ValueError):
    """An image the engine could not load: its message is the one the replica answers with."""


@dataclass(frozen=True)
class SeenImage:
    """An image as the model saw it: its bytes' digest, its size after orientation, its patch grid and tokens."""

    sha256: str
    width: int
    height: int
    grid: tuple[int, int, int]
    tokens: int

    def description(self) -> str:
        return f"[image {self.sha256[:8]} {self.width}x{self.height}]"

    def item(self) -> str:
        """The processed item as a server passes it between its stages (opaque to a client): base64 of its facts."""
        facts = {"sha256": self.sha256, "width": self.width, "height": self.height, "image_grid_thw": list(self.grid)}
        return base64.b64encode(json.dumps(facts, sort_keys=True).encode()).decode()

    @classmethod
    def from_item(cls, item: str) -> SeenImage:
        facts = json.loads(base64.b64decode(item, validate=True))
        grid = tuple(int(v) for v in facts["image_grid_thw"])
        return cls(facts["sha256"], facts["width"], facts["height"], (grid[0], grid[1], grid[2]), 0)


class VisionModel:
    """One vision-language model's image side: loads an image the way the servers do and counts its tokens."""

    def __init__(self, name: str) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

        self.name = name
        self.settings = PREPROCESSORS[name]
        self.processor = Qwen2VLImageProcessorPil(**self.settings)
        self.smart_resize = smart_resize
        self.patch = int(self.settings["patch_size"])
        self.merge = int(self.settings["merge_size"])

    def load(self, source: Any) -> SeenImage:
        """A data URL or bare base64, as both servers take them (a server would also fetch URLs: the replicas are
        offline)."""
        if not isinstance(source, str) or not source:
            raise ImageLoadError("image data must be a non-empty string")
        match = _DATA_URL.match(source)
        payload = source[match.end() :] if match else source
        if source.startswith(("http://", "https://", "file:")):
            raise ImageLoadError(f"this replica loads inline images only, not {source[:24]!r}")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageLoadError("image data is not valid base64") from None
        return self.seen(data)

    def seen(self, data: bytes) -> SeenImage:
        from PIL import Image, ImageOps, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as opened:
                opened.load()
                image = ImageOps.exif_transpose(opened)
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise ImageLoadError(f"cannot identify image file: {exc}") from None
        width, height = image.size
        try:
            patches = self.processor.get_number_of_image_patches(height, width, {})
        except ValueError as exc:  # smart_resize: an aspect ratio over 200
            raise ImageLoadError(str(exc)) from None
        size = self.settings["size"]
        resized = self.smart_resize(
            height, width, self.patch * self.merge, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
        )
        grid = (1, resized[0] // self.patch, resized[1] // self.patch)
        return SeenImage(hashlib.sha256(data).hexdigest(), width, height, grid, patches // (self.merge * self.merge))


def expand(ids: list[int], pad_id: int, images: list[SeenImage]) -> tuple[list[int], list[dict[str, int]]] | None:
    """The ids with the i-th pad repeated for the i-th image, and each run's `{offset, length}`; None when the pads
    do not pair one to one with the images."""
    if sum(1 for token in ids if token == pad_id) != len(images):
        return None
    out: list[int] = []
    runs: list[dict[str, int]] = []
    pending = iter(images)
    for token in ids:
        if token != pad_id:
            out.append(token)
            continue
        image = next(pending)
        runs.append({"offset": len(out), "length": image.tokens})
        out.extend([pad_id] * image.tokens)
    return out, runs


def described(text: str, images: list[SeenImage]) -> str:
    """Decoded prompt text with each expanded image run replaced by its image's description, in order."""
    pending = iter(images)

    def name(_: re.Match[str]) -> str:
        image = next(pending, None)
        return image.description() if image is not None else "[image]"

    return EXPANDED_RUN.sub(name, text)
