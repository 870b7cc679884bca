"""One agent turn, end to end: validate -> locate -> prepare ids -> backend -> record -> commit -> reply.

This is the whole addon minus mitmproxy: it takes the request's path, headers and body and returns the
HTTP reply, so it can be tested and reused without a proxy. Validation and preparation touch no state; the
only state changes (the record line and the new tree node) happen together, synchronously, after the
backend answered, so a rejected or failed request leaves no trace in memory or on disk.
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from tito_addon.backends.backend_protocol import Backend, BackendResult, BackendTurn
from tito_addon.canonical_chat import ChatMessage, ChatRequest
from tito_addon.engine.prompt_ids import EncodedPrefixes, PromptIds
from tito_addon.engine.token_engine import PromptPiece, TokenEngine
from tito_addon.protocols.agent_api import AgentApi, AgentRequest, ReplyContext, Responder, Route, TurnOutcome
from tito_addon.protocols.http_reply import HttpReply, json_reply
from tito_addon.protocols.known_messages import DEFAULT_BUDGET_BYTES
from tito_addon.protocols.openai_responses import reply_session
from tito_addon.protocols.routing import agent_apis, find_route
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.records.record_reader import RecordError, read_session, rebuild_session
from tito_addon.records.trajectory_recorder import TrajectoryRecorder
from tito_addon.sessions.message_keys import message_key
from tito_addon.sessions.session_ids import automatic_session_id, session_id_problem
from tito_addon.sessions.session_tree import Attachment, Session, SessionStore, TurnNode
from tito_addon.sessions.shared_sessions import SharedSessions
from tito_addon.tito_errors import BadRequest, SessionClosed, TitoError, UpstreamMalformed
from tito_addon.turns.live_stream import LiveStream
from tito_addon.turns.shared_turns import Claim, SharedTurns, attach_to_reply
from tito_addon.turns.turn_record import completed_turn
from tito_addon.turns.turn_replies import error_reply, matched_stop

logger = logging.getLogger(__name__)

SESSION_PREFIX = re.compile(r"^/sessions/[^/?#]+(?=/)")
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
    # With a shared store: the digest of all the request's message keys (its GRPO group, when it is a first turn).
    request_path: bytes = b""

    @functools.cached_property
    def new_session_id(self) -> str:
        """The id a new automatic session will get, known before the commit so a reply id can name it. Minted when
        first asked (a first turn's reply or claim): a turn that continues a session never needs one, and minting
        reads the system's random source."""
        return automatic_session_id()


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request, before it is placed in a session tree."""

    route: Route
    agent: AgentRequest
    session_id: str | None
    kwargs: dict[str, Any]
    keys: list[Any]
    reasonings: list[str | None]
    namespace: str


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
        shared: SharedSessions | None = None,
        after_close: str = "refuse",
        memo_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        """`shared`: sessions in a store several proxies share (Redis) instead of `store`, this process's own.
        `after_close`: what a request naming a session its driver closed gets: `refuse` (409) or a `new` tree."""
        self.record_message_text = record_message_text
        # Signs what agents echo back (thinking signatures, encrypted reasoning); a random key when the proxy
        # has none, so nothing is ever signed with a guessable one.
        self.signer = signer if signer is not None else TurnSigner(secrets.token_bytes(32))
        # `memo_bytes`: what each API may remember of the requests it read, per memo (see `AgentApi.memos`).
        self.apis: list[AgentApi] = agent_apis(self.signer, memo_bytes)
        self.engine = engine
        self.backend = backend
        self.store = store
        self.prefixes = prefixes if prefixes is not None else EncodedPrefixes()
        self.recorder = recorder
        self.session_header = session_header.lower()
        self.shared = SharedTurns(shared, recorder, after_close) if shared is not None else None
        self.after_close = after_close
        # Names closed by their driver in this process (`memory`): refused even by a first turn already in flight.
        self.closed_names: OrderedDict[str, float] = OrderedDict()

    def route(self, path: str) -> Route | None:
        return find_route(self.apis, path)

    async def handle(
        self, path: str, headers: dict[str, str], body: bytes, base_url: str, episode: str | None = None
    ) -> HttpReply:
        """Serve one agent request. Never raises: every outcome is an HTTP reply in the agent's own API.
        `episode`: the session a rollout driver named through the proxy (its user name or API key), used when the
        request names none itself."""
        route = self.route(path)
        if route is None:
            return json_reply(400, BadRequest(f"not an agent API path: {path}; nothing was forwarded").body())
        try:
            headers = {k.lower(): v for k, v in headers.items()}
            return await self._handle(route, headers, body, base_url, episode)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the API's own error reply
            return error_reply(route.api, exc)

    def prepare(
        self, path: str, headers: dict[str, str], body: bytes, base_url: str = "", route: Route | None = None,
        episode: str | None = None,
    ) -> PreparedTurn:  # fmt: skip
        """Validate a request and decide its prompt, on this process's own session tree (`memory`)."""
        if self.shared is not None:
            raise RuntimeError("a shared session store is prepared with prepare_async")
        parsed = self._parse(path, headers, body, base_url, route, episode)
        if parsed.session_id is not None and parsed.session_id not in self.store.sessions:
            self.restore(parsed.session_id)
        if parsed.agent.previous_response_id is not None:
            attachment = self.continued(parsed.agent.previous_response_id, parsed.session_id)
        else:
            attachment = self.store.locate(parsed.session_id, parsed.keys, parsed.reasonings, parsed.namespace)
        return self._place(parsed, attachment)

    async def prepare_async(
        self, path: str, headers: dict[str, str], body: bytes, base_url: str = "", route: Route | None = None,
        episode: str | None = None,
    ) -> PreparedTurn:  # fmt: skip
        """`prepare`, wherever the sessions live: with a shared store the attachment is looked up in it."""
        if self.shared is None:
            return self.prepare(path, headers, body, base_url, route, episode)
        parsed = self._parse(path, headers, body, base_url, route, episode)
        if parsed.agent.previous_response_id is not None:
            attachment = await self.shared.continued(parsed.agent.previous_response_id, parsed.session_id)
            return self._place(parsed, attachment)
        attachment, request_path = await self.shared.locate(parsed)
        return self._place(parsed, attachment, request_path)

    def _parse(
        self, path: str, headers: dict[str, str], body: bytes, base_url: str, route: Route | None,
        episode: str | None = None,
    ) -> ParsedRequest:  # fmt: skip
        route = route or self.route(path)
        if route is None:
            raise BadRequest(f"not an agent API path: {path}")
        session_id = checked_session_id(headers.get(self.session_header), f"header {self.session_header}")
        path_id = route.path_session_id
        path_id = checked_session_id(unquote(path_id), "path") if path_id is not None else None
        session_id = session_id if session_id is not None else path_id
        if session_id is None and episode is not None:
            session_id = checked_session_id(episode, "the episode name (proxy user or API key)")
        agent = route.api.parse(body, route.action)
        request = agent.chat
        self.backend.check_request(request)
        kwargs = self.engine.effective_kwargs(request.chat_template_kwargs, thinking=agent.thinking)
        messages = request.messages
        keys = [message_key(m) for m in messages]
        reasonings = [m.reasoning_text() if m.role == "assistant" else None for m in messages]
        namespace = f"{base_url} {request.model or ''}"
        return ParsedRequest(route, agent, session_id, kwargs, keys, reasonings, namespace)

    def _place(self, parsed: ParsedRequest, attachment: Attachment, request_path: bytes = b"") -> PreparedTurn:
        """The prompt of a located request: a continuation of the turn it extends, or a fresh render."""
        agent, kwargs = parsed.agent, parsed.kwargs
        request = agent.chat
        messages = request.messages
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
            parsed.route, agent, request, parsed.session_id, attachment, parent, appended, piece, prompt, kwargs,
            parsed.keys, parsed.namespace, request_path=request_path,
        )  # fmt: skip

    def continued(self, reply_id: str, session_id: str | None) -> Attachment:
        """Where a request that names a previous reply attaches: that reply's turn, found in the live tree or,
        after a restart, in the record of the session the id names."""
        node = self.store.replies.get(reply_id)
        if node is None:
            named = reply_session(reply_id)
            if named is not None and named not in self.store.sessions and session_id_problem(named) is None:
                self.restore(named)
                node = self.store.replies.get(reply_id)
        return attach_to_reply(node, reply_id, session_id)

    async def _handle(
        self, route: Route, headers: dict[str, str], body: bytes, base_url: str, episode: str | None
    ) -> HttpReply:
        self.sweep()
        prepared = await self.prepare_async("", headers, body, base_url, route, episode)
        if route.action == "count_tokens":
            # The exact prompt length this turn would have: our own render, nothing forwarded or recorded.
            return json_reply(200, route.api.count_tokens_body(len(prepared.prompt)))
        claim = await self.claim(prepared)
        busy = prepared.attachment.session if claim is None else None
        if busy is not None:
            busy.inflight += 1  # protects it from eviction while the backend works
        try:
            return await self._run(prepared, headers, base_url, claim)
        finally:
            self._release(busy)

    async def claim(self, prepared: PreparedTurn) -> Claim | None:
        """With a shared store: the session and turn id the turn will have, claimed before the backend runs (so
        no proxy closes the session meanwhile). None with `memory`, where the commit decides both."""
        return await self.shared.claim(prepared) if self.shared is not None else None

    def backend_turn(self, prepared: PreparedTurn, headers: dict[str, str], base_url: str) -> BackendTurn:
        chat_body = dict(prepared.agent.chat_body)
        chat_body["chat_template_kwargs"] = prepared.kwargs
        forward = {k: v for k, v in headers.items() if k not in DROPPED_HEADERS and k != self.session_header}
        engine = self.engine
        route = prepared.route
        return BackendTurn(
            base_url, route.chat_path, chat_body, prepared.prompt, forward, engine.stop_texts, engine.special_ids
        )

    def responder(self, prepared: PreparedTurn, claim: Claim | None = None) -> Responder:
        api = prepared.route.api
        session = prepared.attachment.session if claim is None else claim.session
        known = session.session_id if session is not None else (prepared.session_id or prepared.new_session_id)
        reply_id = api.reply_id(known) or ""
        if api.signs:
            try:
                self.signer.key  # noqa: B018 - loaded before the backend runs, so a failure records nothing
            except OSError as exc:
                raise TitoError(f"cannot keep the signing key: {exc}; nothing was forwarded") from exc
        context = ReplyContext(reply_id=reply_id, prompt_tokens=len(prepared.prompt), signer=self.signer)
        return api.responder(prepared.agent, context)

    async def finish(
        self,
        prepared: PreparedTurn,
        result: BackendResult,
        headers: dict[str, str],
        responder: Responder,
        claim: Claim | None = None,
    ) -> tuple[dict[str, Any], TurnOutcome]:
        """Commit a turn the backend completed; the flow metadata that describes it, and what the agent gets."""
        result.message = responder.adapt(result.message)
        request_id = headers.get("x-request-id")
        if claim is None:
            node, fields = self.commit(prepared, result, request_id, responder.reply_id)
            self.sweep()  # a new session may have taken the store past its capacity
        else:
            assert self.shared is not None
            done = completed_turn(
                prepared, result, self.engine, self.backend.kind, session_id=claim.session.session_id,
                turn_id=claim.turn_id, request_id=request_id, reply_id=responder.reply_id,
                record_message_text=self.record_message_text,
            )  # fmt: skip
            node, fields = await self.shared.commit(prepared, done, result, claim), done.fields
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

    async def _run(
        self, prepared: PreparedTurn, headers: dict[str, str], base_url: str, claim: Claim | None = None
    ) -> HttpReply:
        responder = self.responder(prepared, claim)
        result = await self.backend.run_turn(self.backend_turn(prepared, headers, base_url))
        metadata, outcome = await self.finish(prepared, result, headers, responder, claim)
        reply = responder.reply(outcome)
        reply.headers.update(outcome.headers)
        reply.metadata = metadata
        return reply

    async def open_stream(
        self, path: str, headers: dict[str, str], body: bytes, base_url: str, episode: str | None = None
    ) -> HttpReply | LiveStream:
        """A live stream of the turn, or an ordinary reply when it fails before its first chunk (status and
        body as for a whole turn). Nothing is committed unless the backend finishes the turn."""
        headers = {k.lower(): v for k, v in headers.items()}
        route = self.route(path)
        if route is None:
            return json_reply(400, BadRequest(f"not an agent API path: {path}; nothing was forwarded").body())
        try:
            self.sweep()
            prepared = await self.prepare_async(path, headers, body, base_url, route, episode)
            if route.action != "turn":
                raise BadRequest(f"{route.action} does not stream")
            claim = await self.claim(prepared)
            responder = self.responder(prepared, claim)
        except TitoError as error:
            return error_reply(route.api, error)
        events = self.backend.stream_turn(self.backend_turn(prepared, headers, base_url))
        busy = prepared.attachment.session if claim is None else None
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
            commit=lambda result: self.finish(prepared, result, headers, responder, claim),
            release=lambda: self._release(busy),
        )

    def _release(self, session: Session | None) -> None:
        if session is not None:
            session.inflight -= 1
            self.store.touch(session)

    def commit(
        self, prepared: PreparedTurn, result: BackendResult, request_id: str | None, reply_id: str | None = None
    ) -> tuple[TurnNode, dict[str, Any]]:
        """Write the record line, then add the node to this process's tree; returns the node and the line's
        fields. Synchronous, so no other turn can interleave."""
        session = prepared.attachment.session
        if session is None and prepared.session_id is not None:
            session = self.store.sessions.get(prepared.session_id)
        if session is None and prepared.session_id in self.closed_names and self.after_close == "refuse":
            raise SessionClosed(prepared.session_id)  # its driver closed it while this first turn ran
        if session is None and prepared.session_id is None:
            # Looked up again now: identical first requests that were in flight together (a GRPO group)
            # join the group of whichever committed first.
            session = self.store.prompt_group(prepared.namespace, prepared.keys)
        if session is None:
            session = self.store.new_session(prepared.session_id, prepared.namespace, prepared.new_session_id)
        parent = prepared.parent
        done = completed_turn(
            prepared, result, self.engine, self.backend.kind, session_id=session.session_id,
            turn_id=session.next_turn_id, request_id=request_id, reply_id=reply_id,
            record_message_text=self.record_message_text,
        )  # fmt: skip
        if self.recorder is not None:
            self.recorder.write_turn_line(done.session_id, done.fields)
        node = self.store.commit(
            session,
            parent,
            done.message_end(parent),
            done.segment_keys,
            done.segment_reasoning,
            prepared.piece.ids,
            result.completion_ids,
            result.finish_reason,
            done.tools_sha256,
            template_kwargs=prepared.kwargs,
            reply_id=reply_id or None,
        )
        prepared.prompt.remember(node, result.completion_ids)
        return node, done.fields

    def restore(self, session_id: str) -> None:
        """Rebuild a named session from its record file (after a restart or hot reload), so its turns
        extend the recorded ids and its turn ids continue instead of colliding."""
        if session_id in self.closed_names and self.after_close == "refuse":
            raise SessionClosed(session_id)
        if self.recorder is None:
            return
        try:
            recorded = read_session(self.recorder.record_dir, session_id)  # every writer's part
            if recorded is None:
                return
            recorded.full_ids()  # proves every parent is present and every prompt length adds up
        except (OSError, RecordError) as exc:
            raise TitoError(f"cannot resume session from its record file: {exc}", status=409) from exc
        if recorded.closed_by_driver and self.after_close == "refuse":
            raise SessionClosed(session_id)
        session = self.store.new_session(session_id)
        nodes = rebuild_session(self.store, session, recorded.turns_since_driver_close())
        # Live even with no turn put back (a `new` tree after its driver's close), so its ids continue: never reuse
        # the id of a turn left out, nor of a torn line.
        live = self.store.sessions.setdefault(session_id, session)
        live.next_turn_id = recorded.highest_turn_id + 1 + len(recorded.skipped_lines)
        logger.info("tito: resumed session %s with %d recorded turns", session_id, len(nodes))

    async def sweep_async(self) -> None:
        """The periodic sweep, wherever the sessions live."""
        if self.shared is not None:
            await self.shared.sweep()
        else:
            self.sweep()

    def sweep(self) -> None:
        """Close idle sessions and those beyond capacity (never one with a turn in flight)."""
        if self.shared is not None:
            return  # shared sessions are swept by `sweep_async`, off the turn's path
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
