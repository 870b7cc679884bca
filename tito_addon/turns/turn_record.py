"""The record line of a completed turn, and the tree segment it adds: built once, whichever store commits it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from tito_addon.backends.backend_protocol import BackendResult
from tito_addon.backends.expert_routes import TurnRoutes
from tito_addon.canonical_chat import ChatMessage
from tito_addon.chat_images import ChatImage, without_image_data
from tito_addon.engine.token_engine import TokenEngine
from tito_addon.records.record_models import TURN_SCHEMA, TurnRecord, without_defaults
from tito_addon.records.stored_turns import turn_of
from tito_addon.sessions.message_keys import message_key
from tito_addon.sessions.turn_entity import Turn
from tito_addon.turns.episode_places import record_fields
from tito_addon.turns.prompt_images import added_spans
from tito_addon.turns.turn_types import PreparedTurn

SAMPLING_KEYS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "seed", "stop", "n", "logit_bias", "tool_choice",
    "parallel_tool_calls", "reasoning_effort", "response_format",
})  # fmt: skip


class ToolsDigests:
    """The digest of a tool list (its canonical JSON's sha256), remembered by the list's orjson bytes: an agent sends
    the same tools every turn, and writing them canonically (sorted keys, by the standard library) cost ~0.5 ms a
    turn for Claude Code's. Equal orjson bytes are equal JSON values (it writes each number's shortest exact form),
    so a remembered digest is the one the canonical writing gives."""

    def __init__(self, entries: int = 32) -> None:
        self.entries = entries
        self._known: OrderedDict[bytes, str] = OrderedDict()

    def __call__(self, tools: list[dict[str, Any]] | None) -> str | None:
        if not tools:
            return None
        try:
            encoded: bytes | None = orjson.dumps(tools)
        except TypeError:  # (orjson's JSONEncodeError) beyond what it writes: a 65-bit integer, a lone surrogate
            encoded = None
        if encoded is not None and (known := self._known.get(encoded)) is not None:
            self._known.move_to_end(encoded)
            return known
        canonical = json.dumps(tools, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        digest = hashlib.sha256(canonical.encode()).hexdigest()
        if encoded is not None:
            self._known[encoded] = digest
            if len(self._known) > self.entries:
                self._known.popitem(last=False)
        return digest


tools_digest = ToolsDigests()


def reasoning_tokens(completion_ids: list[int], message: dict[str, Any], end_id: int | None) -> int:
    """How many of a completion's ids were its reasoning (the backend parsed some out of it): up to and with the
    family's end-of-reasoning token (`TokenEngine.reasoning_end_id`), or all of them when the turn was cut off
    before it."""
    if end_id is None or not (message.get("reasoning_content") or message.get("reasoning")):
        return 0
    try:
        return completion_ids.index(end_id) + 1
    except ValueError:
        return len(completion_ids)


@dataclass(frozen=True)
class CompletedTurn:
    """A turn the backend finished: its record line, and the turn its session's tree holds (read from that line)."""

    session_id: str
    turn_id: int
    fields: dict[str, Any]  # the line's fields (`TurnRecord.line_fields`), for the line and for the flow metadata
    turn: Turn
    routes: bytes | None = None  # its MoE routes' rows, kept beside the line (`fields["routed_experts"]` says how)
    images: tuple[ChatImage, ...] = ()  # the images its prompt added, kept in the image store (`fields["images"]`)


def other_weights(parent: str | None, version: str | None) -> str | None:
    """The parent turn's weight version where it is not this turn's (both reported): what the record flags."""
    return parent if parent is not None and version is not None and parent != version else None


