"""Images given by URL, with `tito_image_fetch=true`: the proxy fetches each URL once, from a real HTTP server on
loopback, and the turn is an inline image turn like any other (counted, sent to the engine, kept once on disk); an
agent that re-sends the URL continues its stored turn without a second fetch. A URL that does not answer an image is
a 400 and nothing is forwarded. (Without the option such an image is refused: test_image_turns.)"""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from support.basics import tokenizer_path
from support.images import png
from support.proxy_harness import Mitmdump, post

from tito_addon.records.record_reader import read_session
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

SHOT = png(160, 90, (12, 34, 56))
OTHER = png(90, 160, (65, 43, 21))


class Images(BaseHTTPRequestHandler):
    hits: dict[str, int] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        Images.hits[self.path] = Images.hits.get(self.path, 0) + 1
        body = {"/shot.png": SHOT, "/other.png": OTHER, "/text": b"not an image"}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("content-type", "image/png" if body and body.startswith(b"\x89PNG") else "text/plain")
        self.end_headers()
        self.wfile.write(body or b"missing")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    record_dir = tmp_path_factory.mktemp("fetch") / "rec"
    settings = {"tokenizer": tokenizer_path("qwen2.5"), "family": "qwen2.5-vl", "record_dir": record_dir}
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen2.5"), vision="qwen2.5-vl")
    options = {"tito_image_fetch": "true"}
    with (
        ReplicaThread(config) as replica,
        Mitmdump(replica.url, cwd=record_dir.parent, options=options, **settings) as proxy,
    ):
        yield proxy, replica, record_dir, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_an_image_url_is_fetched_once_and_recorded_like_an_inline_image(stack) -> None:
    proxy, replica, record_dir, base = stack
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", default_headers={"x-session-id": "fetched"})
    part = {"type": "image_url", "image_url": {"url": f"{base}/shot.png"}}
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, part]}]
    before = len(replica.generated())
    for follow_up in ("And now?", "Once more?"):
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=80)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": follow_up}]
    turns = read_session(record_dir, "fetched").turns
    assert [t.parent_turn_id for t in turns] == [None, 0], "the re-sent URL is the same image: the turn continues"
    assert Images.hits["/shot.png"] == 1
    digest = hashlib.sha256(SHOT).hexdigest()
    assert [image.sha256 for image in turns[0].images] == [digest]
    assert (record_dir / "images" / f"{digest}.png").read_bytes() == SHOT
    assert [[image["sha256"] for image in run["images"]] for run in replica.generated()[before:]] == [[digest]] * 2


def test_anthropic_and_gemini_urls_are_fetched_too(stack) -> None:
    proxy, replica, record_dir, base = stack
    before = len(replica.generated())
    image = {"type": "image", "source": {"type": "url", "url": f"{base}/other.png"}}
    anthropic_body = {
        "model": "m",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": "?"}]}],
    }
    reply = post(proxy.url + "/v1/messages", json=anthropic_body, headers={"x-session-id": "claude"})
    assert reply.status_code == 200, reply.text
    gemini_body = {"contents": [{"role": "user", "parts": [
        {"fileData": {"fileUri": f"{base}/other.png", "mimeType": "image/png"}}, {"text": "?"}]}]}  # fmt: skip
    reply = post(proxy.url + "/v1beta/models/m:generateContent", json=gemini_body, headers={"x-session-id": "gem"})
    assert reply.status_code == 200, reply.text
    assert Images.hits["/other.png"] == 1
    digest = hashlib.sha256(OTHER).hexdigest()
    assert [[image["sha256"] for image in run["images"]] for run in replica.generated()[before:]] == [[digest]] * 2


@pytest.mark.parametrize(("path", "why"), [("/missing", "answered 404"), ("/text", "does not decode")])
def test_a_url_that_does_not_answer_an_image_is_refused(stack, path: str, why: str) -> None:
    proxy, replica, record_dir, base = stack
    before = len(replica.generated())
    part = {"type": "image_url", "image_url": {"url": base + path}}
    body = {"model": "m", "messages": [{"role": "user", "content": [part]}]}
    reply = post(proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": "bad"})
    assert reply.status_code == 400 and why in reply.json()["error"]["message"], reply.text
    assert len(replica.generated()) == before and read_session(record_dir, "bad") is None
