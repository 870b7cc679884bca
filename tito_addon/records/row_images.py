"""A row's images, as the export's layouts carry them (and a turn's, as re-drive sends them): read from the record
dir's image store, in prompt order, each checked against its digest.

Rows are self-contained (an export is moved, sent, read where the record dir is not), so each carries its images'
bytes, as the agent sent them: what the engine saw, and what the trainers' own processors read again.
"""

from __future__ import annotations

from typing import Any

from tito_addon.records.image_store import ImageStore
from tito_addon.records.record_models import RecordedImage
from tito_addon.records.record_reader import RecordError, SessionFile
from tito_addon.records.segment_branches import Branch


class MissingImage(RecordError):
    """An image a row's ids hold is not in the record dir's image store (or is not the bytes its name says)."""


def stored_images(session: SessionFile, images: list[RecordedImage], who: str) -> list[tuple[RecordedImage, bytes]]:
    """`images` (of `session`'s lines) with their bytes from its record dir's image store, each checked against its
    digest; one not there is a `MissingImage`: ids whose pad ids have no pixels can be neither scored nor trained on."""
    if not images:
        return []
    store = ImageStore(session.path.parent)
    out = []
    for image in images:
        name = f"{image.sha256}.{image.format}"
        try:
            out.append((image, store.read(name)))
        except OSError as exc:
            raise MissingImage(
                f"{who}: image {name} is not in {store.root} ({exc}); every image its ids hold is needed"
            ) from None
    return out


def row_images(branch: Branch) -> list[tuple[RecordedImage, bytes]]:
    """The row's images with their bytes, in prompt order."""
    if branch.session is None:
        return []
    return stored_images(branch.session, branch.images(), f"session {branch.path[-1].session_id}")


def images_column(branch: Branch) -> list[dict[str, Any]]:
    """Each image of the row (`images`): its digest, format, displayed size, run of pad ids in `input_ids` and bytes."""
    return [{**image.model_dump(), "bytes": data} for image, data in row_images(branch)]


def media_column(branch: Branch) -> dict[str, list[bytes]] | None:
    """The row's images as verl's agent loop and slime's `Sample` keep raw media: `{"images": [...]}` in prompt order
    (verl `AgentLoopOutput.multi_modal_data`, slime `Sample.multimodal_inputs`), each the bytes the agent sent; null
    for a text-only row. Both trainers run their processor over them (verl's `_compute_multi_modal_inputs`, slime's
    `multimodal_train_inputs`)."""
    images = row_images(branch)
    return {"images": [data for _, data in images]} if images else None
