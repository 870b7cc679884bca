"""Which backend a chat flow goes to, if any.

`tito_backends` lists the backend hosts: `HOST[:PORT]` (the target itself is the backend) or `HOST[:PORT]=URL`
(served by URL, e.g. an agent hard-wired to a public API host served by a local vLLM). When it is set, only chat
requests to a listed host are rewritten, in any mode; everything else passes through untouched. When it is empty,
every chat request is rewritten and served by `tito_backend_url`, else (reverse mode) the flow's own reverse
target, else $TITO_BACKEND_URL, $SGLANG_BASE_URL, $VLLM_BASE_URL, else the request's own target. Several backends
behind one proxy: several `--mode reverse:…` listeners, or several `tito_backends` entries.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

BACKEND_URL_ENV = ("TITO_BACKEND_URL", "SGLANG_BASE_URL", "VLLM_BASE_URL")


@functools.lru_cache(maxsize=256)  # asked for every chat flow (the environment's URL), with few distinct values
def normalize_backend_url(value: str) -> str:
    """`host:port`, `http://host:port/`, `http://host:port/v1` -> `http://host:port` (a path prefix is kept)."""
    value = value.strip()
    if "://" not in value:
        value = "http://" + value
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {value!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


def backend_url_from_env() -> str | None:
    for name in BACKEND_URL_ENV:
        value = os.environ.get(name)
        if value:
            return normalize_backend_url(value)
    return None


def parse_backends(spec: str) -> dict[tuple[str, int | None], str | None]:
    """`api.example.com=http://127.0.0.1:8000, 10.0.0.5:30000` -> {(host, port): url or None}."""
    entries: dict[tuple[str, int | None], str | None] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        host_part, _, url = item.partition("=")
        host, port = _host_port(host_part.strip())
        entries[(host, port)] = normalize_backend_url(url) if url.strip() else None
    return entries


def _host_port(value: str) -> tuple[str, int | None]:
    if not value or "/" in value:
        raise ValueError(f"not a HOST[:PORT]: {value!r}")
    parsed = urlsplit("//" + value)
    if not parsed.hostname:
        raise ValueError(f"not a HOST[:PORT]: {value!r}")
    return parsed.hostname.lower(), parsed.port


@dataclass(frozen=True)
class BackendRoutes:
    entries: dict[tuple[str, int | None], str | None] = field(default_factory=dict)
    backend_url: str | None = None  # tito_backend_url, or the environment's
    override_reverse: bool = False  # tito_backend_url was set explicitly: it wins in reverse mode too

    def resolve(self, *, reverse: bool, scheme: str, host: str, port: int) -> str | None:
        """The backend base URL for a chat flow to scheme://host:port, or None to leave the flow alone."""
        own = normalize_backend_url(f"{scheme}://{host}:{port}")
        if self.entries:
            host = host.lower()
            for key in ((host, port), (host, None)):
                if key in self.entries:
                    return self.entries[key] or own
            return None
        if self.override_reverse and self.backend_url:
            return self.backend_url
        if reverse:
            return own
        return self.backend_url or own
