"""A row's images for a trainer: decoded as the engine decoded them, and processed as the trainer's own processor does.

Exported rows carry each image as the agent sent it (`multi_modal_data` / `multimodal_inputs`: `{"images": [...]}`,
bytes in Parquet, base64 in JSON Lines). Both trainers run the model's image processor over the images to get the pixel
tensors their models read (verl `_compute_multi_modal_inputs`, slime `multimodal_train_inputs`); the image tokens of the
row's ids must be what that processor counts, or the model would pair the pixels with the wrong positions, so the counts
are checked here before anything trains.
"""

from __future__ import annotations

import base64
import io
from typing import Any


def media_images(value: Any, where: str) -> list[Any] | None:
    """A row's raw images as PIL images, turned by their EXIF orientation as the engines' loaders turn them; None for a
    row without images."""
    if value is None:
        return None
    images = value.get("images") if isinstance(value, dict) else None
    if not isinstance(images, list) or not images:
        raise ValueError(f"{where}: its media is not {{'images': [...]}} with at least one image")
    from PIL import Image, ImageOps

    out = []
    for item in images:
        data = base64.b64decode(item, validate=True) if isinstance(item, str) else bytes(item)
        with Image.open(io.BytesIO(data)) as opened:
            opened.load()
            out.append(ImageOps.exif_transpose(opened).convert("RGB"))
    return out


def image_inputs(processor: Any, images: list[Any], ids: list[int], where: str) -> dict[str, Any]:
    """The image processor's tensors for a row's images (`pixel_values`, `image_grid_thw`), checked against the row's
    ids: each image's run of `<|image_pad|>` must be as long as the processor counts it. `processor`: the model's
    processor (its `image_processor` and `tokenizer` are read) or an object with both."""
    image_processor = processor.image_processor
    merge = int(image_processor.merge_size)
    out = dict(image_processor(images=images, return_tensors="pt"))
    grid = out["image_grid_thw"]
    counted = [int(t * h * w) // (merge * merge) for t, h, w in grid.tolist()]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    runs: list[int] = []
    previous = None
    for token in ids:
        if token == pad:
            if previous != pad:
                runs.append(0)
            runs[-1] += 1
        previous = token
    if runs != counted:
        raise ValueError(
            f"{where}: its ids hold image runs of {runs} tokens where this processor counts {counted}: it resizes "
            "images with other bounds than the engine that sampled the row (its min_pixels / max_pixels)"
        )
    return out
