"""One agent turn, end to end: validate -> locate -> prepare ids -> backend -> record -> commit -> reply.

This is the whole addon minus mitmproxy: it takes the request's path, headers and body and returns the
HTTP reply, so it can be tested and reused without a proxy. Validation and preparation touch no state; the
only state changes (the record line and the new tree node) happen together, synchronously, after the
backend answered, so a rejected or failed request leaves no trace in memory or on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from tito_addon.backends.backend_protocol import Backend, BackendResult, BackendTurn
from tito_addon.canonical_chat import ChatMessage, ChatRequest
from tito_addon.engine.prompt_ids import EncodedPrefixes, PromptIds
from tito_addon.engine.token_engine import PromptPiece, TokenEngine
from tito_addon.protocols.agent_api import AgentApi, AgentRequest, ReplyContext, Responder, Route, TurnOutcome
from tito_addon.protocols.http_reply import HttpReply, json_reply
from tito_addon.protocols.openai_responses import reply_session
from tito_addon.protocols.routing import agent_apis, find_route
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.records.record_models import SegmentSpan, TokenizerInfo, TurnRecord
from tito_addon.records.record_reader import RecordError, read_session_file, rebuild_session
from tito_addon.records.trajectory_recorder import TrajectoryRecorder
from tito_addon.sessions.message_keys import message_key
from tito_addon.sessions.session_ids import session_id_problem
from tito_addon.sessions.session_tree import Attachment, Session, SessionStore, TurnNode
from tito_addon.tito_errors import BadRequest, TitoError, UpstreamMalformed, UpstreamPassthrough
from tito_addon.turns.live_stream import LiveStream

logger = logging.getLogger(__name__)

SESSION_PREFIX = re.compile(r"^/sessions/[^/?#]+(?=/)")
SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "seed", "stop", "n", "logit_bias", "tool_choice",
    "parallel_tool_calls", "reasoning_effort", "response_format",
)  # fmt: skip
# Never forwarded: hop-by-hop headers and those the upstream call sets itself.
DROPPED_HEADERS = frozenset(
    {
        "host", "content-length", "content-encoding", "transfer-encoding", "accept-encoding", "connection",
        "keep-alive", "proxy-authorization", "proxy-connection", "te", "trailer", "upgrade", "expect",
    }
)  # fmt: skip


def strip_session_prefix(path: str) -> str:
    """`/sessions/{id}/v1/models` -> `/v1/models`: session-scoped base URLs reach the backend's own routes."""
    return SESSION_PREFIX.sub("", path, count=1)


def checked_session_id(value: str | None, where: str) -> str | None:
    if value is None:
        return None
    problem = session_id_problem(value)
    if problem is not None:
        raise BadRequest(f"invalid session id in {where}: {problem}; nothing was forwarded")
    return value


