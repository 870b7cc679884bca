"""HTTP helpers for the integration tests (stdlib only), and mitmdump in front of a vLLM-shaped backend; the
mitmdump launcher lives in the package."""

from __future__ import annotations

from pathlib import Path

from tito_addon.replicas.proxy_process import REPO, Mitmdump

from .basics import tokenizer_path

__all__ = ["REPO", "Mitmdump", "Reply", "get", "post", "vllm_proxy"]


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


def vllm_proxy(backend_url: str, record_dir: Path, cwd: Path) -> Mitmdump:
    """mitmdump with the addon in front of a vLLM(-shaped) backend, qwen3 tokenizer and family."""
    options = {"tito_backend_kind": "vllm"}
    return Mitmdump(backend_url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=cwd, options=options)
