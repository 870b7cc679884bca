"""The capture addon: a thin shell that hands agent turns to the turn service and answers the flows.

Options are the settings' own (`TitoSettings.declare_options`); each configuration is validated into settings and
handed to the mitmproxy-free `TurnWiring`, which builds the turn service. Lifecycle hooks stay synchronous (an async
`configure`/`running`/`done` breaks script hot reload); `request` alone is async. Every chat flow is answered here:
an unexpected exception is a 500 JSON reply, never a raw request upstream. A committed turn's flow carries its record
line in `flow.metadata["tito"]`, a refused one its status and error body (`["tito"]["refused"]`), for flow files and
the content view. Sweeping sessions, listing them and regenerating records from flow files are addons of their own
(`session_addons`, `flow_file_records`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from mitmproxy import ctx, exceptions, http
from mitmproxy.proxy.mode_specs import ReverseMode
from mitmproxy.utils import asyncio_utils
from pydantic import ValidationError

from tito_addon.protocols.agent_api import Route
from tito_addon.protocols.http_reply import HttpReply, json_reply, refusal_reply
from tito_addon.protocols.routing import is_agent_path
from tito_addon.proxy.episode_naming import EPISODE
from tito_addon.proxy.flow_messages import folded_headers, reply_response
from tito_addon.proxy.live_stream_server import LiveStreamServer
from tito_addon.proxy.tito_settings import TitoSettings
from tito_addon.proxy.turn_wiring import TurnWiring, WiringError
from tito_addon.tito_errors import BadRequest, TitoError
from tito_addon.turns.live_stream import LiveStream
from tito_addon.turns.turn_service import strip_session_prefix

logger = logging.getLogger(__name__)

LIVE = "tito_live"  # a live flow's path on the live server
AGENT_REQUEST = "tito_agent_request"  # the agent's request as it came, put back once the stream is relayed
REFUSAL_BYTES = 4096  # of a refusal's body kept in the flow's metadata


class TitoAddon:
    """Rewrites each agent chat turn into a token-exact backend turn and records the trajectory."""

    def __init__(self, wiring: TurnWiring | None = None) -> None:
        self.wiring = wiring if wiring is not None else TurnWiring()
        self.live = LiveStreamServer()
        self._turns: dict[str, set[asyncio.Task[HttpReply | LiveStream]]] = {}
        self.server_replay = False

    def load(self, loader: Any) -> None:
        TitoSettings.declare_options(loader)

    def configure(self, updated: set[str]) -> None:
        if "server_replay" in updated:  # read here, not per request: each option read deep-copies its value
            self.server_replay = bool(getattr(ctx.options, "server_replay", None))
        if not updated & TitoSettings.option_names():
            return
        opts = ctx.options
        facts = self.wiring.facts
        facts.record_dir, facts.message_memo_bytes = opts.tito_record_dir, opts.tito_message_memo_mb * 1024 * 1024
        if not opts.tito_tokenizer:
            # Not an OptionsError: that would refuse to load the script at all in interactive mitmproxy,
            # where the user can still `set tito_tokenizer`. Until then chat turns are answered 503, and an
            # ERROR at startup makes mitmdump exit. A pure offline replay needs no tokenizer.
            self.wiring.unconfigure()
            replay_only = facts.replaying and not facts.replay_fallback_live
            if not replay_only and not getattr(opts, "rfile", None):  # -r only rewrites recorded trajectories
                logger.error("tito: tito_tokenizer is required: --set tito_tokenizer=<HF model name or tokenizer dir>")
            return
        try:
            settings = TitoSettings.from_options(opts)
        except ValidationError as exc:
            first = exc.errors()[0]
            option = "tito_" + str(first["loc"][0]) if first.get("loc") else "tito options"
            message = str(first["msg"]).removeprefix("Value error, ")
            raise exceptions.OptionsError(f"invalid {option}: {message}") from exc
        try:
            self.wiring.configure(settings)
        except WiringError as exc:
            raise exceptions.OptionsError(str(exc)) from exc
        if self.wiring.retired:
            asyncio_utils.create_task(self.wiring.close_retired(), name="tito-close-store", keep_ref=True)

    def backend_base_url(self, flow: http.HTTPFlow) -> str | None:
        """Where this chat flow's turn runs, or None when its host is not a configured backend."""
        return backend_of(self.wiring, flow)

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.error is not None or not flow.live:
            return
        if self.server_replay:
            return  # mitmproxy's own replay answers this flow
        path = flow.request.path
        base_url = self.backend_base_url(flow) if self.wiring.settings is not None else None
        if self.wiring.settings is not None and base_url is None:
            return  # not a backend host: this flow is none of our business
        service = self.wiring.service
        # The path is matched here once; an unconfigured addon still knows an agent's path, to refuse it.
        route = service.route(path) if service is not None and flow.request.method == "POST" else None
        if flow.request.method != "POST" or (route is None and (service is not None or not is_agent_path(path))):
            if path.startswith("/sessions/"):
                flow.request.path = strip_session_prefix(path)
            return
        try:
            reply = self._refuse_ambiguous_session(flow)
            if reply is None:
                reply = await self._serve_cancellable(flow, base_url, route)
            if isinstance(reply, LiveStream):
                await self._relay(flow, reply)
                return
        except Exception:
            logger.exception("tito: unexpected failure")
            reply = json_reply(500, TitoError("internal error in tito_addon; nothing was recorded").body())
        if reply is None:
            flow.kill()  # the agent hung up: its turn was cancelled before anything was recorded
            return
        flow.response = reply_response(reply)
        if reply.metadata:
            flow.metadata["tito"] = reply.metadata
        elif reply.status >= 400:
            flow.metadata["tito"] = {"refused": refusal_metadata(reply)}  # for the content view: why, no headers

    def _refuse_ambiguous_session(self, flow: http.HTTPFlow) -> HttpReply | None:
        """Two session headers would be joined into one id ("a, b") that names neither: refuse instead of guessing."""
        if self.wiring.settings is None or len(flow.request.headers.get_all(self.wiring.settings.session_header)) < 2:
            return None
        message = f"the {self.wiring.settings.session_header} header appears more than once; nothing was forwarded"
        return refusal_reply(BadRequest(message))

    async def _relay(self, flow: http.HTTPFlow, stream: LiveStream) -> None:
        """Point the flow at the live server, which relays the opened stream; the agent's body stays here (the turn
        service has read it), and the agent's request is put back once the stream is relayed."""
        try:
            port = await self.live.ensure_started()
        except BaseException:
            await stream.aclose()
            raise

        def on_commit(metadata: dict[str, Any]) -> None:
            flow.metadata["tito"] = metadata

        path = self.live.park(stream, on_commit)
        flow.metadata[LIVE], flow.metadata[AGENT_REQUEST] = path, flow.request.copy()
        request = flow.request
        request.scheme, request.host, request.port, request.path = "http", "127.0.0.1", port, path
        for header in ("content-encoding", "transfer-encoding"):
            request.headers.pop(header, None)
        request.raw_content = b""
        request.headers["content-length"] = "0"

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get(LIVE) and flow.response is not None:
            flow.response.stream = True  # relay the live server's chunks as they come

    def response(self, flow: http.HTTPFlow) -> None:
        agent_request = flow.metadata.pop(AGENT_REQUEST, None)
        if agent_request is not None:
            flow.request = agent_request  # what a flow file (`-w`) keeps is what the agent sent

    def error(self, flow: http.HTTPFlow) -> None:
        live = flow.metadata.get(LIVE)
        if live is not None:
            self.live.abandon(live)  # never relayed (its agent left first), or relayed already: no-op
        self.response(flow)

    async def _serve_cancellable(
        self, flow: http.HTTPFlow, base_url: str | None, route: Route | None
    ) -> HttpReply | LiveStream | None:
        """Serve the turn as a task that a client disconnect cancels (None then): mitmproxy keeps running a
        request hook after its client has gone, and a turn nobody receives must not be recorded."""
        # Awaited right here and held in `_turns`, so neither mitmproxy's keep-alive set nor its debug info (an
        # environment lookup per task) is needed.
        serving = self._serve(flow, base_url, route)
        task: asyncio.Task[HttpReply | LiveStream] = asyncio.create_task(serving, name="tito-turn")
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

    async def _serve(self, flow: http.HTTPFlow, base_url: str | None, route: Route | None) -> HttpReply | LiveStream:
        if self.wiring.service is None or route is None:
            message = "tito_addon is not configured: set tito_tokenizer; nothing was forwarded"
            return refusal_reply(TitoError(message, status=503))
        try:
            body = flow.request.content or b""
        except ValueError:
            return refusal_reply(BadRequest("request body has an invalid content-encoding"))
        headers = folded_headers(flow.request.headers)
        assert base_url is not None  # request() only serves flows to backend hosts
        episode = flow.metadata.get(EPISODE)
        return await self.wiring.service.serve(flow.request.path, headers, body, base_url, episode, route=route)

    def done(self) -> None:
        self.wiring.close_all("shutdown")  # this process's own sessions; shared ones live on in their store
        try:
            asyncio_utils.create_task(self.live.stop(), name="tito-stop-live", keep_ref=True)
            asyncio_utils.create_task(self.wiring.aclose(), name="tito-close-upstream", keep_ref=True)
        except RuntimeError:
            pass  # no running loop: the process is exiting anyway


def refusal_metadata(reply: HttpReply) -> dict[str, Any]:
    """What a flow file keeps of a refusal: its status and error body (parsed when JSON), cut short; never a header,
    so no API key or Authorization value reaches the metadata."""
    text = reply.body[:REFUSAL_BYTES].decode("utf-8", "replace")
    error: Any = text
    if len(reply.body) <= REFUSAL_BYTES:
        try:
            error = json.loads(reply.body)
        except ValueError:
            pass
    return {"status": reply.status, "error": error}


def backend_of(wiring: TurnWiring, flow: http.HTTPFlow) -> str | None:
    """Where a flow's turn would run: None when it does not go to a configured backend (the only hosts that may
    receive the backend's API key; episode naming asks the same)."""
    if wiring.settings is None:
        return None
    reverse = isinstance(flow.client_conn.proxy_mode, ReverseMode)
    return wiring.backend_for(
        reverse=reverse, scheme=flow.request.scheme, host=flow.request.host, port=flow.request.port
    )