def tools_digest(tools: list[dict[str, Any]] | None) -> str | None:
    if not tools:
        return None
    canonical = json.dumps(tools, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class PreparedTurn:
    """Everything decided before the backend call; nothing here has changed any state."""

    route: Route
    agent: AgentRequest
    request: ChatRequest  # the canonical request (agent.chat)
    session_id: str | None
    attachment: Attachment
    parent: TurnNode | None
    appended: list[ChatMessage]
    piece: PromptPiece
    prompt: PromptIds
    kwargs: dict[str, Any]
    keys: list[Any]
    namespace: str
    # The id a new automatic session will get, known before the commit so a reply id can name it.
    new_session_id: str = field(default_factory=lambda: uuid.uuid4().hex)


class TurnService:
    def __init__(
        self,
        engine: TokenEngine,
        backend: Backend,
        store: SessionStore,
        recorder: TrajectoryRecorder | None,
        *,
        session_header: str = "x-session-id",
        prefixes: EncodedPrefixes | None = None,
        record_message_text: bool = True,
        signer: TurnSigner | None = None,
    ) -> None:
        self.record_message_text = record_message_text
        # Signs what agents echo back (thinking signatures, encrypted reasoning); a random key when the proxy
        # has none, so nothing is ever signed with a guessable one.
        self.signer = signer if signer is not None else TurnSigner(secrets.token_bytes(32))
        self.apis: list[AgentApi] = agent_apis(self.signer)
        self.engine = engine
        self.backend = backend
        self.store = store
        self.prefixes = prefixes if prefixes is not None else EncodedPrefixes()
        self.recorder = recorder
        self.session_header = session_header.lower()

    def route(self, path: str) -> Route | None:
        return find_route(self.apis, path)

    async def handle(self, path: str, headers: dict[str, str], body: bytes, base_url: str) -> HttpReply:
        """Serve one agent request. Never raises: every outcome is an HTTP reply in the agent's own API."""
        route = self.route(path)
        if route is None:
            return json_reply(400, BadRequest(f"not an agent API path: {path}; nothing was forwarded").body())
        try:
            return await self._handle(route, {k.lower(): v for k, v in headers.items()}, body, base_url)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the API's own error reply
            return error_reply(route.api, exc)

    def prepare(
        self, path: str, headers: dict[str, str], body: bytes, base_url: str = "", route: Route | None = None
    ) -> PreparedTurn:
        route = route or self.route(path)
        if route is None:
            raise BadRequest(f"not an agent API path: {path}")
        session_id = checked_session_id(headers.get(self.session_header), f"header {self.session_header}")
        path_id = route.path_session_id
        path_id = checked_session_id(unquote(path_id), "path") if path_id is not None else None
        session_id = session_id if session_id is not None else path_id
        agent = route.api.parse(body, route.action)
        request = agent.chat
        self.backend.check_request(request)
        if session_id is not None and session_id not in self.store.sessions:
            self.restore(session_id)
        kwargs = self.engine.effective_kwargs(request.chat_template_kwargs, thinking=agent.thinking)
        messages = request.messages
        keys = [message_key(m) for m in messages]
        reasonings = [m.reasoning_text() if m.role == "assistant" else None for m in messages]
        namespace = f"{base_url} {request.model or ''}"
        if agent.previous_response_id is not None:
            attachment = self.continued(agent.previous_response_id, session_id)
        else:
            attachment = self.store.locate(session_id, keys, reasonings, namespace)
        parent = attachment.parent
        appended = messages[attachment.matched :]
        if agent.previous_response_id is not None and (
            any(m.role == "assistant" for m in appended)
            or self.engine.history_changed(parent.template_kwargs or {}, kwargs, request.tools)  # type: ignore[union-attr]
        ):
            # The stored history's text is not at hand to render afresh: the client must send it.
            raise BadRequest(
                "this request cannot continue previous_response_id exactly (it appends an assistant item or renders "
                "the history with other template kwargs); send the whole input instead"
            )
        if parent is not None and any(m.role == "assistant" for m in appended):
            # An edited or injected assistant message cannot extend stored ids: serve it as a fresh render,
            # a new root of the same session.
            parent, appended = None, messages
        elif parent is not None and self.engine.history_changed(parent.template_kwargs or {}, kwargs, request.tools):
            # Kwargs that render the stored history differently (gpt-oss `reasoning_effort` lives in the system
            # message) would not reach the model through a continuation: a fresh render tells it, as a new root.
            parent, appended = None, messages
        if parent is None:
            piece = self.engine.first_turn(messages, request.tools, kwargs)
        else:
            piece = self.engine.continuation(parent.completion_ids, appended, request.tools, kwargs)
        prompt = PromptIds(parent, piece.ids, self.prefixes)
        return PreparedTurn(
            route, agent, request, session_id, attachment, parent, appended, piece, prompt, kwargs, keys, namespace
        )

    def continued(self, reply_id: str, session_id: str | None) -> Attachment:
        """Where a request that names a previous reply attaches: that reply's turn, found in the live tree or,
        after a restart, in the record of the session the id names."""
        node = self.store.replies.get(reply_id)
        if node is None:
            named = reply_session(reply_id)
            if named is not None and named not in self.store.sessions and session_id_problem(named) is None:
                self.restore(named)
                node = self.store.replies.get(reply_id)
        if node is None:
            raise TitoError(f"previous response {reply_id!r} is not a turn this proxy has recorded", status=404)
        if session_id is not None and node.session.session_id != session_id:
            raise BadRequest(f"previous response {reply_id!r} belongs to another session than {session_id!r}")
        return Attachment(node.session, node, node.message_end)

    async def _handle(self, route: Route, headers: dict[str, str], body: bytes, base_url: str) -> HttpReply:
        self.sweep()
        prepared = self.prepare("", headers, body, base_url, route)
        if route.action == "count_tokens":
            # The exact prompt length this turn would have: our own render, nothing forwarded or recorded.
            return json_reply(200, route.api.count_tokens_body(len(prepared.prompt)))
        busy = prepared.attachment.session
        if busy is not None:
            busy.inflight += 1  # protects it from eviction while the backend works
        try:
            return await self._run(prepared, headers, base_url)
        finally:
            self._release(busy)

    def backend_turn(self, prepared: PreparedTurn, headers: dict[str, str], base_url: str) -> BackendTurn:
        chat_body = dict(prepared.agent.chat_body)
        chat_body["chat_template_kwargs"] = prepared.kwargs
        forward = {k: v for k, v in headers.items() if k not in DROPPED_HEADERS and k != self.session_header}
        return BackendTurn(
            base_url, prepared.route.chat_path, chat_body, prepared.prompt, forward, self.engine.stop_texts
        )

    def responder(self, prepared: PreparedTurn) -> Responder:
        api = prepared.route.api
        session = prepared.attachment.session
        known = session.session_id if session is not None else (prepared.session_id or prepared.new_session_id)
        reply_id = api.reply_id(known) or ""
        if api.signs:
            try:
                self.signer.key  # noqa: B018 - loaded before the backend runs, so a failure records nothing
            except OSError as exc:
                raise TitoError(f"cannot keep the signing key: {exc}; nothing was forwarded") from exc
        context = ReplyContext(reply_id=reply_id, prompt_tokens=len(prepared.prompt), signer=self.signer)
        return api.responder(prepared.agent, context)

    def finish(
        self, prepared: PreparedTurn, result: BackendResult, headers: dict[str, str], responder: Responder
    ) -> tuple[dict[str, Any], TurnOutcome]:
        """Commit a turn the backend completed; the flow metadata that describes it, and what the agent gets."""
        result.message = responder.adapt(result.message)
        node, fields = self.commit(prepared, result, headers.get("x-request-id"), responder.reply_id)
        self.sweep()  # a new session may have taken the store past its capacity
        metadata = {
            "session_id": node.session.session_id,
            "turn_id": node.turn_id,
            "parent_turn_id": node.parent.turn_id if node.parent else None,
            "prompt_tokens": len(prepared.prompt),
            "completion_tokens": len(result.completion_ids),
            # The whole record line: a `-w` flow file is then enough to regenerate the trajectory (`-r`).
            "record": fields,
        }
        tito_headers = {"x-tito-session-id": metadata["session_id"], "x-tito-turn-id": str(metadata["turn_id"])}
        outcome = TurnOutcome(
            message=result.message,
            finish_reason=result.finish_reason,
            prompt_tokens=len(prepared.prompt),
            completion_tokens=len(result.completion_ids),
            agent_body=result.agent_body,
            agent_bytes=result.agent_bytes,
            matched_stop=matched_stop(result.agent_body),
            headers=tito_headers,
        )
        return metadata, outcome

    async def _run(self, prepared: PreparedTurn, headers: dict[str, str], base_url: str) -> HttpReply:
        responder = self.responder(prepared)
        result = await self.backend.run_turn(self.backend_turn(prepared, headers, base_url))
        metadata, outcome = self.finish(prepared, result, headers, responder)
        reply = responder.reply(outcome)
        reply.headers.update(outcome.headers)
        reply.metadata = metadata
        return reply

    async def open_stream(
        self, path: str, headers: dict[str, str], body: bytes, base_url: str
    ) -> HttpReply | LiveStream:
        """A live stream of the turn, or an ordinary reply when it fails before its first chunk (status and
        body as for a whole turn). Nothing is committed unless the backend finishes the turn."""
        headers = {k.lower(): v for k, v in headers.items()}
        route = self.route(path)
        if route is None:
            return json_reply(400, BadRequest(f"not an agent API path: {path}; nothing was forwarded").body())
        try:
            self.sweep()
            prepared = self.prepare(path, headers, body, base_url, route)
            if route.action != "turn":
                raise BadRequest(f"{route.action} does not stream")
        except TitoError as error:
            return error_reply(route.api, error)
        responder = self.responder(prepared)
        events = self.backend.stream_turn(self.backend_turn(prepared, headers, base_url))
        busy = prepared.attachment.session
        if busy is not None:
            busy.inflight += 1
        try:
            first = await anext(events)
        except (StopAsyncIteration, Exception) as exc:
            await events.aclose()
            self._release(busy)
            if isinstance(exc, StopAsyncIteration):
                exc = UpstreamMalformed("backend stream ended before its first chunk")
            return error_reply(route.api, exc)
        return LiveStream(
            events,
            first,
            responder,
            commit=lambda result: self.finish(prepared, result, headers, responder),
            release=lambda: self._release(busy),
        )

    def _release(self, session: Session | None) -> None:
        if session is not None:
            session.inflight -= 1
            self.store.touch(session)

    def commit(
        self, prepared: PreparedTurn, result: BackendResult, request_id: str | None, reply_id: str | None = None
    ) -> tuple[TurnNode, dict[str, Any]]:
        """Write the record line, then add the node; returns the node and the line's fields. Synchronous, so no
        other turn can interleave."""
        session = prepared.attachment.session
        if session is None and prepared.session_id is not None:
            session = self.store.sessions.get(prepared.session_id)
        elif session is None:
            # Looked up again now: identical first requests that were in flight together (a GRPO group)
            # join the group of whichever committed first.
            session = self.store.prompt_group(prepared.namespace, prepared.keys)
        if session is None:
            session = self.store.new_session(prepared.session_id, prepared.namespace, prepared.new_session_id)
        assistant = ChatMessage.model_validate({**result.message, "role": "assistant"})
        parent = prepared.parent
        appended_keys = prepared.keys[len(prepared.keys) - len(prepared.appended) :]
        segment_keys = tuple(appended_keys) + (message_key(assistant),)
        segment_reasoning = tuple(None for _ in prepared.appended) + (assistant.reasoning_text(),)
        tools_sha = tools_digest(prepared.request.tools)
        request = prepared.request
        # Only the sampling fields are dumped: dumping the whole request would re-serialise every message.
        dumped = request.model_dump(mode="json", include=set(SAMPLING_KEYS) & set(prepared.agent.chat_body))
        sampling = {k: v for k, v in dumped.items() if v is not None}
        record = TurnRecord(
            session_id=session.session_id,
            turn_id=session.next_turn_id,
            parent_turn_id=parent.turn_id if parent else None,
            ts=time.time(),
            model=request.model,
            backend_kind=self.backend.kind,
            request_id=request_id,
            sampling=sampling,
            chat_template_kwargs=prepared.kwargs,
            tools_sha256=tools_sha,
            tools=request.tools if (parent is None or tools_sha != parent.tools_sha256) else None,
            appended_messages=[m.model_dump(mode="json", exclude_none=True) for m in prepared.appended]
            if self.record_message_text
            else None,
            appended_keys=None if self.record_message_text else [key.hex() for key in appended_keys],
            api=prepared.route.api.name,
            reply_id=reply_id or None,
            appended_items=(prepared.agent.appended_items(len(prepared.keys) - len(prepared.appended)) or None)
            if self.record_message_text
            else None,
            left_out=prepared.agent.dropped or None,
            prompt_added_ids=prepared.piece.ids,
            prompt_segments=[SegmentSpan(source=s.source, start=s.start, end=s.end) for s in prepared.piece.segments],
            prompt_len=len(prepared.prompt),
            completion_ids=result.completion_ids,
            completion_logprobs=result.completion_logprobs,
            assistant_message=result.message,
            finish_reason=result.finish_reason,
            ambiguous_parent=prepared.attachment.ambiguous and parent is not None,
            render_skew=result.extra.get("render_skew"),
            backend_version=result.extra.get("backend_version"),
            tokenizer=TokenizerInfo(
                name=self.engine.tokenizer_name,
                tokenizer_sha256=self.engine.tokenizer_sha256,
                template_sha256=self.engine.template_sha256,
                family=self.engine.family.name,
            ),
        )
        fields = record.line_fields()  # dumped once: for the line and for the flow metadata
        if self.recorder is not None:
            self.recorder.write_turn(record, fields)
        node = self.store.commit(
            session,
            parent,
            (parent.message_end if parent else 0) + len(segment_keys),
            segment_keys,
            segment_reasoning,
            prepared.piece.ids,
            result.completion_ids,
            result.finish_reason,
            tools_sha,
            template_kwargs=prepared.kwargs,
            reply_id=reply_id or None,
        )
        prepared.prompt.remember(node, result.completion_ids)
        return node, fields

    def restore(self, session_id: str) -> None:
        """Rebuild a named session from its record file (after a restart or hot reload), so its turns
        extend the recorded ids and its turn ids continue instead of colliding."""
        if self.recorder is None:
            return
        path = self.recorder.path_for(session_id)
        if not path.is_file():
            return
        try:
            recorded = read_session_file(path)
            recorded.full_ids()  # proves every parent is present and every prompt length adds up
        except (OSError, RecordError) as exc:
            raise TitoError(f"cannot resume session from its record file: {exc}", status=409) from exc
        session = self.store.new_session(session_id)
        nodes = rebuild_session(self.store, session, recorded.turns)
        if recorded.skipped_lines:
            session.next_turn_id += len(recorded.skipped_lines)  # never reuse the id of a torn line
        logger.info("tito: resumed session %s with %d recorded turns", session_id, len(nodes))

    def sweep(self) -> None:
        """Close idle sessions and those beyond capacity (never one with a turn in flight)."""
        for session, reason in self.store.sweep():
            self._close(session, reason)

    def close_all(self, reason: str) -> None:
        for session in list(self.store.sessions.values()):
            self.store.remove(session)
            self._close(session, reason)

    def _close(self, session: Session, reason: str) -> None:
        logger.info("tito: session %s closed (%s) after %d turns", session.session_id, reason, session.turns)
        if self.recorder is None or session.turns == 0:
            return
        try:
            self.recorder.close_session(session.session_id, session.turns, reason)
        except OSError:
            logger.exception("could not close the record of session %s", session.session_id)


def matched_stop(agent_body: dict[str, Any]) -> str | None:
    """The stop string that ended the turn, if one did: sglang says `matched_stop`, vLLM `stop_reason` (each is a
    token id instead when a stop token ended it)."""
    choices = agent_body.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    for key in ("matched_stop", "stop_reason"):
        if isinstance(choice.get(key), str):
            return choice[key]
    return None


def error_reply(api: AgentApi, exc: BaseException) -> HttpReply:
    """A failed turn in the agent's own API: the upstream's status verbatim, ours with its status."""
    if isinstance(exc, UpstreamPassthrough):
        body = api.passthrough_body(exc)
        return HttpReply(
            exc.status, {"content-type": exc.content_type if body is exc.body else "application/json"}, body
        )
    if isinstance(exc, TitoError):
        if exc.status >= 500:
            logger.warning("turn failed: %s", exc.message)
        return json_reply(exc.status, api.error_body(exc))
    logger.error("unexpected failure while serving a turn", exc_info=exc)
    return json_reply(500, api.error_body(TitoError("internal error in tito_addon; nothing was recorded")))
