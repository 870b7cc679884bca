"""Refusals that retrying cannot fix stop the agent at once: a closed episode is a 410 with `x-should-retry: false`
(a 409 had Claude Code retrying for minutes), a bad request a 400 with the same header; a refusal that a retry can
fix (an unreachable backend's 502) keeps its status and has no such header, so clients still retry it.

Each real SDK runs with its default retry settings against a real mitmdump; the proxy's own log counts the requests it
got, so a client that retried fails the count."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import anthropic
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types as genai_types
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump, post

from tito_addon.client import TitoClient, episode_api_key
from tito_addon.records.record_reader import read_session
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.tito_errors import (
    BadRequest,
    SessionClosed,
    SessionGone,
    StoreUnavailable,
    TemplateRefusal,
    TitoError,
    TokenizationError,
    UpstreamMalformed,
    UpstreamUnavailable,
)

TOKEN = "control-token-final-0123456789"
KEY_PREFIX = "sk-ep-"
EPISODE = "ep-final"
REASON = "was closed by its driver"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def replica():
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as running:
        yield running


@pytest.fixture(scope="module")
def closed(replica, tmp_path_factory):
    """A proxy whose API keys name episodes, and EPISODE: one turn, then closed by its driver."""
    tmp = tmp_path_factory.mktemp("final")
    options = {"tito_control_token": TOKEN, "tito_session_api_key_prefix": KEY_PREFIX}
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp / "rec", cwd=tmp,
                  options=options) as proxy:  # fmt: skip
        agent = openai.OpenAI(base_url=proxy.url + "/v1", api_key=episode_api_key(KEY_PREFIX, EPISODE))
        agent.chat.completions.create(model="m", messages=MESSAGES)
        with TitoClient(proxy.url, TOKEN) as tito:
            assert tito.close(EPISODE)["closed"] is True
        # The log lags the answers: a test counting from here must not see this turn's 200 arrive after its baseline.
        deadline = time.monotonic() + 10
        while "200" not in answered(proxy) and time.monotonic() < deadline:
            time.sleep(0.05)
        requests_seen(proxy, 0, at_least=len(answered(proxy)))
        yield proxy


def answered(proxy: Mitmdump) -> list[str]:
    """The statuses of the flows mitmdump has answered so far, from its own log (one `<< STATUS` line per flow)."""
    return re.findall(r"<< (\d{3})\b", proxy.output())


def requests_seen(proxy: Mitmdump, before: int, at_least: int = 1) -> list[str]:
    """The statuses answered since `before` flows, once at least `at_least` are logged (every retry of a client
    precedes the error it raises, so a grace period covers only the log's own lag)."""
    deadline = time.monotonic() + 10
    while len(answered(proxy)) < before + at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    return answered(proxy)[before:]


def key() -> str:
    return episode_api_key(KEY_PREFIX, EPISODE)


def chat(proxy: Mitmdump) -> None:
    openai.OpenAI(base_url=proxy.url + "/v1", api_key=key()).chat.completions.create(model="m", messages=MESSAGES)


def responses(proxy: Mitmdump) -> None:
    openai.OpenAI(base_url=proxy.url + "/v1", api_key=key()).responses.create(model="m", input="Hi")


def messages(proxy: Mitmdump) -> None:
    api = anthropic.Anthropic(base_url=proxy.url, api_key=key())
    api.messages.create(model="m", max_tokens=64, messages=MESSAGES)


def gemini(proxy: Mitmdump, retry: genai_types.HttpRetryOptions | None = None) -> None:
    options = genai_types.HttpOptions(base_url=proxy.url, api_version="v1beta", retry_options=retry)
    client = genai.Client(api_key=key(), http_options=options)  # held: a collected client closes its connection
    client.models.generate_content(model="m", contents="Hi")


def gemini_retrying(proxy: Mitmdump) -> None:
    """google-genai retries only when asked to: with its own retry options on, a 410 is still final."""
    gemini(proxy, genai_types.HttpRetryOptions())


def status_and_headers(error: Exception) -> tuple[int, dict[str, str]]:
    if isinstance(error, genai_errors.APIError):
        return error.code, {k.lower(): v for k, v in error.response.headers.items()}
    assert isinstance(error, openai.APIStatusError | anthropic.APIStatusError), type(error)
    return error.status_code, {k.lower(): v for k, v in error.response.headers.items()}


@pytest.mark.parametrize("call", [chat, responses, messages, gemini, gemini_retrying])
def test_an_sdk_with_default_retries_stops_at_once_on_a_closed_episode(closed: Mitmdump, replica, call) -> None:
    served, before = len(replica.received()), len(answered(closed))
    started = time.monotonic()
    with pytest.raises(Exception, match=REASON) as refused:
        call(closed)
    took = time.monotonic() - started
    status, headers = status_and_headers(refused.value)
    expected = 400 if call is responses else 410  # the Responses API's final refusals are 400s: Codex retries a 410
    assert status == expected and headers["x-should-retry"] == "false", (status, headers)
    message = str(refused.value)
    assert repr(EPISODE) in message and "tito_after_close=refuse" in message and "nothing was forwarded" in message
    # One request, one answer: the SDK did not send it again (each of these would retry a 409 with backoff).
    assert requests_seen(closed, before) == [str(expected)]
    assert len(replica.received()) == served, "nothing was forwarded"
    assert took < 5, took
    recorded = read_session(closed.record_dir, EPISODE)
    assert recorded is not None and len(recorded.turns) == 1 and [c.reason for c in recorded.closes] == ["closed"]


def test_each_api_names_a_closed_episode_in_its_own_error_shape(closed: Mitmdump) -> None:
    bearer, api_key = {"authorization": f"Bearer {key()}"}, {"x-api-key": key(), "anthropic-version": "2023-06-01"}
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 16}
    gemini_body = {"contents": [{"parts": [{"text": "Hi"}]}]}
    cases = [
        ("/v1/chat/completions", bearer, body, {"type": "session_closed", "code": 410}),
        ("/v1/responses", bearer, {"model": "m", "input": "Hi"},
         {"type": "invalid_request_error", "code": "session_closed"}),
        ("/v1/messages", api_key, body, {"type": "invalid_request_error"}),
        ("/v1beta/models/m:generateContent", {"x-goog-api-key": key()}, gemini_body,
         {"status": "FAILED_PRECONDITION", "code": 410}),
    ]  # fmt: skip
    before = len(answered(closed))
    for path, headers, payload, shape in cases:
        reply = post(closed.url + path, json=payload, headers=headers)
        status = 400 if path == "/v1/responses" else 410  # Codex retries every final status but a 400
        assert reply.status_code == status and reply.headers["x-should-retry"] == "false", (path, reply.headers)
        error = reply.json()["error"]
        assert {k: error[k] for k in shape} == shape and REASON in error["message"], (path, error)
    # The log lags the answers: the next test's baseline must not see these arrive after it was taken.
    assert requests_seen(closed, before, at_least=len(cases)) == ["410", "400", "410", "410"]


