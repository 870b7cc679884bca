"""How many tokens an image becomes in a vision-language family's prompt, and where those tokens sit.

A Qwen-VL chat template writes one `<|image_pad|>` per image between `<|vision_start|>` and `<|vision_end|>`; the
model's processor then repeats that pad once for each 2×2 group of patches of the image resized by `smart_resize`.
The proxy keeps the expanded ids (what the model ran on, what a trainer scores), so it counts them itself, from the
size the image is displayed at: the same integer arithmetic as transformers' `smart_resize`
(`models/qwen2_vl/image_processing_pil_qwen2_vl.py`), no pixels and no torch. Each engine reports the ids it
expanded, and a turn whose count differs from the proxy's is refused (`ImageCountMismatch`), never recorded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tito_addon.canonical_chat import ChatMessage
from tito_addon.chat_images import ImagePart
from tito_addon.tito_errors import BadRequest


@dataclass(frozen=True)
class VisionScheme:
    """A family's image placeholder and its processor's resize bounds (the model's `preprocessor_config.json`)."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_start: str = "<|vision_start|>"
    image_pad: str = "<|image_pad|>"
    image_end: str = "<|vision_end|>"

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def with_pixels(self, min_pixels: int | None, max_pixels: int | None) -> VisionScheme:
        """The same scheme under a server's own bounds (`--mm-processor-kwargs`, a checkpoint's own config)."""
        return replace(
            self,
            min_pixels=self.min_pixels if min_pixels is None else min_pixels,
            max_pixels=self.max_pixels if max_pixels is None else max_pixels,
        )

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """`(height, width)` after the processor's resize: transformers' `smart_resize`, operation for operation
        (Python's `round` halves to even, as there)."""
        factor = self.factor
        if max(height, width) / min(height, width) > 200:
            raise BadRequest(f"a {width}×{height} image has an aspect ratio over 200, which the processor refuses")
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The image's `image_grid_thw`: one frame, and its patches down and across."""
        h_bar, w_bar = self.resized(width, height)
        return 1, h_bar // self.patch_size, w_bar // self.patch_size

    def image_tokens(self, width: int, height: int) -> int:
        _, rows, columns = self.grid(width, height)
        return rows * columns // (self.merge_size * self.merge_size)


QWEN2_5_VL = VisionScheme(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=12845056)
QWEN3_VL = VisionScheme(patch_size=16, merge_size=2, min_pixels=65536, max_pixels=16777216)


@dataclass(frozen=True)
class PlacedImage:
    """An image in a prompt: its part, and the run of pad ids it became (`offset` counts from the start of the ids it
    was placed in)."""

    part: ImagePart
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def shifted(self, by: int) -> PlacedImage:
        return replace(self, offset=self.offset + by)


def expand_images(
    ids: Sequence[int], pad_id: int, parts: Sequence[ImagePart], scheme: VisionScheme
) -> tuple[list[int], list[PlacedImage]]:
    """`ids` with the i-th pad repeated for the i-th image, and where each image's run lies.

    The template writes one pad per image part of the messages, in order; a count that differs means a template that
    renders no image in that role (Qwen3-VL drops images in system and assistant messages) or a pad token in an
    agent's text: refused, since the engine would pair the images with the wrong runs."""
    pads = sum(1 for token in ids if token == pad_id)
    if pads != len(parts):
        raise BadRequest(
            f"the messages hold {len(parts)} image(s) but their rendered prompt holds {pads} image placeholder(s): "
            "the chat template renders no image where one was sent (check the message's role), or a message's "
            "text holds the image placeholder token; nothing was forwarded"
        )
    if not parts:
        return list(ids), []
    out: list[int] = []
    placed: list[PlacedImage] = []
    images = iter(parts)
    for token in ids:
        if token != pad_id:
            out.append(token)
            continue
        part = next(images)
        length = scheme.image_tokens(part.width, part.height)
        placed.append(PlacedImage(part=part, offset=len(out), length=length))
        out.extend([pad_id] * length)
    return out, placed


class ImagePads:
    """A family's images in one tokenizer's ids: the pad id to expand, or None for a family that reads text only."""

    def __init__(self, scheme: VisionScheme | None, tokenizer: Any, *, family: str, tokenizer_name: str) -> None:
        self.scheme = scheme
        self.family = family
        self.pad_id: int | None = None
        if scheme is None:
            return
        markers = (scheme.image_start, scheme.image_pad, scheme.image_end)
        ids = [tokenizer.convert_tokens_to_ids(token) for token in markers]
        if [tokenizer.convert_ids_to_tokens(i) if isinstance(i, int) else None for i in ids] != list(markers):
            raise ValueError(
                f"family {family} places images with {''.join(markers)}, which the tokenizer {tokenizer_name!r} does "
                "not hold as tokens"
            )
        self.pad_id = int(ids[1])

    def expanded(self, ids: list[int], messages: Sequence[ChatMessage]) -> tuple[list[int], list[PlacedImage]]:
        """The ids with each image's pad repeated as the family's processor repeats it."""
        parts = [part for message in messages for part in message.images()]
        if self.scheme is None or self.pad_id is None:
            if parts:
                raise BadRequest(
                    f"the request holds {len(parts)} image(s) but model family {self.family!r} reads text only (a "
                    "vision-language model is served with tito_model_family=qwen2.5-vl or qwen3-vl); nothing was "
                    "forwarded"
                )
            return ids, []
        return expand_images(ids, self.pad_id, parts, self.scheme)


def collapse_runs(ids: Sequence[int], runs: Sequence[tuple[int, int]]) -> list[int]:
    """The ids with each image's run (`[start, end)` of pads) back to its single pad: what an engine that expands
    pads itself is sent."""
    out: list[int] = []
    at = 0
    for start, end in sorted(runs):
        out.extend(ids[at : start + 1])
        at = end
    out.extend(ids[at:])
    return out
