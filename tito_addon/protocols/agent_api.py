"""What every agent-facing API provides to the turn: a route, a parsed request, and a responder per turn.

An API module translates its request into the canonical chat form (the engine, the session tree and the backends
see nothing else) and translates the completed turn back. Streaming is one mechanism for every API: a responder
consumes canonical `chat.completion.chunk` dicts, live from the backend or made from a finished message
(`chunks_from_message`), so a re-framed stream and a live one are written by the same code. The APIs translated to
chat fill in one template, `translated_api`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from tito_addon.canonical_chat import ChatMessage, ChatRequest, json_value_problem
from tito_addon.protocols.http_reply import HttpReply
from tito_addon.protocols.known_messages import KnownMessages
from tito_addon.protocols.known_requests import KnownRequests
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.tito_errors import TitoError, UpstreamPassthrough

EVENT_STREAM_HEADERS = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}
# A stream made from a finished turn (the agent asked for one, the backend answered whole); a live one says `live`.
REFRAMED_STREAM_HEADERS = {**EVENT_STREAM_HEADERS, "x-tito-stream": "reframed"}

# Fields no agent API defines that sglang and vLLM read from a chat body (sampling, constrained decoding, template
# kwargs): an Anthropic or Responses request may carry them as extensions, and they go to the backend as they are.
BACKEND_EXTENSIONS = (
    "chat_template_kwargs", "structured_outputs", "seed", "min_p", "repetition_penalty", "frequency_penalty",
    "presence_penalty", "min_tokens", "ignore_eos", "regex", "ebnf", "json_schema",
)  # fmt: skip


def backend_extensions(raw: dict[str, Any]) -> dict[str, Any]:
    return {name: raw[name] for name in BACKEND_EXTENSIONS if name in raw}


def with_known_chat(
    chat_body: dict[str, Any], found: list[ChatMessage | None], *, walked: bool, rest_walked: bool = False
) -> ChatRequest | None:
    """The chat form validated with each message that `found` holds (validated on an earlier turn) taken as it was;
    None when there is none, or when it is refused (the whole validation then says why, exactly as always).
    `walked`: the body's JSON bounds were checked already (a translation); else the new messages' are, each at its
    depth in the request, with the other members unless `rest_walked` (they are a known request's own)."""
    if not any(found):
        return None
    messages = chat_body["messages"]
    if not walked:
        new = [raw for raw, message in zip(messages, found, strict=True) if message is None]
        if json_value_problem({"messages": new} if rest_walked else {**chat_body, "messages": new}) is not None:
            return None
    mixed = [raw if message is None else message for raw, message in zip(messages, found, strict=True)]
    try:
        return ChatRequest.model_validate({**chat_body, "messages": mixed}, context={"bounded": True})
    except (ValidationError, RecursionError):
        return None


@dataclass(frozen=True)
class Route:
    """Where a request goes: its API, the action, the session id in its path, and the backend's chat path."""

    api: AgentApi
    action: str  # "turn", "count_tokens", or "compact" (a compaction the proxy serves: /v1/responses/compact)
    path_session_id: str | None  # still percent-encoded, as it appeared in `/sessions/{id}/`
    chat_path: str  # the backend's chat-completions path for this turn (the agent's own prefix kept)
    # What the path itself says, where the API puts it there (Gemini's `models/{model}:streamGenerateContent`): the
    # model asked for, and that the agent asked for a stream.
    model: str | None = None
    stream: bool = False


@dataclass
class AgentRequest:
    """An agent's request in the canonical form, with what its own form adds."""

    chat: ChatRequest
    chat_body: dict[str, Any]  # what the backend receives besides the ids (the canonical chat body)
    stream: bool
    # The request's conversation in its own form, and for each canonical message the index of the item it came
    # from: what a turn appended is recorded in both forms.
    items: list[dict[str, Any]] = field(default_factory=list)
    item_of: list[int] = field(default_factory=list)
    thinking: bool | None = None  # the agent's thinking switch, where its API has one
    previous_response_id: str | None = None
    # What the prompt leaves out of the request and the record says (hosted tools, unreadable reasoning).
    dropped: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # API-specific reply options
    # A compaction the proxy is asked to serve (what asked: `compaction_trigger`, `/responses/compact`), and the
    # replies whose summaries the request's compaction items carry, oldest first (`protocols/compaction_items`).
    compacts: str | None = None
    compaction_refs: list[str] = field(default_factory=list)
    # Compact instead of answering once the prompt holds this many tokens, asking the model this (Anthropic's
    # `compact_20260112` edit).
    compact_when: tuple[int, str] | None = None

    def appended_items(self, first_appended: int) -> list[dict[str, Any]]:
        """The agent's own items from the one the first appended canonical message came from."""
        if not self.items or first_appended >= len(self.item_of):
            return []
        return self.items[self.item_of[first_appended] :]


@dataclass
class TurnOutcome:
    """A committed turn, as the responders need it."""

    message: dict[str, Any]  # the assistant message as the agent sees it (after `Responder.adapt`)
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    agent_body: dict[str, Any]  # the backend's chat completion (the chat API answers with it)
    agent_bytes: bytes | None
    matched_stop: str | None
    headers: dict[str, str]
    reasoning_tokens: int = 0  # the completion's tokens that were reasoning (up to the family's end-of-thinking)


class Responder(Protocol):
    """One turn's answer in its API: minted ids, the whole reply, and the stream."""

    stream_headers: dict[str, str]  # a live stream's (the proxy adds `x-tito-stream: live`)
    reply_id: str | None  # recorded with the turn

    def adapt(self, message: dict[str, Any]) -> dict[str, Any]:
        """The assistant message as this API presents it (tool-call ids it minted): committed and echoed back."""
        ...

    def reply(self, outcome: TurnOutcome) -> HttpReply: ...

    def stream_start(self) -> bytes: ...

    def stream_chunk(self, chunk: dict[str, Any]) -> bytes: ...

    def stream_end(self, outcome: TurnOutcome, tail: list[dict[str, Any]]) -> bytes: ...

    def stream_error(self, message: str) -> bytes: ...


class AgentApi(Protocol):
    name: str  # recorded as the turn's `api`
    signs: bool  # whether its replies carry signed values (the signing key must exist before the turn runs)

    @property
    def memos(self) -> tuple[KnownRequests | KnownMessages, ...]:
        """What it remembers of the requests it read (`known_requests`, `known_messages`), so that a request which
        extends one parses only what its agent appended; each is bounded by `resize_memos`."""
        ...

    def resize_memos(self, budget_bytes: int) -> None:
        """Bound each memo to `budget_bytes` (an estimate of its memory), forgetting the least recently used."""
        ...

    def route(self, path: str) -> Route | None: ...

    def parse(self, body: bytes, action: str = "turn", route: Route | None = None) -> AgentRequest:
        """The request in the canonical form; `route` the path it came on, where the path says more than `action`."""
        ...

    def reply_id(self, session_id: str | None = None) -> str | None:
        """A fresh id for one turn's reply (naming its session where that is known and the id must find its turn
        again), or None where the backend's own completion id is the reply's."""
        ...

    def responder(self, request: AgentRequest, context: ReplyContext) -> Responder: ...

    def error_status(self, error: TitoError) -> int:
        """The status the API answers the error with: its own, where the API's agents read it as TitoError means it."""
        ...

    def error_body(self, error: TitoError) -> bytes: ...

    def passthrough_body(self, upstream: UpstreamPassthrough) -> bytes: ...

    def count_tokens_body(self, count: int) -> bytes: ...


@dataclass(frozen=True)
class ReplyContext:
    """What a responder may need from the turn before the backend answers."""

    reply_id: str  # the id the agent gets for this turn (`msg_…`, `resp_…`); recorded with the turn
    prompt_tokens: int
    signer: TurnSigner  # thinking signatures, encrypted_content
    # A recorded turn answered again: its ids are the recorded ones, never minted anew (the agent echoes them).
    replayed: bool = False


def chunks_from_message(
    base: dict[str, Any], message: dict[str, Any], finish_reason: str | None
) -> list[dict[str, Any]]:
    """A finished assistant message as the `chat.completion.chunk`s a backend would have streamed (without the
    finish chunk, which the responder writes after the commit)."""

    def chunk(delta: dict[str, Any]) -> dict[str, Any]:
        return {**base, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}

    out = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        out.append(chunk({"reasoning_content": reasoning}))
    if message.get("content"):
        out.append(chunk({"content": message["content"]}))
    for position, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {}
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        delta_call = {
            "index": position,
            "id": call.get("id"),
            "type": "function",
            "function": {"name": function.get("name"), "arguments": arguments},
        }
        out.append(chunk({"tool_calls": [delta_call]}))
    return out
