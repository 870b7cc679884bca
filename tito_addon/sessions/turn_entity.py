"""A committed turn: the one shape of what a turn adds to its session, whichever store holds it.

The tree holds it by reference (`TurnNode.turn`), a shared store packs it with one codec (`redis_tree`), and it is
read from its record line in one place (`records/stored_turns`), the same way for a turn just written and for one read
back after a restart. A field the record line carries has the line's name; a new field is one line here (and, to be
on disk, the same name in `TurnRecord`).
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tito_addon.chat_images import ImageSpan
from tito_addon.sessions.message_keys import MessageKey


def id_array(ids: Sequence[int]) -> array:
    """Token ids as a compact array (4 bytes an id, not a Python int's 28): a session's tree holds every id once."""
    return ids if isinstance(ids, array) and ids.typecode == "I" else array("I", ids)


@dataclass(frozen=True, slots=True)
class Turn:
    """What a turn adds to its session's tree (immutable): the keys of the messages it appended and of its answer,
    that answer's reasoning, the prompt ids after its parent's completion, its completion ids, and what its record
    line says that its children need."""

    # Where its segment ends in the request's messages, and their keys (the appended messages, then its answer).
    message_end: int
    segment_keys: tuple[MessageKey, ...]
    # Its answer's reasoning as the store compares it: the text in this process's tree, a digest in a shared store.
    reasoning: str | None
    # From here on, the fields its record line carries under the same names (`line_fields`).
    prompt_added_ids: array
    completion_ids: array
    finish_reason: str | None
    tools_sha256: str | None = None  # a child's line carries its tools only when they changed
    chat_template_kwargs: dict[str, Any] | None = None  # what its prompt was rendered with (a child compares)
    reply_id: str | None = None  # the id an agent holds for it (`resp_…`)
    episode_id: str | None = None  # its episode and kind of call: a continuation inherits them
    call: str = "main"
    weight_version: str | None = None  # the weights that sampled it, where reported (a child on others is flagged)
    # How many of its sequence's first positions its record chain holds MoE routes for (its child asks from there).
    routed_experts_through: int | None = None
    # The images its prompt added, each with the run of pad ids it became (offsets from its sequence's first id).
    images: tuple[ImageSpan, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_added_ids", id_array(self.prompt_added_ids))
        object.__setattr__(self, "completion_ids", id_array(self.completion_ids))
        if not self.images:
            object.__setattr__(self, "images", ())
        elif not all(isinstance(image, ImageSpan) for image in self.images):
            object.__setattr__(self, "images", tuple(image_span(image) for image in self.images))
        if not self.chat_template_kwargs:
            object.__setattr__(self, "chat_template_kwargs", None)

    @property
    def segment_reasoning(self) -> tuple[str | None, ...]:
        """The reasoning per message of its segment: only its own answer has one."""
        return (None,) * (len(self.segment_keys) - 1) + (self.reasoning,)

    @property
    def tokens(self) -> int:
        return len(self.prompt_added_ids) + len(self.completion_ids)

    def with_values(self, **changes: Any) -> Turn:
        return dataclasses.replace(self, **changes)


def image_span(value: Any) -> ImageSpan:
    """An image span from its record line's or a shared store's form (a model with its fields, or their dict)."""
    if isinstance(value, ImageSpan):
        return value
    fields = value if isinstance(value, dict) else value.model_dump()
    return ImageSpan(**{f.name: fields[f.name] for f in dataclasses.fields(ImageSpan)})


#: The fields a turn's record line carries under their own names, in `Turn`'s order.
LINE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Turn))[3:]


@dataclass(frozen=True, slots=True)
class RecordedTurn:
    """A recorded turn put back into its session (parents first): its and its parent's turn ids, and the turn."""

    turn_id: int
    parent_turn_id: int | None
    turn: Turn
