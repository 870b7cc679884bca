"""vLLM's image features for a prompt of the proxy's own ids: render's items, placed where the proxy's ids hold them.

Render expands each image of the chat it is given and answers its `features`: per image a content hash, the run of
placeholder ids in *its* ids, and the processed pixels (`kwargs_data`, opaque). Generate runs on the proxy's ids and
takes `features` as given: nothing on that path expands, re-tokenizes or checks the ids under a placeholder. So each
item keeps its hash and data and gets the proxy's run for that image; render's run length must equal the proxy's
count (its processor resized the image as the family's does), else the engine would write the image's embeddings over
the wrong positions. Every image goes with its data on every turn: an item left to the engine's cache is found only on
the engine that saw it, which a router does not promise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tito_addon.chat_images import PromptImage
from tito_addon.tito_errors import UpstreamMalformed

MODALITY = "image"
FEATURE_MAPS = ("mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata")


class ImageCountMismatch(UpstreamMalformed):
    """The engine expanded an image to another number of tokens than the proxy: the two resize it differently."""


def placed_features(features: Any, images: Sequence[PromptImage]) -> Any:
    """Render's `features`, each image's placeholder moved to where the proxy's ids hold it; as given when the prompt
    holds no image."""
    if not images:
        if isinstance(features, dict) and any(features.get(key) for key in FEATURE_MAPS):
            raise UpstreamMalformed("vLLM render found media in a request that holds none; nothing was recorded")
        return features
    if not isinstance(features, dict):
        raise UpstreamMalformed(
            f"vLLM render answered no image features for a prompt with {len(images)} image(s): the server does not "
            "serve a vision-language model (or predates features); nothing was recorded"
        )
    maps: dict[str, Any] = {key: features.get(key) for key in FEATURE_MAPS}
    for key in ("mm_hashes", "mm_placeholders", "kwargs_data"):
        if not isinstance(maps[key], dict) or set(maps[key]) != {MODALITY}:
            raise UpstreamMalformed(f"vLLM render answered features whose {key} is not one list of images")
    placeholders = maps["mm_placeholders"][MODALITY]
    hashes = maps["mm_hashes"][MODALITY]
    data = maps["kwargs_data"][MODALITY]
    if not all(isinstance(items, list) and len(items) == len(images) for items in (placeholders, hashes, data)):
        raise UpstreamMalformed(
            f"vLLM render answered features for another number of images than the prompt's {len(images)}"
        )
    placed = []
    for index, (image, placeholder, item) in enumerate(zip(images, placeholders, data, strict=True)):
        length = placeholder.get("length") if isinstance(placeholder, dict) else None
        if type(length) is not int:
            raise UpstreamMalformed("vLLM render answered an image placeholder without a length")
        if length != image.length:
            raise ImageCountMismatch(
                f"vLLM expanded image {index + 1} ({image.image.width}×{image.image.height}) to {length} tokens where "
                f"the model family counts {image.length}: the server's image processor resizes with other pixel "
                "bounds (set tito_image_min_pixels and tito_image_max_pixels to the server's); nothing was recorded"
            )
        if not isinstance(item, str):
            raise UpstreamMalformed(
                f"vLLM render answered image {index + 1} without its data (a processor-cache hit): every image goes "
                "with its data on every turn; start vLLM with --mm-processor-cache-gb 0"
            )
        placed.append({**placeholder, "offset": image.offset, "length": image.length})
    return {**features, "mm_placeholders": {MODALITY: placed}}