def test_a_bad_request_is_final_too(closed: Mitmdump, replica) -> None:
    served, before = len(replica.received()), len(answered(closed))
    api = openai.OpenAI(base_url=closed.url + "/v1", api_key="sk-plain")  # names no episode
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model="m", messages=[{"role": "nobody", "content": "Hi"}])
    assert bad.value.response.headers["x-should-retry"] == "false"
    assert requests_seen(closed, before) == ["400"] and len(replica.received()) == served
    # Refused before any route is known (a session header twice), in the generic shape: final all the same.
    twice = [("x-session-id", "a"), ("x-session-id", "b")]
    reply = _raw_post(closed.port, "/v1/chat/completions", twice, b'{"model": "m", "messages": []}')
    assert reply[0] == 400 and reply[1].get("x-should-retry") == "false", reply
    assert requests_seen(closed, before + 1) == ["400"]  # its log line too, before a later test's baseline


def _raw_post(port: int | None, path: str, headers: list[tuple[str, str]], body: bytes) -> tuple[int, dict, bytes]:
    """A POST with a repeated header (urllib folds duplicates away), over a plain socket."""
    import http.client

    assert port is not None
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest("POST", path)
        for name, value in [*headers, ("content-type", "application/json"), ("content-length", str(len(body)))]:
            connection.putheader(name, value)
        connection.endheaders(body)
        reply = connection.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    finally:
        connection.close()


def test_a_refusal_a_retry_can_fix_carries_no_such_header(tmp_path: Path) -> None:
    """An unreachable backend is a 502 without the header: the SDK retries it as it always did, which the same
    count sees (so the count would see a retried 410 too)."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{unused.getsockname()[1]}"  # closed again before the proxy starts
    with Mitmdump(dead, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path) as proxy:
        reply = post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
        assert reply.status_code == 502 and "x-should-retry" not in reply.headers, (reply.status_code, reply.headers)
        # The count starts after this request's own log line, which may lag its answer on a loaded machine.
        assert requests_seen(proxy, 0, at_least=1) == ["502"]
        before = 1
        with pytest.raises(openai.InternalServerError):
            openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-plain").chat.completions.create(
                model="m", messages=MESSAGES
            )
        assert requests_seen(proxy, before, at_least=3) == ["502"] * 3  # openai-python's default: 2 retries


@pytest.mark.parametrize(
    ("error", "final"),
    [
        (SessionClosed("s"), True), (BadRequest("b"), True), (TemplateRefusal("t"), True),
        (TokenizationError("t"), True), (TitoError("too large", status=413), True), (TitoError("no", status=404), True),
        (SessionGone("s"), False), (StoreUnavailable("s"), False), (UpstreamMalformed("u"), False),
        (UpstreamUnavailable("u"), False), (TitoError("in flight", status=409), False), (TitoError("internal"), False),
    ],
)  # fmt: skip
def test_which_errors_are_final(error: TitoError, final: bool) -> None:
    assert error.final is final
    assert (error.headers().get("x-should-retry") == "false") is final
    assert SessionClosed("s").status == 410 and SessionGone("s").status == 409
