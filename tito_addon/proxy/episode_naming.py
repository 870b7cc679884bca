"""Episode names a rollout driver gives an unmodified agent through settings it already has: the proxy's user name
or its API key.

- Regular (HTTP/HTTPS proxy) mode: `HTTP_PROXY=http://EPISODE@HOST:PORT`. Clients send the user name in
  `Proxy-Authorization` on every plain-HTTP request, or once on the CONNECT of an HTTPS tunnel (then it names every
  request in that tunnel). The header is for the proxy: it is removed from every flow, never forwarded. A password
  is required only when `tito_proxy_auth_password` is set (or mitmproxy's own `proxyauth` is, which then checks
  the credentials and leaves us the user name in `flow.metadata["proxyauth"]`).
- Reverse mode (or any mode): an API key of the form `tito_session_api_key_prefix` + EPISODE, in
  `Authorization: Bearer …` (OpenAI SDKs, Codex, Claude Code's `ANTHROPIC_AUTH_TOKEN`) or `x-api-key` (Claude Code's
  `ANTHROPIC_API_KEY`) or `x-goog-api-key` (Gemini CLI's `GEMINI_API_KEY`, the google-genai SDK). It is removed
  before the flow goes anywhere, and `tito_backend_api_key` (when set) sent as `Authorization: Bearer` (the header
  sglang and vLLM read), so the backend sees the real key and no recording, flow file or log sees either: flows to
  hosts that are not backends lose the episode key and never get the backend's.

The name lands in `flow.metadata["tito_episode"]`; the capture addon uses it as the session id unless a
`/sessions/{id}/` base URL names one. It wins over the session header: agents send that header of their own accord
(opencode: `X-Session-Id` with its own session id on every request), and the driver's name must not be lost.
"""

from __future__ import annotations

import binascii
import hmac
import logging
import weakref
from collections.abc import Callable, MutableMapping
from typing import Any

from mitmproxy import connection, ctx, exceptions, http
from mitmproxy.proxy.mode_specs import RegularMode, UpstreamMode

from tito_addon.proxy.proxy_facts import ProxyFacts
from tito_addon.tito_errors import FINAL_HEADERS

logger = logging.getLogger(__name__)

EPISODE = "tito_episode"
KEY_HEADERS = ("authorization", "x-api-key", "x-goog-api-key")


def proxy_user(value: str) -> tuple[str, str] | None:
    """(user, password) of a `Basic` Proxy-Authorization value, or None when it is not one."""
    scheme, _, encoded = value.strip().partition(" ")
    if scheme.lower() != "basic" or not encoded.strip():
        return None
    try:
        decoded = binascii.a2b_base64(encoded.strip().encode("ascii"), strict_mode=True).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        return None
    user, _, password = decoded.partition(":")
    return user, password


def proxy_auth_required() -> http.Response:
    body = b'{"error":{"message":"proxy authentication required","type":"proxy_auth_required","code":407}}'
    return http.Response.make(
        407, body, {"content-type": "application/json", "proxy-authenticate": 'Basic realm="tito"', **FINAL_HEADERS}
    )  # the same credentials fail again: final


