"""The boundary between the session flow and a backend kind.

The flow is always prepare (token engine) -> backend turn -> commit (session tree + recorder). A backend
kind turns exact prompt ids plus the agent's chat request into exact completion ids, their logprobs, the
parsed assistant message and the body the agent receives; everything kind-specific stays behind `Backend`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tito_addon.backends.engine_failover import FailoverLog
from tito_addon.backends.expert_routes import RoutesAsked, TurnRoutes
from tito_addon.canonical_chat import AssistantMessage, ChatRequest
from tito_addon.chat_images import PromptImage
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
    special_ids: frozenset[int] = frozenset()  # the tokenizer's added and special tokens
    output_text: Callable[[list[int]], str] | None = None  # generated ids' text, as stop strings are checked on it
    failover: FailoverLog = field(default_factory=FailoverLog)  # the engines its calls may go to, what failed over
    routes: RoutesAsked | None = None  # its MoE routes, asked from where its session's recorded ones end
    # Every image of the prompt, in order, with where its pad ids lie (`prompt_ids` holds them expanded).
    images: tuple[PromptImage, ...] = ()
    # The sampling params the model recommends (its generation_config.json), for a backend call that the server does
    # not fill them in for as its chat endpoint would (sglang's /generate).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

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
    # The weights that sampled the turn, where the backend says (see `weight_version_of` / `weight_spans_of`).
    weight_version: str | None = None
    weight_version_spans: list[dict[str, Any]] | None = None  # only when the weights changed mid-turn
    # Only for a generation the backend aborted and we resumed: {attempts, cuts} (`StitchedGeneration.record`).
    resumed: dict[str, Any] | None = None
    # Asked for (`BackendTurn.routes`): the MoE routes its engine requests gave, laid from where they were asked.
    routes: TurnRoutes | None = None


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

    async def context_length(self, base_url: str, headers: dict[str, str]) -> int | None:
        """The server's context length (prompt + completion), asked once per backend; None when it does not say."""
        ...

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


def weight_version_of(value: Any) -> str | None:
    """A reported weight version as recorded: a string (an integer is taken as its decimal text), else None.

    It describes the turn, never decides it, so a malformed one is dropped rather than failing the turn."""
    if isinstance(value, str):
        return value
    if type(value) is int:
        return str(value)
    return None


def weight_spans_of(value: Any, count: int) -> tuple[str | None, list[dict[str, Any]] | None]:
    """vLLM's (0.32+) `weight_versions` of a generate choice: `[{version, start, end}]` over the completion tokens.

    Returns the turn's weight version (the last span's: the weights that sampled its last token, as sglang's
    `meta_info.weight_version` is the version current when the output finished) and, when the weights changed
    during the turn, every span. Malformed spans give neither; spans that do not tile the `count` completion
    tokens give the version but not the spans (kept only when they can be laid over the recorded tokens)."""
    if not isinstance(value, list) or not value:
        return None, None
    spans: list[dict[str, Any]] = []
    for span in value:
        if not isinstance(span, dict):
            return None, None
        version = weight_version_of(span.get("version"))
        start, end = span.get("start"), span.get("end")
        if version is None or type(start) is not int or type(end) is not int:
            return None, None
        spans.append({"version": version, "start": start, "end": end})
    bounds = [0] + [b for s in spans for b in (s["start"], s["end"])] + [count]
    tiles = all(bounds[i] == bounds[i + 1] for i in range(0, len(bounds), 2))
    tiles = tiles and all(s["start"] < s["end"] for s in spans)
    changed = len({s["version"] for s in spans}) > 1
    return spans[-1]["version"], spans if tiles and changed else None


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
    weight: tuple[str | None, list[dict[str, Any]] | None] = (None, None),
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
        weight_version=weight[0],
        weight_version_spans=weight[1],
    )
    return StreamEnd(result, tail)
