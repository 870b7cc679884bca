"""The control API for rollout drivers, served by the proxy itself on a reserved host, as mitmproxy serves `mitm.it`.

A driver reaches it through the proxy's own port in every mode: in regular mode as any other host
(`http://tito.control/v1/sessions` with the proxy set), in reverse mode with the same absolute-form request (every
HTTP client does that when told to use the proxy), or with `Host: tito.control` when mitmproxy keeps host headers.
Off unless `tito_control_token` is set; the host is then not served at all (the flow goes wherever it was going).
With it, every request must carry `Authorization: Bearer TOKEN`: anything else is the same 401, whatever the path,
so a caller without the token learns nothing. A body over 1 MiB is a 413 (mitmproxy reads a body before any answer
goes out, so one declared over 64 MiB closes the connection unread). The routes: `control_routes`, and `GET /v1/info`,
answered here: what a driver must know of this proxy's configuration before it runs agents.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import re
from importlib import metadata
from typing import Any

from mitmproxy import ctx, exceptions, http

from tito_addon.protocols.http_reply import HttpReply, json_reply, refusal_reply
from tito_addon.proxy.control_routes import MAX_BODY, Call, ControlRoutes, Route
from tito_addon.proxy.turn_wiring import TurnWiring
from tito_addon.tito_errors import TitoError
from tito_addon.turns.session_control import SessionControl

logger = logging.getLogger(__name__)

CONTROL = "tito_control"
HOST_NAME = re.compile(r"(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")
MIN_TOKEN = 16
HARD_CAP = 64 * 1024 * 1024  # a declared control body past this closes the connection unread
INFO_PATH = "/v1/info"


def package_version() -> str:
    try:
        return metadata.version("tito_addon")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def proxy_info(wiring: TurnWiring) -> dict[str, Any]:
    """What a driver checks before it starts an agent: how episodes are named (the API-key prefix, whether proxy
    auth needs a password: never the password itself), what a closed name does, and which backend and tokenizer
    the rows will come from (null until the proxy is configured)."""
    settings, facts = wiring.settings, wiring.facts
    return {
        "version": package_version(),
        "session_api_key_prefix": facts.session_api_key_prefix or None,
        "after_close": settings.after_close if settings is not None else None,
        "proxy_auth_password_required": facts.proxy_auth_password_required,
        "backend_kind": settings.backend_kind if settings is not None else None,
        "model_family": settings.model_family if settings is not None else None,
        "tokenizer": (settings.tokenizer or None) if settings is not None else None,
        # Generations a weight update cut, in this process: resuming now (0 once an update has drained), resumed.
        "generations_cut": dataclasses.asdict(wiring.resume_stats),
        # Turns waiting on a backend now (during a pause: those the paused engines hold), and the oldest's wait.
        "turns_in_flight": wiring.in_flight.summary(),
        # The router in front of the engines, and a fixed list's engines with those a call found dead (tried last).
        "router": settings.router if settings is not None else None,
        "engines": engines_info(wiring),
    }


def engines_info(wiring: TurnWiring) -> dict[str, Any] | None:
    engines = wiring.client.engines
    return {"urls": list(engines.urls), "down": engines.down()} if engines is not None else None


def unauthorized() -> http.Response:
    error = TitoError("unauthorized", status=401)
    return http.Response.make(401, error.body(), {**error.headers(), "www-authenticate": "Bearer"})


class ControlAddon:
    def __init__(self, wiring: TurnWiring) -> None:
        async def info(routes: ControlRoutes, call: Call) -> HttpReply:
            return json_reply(200, json.dumps(proxy_info(wiring)).encode())

        self.routes = ControlRoutes(SessionControl(lambda: wiring.sessions), (Route(("GET",), INFO_PATH, info),))
        self.token = b""
        self.host = "tito.control"

    def load(self, loader: Any) -> None:
        loader.add_option(
            "tito_control_token",
            str,
            "",
            "Serve the control API for rollout drivers (list sessions, fetch rows, annotate, wait, close) on "
            "tito_control_host, to callers that send this bearer token (at least 16 characters). Empty: off.",
        )
        loader.add_option("tito_control_host", str, "tito.control", "The reserved host name of the control API.")

    def configure(self, updated: set[str]) -> None:
        if not updated & {"tito_control_token", "tito_control_host"}:
            return
        token = ctx.options.tito_control_token
        if token and (len(token) < MIN_TOKEN or not token.isascii() or not token.isprintable() or " " in token):
            raise exceptions.OptionsError(
                f"invalid tito_control_token: at least {MIN_TOKEN} printable ASCII characters without spaces"
            )
        host = ctx.options.tito_control_host.strip().lower()
        if not HOST_NAME.fullmatch(host):
            raise exceptions.OptionsError(f"invalid tito_control_host: not a host name: {host!r}")
        self.token, self.host = token.encode(), host

    def serves(self, flow: http.HTTPFlow) -> bool:
        if not self.token:
            return False
        request = flow.request
        names = (request.host, request.authority.rpartition(":")[0] or request.authority, request.host_header or "")
        # `tito.control.` is the same name (the root's trailing dot): a driver spelling it so must not send its
        # token to the backend instead.
        return any(name.lower().split(":")[0].rstrip(".") == self.host for name in names if name)

    def _authorized(self, flow: http.HTTPFlow) -> bool:
        values = flow.request.headers.get_all("authorization")
        if len(values) != 1:
            return False
        scheme, _, token = values[0].partition(" ")
        try:
            given = token.strip().encode("utf-8")
        except UnicodeError:  # a header that is not UTF-8 (mitmproxy decodes it with surrogate escapes)
            return False
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self.token)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Refuse what needs no body to refuse: no token, or a declared body larger than any control request."""
        if flow.response is not None or flow.error is not None or not flow.live:
            return
        try:
            if not self.serves(flow):
                return
            flow.metadata[CONTROL] = True  # its Authorization is our token: no other addon reads or rewrites it
            length = flow.request.headers.get("content-length", "0").strip()
            declared = int(length) if length.isdigit() and len(length) < 20 else HARD_CAP + 1
            if declared > HARD_CAP:
                # mitmproxy reads a body before it sends any answer: one this large is not read at all.
                flow.kill()
            elif not self._authorized(flow):
                flow.response = unauthorized()
            elif declared > MAX_BODY:
                reply = refusal(413, f"a control request body is at most {MAX_BODY} bytes")
                flow.response = http.Response.make(reply.status, reply.body, reply.headers)
        except Exception:
            logger.exception("tito control: unexpected failure")
            flow.response = internal_error()

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.error is not None or not flow.live or not flow.metadata.get(CONTROL):
            return
        try:
            if not self._authorized(flow):
                flow.response = unauthorized()
                return
            body = flow.request.raw_content or b""
            if len(body) > MAX_BODY or flow.request.headers.get("content-encoding"):
                reply = refusal(413 if len(body) > MAX_BODY else 415, "request body too large or encoded")
            else:
                reply = await self.routes.handle(flow.request.method, flow.request.path, body)
            flow.response = http.Response.make(reply.status, reply.body, reply.headers)
        except Exception:
            logger.exception("tito control: unexpected failure")
            flow.response = internal_error()


def internal_error() -> http.Response:
    error = TitoError("internal error in the tito control API; nothing was changed")
    return http.Response.make(500, error.body(), {"content-type": "application/json"})


def refusal(status: int, message: str) -> HttpReply:
    return refusal_reply(TitoError(message, status=status))