class EpisodeNaming:
    """Reads an episode name off proxy auth or an API key; rewrites the key to the backend's."""

    def __init__(
        self, is_backend: Callable[[http.HTTPFlow], bool] | None = None, facts: ProxyFacts | None = None
    ) -> None:
        # Which flows go to a backend (only those may carry the backend's key); the capture addon decides.
        self.is_backend = is_backend or (lambda flow: True)
        self.facts = facts if facts is not None else ProxyFacts()  # what it publishes of its options
        # CONNECT tunnels named by their proxy auth: every request inside carries that name.
        self.tunnels: MutableMapping[connection.Client, str] = weakref.WeakKeyDictionary()
        self.key_prefix = ""
        self.backend_key = ""
        self.password = ""

    def load(self, loader: Any) -> None:
        loader.add_option(
            "tito_session_api_key_prefix",
            str,
            "",
            "An API key that starts with this (e.g. sk-tito-) names its request's session: sk-tito-EPISODE. The key "
            "is replaced by tito_backend_api_key before the request leaves the proxy and is never recorded.",
        )
        loader.add_option(
            "tito_backend_api_key", str, "", "The backend's real API key, sent in place of an episode key."
        )
        loader.add_option(
            "tito_proxy_auth_password",
            str,
            "",
            "Require this password with an episode's proxy user name (HTTP_PROXY=http://EPISODE:PASSWORD@HOST:PORT); "
            "empty: the user name alone names the episode.",
        )

    def configure(self, updated: set[str]) -> None:
        if not updated & {"tito_session_api_key_prefix", "tito_backend_api_key", "tito_proxy_auth_password"}:
            return
        prefix = ctx.options.tito_session_api_key_prefix
        if prefix and (len(prefix) < 3 or not prefix.isascii() or not prefix.isprintable() or " " in prefix):
            raise exceptions.OptionsError(
                "invalid tito_session_api_key_prefix: at least 3 printable ASCII characters without spaces"
            )
        backend_key = ctx.options.tito_backend_api_key
        if any(c in backend_key for c in "\r\n"):
            raise exceptions.OptionsError("invalid tito_backend_api_key: a line break")
        if prefix and backend_key.startswith(prefix):
            raise exceptions.OptionsError("invalid tito_backend_api_key: it starts with tito_session_api_key_prefix")
        self.key_prefix, self.backend_key = prefix, backend_key
        self.password = ctx.options.tito_proxy_auth_password
        self.facts.session_api_key_prefix, self.facts.proxy_auth_password_required = prefix, bool(self.password)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return  # refused already (mitmproxy's proxyauth)
        user = self._proxy_user(flow)
        if user is not None:
            self.tunnels[flow.client_conn] = user

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.error is not None or flow.metadata.get("tito_control"):
            return
        proxied = isinstance(flow.client_conn.proxy_mode, (RegularMode, UpstreamMode))
        name = self._proxy_user(flow) if proxied else None
        flow.request.headers.pop("proxy-authorization", None)  # for this proxy alone: never forwarded
        if flow.response is not None:
            return  # 407: a password is required
        name = name or self.tunnels.get(flow.client_conn)
        keyed = self._rewrite_key(flow)
        name = name or keyed
        if name:
            flow.metadata[EPISODE] = name

    def _proxy_user(self, flow: http.HTTPFlow) -> str | None:
        """The proxy-auth user of this request (or CONNECT); answers 407 when a password is required and wrong."""
        checked = flow.metadata.get("proxyauth")  # mitmproxy's own proxyauth checked these credentials
        if isinstance(checked, tuple) and checked and checked[0]:
            return str(checked[0])
        value = flow.request.headers.get("proxy-authorization")
        credentials = proxy_user(value) if value is not None else None
        if self.password and flow.client_conn not in self.tunnels:
            if credentials is None or not hmac.compare_digest(credentials[1].encode(), self.password.encode()):
                flow.response = proxy_auth_required()
                return None
        if credentials is None or not credentials[0]:
            return None
        return credentials[0]

    def _rewrite_key(self, flow: http.HTTPFlow) -> str | None:
        """The episode an API key names (None: no episode key); every episode key removed, and the backend's key
        put in `Authorization: Bearer`, whichever header the agent used: sglang's and vLLM's `--api-key` read that
        header alone, and every call the proxy makes to them (a translated Messages or Gemini turn too) carries the
        agent's headers."""
        if not self.key_prefix:
            return None
        episode = None
        headers = flow.request.headers
        for name in KEY_HEADERS:
            values = headers.get_all(name)
            if not values:
                continue
            kept = []
            for value in values:
                bearer = (value[7:] if value[:7].lower() == "bearer " else value).strip()
                if bearer.startswith(self.key_prefix):
                    episode = episode or bearer[len(self.key_prefix) :]
                else:
                    kept.append(value)
            if kept:
                headers.set_all(name, kept)
            else:
                del headers[name]
        if episode is not None and self.backend_key and self.is_backend(flow):
            headers["authorization"] = "Bearer " + self.backend_key
        return episode
