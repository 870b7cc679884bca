"""HTTP helpers for the integration tests (stdlib only); the mitmdump launcher lives in the package."""

from __future__ import annotations

from tito_addon.replicas.proxy_process import REPO, Mitmdump

__all__ = ["REPO", "Mitmdump", "Reply", "get", "post"]


class Reply:
    """A minimal HTTP reply (the stdlib client: no extra test dependency)."""

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = {k.lower(): v for k, v in headers.items()}
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self):
        import json

        return json.loads(self.content)


def http_request(method: str, url: str, *, json=None, content: bytes | None = None, headers=None, timeout=30.0):
    import json as jsonlib
    import urllib.error
    import urllib.request

    data = content if content is not None else (jsonlib.dumps(json).encode() if json is not None else None)
    send = {"content-type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, method=method, headers=send)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Reply(response.status, dict(response.headers), response.read())
    except urllib.error.HTTPError as error:
        return Reply(error.code, dict(error.headers), error.read())


def post(url: str, **kw) -> Reply:
    return http_request("POST", url, **kw)


def get(url: str, **kw) -> Reply:
    return http_request("GET", url, **kw)