def completed_turn(
    prepared: PreparedTurn,
    result: BackendResult,
    engine: TokenEngine,
    backend_kind: str,
    *,
    session_id: str,
    turn_id: int,
    request_id: str | None,
    reply_id: str | None,
    record_message_text: bool,
    completion_budget: dict[str, int] | None = None,
) -> CompletedTurn:
    assistant = ChatMessage.model_validate({**result.message, "role": "assistant"})
    parent = prepared.parent
    appended_keys = prepared.keys[len(prepared.keys) - len(prepared.appended) :]
    segment_keys = tuple(appended_keys) + (message_key(assistant),)
    tools_sha = tools_digest(prepared.request.tools)
    place = prepared.place
    episode = place.episode_of(session_id, turn_id, automatic=prepared.session_id is None)
    request = prepared.request
    # Only the sampling fields are dumped: dumping the whole request would re-serialise every message.
    asked = SAMPLING_KEYS.intersection(prepared.agent.chat_body)
    dumped = request.model_dump(mode="json", include=asked) if asked else {}
    first_appended = len(prepared.keys) - len(prepared.appended)
    parent_end = parent.end_len if parent is not None else 0
    # The line is built as `TurnRecord.line_fields` would give it, then validated as a TurnRecord (what every
    # reader does with it), not dumped from one: a model and its dump cost twice the validation.
    fields = without_defaults({
        "schema": TURN_SCHEMA,
        "session_id": session_id,
        "turn_id": turn_id,
        "parent_turn_id": parent.turn_id if parent else None,
        "ts": time.time(),
        "model": request.model,
        "backend_kind": backend_kind,
        "request_id": request_id,
        "sampling": {k: v for k, v in dumped.items() if v is not None},
        "chat_template_kwargs": dict(prepared.kwargs),
        "tools_sha256": tools_sha,
        "tools": request.tools if (parent is None or tools_sha != parent.turn.tools_sha256) else None,
        "appended_messages": [m.model_dump(mode="json", exclude_none=True) for m in prepared.appended]
        if record_message_text
        else None,
        "appended_keys": None if record_message_text else [key.hex() for key in appended_keys],
        "prompt_added_ids": prepared.piece.ids,
        "prompt_segments": [{"source": s.source, "start": s.start, "end": s.end} for s in prepared.piece.segments],
        "prompt_len": len(prepared.prompt),
        "completion_ids": result.completion_ids,
        "completion_logprobs": result.completion_logprobs,
        "assistant_message": result.message,
        "finish_reason": result.finish_reason,
        "reasoning_tokens": reasoning_tokens(result.completion_ids, result.message, engine.reasoning_end_id) or None,
        "ambiguous_parent": prepared.attachment.ambiguous and parent is not None,
        "api": prepared.route.api.name,
        "reply_id": reply_id or None,
        "appended_items": appended_items(prepared, first_appended) if record_message_text else None,
        "left_out": prepared.agent.dropped or None,
        "render_skew": result.extra.get("render_skew"),
        "backend_version": result.extra.get("backend_version"),
        "weight_version": result.weight_version,
        "weight_version_spans": result.weight_version_spans,
        "resumed": result.resumed,
        "parent_weight_version": other_weights(parent.turn.weight_version if parent else None, result.weight_version),
        "engine": result.extra.get("engine"),
        "failover": result.extra.get("failover"),
        "completion_budget": completion_budget,
        "served_model": result.extra.get("served_model"),
        **routes_fields(result.routes),
        "images": [dataclasses.asdict(span) for span in added_spans(prepared.piece, parent_end)] or None,
        **record_fields(place, episode),
        "tokenizer": {
            "name": engine.tokenizer_name,
            "tokenizer_sha256": engine.tokenizer_sha256,
            "template_sha256": engine.template_sha256,
            "family": engine.family.name,
        },
    })  # fmt: skip
    line = TurnRecord.model_validate(fields)
    message_end = (parent.message_end if parent else 0) + len(segment_keys)
    turn = turn_of(line, message_end, segment_keys, assistant.reasoning_text())
    rows = result.routes.rows() if result.routes is not None else None
    images = tuple(placed.part.image for placed in prepared.piece.images if placed.part.image is not None)
    routes = rows.array.tobytes() if rows is not None else None
    return CompletedTurn(session_id, turn_id, fields, turn, routes, images)


def appended_items(prepared: PreparedTurn, first_appended: int) -> list[dict[str, Any]] | None:
    """The appended items in the agent's own form; where the prompt holds images, each image's bytes are its digest
    (the image store keeps them once; a line never holds one)."""
    items = prepared.agent.appended_items(first_appended) or None
    return without_image_data(items) if items and prepared.piece.images else items


def routes_fields(routes: TurnRoutes | None) -> dict[str, Any]:
    """A turn's `routed_experts` and `routed_experts_through` (where its file and offset are set as it is written)."""
    if routes is None:
        return {"routed_experts": None, "routed_experts_through": None}
    rows = routes.rows()
    kept: dict[str, Any] = {"start": routes.asked.start, "rows": rows.rows if rows is not None else 0}
    if rows is not None:
        kept.update(layers=rows.shape.layers, topk=rows.shape.topk, dtype=rows.array.dtype.name)
    if routes.attempt_starts:
        kept["attempts"] = routes.attempt_starts
    if routes.missing:
        kept["missing"] = routes.missing
    return {"routed_experts": kept, "routed_experts_through": routes.end}
