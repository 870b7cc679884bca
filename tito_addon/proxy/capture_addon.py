"""The mitmproxy addon: a thin shell that hands chat-completion flows to the turn service.

Lifecycle hooks stay synchronous (an async `configure`/`running`/`done` breaks script hot reload); `request` alone is
async. Every chat flow is answered here: an unexpected exception is a 500 JSON reply, never a raw request upstream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from mitmproxy import command, ctx, exceptions, http
from mitmproxy.proxy.mode_specs import ReverseMode
from mitmproxy.utils import asyncio_utils
from pydantic import ValidationError

from tito_addon.backends.backend_kinds import make_backend
from tito_addon.backends.backend_routes import BackendRoutes, backend_url_from_env
from tito_addon.backends.upstream_client import UpstreamClient
from tito_addon.engine.model_families import FAMILIES
from tito_addon.engine.prompt_ids import EncodedPrefixes
from tito_addon.engine.token_engine import APPENDABLE_ROLES, TokenEngine
from tito_addon.engine.tokenizer_loading import load_tokenizer
from tito_addon.protocols.http_reply import HttpReply, json_reply
from tito_addon.protocols.routing import is_agent_path
from tito_addon.protocols.turn_refs import TurnSigner, stored_key
from tito_addon.proxy.collector_tuning import tune_collector
from tito_addon.proxy.episode_naming import EPISODE
from tito_addon.proxy.flow_messages import folded_headers, reply_response
from tito_addon.proxy.live_stream_server import LiveStreamServer, StreamJob
from tito_addon.proxy.shared_store import SharedStore
from tito_addon.proxy.tito_settings import TitoSettings
from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import read_session
from tito_addon.records.trajectory_recorder import TrajectoryRecorder, default_writer_id
from tito_addon.sessions.session_tree import SessionStore, sweep_interval
from tito_addon.sessions.shared_sessions import SharedSessions
from tito_addon.tito_errors import BadRequest, TitoError
from tito_addon.turns.turn_service import TurnService, strip_session_prefix

logger = logging.getLogger(__name__)

STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')

# Options whose change needs a new token engine (and so a new tokenizer load).
ENGINE_OPTIONS = {
    "tito_tokenizer", "tito_model_family", "tito_append_roles", "tito_chat_template_kwargs", "tito_trust_remote_code",
}  # fmt: skip


class TitoAddon:
    """Rewrites each agent chat turn into a token-exact backend turn and records the trajectory."""

    def __init__(self) -> None:
        self.settings: TitoSettings | None = None
        self.engine: TokenEngine | None = None
        self.store = SessionStore()
        self.client = UpstreamClient()
        # Kept across reconfiguration like the store: the cached text is ids, valid whatever the engine.
        self.prefixes = EncodedPrefixes()
        self.service: TurnService | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.live = LiveStreamServer()
        self._turns: dict[str, set[asyncio.Task[HttpReply]]] = {}
        self.regenerator: TrajectoryRecorder | None = None
        self._regenerated: dict[str, set[int]] = {}
        self.shared_store: SharedStore | None = None
        self.writer_id = default_writer_id()
        self.server_replay = False

    def load(self, loader: Any) -> None:
        loader.add_option(
            "tito_backend_kind",
            str,
            "sglang",
            "Backend protocol: sglang (input_ids) or vllm (render/generate/derender).",
        )
        loader.add_option(
            "tito_backend_url",
            str,
            "",
            "Backend base URL. Default: the reverse-mode target, else $TITO_BACKEND_URL, $SGLANG_BASE_URL, "
            "$VLLM_BASE_URL, else the request's own target.",
        )
        loader.add_option(
            "tito_backends",
            str,
            "",
            "Comma-separated backend hosts, HOST[:PORT] or HOST[:PORT]=URL: when set, only chat requests to these "
            "hosts are rewritten (URL: where that host's turns run).",
        )
        loader.add_option("tito_tokenizer", str, "", "Tokenizer: a Hugging Face model name or a local directory.")
        loader.add_option("tito_model_family", str, "default", f"Boundary and template rules: {', '.join(FAMILIES)}.")
        loader.add_option("tito_record_dir", str, "recordings", "Directory for the per-session JSONL trajectories.")
        loader.add_option(
            "tito_append_roles",
            str,
            "auto",
            "Comma-separated roles a request may append to a stored turn; auto: every role the model family can "
            "append (tool,user,system, less what the family refuses, e.g. system for deepseek-r1 and mistral).",
        )
        loader.add_option(
            "tito_chat_template_kwargs", str, "", "JSON object of chat template kwargs applied to every render."
        )
        loader.add_option("tito_session_header", str, "x-session-id", "Request header that names the session.")
        loader.add_option("tito_trust_remote_code", bool, False, "Allow the tokenizer to run code from its repository.")
        loader.add_option("tito_upstream_timeout", int, 600, "Seconds to wait for the backend before answering 504.")
        loader.add_option(
            "tito_verify_prompt_echo",
            bool,
            False,
            "sglang: have the backend echo the whole prompt on every turn and compare it id for id (by default the "
            "echo is checked on the first turn per backend and the prompt length on every turn).",
        )
        loader.add_option(
            "tito_record_message_text",
            bool,
            True,
            "Record the text of the messages each turn appends (needed by the drift audit). Off: only their digests "
            "(enough to resume and replay), for agents whose tool results are large.",
        )
        loader.add_option(
            "tito_prefix_cache_mb",
            int,
            256,
            "Memory for the ready-encoded ids of recent turns, so a long prompt is not re-encoded every turn.",
        )
        loader.add_option(
            "tito_message_memo_mb",
            int,
            128,
            "Memory for recent requests' validated messages, and as much again for each agent API's recent request "
            "bytes (chat, Anthropic Messages, Responses), so a re-sent history is neither parsed nor validated again.",
        )
        loader.add_option(
            "tito_gc_threshold",
            int,
            50_000,
            "Allocations between two collections of the youngest generation of Python's garbage collector (Python's "
            "default is 700); what exists once configured is frozen out of its walks (0: leave the collector as is).",
        )
        loader.add_option(
            "tito_session_idle_timeout", int, 1800, "Close a session unused for this many seconds (0: never)."
        )
        loader.add_option(
            "tito_signing_key",
            str,
            "",
            "Key that signs what agents echo back (thinking signatures, encrypted reasoning); proxies sharing sessions "
            "share it. Empty: a key kept in the record dir (.tito-signing-key, made on first use).",
        )
        loader.add_option(
            "tito_session_store",
            str,
            "memory",
            "Where sessions live: memory (this process) or a Redis URL (redis://HOST:PORT/DB, rediss://…, unix://…) "
            "shared by every proxy that names it, so any of them serves any turn of any session.",
        )
        loader.add_option(
            "tito_after_close",
            str,
            "refuse",
            "A request naming a session its driver closed (control API): refuse (409, nothing forwarded) or new (the "
            "name starts a new tree; turn ids continue, nothing extends the closed turns).",
        )
        loader.add_option(
            "tito_max_sessions", int, 10000, "Live sessions kept; the least recently used closes first (0: no limit)."
        )

    def configure(self, updated: set[str]) -> None:
        if "server_replay" in updated:  # read here, not per request: each option read deep-copies its value
            self.server_replay = bool(getattr(ctx.options, "server_replay", None))
        if not any(name.startswith("tito_") for name in updated):
            return
        opts = ctx.options
        if not opts.tito_tokenizer:
            # Not an OptionsError: that would refuse to load the script at all in interactive mitmproxy,
            # where the user can still `set tito_tokenizer`. Until then chat turns are answered 503, and an
            # ERROR at startup makes mitmdump exit. A pure offline replay needs no tokenizer.
            self.service = None
            replay_only = getattr(opts, "tito_replay_dir", "") and getattr(opts, "tito_replay_fallback", "") != "live"
            self.regenerator = TrajectoryRecorder(opts.tito_record_dir)
            if not replay_only and not getattr(opts, "rfile", None):  # -r only rewrites recorded trajectories
                logger.error("tito: tito_tokenizer is required: --set tito_tokenizer=<HF model name or tokenizer dir>")
            return
        try:
            settings = TitoSettings(
                backend_kind=opts.tito_backend_kind,
                backend_url=opts.tito_backend_url or None,
                backends=opts.tito_backends,
                tokenizer=opts.tito_tokenizer,
                model_family=opts.tito_model_family,
                record_dir=opts.tito_record_dir,
                append_roles=opts.tito_append_roles,
                chat_template_kwargs=opts.tito_chat_template_kwargs,
                session_header=opts.tito_session_header,
                trust_remote_code=opts.tito_trust_remote_code,
                upstream_timeout=opts.tito_upstream_timeout,
                verify_prompt_echo=opts.tito_verify_prompt_echo,
                prefix_cache_mb=opts.tito_prefix_cache_mb,
                message_memo_mb=opts.tito_message_memo_mb,
                gc_threshold=opts.tito_gc_threshold,
                record_message_text=opts.tito_record_message_text,
                session_idle_timeout=opts.tito_session_idle_timeout,
                max_sessions=opts.tito_max_sessions,
                signing_key=opts.tito_signing_key,
                session_store=opts.tito_session_store,
                after_close=opts.tito_after_close,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            option = "tito_" + str(first["loc"][0]) if first.get("loc") else "tito options"
            message = str(first["msg"]).removeprefix("Value error, ")
            raise exceptions.OptionsError(f"invalid {option}: {message}") from exc
        engine = self.engine
        if engine is None or updated & ENGINE_OPTIONS:
            engine = self._build_engine(settings)
        self.client.timeout_s = settings.upstream_timeout
        self.store.idle_timeout = settings.session_idle_timeout
        self.store.max_sessions = settings.max_sessions
        self.prefixes.resize(settings.prefix_cache_mb * 1024 * 1024)
        shared = self._shared_sessions(settings)
        self.settings = settings
        self.engine = engine
        self.service = TurnService(
            engine,
            make_backend(
                settings.backend_kind,
                self.client,
                verify_echo=settings.verify_prompt_echo,
                merge_stream_chunks=engine.family.chunking_invariant_parsers,
                compact_requests=engine.family.compact_requests,
            ),  # fmt: skip
            self.store,
            # With a shared store several processes write turns of one session: each its own part of the file.
            TrajectoryRecorder(settings.record_dir, writer=self.writer_id if shared is not None else None),
            session_header=settings.session_header,
            prefixes=self.prefixes,
            record_message_text=settings.record_message_text,
            signer=self._signer(settings),
            memo_bytes=settings.message_memo_mb * 1024 * 1024,
            shared=shared,
            after_close=settings.after_close,
        )
        tune_collector(settings.gc_threshold)
        logger.info(
            "tito: %s backend, tokenizer %s, family %s, recording to %s, sessions in %s",
            settings.backend_kind,
            settings.tokenizer,
            settings.model_family,
            settings.record_dir,
            "this process" if shared is None else f"Redis (writer {self.writer_id})",
        )

    def _shared_sessions(self, settings: TitoSettings) -> SharedSessions | None:
        if settings.session_store == "memory":
            return None
        if self.shared_store is None or self.shared_store.url != settings.session_store:
            old, self.shared_store = self.shared_store, SharedStore(settings.session_store)
            if old is not None:
                asyncio_utils.create_task(old.close(), name="tito-close-store", keep_ref=True)
        return self.shared_store.configure(
            idle_timeout=settings.session_idle_timeout,
            max_sessions=settings.max_sessions,
            upstream_timeout=settings.upstream_timeout,
        )

    @staticmethod
    def _signer(settings: TitoSettings) -> TurnSigner:
        if settings.signing_key:
            return TurnSigner(settings.signing_key.encode())
        record_dir = Path(settings.record_dir)
        return TurnSigner(lambda create: stored_key(record_dir, create))

    @staticmethod
    def _build_engine(settings: TitoSettings) -> TokenEngine:
        try:
            tokenizer = load_tokenizer(settings.tokenizer, trust_remote_code=settings.trust_remote_code)
        except Exception as exc:  # transformers raises OSError, ValueError, HF hub errors...
            raise exceptions.OptionsError(f"cannot load tokenizer {settings.tokenizer!r}: {exc}") from exc
        family = FAMILIES[settings.model_family]
        roles = settings.append_roles or tuple(r for r in APPENDABLE_ROLES if r not in family.refused_append_roles)
        try:
            engine = TokenEngine(
                tokenizer,
                family,
                append_roles=roles,
                pinned_kwargs=settings.chat_template_kwargs,
                tokenizer_name=settings.tokenizer,
            )
            engine.check_append_only()
        except (ValueError, TitoError) as exc:
            raise exceptions.OptionsError(f"tito: {exc}") from exc
        return engine

    def running(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio_utils.create_task(self._sweep_forever(), name="tito-session-sweep", keep_ref=True)

    async def _sweep_forever(self) -> None:
        while True:
            idle_timeout = self.settings.session_idle_timeout if self.settings is not None else 0.0
            await asyncio.sleep(sweep_interval(idle_timeout))
            if self.service is not None:
                try:
                    await self.service.sweep_async()
                except TitoError as error:
                    logger.warning("tito: session sweep failed: %s", error.message)
                except Exception:
                    logger.exception("tito: session sweep failed")

    @command.command("tito.sessions")
    def sessions(self) -> str:
        """Live sessions: id, turns, tokens, turns in flight and idle seconds."""
        if self.settings is not None and self.settings.session_store != "memory":
            table = (
                "sessions live in the shared store, not in this process: `redis-cli -u URL ZRANGE tito:live 0 -1` "
                "lists them, `HGETALL tito:s:{ID}` shows one (turns, tokens, next turn id)"
            )
            logger.info("tito sessions: %s", table)
            return table
        now = time.time()
        rows = [f"{'session':36} {'turns':>6} {'tokens':>9} {'busy':>4} {'idle s':>7}"]
        for session in self.store.sessions.values():
            rows.append(
                f"{session.session_id[:36]:36} {session.turns:>6} {session.tokens:>9} {session.inflight:>4} "
                f"{now - session.last_used:>7.0f}"
            )
        table = "\n".join(rows)
        logger.info("tito sessions (%d live):\n%s", len(self.store.sessions), table)
        return table

    def backend_base_url(self, flow: http.HTTPFlow) -> str | None:
        """Where this chat flow's turn runs, or None when its host is not a configured backend."""
        assert self.settings is not None
        routes = BackendRoutes(
            entries=self.settings.backends,
            backend_url=self.settings.backend_url or backend_url_from_env(),
            override_reverse=bool(self.settings.backend_url),
        )
        return routes.resolve(
            reverse=isinstance(flow.client_conn.proxy_mode, ReverseMode),
            scheme=flow.request.scheme,
            host=flow.request.host,
            port=flow.request.port,
        )

    def goes_to_backend(self, flow: http.HTTPFlow) -> bool:
        """Whether a flow goes to a configured backend (the only hosts that may receive the backend's API key)."""
        return self.settings is not None and self.backend_base_url(flow) is not None

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.error is not None or not flow.live:
            return
        if self.server_replay:
            return  # mitmproxy's own replay answers this flow
        path = flow.request.path
        base_url = self.backend_base_url(flow) if self.settings is not None else None
        if self.settings is not None and base_url is None:
            return  # not a backend host: this flow is none of our business
        if flow.request.method != "POST" or not is_agent_path(path):
            if path.startswith("/sessions/"):
                flow.request.path = strip_session_prefix(path)
            return
        try:
            reply = self._refuse_ambiguous_session(flow)
            if reply is None and await self._go_live(flow, base_url):
                return
            if reply is None:
                reply = await self._serve_cancellable(flow, base_url)
        except Exception:
            logger.exception("tito: unexpected failure")
            reply = json_reply(500, TitoError("internal error in tito_addon; nothing was recorded").body())
        if reply is None:
            flow.kill()  # the agent hung up: its turn was cancelled before anything was recorded
            return
        flow.response = reply_response(reply)
        if reply.metadata:
            flow.metadata["tito"] = reply.metadata

    def _refuse_ambiguous_session(self, flow: http.HTTPFlow) -> HttpReply | None:
        """Two session headers would be joined into one id ("a, b") that names neither: refuse instead of guessing."""
        if self.settings is None or len(flow.request.headers.get_all(self.settings.session_header)) < 2:
            return None
        message = f"the {self.settings.session_header} header appears more than once; nothing was forwarded"
        return json_reply(400, BadRequest(message).body())

    async def _go_live(self, flow: http.HTTPFlow, base_url: str | None) -> bool:
        """Hand a streaming turn to the live stream server, if the backend can stream exact ids."""
        if self.service is None:
            return False
        try:
            body = flow.request.content or b""
        except ValueError:
            return False  # an undecodable content-encoding: the ordinary path answers it 400
        if not STREAM_TRUE.search(body):
            return False  # the hot path: no second parse of a body that does not ask for a stream
        try:
            wants_stream = json.loads(body).get("stream") is True
        except (ValueError, AttributeError, RecursionError):
            return False  # the ordinary path answers the bad body
        headers = folded_headers(flow.request.headers)
        if not wants_stream or base_url is None or not await self.service.backend.can_stream(base_url, headers):
            return False
        port = await self.live.ensure_started()

        def on_commit(metadata: dict[str, Any]) -> None:
            flow.metadata["tito"] = metadata

        job = StreamJob(self.service, flow.request.path, headers, body, base_url, on_commit, flow.metadata.get(EPISODE))
        path = self.live.park(job)
        flow.metadata["tito_live"] = True
        flow.request.scheme, flow.request.host, flow.request.port, flow.request.path = "http", "127.0.0.1", port, path
        return True

    def response(self, flow: http.HTTPFlow) -> None:
        """`mitmdump -r FILE`: a recorded flow's metadata holds its turn's record line; write it again."""
        if flow.live:
            return
        record = (flow.metadata.get("tito") or {}).get("record")
        if not isinstance(record, dict):
            return
        recorder = self.service.recorder if self.service is not None else self.regenerator
        if recorder is None:
            return
        try:
            turn = TurnRecord.model_validate(record)
        except ValueError:
            logger.warning("tito: flow %s carries an unreadable record; skipped", flow.id)
            return
        known = self._regenerated.get(turn.session_id)
        if known is None:
            recorded = read_session(recorder.record_dir, turn.session_id)
            known = {t.turn_id for t in recorded.turns} if recorded is not None else set()
            self._regenerated[turn.session_id] = known
        if turn.turn_id not in known:
            recorder.write_turn(turn)
            known.add(turn.turn_id)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("tito_live") and flow.response is not None:
            flow.response.stream = True  # relay the live server's chunks as they come

    async def _serve_cancellable(self, flow: http.HTTPFlow, base_url: str | None) -> HttpReply | None:
        """Serve the turn as a task that a client disconnect cancels (None then): mitmproxy keeps running a
        request hook after its client has gone, and a turn nobody receives must not be recorded."""
        # Awaited right here and held in `_turns`, so neither mitmproxy's keep-alive set nor its debug info (an
        # environment lookup per task) is needed.
        task = asyncio.create_task(self._serve(flow, base_url), name="tito-turn")
        turns = self._turns.setdefault(flow.client_conn.id, set())
        turns.add(task)
        try:
            return await task  # this hook cancelled (shutdown) cancels the task it awaits
        except asyncio.CancelledError:
            if (hook := asyncio.current_task()) is not None and hook.cancelling():
                raise
            return None  # `client_disconnected` cancelled the turn
        finally:
            turns.discard(task)
            if not turns:
                self._turns.pop(flow.client_conn.id, None)

    def client_disconnected(self, client: Any) -> None:
        for task in self._turns.pop(client.id, set()):
            task.cancel()

    async def _serve(self, flow: http.HTTPFlow, base_url: str | None) -> HttpReply:
        if self.service is None:
            message = "tito_addon is not configured: set tito_tokenizer; nothing was forwarded"
            return json_reply(503, TitoError(message, status=503).body())
        try:
            body = flow.request.content or b""
        except ValueError:
            return json_reply(400, TitoError("request body has an invalid content-encoding", status=400).body())
        headers = folded_headers(flow.request.headers)
        assert base_url is not None  # request() only serves flows to backend hosts
        return await self.service.handle(flow.request.path, headers, body, base_url, flow.metadata.get(EPISODE))

    def done(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self.service is not None:
            self.service.close_all("shutdown")  # this process's own sessions; shared ones live on in Redis
        try:
            asyncio_utils.create_task(self.live.stop(), name="tito-stop-live", keep_ref=True)
            asyncio_utils.create_task(self.client.close(), name="tito-close-upstream", keep_ref=True)
            if self.shared_store is not None:
                asyncio_utils.create_task(self.shared_store.close(), name="tito-close-store", keep_ref=True)
        except RuntimeError:
            pass  # no running loop: the process is exiting anyway
