"""One agent turn, end to end: validate -> locate -> prepare ids -> claim -> backend -> record -> commit -> reply.

This is the whole addon minus mitmproxy: it takes the request's path, headers and body and returns the HTTP reply
(or a live stream of it), so it can be tested and reused without a proxy. Validation and preparation touch no state;
a claim marks the turn in flight in its session; the only lasting changes (the record line and the new tree node)
happen together after the backend answered, so a rejected or failed request leaves no trace in memory or on disk.
A whole reply and a live stream are the same steps (`TurnRun`) with a different responder.
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import replace
from urllib.parse import unquote

from tito_addon.backends.backend_protocol import Backend, BackendTurn
from tito_addon.backends.engine_failover import EngineList, FailoverLog
from tito_addon.backends.expert_routes import RoutesAsked, RoutesWanted
from tito_addon.backends.upstream_headers import forwarded_headers, with_router_key
from tito_addon.canonical_chat import ChatMessage
from tito_addon.engine.prompt_ids import EncodedPrefixes, PromptIds
from tito_addon.engine.token_engine import TokenEngine
from tito_addon.engine.tokenizer_loading import sampling_defaults
from tito_addon.protocols.agent_api import AgentApi, ReplyContext, Responder, Route
from tito_addon.protocols.compaction_items import COMPACT_EDIT
from tito_addon.protocols.http_reply import HttpReply, json_reply
from tito_addon.protocols.known_messages import DEFAULT_BUDGET_BYTES
from tito_addon.protocols.routing import agent_apis, find_route
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.records.records_port import Records
from tito_addon.sessions.message_keys import message_key
from tito_addon.sessions.session_ids import session_id_problem
from tito_addon.sessions.session_space import Claim, SessionSpace
from tito_addon.sessions.session_tree import Attachment
from tito_addon.tito_errors import BadRequest, TitoError
from tito_addon.turns.completion_budget import fit_completion_budget
from tito_addon.turns.episode_places import EpisodePlace, Follows, continuation_place, interrupted_call
from tito_addon.turns.image_fetching import ImageFetcher
from tito_addon.turns.live_stream import LiveStream
from tito_addon.turns.prompt_images import prompt_images
from tito_addon.turns.session_records import SessionRecords
from tito_addon.turns.turn_replies import error_reply
from tito_addon.turns.turn_run import LineContext, TurnRun, TurnsInFlight
from tito_addon.turns.turn_types import ParsedRequest, PreparedTurn

logger = logging.getLogger(__name__)

SESSION_PREFIX = re.compile(r"^/sessions/[^/?#]+(?=/)")


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


def compacting(parsed: ParsedRequest, instruction: str, asked_by: str) -> ParsedRequest:
    """The request with the instruction that asks the model for a summary as its last user message: a compaction
    the proxy serves (`protocols/compaction_items`)."""
    agent = parsed.agent
    message = ChatMessage(role="user", content=instruction)
    chat = agent.chat.model_copy(update={"messages": [*agent.chat.messages, message]})
    chat_body = {
        **agent.chat_body,
        "messages": [*agent.chat_body["messages"], {"role": "user", "content": instruction}],
    }
    item_of = [*agent.item_of, agent.item_of[-1] if agent.item_of else 0]
    agent = replace(agent, chat=chat, chat_body=chat_body, compacts=asked_by, item_of=item_of)
    return replace(
        parsed, agent=agent, keys=[*parsed.keys, message_key(message)], reasonings=[*parsed.reasonings, None]
    )


class TurnService:
    def __init__(
        self,
        engine: TokenEngine,
        backend: Backend,
        sessions: SessionSpace,
        records: Records,
        *,
        session_header: str = "x-session-id",
        router_key: str | None = None,
        engines: EngineList | None = None,
        prefixes: EncodedPrefixes | None = None,
        record_message_text: bool = True,
        signer: TurnSigner | None = None,
        after_close: str = "refuse",
        memo_bytes: int = DEFAULT_BUDGET_BYTES,
        warm_apis: Sequence[AgentApi] = (),
        in_flight: TurnsInFlight | None = None,
        routed_experts: RoutesWanted | None = None,
        images_max: int = 100,
        image_fetcher: ImageFetcher | None = None,
    ) -> None:
        """`sessions`: where sessions live (this process, or a store several proxies share). `after_close`: what a
        request naming a session its driver closed gets: `refuse` (410) or a `new` tree. `router_key`: the header an
        engine router keys sessions on (`ROUTER_SESSION_KEYS`), set to the turn's session id on its backend calls.
        `engines`: a fixed engine list (no router), each session's turns on the engine its id hashes to.
        `routed_experts`: ask the backend for every turn's MoE routes (of a model of that shape, where known)."""
        self.routed_experts = routed_experts
        self.images_max = images_max
        self.image_fetcher = image_fetcher  # None: an image given by URL is refused (`tito_image_fetch`)
        # The model's recommended sampling params, for backend calls whose server does not apply them (sglang's
        # /generate, where its chat endpoint would).
        self.sampling_defaults = sampling_defaults(engine.tokenizer_name)
        self.record_message_text = record_message_text
        self.in_flight = in_flight if in_flight is not None else TurnsInFlight()
        # Signs what agents echo back (thinking signatures, encrypted reasoning); a random key when the proxy
        # has none, so nothing is ever signed with a guessable one.
        self.signer = signer if signer is not None else TurnSigner(secrets.token_bytes(32))
        # `memo_bytes`: what each API may remember of the requests it read, per memo (see `AgentApi.memos`);
        # `warm_apis`: the APIs the service this one replaces served with, whose memos stay where they can.
        self.apis: list[AgentApi] = agent_apis(self.signer, memo_bytes, warm_apis)
        self.engine = engine
        # Generated ids' text as vLLM and sglang check stop strings on it: special tokens skipped, their default.
        self.output_text = functools.partial(engine.tokenizer.decode, skip_special_tokens=True)
        self.backend = backend
        self.sessions = SessionRecords(sessions, records, after_close)
        self.prefixes = prefixes if prefixes is not None else EncodedPrefixes()
        self.session_header = session_header.lower()
        self.router_key = router_key
        self.engines = engines

    def route(self, path: str) -> Route | None:
        return find_route(self.apis, path)

    async def serve(
        self,
        path: str,
        headers: dict[str, str],
        body: bytes,
        base_url: str,
        episode: str | None = None,
        *,
        live: bool = True,
        route: Route | None = None,
    ) -> HttpReply | LiveStream:
        """Serve one agent request, read once: answered whole, or (it asks for a stream, `live`, and the backend streams
        exact ids) a live stream, opening: its request on the way to the backend, which a failure before the first
        chunk answers whole (`LiveStream.opened`). Never raises: every outcome is a reply in the agent's own API, or
        the stream. `episode`: the session a rollout driver named through the proxy
        (its user name or API key), used unless the request's `/sessions/{id}/` path names one (it wins over the
        session header). `headers`: names in lower case. `route`: the path's route, where the caller matched it."""
        route = route or self.route(path)
        if route is None:
            return json_reply(400, BadRequest(f"not an agent API path: {path}; nothing was forwarded").body())
        try:
            await self.sweep_inline()
            prepared = await self.prepare("", headers, body, base_url, route, episode)
            if route.action == "count_tokens":
                # The exact prompt length this turn would have: our own render, nothing forwarded or recorded.
                return json_reply(200, route.api.count_tokens_body(len(prepared.prompt)))
            streams = live and route.action == "turn" and prepared.agent.stream
            if streams and await self.backend.can_stream(base_url, headers):
                return await self._open_stream(prepared, headers, base_url)
            return await self._whole(prepared, headers, base_url)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the API's own error reply
            return error_reply(route.api, exc)

    async def handle(
        self, path: str, headers: dict[str, str], body: bytes, base_url: str, episode: str | None = None
    ) -> HttpReply:
        """`serve`, always answered whole (a stream asked for is re-framed from the finished turn), for a caller with
        no connection to stream on."""
        reply = await self.serve(path, headers, body, base_url, episode, live=False)
        assert isinstance(reply, HttpReply)
        return reply

    async def prepare(
        self,
        path: str,
        headers: dict[str, str],
        body: bytes,
        base_url: str = "",
        route: Route | None = None,
        episode: str | None = None,
    ) -> PreparedTurn:
        """Validate a request and decide its prompt, wherever the sessions live."""
        if self.image_fetcher is not None:
            body = await self.image_fetcher.inlined(body)
        parsed = self._parse(path, headers, body, base_url, route, episode)
        if parsed.agent.previous_response_id is not None:
            attachment = await self.sessions.continued(parsed.agent.previous_response_id, parsed.session_id)
            return self._place(parsed, attachment)
        located = await self.sessions.locate(parsed)
        attachment = located.attachment
        root: EpisodePlace | None = None
        if attachment.parent is None and parsed.agent.compaction_refs:
            # A new context started from a compaction this proxy served: the summary turn its item names (404 when
            # not recorded; 400 when it is another named session's).
            summary = (await self.sessions.continued(parsed.agent.compaction_refs[-1], parsed.session_id)).parent
            assert summary is not None
            follows = Follows(summary.session.session_id, summary.turn_id, "compaction_item")
            root = EpisodePlace(summary.turn.episode_id, interrupted_call(summary), follows)
        elif attachment.parent is None:
            named, first_root = parsed.session_id is not None, attachment.session is None
            messages = parsed.agent.chat.messages
            root = await self.sessions.links.place_root(parsed.link_scope, messages, named, first_root)
        prepared = self._place(parsed, attachment, located.group, root)
        when = parsed.agent.compact_when
        if when is not None and parsed.agent.compacts is None and len(prepared.prompt) >= when[0]:
            # Compact instead of answering (Anthropic's compact_20260112): the same turn, asked for a summary.
            prepared = self._place(compacting(parsed, when[1], COMPACT_EDIT), attachment, located.group, root)
        return prepared

    def _parse(
        self,
        path: str,
        headers: dict[str, str],
        body: bytes,
        base_url: str,
        route: Route | None,
        episode: str | None = None,
    ) -> ParsedRequest:
        route = route or self.route(path)
        if route is None:
            raise BadRequest(f"not an agent API path: {path}")
        header_id = checked_session_id(headers.get(self.session_header), f"header {self.session_header}")
        path_id = route.path_session_id
        path_id = checked_session_id(unquote(path_id), "path") if path_id is not None else None
        # The names a rollout driver gives (a `/sessions/{id}/` base URL, then the proxy user or API key) win over
        # the session header, which agents also send of their own accord: opencode sends `X-Session-Id` with its
        # own session id on every request, and would otherwise hide the driver's episode.
        session_id = path_id
        if session_id is None and episode is not None:
            session_id = checked_session_id(episode, "the episode name (proxy user or API key)")
        session_id = session_id if session_id is not None else header_id
        agent = route.api.parse(body, route.action, route)
        request = agent.chat
        self.backend.check_request(request)
        kwargs = self.engine.effective_kwargs(request.chat_template_kwargs, thinking=agent.thinking)
        messages = request.messages
        keys = [message_key(m) for m in messages]
        reasonings = [m.reasoning_text() if m.role == "assistant" else None for m in messages]
        namespace = f"{base_url} {request.model or ''}"
        return ParsedRequest(route, agent, session_id, kwargs, keys, reasonings, namespace, base_url)

    def _place(
        self, parsed: ParsedRequest, attachment: Attachment, group: bytes = b"", root: EpisodePlace | None = None
    ) -> PreparedTurn:
        """The prompt of a located request: a continuation of the turn it extends, or a fresh render."""
        agent, kwargs = parsed.agent, parsed.kwargs
        request = agent.chat
        messages = request.messages
        parent = located_parent = attachment.parent
        appended = messages[attachment.matched :]
        if agent.previous_response_id is not None and (
            any(m.role == "assistant" for m in appended)
            or self.engine.history_changed(parent.turn.chat_template_kwargs or {}, kwargs, request.tools)  # type: ignore[union-attr]
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
        elif parent is not None and self.engine.history_changed(
            parent.turn.chat_template_kwargs or {}, kwargs, request.tools
        ):
            # Kwargs that render the stored history differently (gpt-oss `reasoning_effort` lives in the system
            # message) would not reach the model through a continuation: a fresh render tells it, as a new root.
            parent, appended = None, messages
        if located_parent is not None:
            # Rendered afresh or not, the same conversation: its episode and call (Codex's compaction request offers
            # no tools, so it is rendered afresh, and is still a compaction).
            place = continuation_place(located_parent, messages[attachment.matched :])
        else:
            place = root if root is not None else EpisodePlace(None)
        if agent.compacts is not None:
            place = replace(place, call="compaction", reason=f"a compaction this proxy served ({agent.compacts})")
        if parent is None:
            piece = self.engine.first_turn(messages, request.tools, kwargs)
        else:
            piece = self.engine.continuation(parent.turn.completion_ids, appended, request.tools, kwargs)
        prompt = PromptIds(parent, piece.ids, self.prefixes)
        return PreparedTurn(
            parsed.route,
            agent,
            request,
            parsed.session_id,
            attachment,
            parent,
            appended,
            piece,
            prompt,
            kwargs,
            parsed.keys,
            parsed.namespace,
            group=group,
            place=place,
            link_scope=parsed.link_scope,
            images=prompt_images(parent, piece, messages, self.images_max),
        )

    async def _whole(self, prepared: PreparedTurn, headers: dict[str, str], base_url: str) -> HttpReply:
        run = await self.start(prepared, headers, base_url)
        try:
            await self.fit(run)
            result = await self.backend.run_turn(run.backend_turn)
            metadata, outcome = await run.finish(result)
        finally:
            await run.release()
        reply = run.responder.reply(outcome)
        reply.headers.update(outcome.headers)
        reply.metadata = metadata
        return reply

    async def _open_stream(self, prepared: PreparedTurn, headers: dict[str, str], base_url: str) -> LiveStream:
        """The turn's live stream, its first backend event on the way (`LiveStream.opened`). Nothing is committed
        unless the backend finishes the turn."""
        run = await self.start(prepared, headers, base_url)
        try:
            await self.fit(run)
            events = self.backend.stream_turn(run.backend_turn)
        except BaseException:
            await run.release()
            raise
        return LiveStream(events, run, functools.partial(error_reply, prepared.route.api))

    async def start(self, prepared: PreparedTurn, headers: dict[str, str], base_url: str) -> TurnRun:
        """Claim the turn's place in its session and make its responder: the turn is in flight until released."""
        claim = await self.sessions.claim(prepared)
        try:
            responder = self.responder(prepared, claim)
        except BaseException:
            await self.sessions.release(claim)
            raise
        line = LineContext(self.engine, self.backend.kind, headers.get("x-request-id"), self.record_message_text)
        backend_turn = self.backend_turn(prepared, claim.session_id, headers, base_url)
        run = TurnRun(prepared, claim, responder, backend_turn, self.sessions, line, in_flight=self.in_flight)
        self.in_flight.add(run)
        return run

    async def fit(self, run: TurnRun) -> None:
        """Cut the turn's completion budget to what the backend's context leaves after the prompt (asked of the
        server once); a prompt that leaves no room is refused before anything is forwarded."""
        turn = run.backend_turn
        context_length = await self.backend.context_length(turn.base_url, turn.headers)
        run.budget = fit_completion_budget(turn.chat_body, len(run.prepared.prompt), context_length)

    def backend_turn(
        self, prepared: PreparedTurn, session_id: str, headers: dict[str, str], base_url: str
    ) -> BackendTurn:
        chat_body = dict(prepared.agent.chat_body)
        chat_body["chat_template_kwargs"] = prepared.kwargs
        forward = with_router_key(forwarded_headers(headers, self.session_header), self.router_key, session_id)
        engine = self.engine
        route = prepared.route
        return BackendTurn(
            base_url,
            route.chat_path,
            chat_body,
            prepared.prompt,
            forward,
            engine.stop_texts,
            engine.special_ids,
            self.output_text,
            FailoverLog.for_session(self.engines, session_id),
            self.routes_asked(prepared),
            prepared.images,
            self.sampling_defaults,
        )

    def routes_asked(self, prepared: PreparedTurn) -> RoutesAsked | None:
        """From where the turn asks for its MoE routes: where its parent's record chain's end (the parent's last
        sampled token has none of its own), so each token's route is asked for once."""
        if self.routed_experts is None:
            return None
        parent = prepared.parent
        through = (parent.turn.routed_experts_through or 0) if parent is not None else 0
        return RoutesAsked(min(through, len(prepared.prompt)), self.routed_experts.shape)

    def responder(self, prepared: PreparedTurn, claim: Claim) -> Responder:
        api = prepared.route.api
        reply_id = api.reply_id(claim.session_id) or ""
        if api.signs:
            try:
                self.signer.key  # noqa: B018 - loaded before the backend runs, so a failure records nothing
            except OSError as exc:
                raise TitoError(f"cannot keep the signing key: {exc}; nothing was forwarded") from exc
        context = ReplyContext(reply_id=reply_id, prompt_tokens=len(prepared.prompt), signer=self.signer)
        return api.responder(prepared.agent, context)

    async def sweep_inline(self) -> None:
        await self.sessions.sweep_inline()

    async def sweep(self) -> None:
        """The periodic sweep, wherever the sessions live."""
        await self.sessions.sweep()

    def close_all(self, reason: str) -> None:
        self.sessions.close_all(reason)
