"""The boundary between the session flow and a backend kind.

The flow is always prepare (token engine) -> backend turn -> commit (session tree + recorder). A backend
kind turns exact prompt ids plus the agent's chat request into exact completion ids, their logprobs, the
parsed assistant message and the body the agent receives; everything kind-specific stays behind `Backend`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tito_addon.canonical_chat import AssistantMessage, ChatRequest
from tito_addon.engine.prompt_ids import PromptIds
from tito_addon.tito_errors import UpstreamMalformed


@dataclass(frozen=True)
class BackendTurn:
    base_url: str  # scheme://host:port[/prefix] of the backend
    chat_path: str  # the agent's chat path, e.g. /v1/chat/completions
    chat_body: dict[str, Any]  # the agent's request, with the effective chat_template_kwargs
    prompt: PromptIds
    headers: dict[str, str]  # headers to forward (authorization included; never recorded)
    stop_texts: dict[int, str] = field(default_factory=dict)  # the model's stop ids and their literal text

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids


@dataclass
class BackendResult:
    completion_ids: list[int]
    completion_logprobs: list[float]
    message: dict[str, Any]  # for the trajectory: reasoning mirrored into reasoning_content
    finish_reason: str | None
    agent_body: dict[str, Any]  # the ordinary chat completion the agent receives
    agent_bytes: bytes | None = None  # when set, sent verbatim instead of re-encoding agent_body
    usage: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamEnd:
    """The last event of a live stream: the turn's result, and the chunks that may only follow its commit."""

    result: BackendResult
    tail: list[dict[str, Any]]


class Backend(Protocol):
    kind: str

    def check_request(self, request: ChatRequest) -> None:
        """Refuse (BadRequest) what this kind cannot serve, before any state is looked at."""

    async def run_turn(self, turn: BackendTurn) -> BackendResult: ...

    async def can_stream(self, base_url: str, headers: dict[str, str]) -> bool:
        """Whether this backend can stream a turn with exact ids (else the finished turn is re-framed)."""
        ...

    def stream_turn(self, turn: BackendTurn) -> AsyncIterator[dict[str, Any] | StreamEnd]:
        """Agent-facing `chat.completion.chunk`s as they are generated, then one StreamEnd."""
        ...


def checked_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise UpstreamMalformed(f"backend returned no {what}")
    if not all(type(v) is int and v >= 0 for v in value):
        raise UpstreamMalformed(f"backend returned {what} that are not non-negative integers")
    return value


def checked_logprobs(values: list[Any], count: int) -> list[float]:
    if len(values) != count:
        raise UpstreamMalformed(f"backend returned {len(values)} logprobs for {count} completion tokens")
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UpstreamMalformed(f"backend returned a logprob that is not a finite number: {value!r}")
        out.append(float(value))
    return out


def checked_message(value: Any) -> AssistantMessage:
    if not isinstance(value, dict):
        raise UpstreamMalformed("backend returned a choice without a message object")
    try:
        message = AssistantMessage.model_validate(value)
    except ValueError as exc:
        raise UpstreamMalformed(f"backend returned an invalid assistant message: {exc}") from exc
    if not message.has_output():
        raise UpstreamMalformed("backend returned a message with neither content, tool calls nor reasoning")
    return message


def trajectory_message(raw: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as stored: what the backend sent, with reasoning readable by templates."""
    stored = {k: v for k, v in raw.items() if v is not None}
    stored.setdefault("role", "assistant")
    if not stored.get("reasoning_content") and stored.get("reasoning"):
        stored["reasoning_content"] = stored["reasoning"]
    return stored


def stream_end(
    turn: BackendTurn,
    base: dict[str, Any],
    message: dict[str, Any],
    finish_reason: str | None,
    completion_ids: list[int],
    logprobs: list[float],
    extra: dict[str, Any] | None = None,
) -> StreamEnd:
    """The end of a live stream: the result to commit, then the finish chunk and (if asked) the usage chunk."""
    checked_message(message)
    base = base or {"object": "chat.completion.chunk"}
    tail = [{**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}]}]
    if (turn.chat_body.get("stream_options") or {}).get("include_usage"):
        prompt, completion = len(turn.prompt), len(completion_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        tail.append({**base, "choices": [], "usage": usage})
    choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
    result = BackendResult(
        completion_ids=completion_ids,
        completion_logprobs=logprobs,
        message=trajectory_message(message),
        finish_reason=finish_reason,
        agent_body={**base, "object": "chat.completion", "choices": [choice]},
        extra=extra or {},
    )
    return StreamEnd(result, tail)
