"""Hypothesis-generated malformed and hostile agent requests (chat, Anthropic Messages, OpenAI Responses) through
one real mitmdump.

Every request is sent over a raw socket (so header values, encodings and bodies are exactly what the strategy made)
to the chat route of a mitmdump in front of the sglang replica, behind a tap that sees every upstream call. Each
one must get a 4xx JSON error; nothing may reach the backend; no file under the proxy's directories may appear or
change; and a session opened before the storm must still be extended by a valid follow-up turn afterwards.

The control API (`tito.control`, served by a second mitmdump with `tito_control_token` set, over two recorded
sessions) gets the same treatment: bad or missing tokens, malformed annotation and close bodies, unknown sessions and
turns, path tricks, bad query values and wrong methods each get a 4xx JSON error (401, identical, for every auth
failure), reach no backend and change no byte under the record dir's parents; the same routes then still accept a
valid annotation and close.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump, post
from support.upstream_tap import UpstreamTap

from tito_addon.records.record_reader import read_session_file
from tito_addon.records.trajectory_recorder import session_file_name
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

ANCHOR = "hostile-anchor"
ANCHOR_MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
ROLES = ("system", "user", "assistant", "tool")
SENT: list[int] = []  # one entry per generated request, checked against the >= 300 the suite promises


def profile(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


class World:
    def __init__(self, replica: ReplicaThread, tap: UpstreamTap, proxy: Mitmdump, root: Path) -> None:
        self.replica, self.tap, self.proxy, self.root = replica, tap, proxy, root
        self.record_dir = root / "rec"
        self.snapshot = self.files()

    def files(self) -> dict[str, tuple[int, int]]:
        """Every file under the proxy's working tree (its cwd holds the record dir) with size and mtime."""
        out = {}
        for folder, _, names in os.walk(self.root):
            for name in names:
                stat = os.stat(os.path.join(folder, name))
                out[os.path.join(folder, name)] = (stat.st_size, stat.st_mtime_ns)
        return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    with (
        ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica,
        UpstreamTap(replica.url) as tap,
        Mitmdump(
            tap.url, tokenizer=tokenizer_path("qwen3"), record_dir=root / "rec", cwd=root,
            options={"tito_upstream_timeout": "10"},
        ) as proxy,
    ):  # fmt: skip
        first = post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": ANCHOR_MESSAGES},
                     headers={"x-session-id": ANCHOR})  # fmt: skip
        assert first.status_code == 200, first.text
        state = World(replica, tap, proxy, root)
        state.anchor_reply = first.json()["choices"][0]["message"]
        tap.calls.clear()
        replica.backend.reset()
        yield state
        assert proxy.proc is not None and proxy.proc.poll() is None, "mitmdump died during the storm"
        log = proxy.output()
    assert "Traceback" not in log and "unexpected failure" not in log, log[-4000:]


def raw_post(port: int, path: bytes, body: bytes, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 request with exactly these bytes (no client-side validation of header values)."""
    head = [b"POST " + path + b" HTTP/1.1", b"Host: 127.0.0.1:%d" % port, b"Connection: close"]
    if not any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers):
        head.append(b"Content-Length: %d" % len(body))
    if not any(k.lower() == b"content-type" for k, _ in headers):
        head.append(b"Content-Type: application/json")
    head += [k + b": " + v for k, v in headers]
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def check_rejected(world: World, body: bytes, *, path: bytes = b"/v1/chat/completions", headers=()) -> str:
    SENT.append(1)
    world.tap.calls.clear()  # each example on its own: one failure must not fail every later example
    world.replica.backend.reset()
    status, reply_headers, content = raw_post(world.proxy.port, path, body, list(headers))
    assert 400 <= status < 500, (status, content[:300], body[:300], path, headers)
    assert reply_headers.get("content-type", "").startswith("application/json"), reply_headers
    reply = json.loads(content)
    if b"/v1/messages" in path:  # each API's own error shape
        assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error", reply
    if b"/models/" in path:  # Google's
        assert reply["error"]["code"] == status and reply["error"]["status"] in ("INVALID_ARGUMENT", "NOT_FOUND",
                                                                               "ABORTED"), reply  # fmt: skip
    error = reply["error"]
    assert isinstance(error["message"], str) and error["message"], error
    assert world.tap.calls == [], f"reached the backend: {world.tap.calls[:1]}"
    assert world.replica.received() == []
    assert world.files() == world.snapshot, "a rejected request changed a file"
    return error["message"]


# ------------------------------------------------------------------------------------------------------------------
# strategies
# ------------------------------------------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)  # fmt: skip
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                      max_size=3), max_leaves=8)  # fmt: skip
good_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=40)})
extra_fields = st.dictionaries(
    st.text(max_size=10).filter(lambda k: k not in FIELD_TYPES and k != "messages"), scalars, max_size=3
)


def not_type(*allowed: type) -> st.SearchStrategy:
    """A JSON value whose type is none of `allowed` (bool is never an int here, as for a strict parser)."""

    def ok(value) -> bool:
        if isinstance(value, bool):
            return bool not in allowed
        return not isinstance(value, allowed)

    return values.filter(ok)


# The typed request fields and a value of the wrong JSON type for each.
FIELD_TYPES: dict[str, st.SearchStrategy] = {
    "model": not_type(str, type(None)),
    "stream": not_type(bool, type(None)),
    "n": st.one_of(not_type(int, type(None)), st.integers().filter(lambda n: n != 1)),
    "logprobs": not_type(bool, type(None)),
    "top_logprobs": not_type(int, type(None)),
    "tools": st.one_of(not_type(list, type(None)), st.lists(not_type(dict), min_size=1, max_size=3),
                       st.lists(st.dictionaries(st.sampled_from(["type", "name"]), values), min_size=1, max_size=2)),
    "chat_template_kwargs": st.one_of(not_type(dict, type(None)),
                                      st.just({"chat_template": "{{ 1 }}"}), st.just({"tokenize": True})),
    "stream_options": not_type(dict, type(None)),
    "temperature": not_type(int, float, type(None)),
    "top_p": not_type(int, float, type(None)),
    "max_tokens": st.one_of(not_type(int, type(None)), st.integers(max_value=0), st.integers(min_value=2**31)),
    "max_completion_tokens": st.one_of(not_type(int, type(None)), st.integers(max_value=0)),
    "seed": st.one_of(not_type(int, type(None)), st.integers(min_value=2**64), st.integers(max_value=-(2**63) - 1)),
}  # fmt: skip

MESSAGE_FIELD_TYPES: dict[str, st.SearchStrategy] = {
    "role": st.one_of(not_type(str), st.text(max_size=20).filter(lambda r: r not in ROLES),
                      st.sampled_from(["User", "USER", "developer", "function", " user", "assistant\x00"])),
    "content": st.one_of(not_type(str, list, type(None)), st.lists(not_type(dict), min_size=1, max_size=2),
                         st.lists(st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "file"]),
                                                         "image_url": values}), min_size=1, max_size=2)),
    "name": not_type(str, type(None)),
    "tool_call_id": not_type(str, type(None)),
    "tool_calls": st.one_of(not_type(list, type(None)), st.lists(not_type(dict), min_size=1, max_size=2),
                            st.lists(st.fixed_dictionaries({"id": not_type(str, type(None)),
                                                            "function": st.just({"name": "f"})}), min_size=1,
                                     max_size=2),
                            st.lists(st.fixed_dictionaries({"function": not_type(dict)}), min_size=1, max_size=2)),
    "reasoning_content": not_type(str, type(None)),
}  # fmt: skip


@st.composite
def wrong_type_bodies(draw) -> bytes:
    shape = draw(st.sampled_from(["top", "messages", "message", "field", "message_field", "empty"]))
    messages = draw(st.lists(good_message, min_size=1, max_size=3))
    body: object
    if shape == "top":
        body = draw(not_type(dict))
    elif shape == "messages":
        body = {"messages": draw(not_type(list)), **draw(extra_fields)}
    elif shape == "empty":
        body = draw(st.sampled_from([{}, {"messages": []}, {"messages": None}, {"model": "m"}, {"messages": {}}]))
        body = {**body, **draw(extra_fields)}
    elif shape == "message":
        at = draw(st.integers(0, len(messages)))
        messages.insert(at, draw(not_type(dict)))
        body = {"messages": messages}
    elif shape == "field":
        name = draw(st.sampled_from(sorted(FIELD_TYPES)))
        body = {"messages": messages, name: draw(FIELD_TYPES[name])}
    else:
        name = draw(st.sampled_from(sorted(MESSAGE_FIELD_TYPES)))
        at = draw(st.integers(0, len(messages) - 1))
        messages[at] = {**messages[at], name: draw(MESSAGE_FIELD_TYPES[name])}
        body = {"messages": messages}
    return json.dumps(body).encode()


BAD_UTF8 = [b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82", b"\xf8\x88"]
NON_FINITE = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e999", b"1E+309", b"nan", b"inf"]


@st.composite
def malformed_json_bodies(draw) -> bytes:
    """Bodies a JSON parser must refuse or a chat request cannot be: bad UTF-8, non-finite numbers, duplicate keys,
    lone surrogates, truncation, trailing garbage."""
    text = draw(st.text(max_size=30))
    valid = {"model": "m", "messages": [{"role": "user", "content": text}]}
    kind = draw(st.sampled_from(["utf8", "nonfinite", "duplicate", "surrogate", "truncated", "trailing", "garbage"]))
    if kind == "utf8":
        raw = json.dumps(valid, ensure_ascii=False).encode()
        at = raw.index(b'"content": "') + len(b'"content": "') + draw(st.integers(0, len(text.encode())))
        at = min(at, raw.rindex(b'"}'))
        return raw[:at] + draw(st.sampled_from(BAD_UTF8)) + raw[at:]
    if kind == "nonfinite":
        token = draw(st.sampled_from(NON_FINITE))
        where = draw(st.sampled_from(["temperature", "extra", "nested", "tool_args", "content"]))
        if where == "temperature":
            return b'{"messages": [{"role": "user", "content": "x"}], "temperature": ' + token + b"}"
        if where == "extra":
            return b'{"messages": [{"role": "user", "content": "x"}], "frequency": [1, ' + token + b"]}"
        if where == "nested":
            return b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"42": ' + token + b"}}"
        if where == "tool_args":
            call = b'{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"v": ' + token + b"}}}"
            assistant = b'{"role": "assistant", "tool_calls": [' + call + b"]}"
            return b'{"messages": [{"role": "user", "content": "x"}, ' + assistant + b"]}"
        return b'{"messages": [{"role": "user", "content": ' + token + b"}]}"
    if kind == "duplicate":
        where = draw(st.sampled_from(["top", "message", "nested"]))
        if where == "top":
            key = draw(st.sampled_from([b"messages", b"model", b"stream", b"temperature"]))
            value = b'[{"role": "user", "content": "x"}]' if key == b"messages" else b'"a"' if key == b"model" else b"1"
            if key == b"stream":
                value = b"false"
            pair = b'"' + key + b'": ' + value
            return b'{"messages": [{"role": "user", "content": "x"}], ' + pair + b", " + pair + b"}"
        if where == "message":
            return b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}'
        return b'{"messages": [{"role": "user", "content": "x"}], "metadata": {"a": 1, "a": 1}}'
    if kind == "surrogate":
        surrogate = draw(st.sampled_from([b"\\ud800", b"\\udfff", b"\\udbff x", b"\\ude00\\ud83d"]))
        where = draw(st.sampled_from([b"content", b"model", b"tool"]))
        if where == b"content":
            return b'{"messages": [{"role": "user", "content": "a' + surrogate + b'"}]}'
        if where == b"model":
            return b'{"model": "' + surrogate + b'", "messages": [{"role": "user", "content": "a"}]}'
        return b'{"messages": [{"role": "user", "content": "a"}], "user": "' + surrogate + b'"}'
    raw = json.dumps(valid).encode()
    if kind == "truncated":
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if kind == "trailing":
        return raw + draw(st.sampled_from([b"x", b"{}", b",", b"]", b"\x00", b" {"]))
    return draw(st.binary(max_size=200).filter(lambda b: not _is_json_object(b)))


def _is_json_object(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False


@st.composite
def deep_bodies(draw) -> bytes:
    """Nesting far beyond any real request (limit: 100 levels), in every place a value can hide."""
    depth = draw(st.one_of(st.integers(101, 1500), st.integers(1500, 200_000)))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a": ', b"}")]))
    nested = opener * depth + b"1" + closer * depth
    where = draw(st.sampled_from(["extra", "content", "messages", "kwargs", "tools", "tool_args"]))
    user = b'{"role": "user", "content": "x"}'
    if where == "extra":
        return b'{"messages": [' + user + b'], "metadata": ' + nested + b"}"
    if where == "content":
        return b'{"messages": [{"role": "user", "content": ' + nested + b"}]}"
    if where == "messages":
        return b'{"messages": ' + nested + b"}"
    if where == "kwargs":
        return b'{"messages": [' + user + b'], "chat_template_kwargs": {"x": ' + nested + b"}}"
    if where == "tools":
        return (b'{"messages": [' + user + b'], "tools": [{"type": "function", "function": {"name": "f", '
                b'"parameters": ' + nested + b"}}]}")  # fmt: skip
    return (b'{"messages": [' + user + b', {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", '
            b'"function": {"name": "f", "arguments": ' + nested + b"}}]}]}")  # fmt: skip


def huge_body(kind: str, size: int, unit: bytes) -> bytes:
    """Multi-megabyte bodies, each invalid somewhere (cheap to build: repetition, not generation)."""
    if kind == "role":
        return b'{"messages": [{"role": "wizard", "content": "' + b"x" * size + b'"}]}'
    if kind == "garbage":
        return unit * (size // len(unit))
    if kind == "array":
        return b"[" + b"1," * (size // 2) + b"1]"
    if kind == "many":
        return b'{"messages": [' + b'{"role": "user", "content": "x"},' * (size // 33) + b"7]}"
    return b'{"messages": [{"role": "user", "content": "' + b"y" * size + b'"}], "temperature": NaN}'


def hostile_id() -> st.SearchStrategy[str]:
    """Session ids the policy refuses: control characters, a `..` segment, a leading separator, > 200 chars."""
    word = st.text(st.characters(codec="latin-1", exclude_characters="\r\n"), max_size=20)
    control = st.sampled_from([chr(c) for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if chr(c) not in "\r\n"])
    return st.one_of(
        st.builds(lambda a, c, b: a + c + b, word, control, word),
        st.builds(lambda a, s, b: a + s + b, word.map(lambda w: w + "/" if w else ""), st.sampled_from(["..", "../",
                  "..\\", "/..", "\\.."]), word.map(lambda w: "/" + w if w else "")),
        st.builds(lambda s, w: s + w, st.sampled_from(["/", "\\", "//", "\\\\?\\"]), word),
        st.builds(lambda w, n: (w or "x") * n, word, st.integers(201, 400)).map(lambda s: s[: max(201, len(s))]),
        st.sampled_from(["../../etc/passwd", "..", "/etc/passwd", "\\windows\\system32", "a/../../b",
                         "ok\x00.jsonl", "x\x1b[31mred", "line\x85next", "tab\there\x7f"]),
    )  # fmt: skip


def refused(session_id: str) -> bool:
    """The session-id policy, restated independently of the implementation."""
    import unicodedata

    segments = session_id.replace("\\", "/").split("/")
    return (
        not session_id
        or len(session_id) > 200
        or any(unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp") for c in session_id)
        or session_id[0] in "/\\"
        or ".." in segments
    )


@st.composite
def hostile_session_requests(draw):
    """(path, headers) carrying a refused session id: in the header, in the path, both, or twice."""
    sid = draw(hostile_id())
    good = "fine-" + draw(st.text("abcdef0123456789", min_size=1, max_size=8))
    via = draw(st.sampled_from(["header", "path", "path_with_good_header", "header_with_good_path", "duplicate",
                                "crlf_path"]))  # fmt: skip
    header = sid.encode("latin-1")
    # The HTTP parser strips surrounding blanks and reads bytes as UTF-8 (others become surrogates): the id the
    # proxy sees must itself be one the policy refuses.
    assume(refused(header.strip(b" \t").decode("utf-8", "surrogateescape")))
    path_of = lambda s: b"/sessions/" + quote(s, safe="").encode() + b"/v1/chat/completions"  # noqa: E731
    if via == "header":
        return b"/v1/chat/completions", [(b"x-session-id", header)]
    if via == "path":
        return path_of(sid), []
    if via == "path_with_good_header":
        return path_of(sid), [(b"x-session-id", good.encode())]
    if via == "header_with_good_path":
        return path_of(good), [(b"X-Session-Id", header)]
    if via == "duplicate":
        return b"/v1/chat/completions", [(b"x-session-id", good.encode()), (b"x-session-id", (good + "-2").encode())]
    injected = draw(st.sampled_from(["%0d%0aX-Evil:%201", "%0aHost:%20evil", "%00", "%0d%0a%0d%0aGET%20/%20HTTP/1.1",
                                     "%E2%80%A8", "%C2%85", "%1b[2J"]))  # fmt: skip
    return b"/sessions/" + good.encode() + injected.encode() + b"/v1/chat/completions", []


# ------------------------------------------------------------------------------------------------------------------
# the storm
# ------------------------------------------------------------------------------------------------------------------

VALID = json.dumps({"model": "m", "messages": [{"role": "user", "content": "never sent"}]}).encode()


@profile(150)
@given(body=wrong_type_bodies())
def test_wrong_types_missing_fields_and_unknown_roles(world, body) -> None:
    check_rejected(world, body)


@profile(100)
@given(body=malformed_json_bodies())
def test_bad_utf8_non_finite_numbers_duplicate_keys_and_broken_json(world, body) -> None:
    check_rejected(world, body)


@profile(40)
@given(body=deep_bodies())
def test_deep_nesting(world, body) -> None:
    assert "nest" in check_rejected(world, body)


@profile(10)
@given(
    kind=st.sampled_from(["role", "garbage", "array", "many", "nan"]),
    size=st.integers(1 << 20, 24 << 20),
    unit=st.binary(min_size=1, max_size=64).filter(lambda b: b.strip() not in (b"", b"{}")),
)
def test_huge_bodies(world, kind, size, unit) -> None:
    check_rejected(world, huge_body(kind, size, unit))


@profile(80)
@given(request=hostile_session_requests())
def test_hostile_session_ids_and_header_injection(world, request) -> None:
    path, headers = request
    check_rejected(world, VALID, path=path, headers=headers)


@profile(20)
@given(
    encoding=st.sampled_from([b"gzip", b"deflate", b"br", b"zstd", b"x-unknown", b"gzip, gzip"]),
    garbage=st.binary(min_size=1, max_size=64),
)
def test_undecodable_content_encoding(world, encoding, garbage) -> None:
    check_rejected(world, garbage, headers=[(b"content-encoding", encoding)])


# ------------------------------------------------------------------------------------------------------------------
# Anthropic Messages and OpenAI Responses: the same storm in their shapes
# ------------------------------------------------------------------------------------------------------------------

MESSAGES_PATH = b"/v1/messages"
RESPONSES_PATH = b"/v1/responses"
USER = {"role": "user", "content": "x"}
ANTHROPIC_FIELD_TYPES: dict[str, st.SearchStrategy] = {
    "model": st.one_of(not_type(str), st.just("")),
    "max_tokens": st.one_of(not_type(int), st.integers(max_value=0), st.integers(min_value=2**31)),
    "messages": st.one_of(not_type(list), st.just([])),
    "system": st.one_of(not_type(str, list, type(None)), st.lists(not_type(dict), min_size=1, max_size=2),
                        st.just([{"type": "image", "source": {}}])),
    "tools": st.one_of(not_type(list, type(None)), st.lists(not_type(dict), min_size=1, max_size=2),
                       st.just([{"description": "no name"}])),
    "tool_choice": st.one_of(not_type(dict, type(None)), st.just({"type": "tool"}), st.just({"type": "some"})),
    "thinking": st.one_of(not_type(dict, type(None)), st.just({"type": "on"}), st.just({"type": "enabled",
                          "budget_tokens": -1})),
    "stop_sequences": st.one_of(not_type(list, type(None)), st.lists(not_type(str), min_size=1, max_size=2)),
    "temperature": not_type(int, float, type(None)),
    "top_k": st.one_of(not_type(int, type(None)), st.integers(max_value=-1)),
    "stream": not_type(bool, type(None)),
}  # fmt: skip
ANTHROPIC_BAD_BLOCKS = st.one_of(
    not_type(dict),
    st.fixed_dictionaries({"type": st.text(max_size=12).filter(lambda k: k not in (
        "text", "image", "thinking", "redacted_thinking", "tool_use", "tool_result"))}),
    st.just({"type": "text"}), st.just({"type": "text", "text": 7}),
    st.just({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}),
    st.just({"type": "tool_result", "content": "x"}),
    st.just({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}),
    st.just({"type": "tool_result", "tool_use_id": "t", "content": "x", "is_error": "yes"}),
    st.just({"type": "thinking", "signature": "s"}),
    st.builds(lambda s: {"type": "thinking", "thinking": "t", "signature": s}, not_type(str, type(None))),
    st.just({"type": "thinking", "thinking": "t", "signature": "f" * 70000}),
    st.just({"type": "tool_use", "name": "f", "input": {}}),
    st.builds(lambda i: {"type": "tool_use", "id": "t", "name": "f", "input": i}, not_type(dict)),
    st.just({"type": "tool_use", "id": "t" * 300, "name": "f", "input": {}}),
)  # fmt: skip


@st.composite
def anthropic_bodies(draw) -> bytes:
    body: dict = {"model": "m", "max_tokens": 16, "messages": [USER]}
    shape = draw(st.sampled_from(["field", "role", "user_block", "assistant_block", "missing"]))
    if shape == "field":
        name = draw(st.sampled_from(sorted(ANTHROPIC_FIELD_TYPES)))
        body[name] = draw(ANTHROPIC_FIELD_TYPES[name])
    elif shape == "role":
        role = draw(
            st.one_of(not_type(str), st.text(max_size=10).filter(lambda r: r not in ("user", "assistant", "system")))
        )
        body["messages"] = [USER, {"role": role, "content": "x"}]
    elif shape == "missing":
        del body[draw(st.sampled_from(["model", "max_tokens", "messages"]))]
    else:
        role = "user" if shape == "user_block" else "assistant"
        body["messages"] = [USER, {"role": role, "content": [draw(ANTHROPIC_BAD_BLOCKS)]}]
        if role == "user":
            body["messages"] = [{"role": "user", "content": [draw(ANTHROPIC_BAD_BLOCKS)]}]
    return json.dumps(body).encode()


RESPONSES_BAD_ITEMS = st.one_of(
    not_type(dict),
    st.fixed_dictionaries({"type": st.text(max_size=12).filter(lambda k: k not in (
        "message", "function_call", "function_call_output", "reasoning"))}),
    st.builds(lambda r: {"type": "message", "role": r, "content": "x"}, st.one_of(not_type(str),
              st.sampled_from(["tool", "User", "function"]))),
    st.just({"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}),
    st.just({"type": "message", "role": "user", "content": [{"type": "input_text"}]}),
    st.just({"type": "function_call", "name": "f", "arguments": "{}"}),
    st.builds(lambda a: {"type": "function_call", "call_id": "c", "name": "f", "arguments": a}, not_type(str)),
    st.just({"type": "function_call_output", "output": "x"}),
    st.builds(lambda o: {"type": "function_call_output", "call_id": "c", "output": o}, not_type(str, list)),
    st.builds(lambda e: {"type": "reasoning", "summary": [], "encrypted_content": e}, not_type(str, type(None))),
    st.just({"type": "reasoning", "summary": "not a list"}),
)  # fmt: skip
RESPONSES_FIELD_TYPES: dict[str, st.SearchStrategy] = {
    "model": st.one_of(not_type(str), st.just("")),
    "input": st.one_of(not_type(str, list), st.just([])),
    "instructions": not_type(str, type(None)),
    "max_output_tokens": st.one_of(not_type(int, type(None)), st.integers(max_value=0)),
    "tools": st.one_of(not_type(list, type(None)), st.just([{"type": "function"}]), st.lists(not_type(dict),
                       min_size=1, max_size=2)),
    "previous_response_id": st.one_of(not_type(str, type(None)), st.just("")),
    "text": st.one_of(not_type(dict, type(None)), st.just({"format": {"type": "grammar"}})),
    "stream": not_type(bool, type(None)),
    "temperature": not_type(int, float, type(None)),
}  # fmt: skip


@st.composite
def responses_bodies(draw) -> bytes:
    body: dict = {"model": "m", "input": [USER]}
    shape = draw(st.sampled_from(["field", "item", "missing"]))
    if shape == "field":
        name = draw(st.sampled_from(sorted(RESPONSES_FIELD_TYPES)))
        body[name] = draw(RESPONSES_FIELD_TYPES[name])
    elif shape == "missing":
        del body[draw(st.sampled_from(["model", "input"]))]
    else:
        body["input"] = [USER, draw(RESPONSES_BAD_ITEMS)]
    return json.dumps(body).encode()


# A boolean is no integer to a strict parser: both were once read as 0 and 1 (a random draw found `top_k: false`).
BOOLEAN_INTEGERS = [
    {"model": "m", "max_tokens": 16, "messages": [USER], "top_k": False},
    {"model": "m", "max_tokens": 16, "messages": [USER], "thinking": {"type": "enabled", "budget_tokens": True}},
]


@profile(60)
@given(body=anthropic_bodies())
@example(body=json.dumps(BOOLEAN_INTEGERS[0]).encode())
@example(body=json.dumps(BOOLEAN_INTEGERS[1]).encode())
def test_anthropic_messages_malformed_blocks_fields_and_roles(world, body) -> None:
    check_rejected(world, body, path=MESSAGES_PATH)


@profile(50)
@given(body=responses_bodies())
def test_openai_responses_malformed_items_and_fields(world, body) -> None:
    check_rejected(world, body, path=RESPONSES_PATH)


@profile(30)
@given(
    path=st.sampled_from([MESSAGES_PATH, MESSAGES_PATH + b"/count_tokens", MESSAGES_PATH + b"?beta=true",
                          RESPONSES_PATH]),
    body=st.one_of(malformed_json_bodies(), deep_bodies()),
)  # fmt: skip
def test_new_apis_refuse_broken_json_and_deep_nesting(world, path, body) -> None:
    check_rejected(world, body, path=path)


@profile(4)
@given(path=st.sampled_from([MESSAGES_PATH, RESPONSES_PATH]), size=st.integers(1 << 20, 12 << 20))
def test_new_apis_refuse_huge_bodies(world, path, size) -> None:
    key = b"messages" if path == MESSAGES_PATH else b"input"
    check_rejected(world, b'{"model": "m", "max_tokens": 5, "' + key + b'": [{"role": "robot", "content": "'
                   + b"z" * size + b'"}]}', path=path)  # fmt: skip


# Gemini: generateContent, streamGenerateContent and countTokens, each a 4xx in Google's shape
GEMINI_PATHS = [b"/v1beta/models/m:generateContent", b"/v1beta/models/m:streamGenerateContent?alt=sse",
                b"/v1/models/flash-lite:countTokens", b"/sessions/s1/v1beta/models/m:generateContent"]  # fmt: skip
GEMINI_USER = {"role": "user", "parts": [{"text": "x"}]}
GEMINI_BAD_PARTS = st.one_of(
    not_type(dict),
    st.just({}), st.just({"text": 7}), st.just({"text": "a", "functionCall": {"name": "f"}}),
    st.just({"inlineData": {"mimeType": "image/png", "data": "AA"}}), st.just({"fileData": {"fileUri": "gs://x"}}),
    st.just({"executableCode": {"code": "1"}}), st.just({"functionCall": {"args": {}}}),
    st.builds(lambda a: {"functionCall": {"name": "f", "args": a}}, not_type(dict, type(None))),
    st.just({"functionCall": {"name": "f", "id": "i" * 300}}), st.just({"functionResponse": {"response": {}}}),
    st.builds(lambda t: {"text": "a", "thought": t}, not_type(bool, type(None))),
    st.builds(lambda g: {"text": "a", "thoughtSignature": g}, not_type(str, type(None))),
)  # fmt: skip
GEMINI_FIELD_TYPES: dict[str, st.SearchStrategy] = {
    "contents": st.one_of(not_type(list), st.just([]), st.just([{"role": "user", "parts": []}])),
    "systemInstruction": st.one_of(not_type(dict, type(None)), st.just({"parts": "x"})),
    "tools": st.one_of(not_type(list, type(None)), st.just([{"functionDeclarations": [{"description": "x"}]}])),
    "toolConfig": st.one_of(not_type(dict, type(None)), st.just({"functionCallingConfig": {"mode": "SOME"}})),
    "generationConfig": st.one_of(not_type(dict, type(None)), st.just({"candidateCount": 2}),
                                  st.just({"maxOutputTokens": 0}), st.just({"topK": True}),
                                  st.just({"temperature": "hot"}), st.just({"responseMimeType": "text/x.enum"}),
                                  st.just({"responseModalities": ["IMAGE"]}),
                                  st.just({"thinkingConfig": {"thinkingBudget": "big"}}),
                                  st.just({"stopSequences": [1]})),
    "cachedContent": st.one_of(not_type(str, type(None)), st.just("cachedContents/abc")),
}  # fmt: skip


@st.composite
def gemini_bodies(draw) -> bytes:
    body: dict = {"contents": [GEMINI_USER]}
    shape = draw(st.sampled_from(["field", "role", "user_part", "model_part", "missing"]))
    if shape == "field":
        name = draw(st.sampled_from(sorted(GEMINI_FIELD_TYPES)))
        body[name] = draw(GEMINI_FIELD_TYPES[name])
    elif shape == "role":
        role = draw(st.one_of(not_type(str, type(None)), st.text(max_size=10).filter(
            lambda r: r not in ("user", "model", "function"))))  # fmt: skip
        body["contents"] = [GEMINI_USER, {"role": role, "parts": [{"text": "x"}]}]
    elif shape == "missing":
        del body["contents"]
    else:
        role = "user" if shape == "user_part" else "model"
        body["contents"] = [GEMINI_USER, {"role": role, "parts": [draw(GEMINI_BAD_PARTS)]}]
    return json.dumps(body).encode()


@profile(50)
@given(path=st.sampled_from(GEMINI_PATHS), body=gemini_bodies())
@example(
    path=GEMINI_PATHS[0], body=json.dumps({"contents": [GEMINI_USER], "generationConfig": {"topK": True}}).encode()
)  # noqa: E501
def test_gemini_malformed_parts_fields_and_roles(world, path, body) -> None:
    check_rejected(world, body, path=path)


@profile(20)
@given(path=st.sampled_from(GEMINI_PATHS), body=st.one_of(malformed_json_bodies(), deep_bodies()))
def test_gemini_refuses_broken_json_and_deep_nesting(world, path, body) -> None:
    check_rejected(world, body, path=path)


def test_the_storm_changed_no_session(world) -> None:
    """At least 300 hostile requests went through, and the session opened before them is extended as if none had."""
    assert len(SENT) >= 300, len(SENT)
    follow = [*ANCHOR_MESSAGES, {"role": "assistant", "content": world.anchor_reply["content"]},
              {"role": "user", "content": "And tomorrow?"}]  # fmt: skip
    reply = post(world.proxy.url + "/v1/chat/completions", json={"model": "m", "messages": follow},
                 headers={"x-session-id": ANCHOR})  # fmt: skip
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-tito-turn-id"] == "1"
    recorded = read_session_file(world.record_dir / session_file_name(ANCHOR))
    assert [(t.turn_id, t.parent_turn_id) for t in recorded.turns] == [(0, None), (1, 0)]
    assert sorted(p.name for p in world.record_dir.iterdir()) == [session_file_name(ANCHOR)]


# ------------------------------------------------------------------------------------------------------------------
# the control API: hostile requests to the reserved control host, through the same kind of proxy
# ------------------------------------------------------------------------------------------------------------------

CONTROL_TOKEN = "hostile-control-token-0123456789abcdef"
CONTROL_ANCHOR = "control-anchor"
SLASHED = "team/run-1"  # an accepted id whose record file is a digest of it (`sid-….jsonl`)
ANNOTATE = b'{"reward": 1.0, "labels": ["ok"], "metadata": {"k": 1}}'  # a valid annotation: only the request is hostile
CLOSE = b'{"timeout": 0}'


class ControlWorld:
    """A mitmdump serving the control API (in reverse mode, as `world`) with two recorded sessions to protect.

    Its cwd is `root/work` and its record dir `root/work/rec`: the snapshot holds the bytes and mtime of every file
    and every folder under `root` (the record dir, its parent and theirs), and the names beside `root`."""

    def __init__(self, replica: ReplicaThread, tap: UpstreamTap, proxy: Mitmdump, root: Path) -> None:
        self.replica, self.tap, self.proxy, self.root = replica, tap, proxy, root
        self.record_dir = root / "work" / "rec"
        self.snapshot = self.tree()

    def tree(self) -> dict[str, tuple[bytes, int] | None]:
        out: dict[str, tuple[bytes, int] | None] = {"beside:" + p.name: None for p in self.root.parent.iterdir()}
        for folder, dirs, names in os.walk(self.root):
            out.update({os.path.join(folder, name) + "/": None for name in dirs})
            for name in names:
                path = os.path.join(folder, name)
                with open(path, "rb") as handle:
                    out[path] = (handle.read(), os.stat(path).st_mtime_ns)
        return out

    def changes(self) -> list[str]:
        """What differs from the snapshot, after which the snapshot is put back (so one failing case does not fail
        every later one): new files and folders are removed, changed files get their bytes and mtime back."""
        now = self.tree()
        found = [f"new {k}" for k in now.keys() - self.snapshot.keys()]
        found += [f"gone {k}" for k in self.snapshot.keys() - now.keys()]
        found += [f"changed {k}" for k in now.keys() & self.snapshot.keys() if now[k] != self.snapshot[k]]
        for key in sorted(now.keys() - self.snapshot.keys(), key=len, reverse=True):
            path = Path(key.removeprefix("beside:"))
            if key.startswith("beside:") or not path.is_relative_to(self.root):
                continue
            if key.endswith("/"):
                path.rmdir()
            else:
                path.unlink()
        for key, value in self.snapshot.items():
            if value is not None and now.get(key) != value:
                Path(key).write_bytes(value[0])
                os.utime(key, ns=(value[1], value[1]))
        return sorted(found)


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    root = tmp_path_factory.mktemp("control")
    (root / "work").mkdir()
    options = {"tito_control_token": CONTROL_TOKEN, "tito_upstream_timeout": "10"}
    with (
        ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica,
        UpstreamTap(replica.url) as tap,
        Mitmdump(tap.url, tokenizer=tokenizer_path("qwen3"), record_dir=root / "work" / "rec", cwd=root / "work",
                 options=options) as proxy,
    ):  # fmt: skip
        for sid in (CONTROL_ANCHOR, SLASHED):
            first = post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": ANCHOR_MESSAGES},
                         headers={"x-session-id": sid})  # fmt: skip
            assert first.status_code == 200, first.text
        state = ControlWorld(replica, tap, proxy, root)
        assert sorted(p.name for p in state.record_dir.iterdir()) == sorted(
            [session_file_name(CONTROL_ANCHOR), session_file_name(SLASHED)]
        )
        tap.calls.clear()
        replica.backend.reset()
        yield state
        assert proxy.proc is not None and proxy.proc.poll() is None, "mitmdump died during the control storm"
        log = proxy.output()
    assert "Traceback" not in log and "unexpected failure" not in log, log[-4000:]


def control_request(
    port: int, method: bytes, target: bytes, body: bytes = b"", headers=(), *, auth: bool = True,
    host: bytes = b"tito.control", send_body: bool = True, timeout: float = 60,
) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One absolute-form request to the control host through the proxy's port, with exactly these bytes (as any HTTP
    client sends through a proxy, without client-side checks of the target, the headers or the body)."""
    head = [method + b" http://" + host + target + b" HTTP/1.1", b"Host: " + host, b"Connection: close"]
    if auth:
        head.append(b"Authorization: Bearer " + CONTROL_TOKEN.encode())
    framed = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers)
    if not framed and (body or method in (b"POST", b"PUT", b"PATCH")):
        head.append(b"Content-Length: %d" % len(body))
    head += [k + b": " + v for k, v in headers]
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + (body if send_body else b""))
        response = http.client.HTTPResponse(sock, method=method.decode("latin-1"))
        response.begin()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def check_control_refused(
    world: ControlWorld, method: bytes, target: bytes, status: int | tuple[int, ...], body: bytes = b"", headers=(),
    *, json_error: bool = True, **kw,
) -> tuple[dict[str, str], bytes]:  # fmt: skip
    """The request gets `status` with a JSON error (`json_error`: unless mitmproxy's own HTTP parser refused it, before
    any addon saw it); nothing reached the backend; no file or folder changed."""
    world.tap.calls.clear()
    world.replica.backend.reset()
    code, reply_headers, content = control_request(world.proxy.port, method, target, body, headers, **kw)
    changed, forwarded, received = world.changes(), list(world.tap.calls), world.replica.received()
    case = (method, target[:120], body[:120], headers and [(k, v[:60]) for k, v in headers])
    assert code in (status if isinstance(status, tuple) else (status,)), (*case, code, content[:300])
    assert not changed, (*case, code, "a refused control request changed files", changed)
    assert forwarded == [] and received == [], (*case, code, "reached the backend", forwarded[:1])
    if method != b"HEAD" and json_error:
        assert reply_headers.get("content-type", "").startswith("application/json"), (*case, reply_headers)
        error = json.loads(content)["error"]
        assert isinstance(error["message"], str) and error["message"], error
    return reply_headers, content


def control_ok(world: ControlWorld, method: bytes, target: bytes, body: bytes = b"") -> dict:
    code, _, content = control_request(world.proxy.port, method, target, body)
    assert code == 200, (method, target, code, content[:300])
    return json.loads(content)


def sid_path(session_id: str) -> bytes:
    return b"/v1/sessions/" + quote(session_id, safe="").encode()


ANCHOR_PATH = sid_path(CONTROL_ANCHOR)


def test_control_api_answers_the_token_holder(control) -> None:
    """The positive control for every refusal below: with the token, the routes answer (read-only here)."""
    summary = control_ok(control, b"GET", ANCHOR_PATH)
    assert (summary["session_id"], summary["turns"], summary["annotations"], summary["closed"]) == (
        CONTROL_ANCHOR, 1, [], None
    )  # fmt: skip
    assert control_ok(control, b"GET", sid_path(SLASHED))["session_id"] == SLASHED
    listed = control_ok(control, b"GET", b"/v1/sessions?live=true&limit=5")["sessions"]
    assert {row["session_id"] for row in listed} == {CONTROL_ANCHOR, SLASHED}
    code, headers, rows = control_request(control.proxy.port, b"GET", ANCHOR_PATH + b"/rows?format=verl&to=jsonl")
    assert code == 200 and headers["x-tito-rows"] == "1" and len(rows.splitlines()) == 1
    assert control_ok(control, b"GET", ANCHOR_PATH + b"/wait?timeout=0")["idle"] is True
    both = json.dumps({"sessions": [CONTROL_ANCHOR, SLASHED], "format": "slime", "to": "summary"}).encode()
    summary = control_ok(control, b"POST", b"/v1/rows", both)
    # Both sessions sent the same first request: id-less siblings, one automatic group of two.
    assert (summary["rows"], summary["episodes"], len(summary["groups"])) == (2, 2, 1)
    assert summary["groups"][0]["group"].startswith("auto-") and summary["groups"][0]["rows"] == 2
    code, headers, rows = control_request(control.proxy.port, b"POST", b"/v1/rows", both.replace(b"summary", b"jsonl"))
    assert code == 200 and headers["x-tito-rows"] == "2" and headers["x-tito-groups"] == "1"
    assert [json.loads(line)["rollout_id"] for line in rows.splitlines()] == [0, 1]
    assert control.changes() == []


# -- auth ----------------------------------------------------------------------------------------------------------

LONG = b"A" * (60 * 1024)
BAD_AUTH: dict[str, list[tuple[bytes, bytes]]] = {
    "missing": [],
    "wrong": [(b"Authorization", b"Bearer wrong-control-token-0123456789abcd")],
    "no_scheme": [(b"Authorization", CONTROL_TOKEN.encode())],
    "no_space": [(b"Authorization", b"Bearer" + CONTROL_TOKEN.encode())],
    "basic": [(b"Authorization", b"Basic " + base64.b64encode(b"x:" + CONTROL_TOKEN.encode()))],
    "other_scheme": [(b"Authorization", b"Token " + CONTROL_TOKEN.encode())],
    "upper_case": [(b"Authorization", b"Bearer " + CONTROL_TOKEN.upper().encode())],
    "one_char_case": [(b"Authorization", b"Bearer H" + CONTROL_TOKEN[1:].encode())],
    "trailing_char": [(b"Authorization", b"Bearer " + CONTROL_TOKEN.encode() + b"x")],
    "prefix_only": [(b"Authorization", b"Bearer " + CONTROL_TOKEN[:-1].encode())],
    "empty_bearer": [(b"Authorization", b"Bearer ")],
    "very_long": [(b"Authorization", b"Bearer " + LONG)],
    "token_then_long": [(b"Authorization", b"Bearer " + CONTROL_TOKEN.encode() + LONG)],
    "wrong_then_right": [(b"Authorization", b"Bearer wrong"), (b"Authorization", b"Bearer " + CONTROL_TOKEN.encode())],
    "proxy_authorization": [(b"Proxy-Authorization", b"Bearer " + CONTROL_TOKEN.encode())],
    "cookie": [(b"Cookie", b"token=" + CONTROL_TOKEN.encode())],
    "x_api_key": [(b"X-Api-Key", CONTROL_TOKEN.encode())],
    "non_ascii": [(b"Authorization", b"Bearer " + CONTROL_TOKEN.encode()[:-1] + "é".encode())],
    "not_utf8": [(b"Authorization", b"Bearer " + CONTROL_TOKEN.encode()[:-1] + b"\xff")],
}
AUTH_TARGETS = [
    (b"GET", b"/v1/sessions"), (b"GET", ANCHOR_PATH), (b"GET", ANCHOR_PATH + b"/rows?format=slime&to=parquet"),
    (b"POST", ANCHOR_PATH + b"/annotations"), (b"POST", ANCHOR_PATH + b"/close"), (b"GET", ANCHOR_PATH + b"/wait"),
    (b"POST", ANCHOR_PATH + b"/wait?timeout=0"), (b"GET", b"/nothing/here"), (b"DELETE", ANCHOR_PATH),
    (b"GET", sid_path("../../etc/passwd")), (b"GET", b"/v1/sessions/%ff/rows"), (b"POST", b"/v1/rows"),
]  # fmt: skip


@pytest.mark.parametrize("variant", sorted(BAD_AUTH))
def test_control_refuses_every_request_without_the_exact_token(control, variant) -> None:
    """The same 401 (same body, same headers) whatever the path, method, body or how the token is wrong; valid
    annotation and close requests among them change nothing."""
    replies = set()
    for method, target in AUTH_TARGETS:
        body = ANNOTATE if target.endswith(b"/annotations") else CLOSE if target.endswith(b"/close") else b""
        headers, content = check_control_refused(control, method, target, 401, body, BAD_AUTH[variant], auth=False)
        assert headers.get("www-authenticate") == "Bearer", headers
        replies.add((content, headers.get("content-type")))
    # token in the query string instead of the header
    for name in (b"token", b"access_token", b"bearer_token"):  # (mitmdump logs URLs: the audit greps them)
        for method, target in AUTH_TARGETS[:5]:
            body = ANNOTATE if target.endswith(b"/annotations") else CLOSE if target.endswith(b"/close") else b""
            joined = target + (b"&" if b"?" in target else b"?") + name + b"=" + CONTROL_TOKEN.encode()
            _, content = check_control_refused(control, method, joined, 401, body, BAD_AUTH[variant], auth=False)
            replies.add((content, "application/json"))
    assert len(replies) == 1, replies


def test_control_401_is_the_same_through_an_ordinary_client(control) -> None:
    """aiohttp through the proxy (absolute-form, as drivers send): the same 401 bytes as every raw refusal."""
    import asyncio

    import aiohttp
    from yarl import URL

    async def call(method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        async with aiohttp.ClientSession(trust_env=False) as session:
            url = URL("http://tito.control" + path, encoded=True)
            async with session.request(method, url, headers=headers, data=body, proxy=control.proxy.url) as reply:
                return reply.status, await reply.read()

    _, _, expected = control_request(control.proxy.port, b"GET", b"/v1/sessions", auth=False)
    for headers in ({}, {"authorization": "Bearer " + CONTROL_TOKEN.upper()}, {"authorization": CONTROL_TOKEN}):
        for method, path, body in (("POST", ANCHOR_PATH.decode() + "/annotations", ANNOTATE),
                                   ("POST", ANCHOR_PATH.decode() + "/close", b""),
                                   ("GET", "/v1/sessions?token=" + CONTROL_TOKEN, b"")):  # fmt: skip
            control.tap.calls.clear()
            assert asyncio.run(call(method, path, headers, body)) == (401, expected)
            assert control.changes() == [] and control.tap.calls == []


# -- bodies --------------------------------------------------------------------------------------------------------


def nested(depth: int, leaf: bytes = b"1") -> bytes:
    return b'{"a": ' * depth + leaf + b"}" * depth


ANNOTATION_BODIES: list = [
    # not JSON, not UTF-8, not an object
    pytest.param(b"not json", 400, id="not-json"),
    pytest.param(b"", 400, id="empty"),
    pytest.param(b"{", 400, id="truncated"),
    pytest.param(b'{"reward": 1}x', 400, id="trailing-garbage"),
    pytest.param(b'{"reward": 1}{"reward": 2}', 400, id="two-objects"),
    pytest.param(b'{"labels": ["\xff"]}', 400, id="bad-utf8"),
    pytest.param(b"\xef\xbb\xbf" + b'{"reward": 1}', 400, id="utf8-bom"),
    pytest.param(b"[]", 400, id="array"),
    pytest.param(b'[{"reward": 1}]', 400, id="array-of-annotation"),
    pytest.param(b"1", 400, id="number"),
    pytest.param(b'"reward"', 400, id="string"),
    pytest.param(b"null", 400, id="null"),
    pytest.param(b"true", 400, id="true"),
    pytest.param(b"{}", 400, id="empty-object"),
    pytest.param(b'{"reward": null, "labels": null, "metadata": null}', 400, id="all-null"),
    # duplicate keys, non-finite numbers
    pytest.param(b'{"reward": 1, "reward": 2}', 400, id="duplicate-reward"),
    pytest.param(b'{"turn_id": 0, "reward": 1, "turn_id": 5}', 400, id="duplicate-turn-id"),
    pytest.param(b'{"reward": 1, "metadata": {"a": 1, "a": 2}}', 400, id="duplicate-in-metadata"),
    pytest.param(b'{"reward": NaN}', 400, id="reward-nan"),
    pytest.param(b'{"reward": Infinity}', 400, id="reward-infinity"),
    pytest.param(b'{"reward": -Infinity}', 400, id="reward-minus-infinity"),
    pytest.param(b'{"reward": 1e400}', 400, id="reward-1e400"),
    pytest.param(b'{"reward": -1e999}', 400, id="reward-minus-1e999"),
    pytest.param(b'{"reward": 1' + b"0" * 400 + b"}", 400, id="reward-400-digit-integer"),
    pytest.param(b'{"reward": 1' + b"0" * 5000 + b"}", 400, id="reward-5000-digit-integer"),
    pytest.param(b'{"reward": 1, "metadata": {"a": NaN}}', 400, id="metadata-nan"),
    pytest.param(b'{"reward": 1, "metadata": {"a": 1e400}}', 400, id="metadata-1e400"),
    pytest.param(b'{"reward": 1, "metadata": {"a": [1, -1e999]}}', 400, id="metadata-nested-minus-1e999"),
    # unknown fields
    pytest.param(b'{"reward": 1, "session_id": "other"}', 400, id="field-session-id"),
    pytest.param(b'{"reward": 1, "ts": 0}', 400, id="field-ts"),
    pytest.param(b'{"reward": 1, "schema": "tito.annotation.v1"}', 400, id="field-schema"),
    pytest.param(b'{"reward": 1, "schema_": "x"}', 400, id="field-schema_"),
    pytest.param(b'{"Reward": 1}', 400, id="field-Reward"),
    pytest.param(b'{"reward": 1, "": 1}', 400, id="field-empty-name"),
    pytest.param(b'{"reward": 1, "__proto__": {}}', 400, id="field-proto"),
    # reward
    pytest.param(b'{"reward": "1.0"}', 400, id="reward-string"),
    pytest.param(b'{"reward": true}', 400, id="reward-true"),
    pytest.param(b'{"reward": false}', 400, id="reward-false"),
    pytest.param(b'{"reward": [1]}', 400, id="reward-list"),
    pytest.param(b'{"reward": {"v": 1}}', 400, id="reward-object"),
    # labels
    pytest.param(b'{"labels": "solved"}', 400, id="labels-string"),
    pytest.param(b'{"labels": {"solved": true}}', 400, id="labels-object"),
    pytest.param(b'{"labels": [1]}', 400, id="labels-int"),
    pytest.param(b'{"labels": ["ok", null]}', 400, id="labels-null-item"),
    pytest.param(b'{"labels": [true]}', 400, id="labels-bool"),
    pytest.param(b'{"labels": [["nested"]]}', 400, id="labels-nested-list"),
    pytest.param(b'{"labels": [""]}', 400, id="labels-empty-string"),
    pytest.param(json.dumps({"labels": ["l"] * 65}).encode(), 400, id="labels-65"),
    pytest.param(json.dumps({"labels": [f"l{i}" for i in range(10000)]}).encode(), 400, id="labels-10000"),
    pytest.param(json.dumps({"labels": ["x" * 257]}).encode(), 400, id="label-257-chars"),
    pytest.param(json.dumps({"labels": ["é" * 257]}).encode(), 400, id="label-257-non-ascii"),
    pytest.param(b'{"labels": ["\\ud800"]}', 400, id="label-lone-surrogate"),
    # metadata
    pytest.param(b'{"metadata": []}', 400, id="metadata-list"),
    pytest.param(b'{"metadata": "x"}', 400, id="metadata-string"),
    pytest.param(b'{"metadata": 1}', 400, id="metadata-int"),
    pytest.param(b'{"metadata": true}', 400, id="metadata-bool"),
    pytest.param(b'{"metadata": {"a": "\\udc00"}}', 400, id="metadata-lone-surrogate-value"),
    pytest.param(b'{"metadata": {"\\ud83d": 1}}', 400, id="metadata-lone-surrogate-key"),
    pytest.param(json.dumps({"metadata": {"a": "x" * (64 * 1024)}}).encode(), 413, id="metadata-over-64k"),
    pytest.param(json.dumps({"metadata": {"a": "é" * (33 * 1024)}}).encode(), 413, id="metadata-over-64k-utf8"),
    pytest.param(json.dumps({"metadata": {str(i): i for i in range(20000)}}).encode(), 413, id="metadata-many-keys"),
    # deep nesting (the agent APIs refuse more than 100 levels)
    pytest.param(b'{"reward": 1, "metadata": ' + nested(101) + b"}", 400, id="metadata-depth-101"),
    pytest.param(b'{"reward": 1, "metadata": ' + nested(600) + b"}", 400, id="metadata-depth-600"),
    pytest.param(b'{"reward": 1, "metadata": ' + nested(5000) + b"}", 400, id="metadata-depth-5000"),
    pytest.param(b'{"reward": 1, "metadata": {"a": ' + b"[" * 150000 + b"]" * 150000 + b"}}", 400,
                 id="metadata-depth-150000"),
    pytest.param(b'{"labels": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, id="labels-depth-100000"),
    pytest.param(b'{"reward": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, id="reward-depth-100000"),
    # turn ids
    pytest.param(b'{"turn_id": 0.0, "reward": 1}', 400, id="turn-id-float"),
    pytest.param(b'{"turn_id": 0.5, "reward": 1}', 400, id="turn-id-fraction"),
    pytest.param(b'{"turn_id": true, "reward": 1}', 400, id="turn-id-true"),
    pytest.param(b'{"turn_id": false, "reward": 1}', 400, id="turn-id-false"),
    pytest.param(b'{"turn_id": "0", "reward": 1}', 400, id="turn-id-string"),
    pytest.param(b'{"turn_id": 1e400, "reward": 1}', 400, id="turn-id-1e400"),
    pytest.param(b'{"turn_id": [0], "reward": 1}', 400, id="turn-id-list"),
    pytest.param(b'{"turn_id": 1, "reward": 1}', 404, id="turn-id-unknown"),
    pytest.param(b'{"turn_id": -1, "reward": 1}', 404, id="turn-id-negative"),
    pytest.param(b'{"turn_id": 1' + b"0" * 30 + b', "reward": 1}', 404, id="turn-id-huge"),
    pytest.param(b'{"turn_id": 1' + b"0" * 400 + b', "reward": 1}', 404, id="turn-id-400-digits"),
    # groups
    pytest.param(b'{"group": 7}', 400, id="group-int"),
    pytest.param(b'{"group": ""}', 400, id="group-empty"),
    pytest.param(b'{"group": ["a"]}', 400, id="group-list"),
    pytest.param(b'{"group": {"task": 1}}', 400, id="group-object"),
    pytest.param(b'{"group": true}', 400, id="group-bool"),
    pytest.param(json.dumps({"group": "g" * 257}).encode(), 400, id="group-257-chars"),
    pytest.param(b'{"group": "\\ud800"}', 400, id="group-lone-surrogate"),
    pytest.param(b'{"turn_id": 0, "group": "g", "scope": "segment"}', 400, id="group-scoped-to-a-segment"),
    pytest.param(b'{"group": null}', 400, id="group-null-alone"),
]  # fmt: skip

ROWS_BODIES: list = [
    pytest.param(b"not json", 400, id="not-json"),
    pytest.param(b"[]", 400, id="array"),
    pytest.param(b"{}", 400, id="no-sessions"),
    pytest.param(b'{"sessions": []}', 400, id="sessions-empty"),
    pytest.param(b'{"sessions": "control-anchor"}', 400, id="sessions-string"),
    pytest.param(b'{"sessions": [1]}', 400, id="sessions-int"),
    pytest.param(b'{"sessions": ["../../etc/passwd"]}', 400, id="sessions-traversal"),
    pytest.param(b'{"sessions": ["a\\u0000b"]}', 400, id="sessions-nul"),
    pytest.param(b'{"sessions": ["no-such-session"]}', 404, id="sessions-unknown"),
    pytest.param(b'{"sessions": ["control-anchor", "no-such-session"]}', 404, id="sessions-one-unknown"),
    pytest.param(b'{"sessions": ["control-anchor"], "format": "torch"}', 400, id="format-unknown"),
    pytest.param(b'{"sessions": ["control-anchor"], "to": "pt"}', 400, id="to-pt"),
    pytest.param(b'{"sessions": ["control-anchor"], "to": "../x"}', 400, id="to-path"),
    pytest.param(b'{"sessions": ["control-anchor"], "calls": "main,nope"}', 400, id="calls-unknown"),
    pytest.param(b'{"sessions": ["control-anchor"], "calls": 3}', 400, id="calls-int"),
    pytest.param(b'{"sessions": ["control-anchor"], "group_size": 0}', 400, id="group-size-0"),
    pytest.param(b'{"sessions": ["control-anchor"], "group_size": -2}', 400, id="group-size-negative"),
    pytest.param(b'{"sessions": ["control-anchor"], "group_size": 2.5}', 400, id="group-size-float"),
    pytest.param(b'{"sessions": ["control-anchor"], "group_size": true}', 400, id="group-size-bool"),
    pytest.param(b'{"sessions": ["control-anchor"], "group_size": 1e400}', 400, id="group-size-1e400"),
    pytest.param(b'{"sessions": ["control-anchor"], "group_size": 1' + b"0" * 400 + b"}", 400, id="group-size-huge"),
    pytest.param(b'{"sessions": ["control-anchor"], "group_policy": "fill"}', 400, id="group-policy-unknown"),
    pytest.param(b'{"sessions": ["control-anchor"], "dedupe_shared_turns": "yes"}', 400, id="dedupe-string"),
    pytest.param(b'{"sessions": ["control-anchor"], "mask_offpolicy": 1}', 400, id="mask-offpolicy-number"),
    pytest.param(b'{"sessions": ["control-anchor"], "group_size": 2}', 409, id="group-too-small-refused"),
    pytest.param(b'{"sessions": ["control-anchor"], "group_size": 2, "group_policy": "pad"}', 409,
                 id="pad-without-reward"),
    pytest.param(b'{"sessions": ["control-anchor"], "session_id": "x"}', 400, id="field-unknown"),
    pytest.param(b'{"session_prefix": ""}', 400, id="prefix-empty"),
    pytest.param(b'{"session_prefix": ["control"]}', 400, id="prefix-list"),
    pytest.param(b'{"session_prefix": null}', 400, id="prefix-null-alone"),
    pytest.param(b'{"session_prefix": "no-such-"}', 404, id="prefix-matches-nothing"),
    pytest.param(b'{"session_prefix": "control", "format": "torch"}', 400, id="prefix-format-unknown"),
    pytest.param(b'{"session_prefix": "control", "group_size": 2}', 409, id="prefix-group-too-small"),
    pytest.param(b'{"sessions": ["control-anchor"], "sessions": ["team/run-1"]}', 400, id="duplicate-sessions"),
    pytest.param(b'{"sessions": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, id="sessions-deep"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status"), ROWS_BODIES)
def test_control_refuses_malformed_rows_calls(control, body, status) -> None:
    check_control_refused(control, b"POST", b"/v1/rows", status, body)


@pytest.mark.parametrize(("body", "status"), ANNOTATION_BODIES)
def test_control_refuses_malformed_annotations(control, body, status) -> None:
    check_control_refused(control, b"POST", ANCHOR_PATH + b"/annotations", status, body)


CLOSE_BODIES: list = [
    pytest.param(b"not json", 400, id="not-json"),
    pytest.param(b"{", 400, id="truncated"),
    pytest.param(b"\xff", 400, id="bad-utf8"),
    pytest.param(b"[]", 400, id="array"),
    pytest.param(b"null", 400, id="null"),
    pytest.param(b"0", 400, id="number"),
    pytest.param(b'"close"', 400, id="string"),
    pytest.param(b'{"timeout": 1, "timeout": 2}', 400, id="duplicate-timeout"),
    pytest.param(b'{"timeout": NaN}', 400, id="timeout-nan"),
    pytest.param(b'{"timeout": Infinity}', 400, id="timeout-infinity"),
    pytest.param(b'{"timeout": 1e400}', 400, id="timeout-1e400"),
    pytest.param(b'{"timeout": 1' + b"0" * 400 + b"}", 400, id="timeout-400-digit-integer"),
    pytest.param(b'{"timeout": -1}', 400, id="timeout-negative"),
    pytest.param(b'{"timeout": 601}', 400, id="timeout-601"),
    pytest.param(b'{"timeout": "abc"}', 400, id="timeout-string"),
    pytest.param(b'{"timeout": "nan"}', 400, id="timeout-string-nan"),
    pytest.param(b'{"timeout": true}', 400, id="timeout-bool"),
    pytest.param(b'{"timeout": null}', 400, id="timeout-null"),
    pytest.param(b'{"timeout": [1]}', 400, id="timeout-list"),
    pytest.param(b'{"timeout": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, id="timeout-deep"),
    pytest.param(b'{"reason": "closed"}', 400, id="field-reason"),
    pytest.param(b'{"session_id": "other"}', 400, id="field-session-id"),
    pytest.param(b'{"timeout": 0, "turns": 99}', 400, id="field-turns"),
    pytest.param(b'{"timeout": 0, "ts": 0}', 400, id="field-ts"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status"), CLOSE_BODIES)
def test_control_refuses_malformed_close_bodies(control, body, status) -> None:
    """The anchor is live: a close that slipped through would end it (checked at the end of the module)."""
    check_control_refused(control, b"POST", ANCHOR_PATH + b"/close", status, body)


MIB = 1024 * 1024


@pytest.mark.parametrize("route", [b"/annotations", b"/close"])
def test_control_refuses_bodies_over_a_mebibyte(control, route) -> None:
    big = b'{"metadata": {"a": "' + b"x" * (MIB + 10) + b'"}}'
    target = ANCHOR_PATH + route
    check_control_refused(control, b"POST", target, 413, big)
    check_control_refused(control, b"POST", target, 413, b"x" * (3 * MIB))
    chunked = b"".join(b"%x\r\n" % len(part) + part + b"\r\n" for part in (big[:MIB], big[MIB:])) + b"0\r\n\r\n"
    check_control_refused(control, b"POST", target, 413, chunked, [(b"Transfer-Encoding", b"chunked")])
    # also when the route, the method or the session is wrong: the size is checked first
    check_control_refused(control, b"POST", sid_path("no-such-session") + route, 413, big)
    check_control_refused(control, b"POST", ANCHOR_PATH + b"/rows", 413, big)
    # an encoded body is not decoded (a small gzip can inflate to gigabytes)
    import gzip

    check_control_refused(control, b"POST", target, 415, gzip.compress(ANNOTATE), [(b"Content-Encoding", b"gzip")])


@pytest.mark.parametrize("authorized", [True, False], ids=["with-token", "without-token"])
def test_control_refuses_a_large_declared_body(control, authorized) -> None:
    """mitmproxy reads a request's body before any answer goes out. A declared body over 1 MiB is answered 413 (or
    401 without the token) once read; one declared over the hard cap (64 MiB) is not read at all: the connection is
    closed at once. Nothing changes either way."""
    status = 413 if authorized else 401
    body = b'{"labels": ["' + b"x" * (MIB + 1) + b'"]}'
    check_control_refused(control, b"POST", ANCHOR_PATH + b"/annotations", status, body, auth=authorized)
    for length in (64 * MIB + 1, 2**40, 10**30):
        control.tap.calls.clear()
        started = time.monotonic()
        with pytest.raises((ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead)):
            control_request(
                control.proxy.port, b"POST", ANCHOR_PATH + b"/annotations", ANNOTATE,
                [(b"Content-Length", str(length).encode())], send_body=False, timeout=5, auth=authorized,
            )  # fmt: skip
        assert time.monotonic() - started < 5, "closed at once, not after waiting for the body"
        assert not control.changes() and control.tap.calls == [] and control.replica.received() == []


# -- sessions, turns and paths -------------------------------------------------------------------------------------

ACTIONS = [  # (method, suffix, body) of every per-session route
    (b"GET", b"", b""), (b"GET", b"/rows", b""), (b"GET", b"/rows?format=verl&to=parquet", b""),
    (b"POST", b"/annotations", ANNOTATE), (b"POST", b"/annotations", b'{"turn_id": 0, "labels": ["x"]}'),
    (b"GET", b"/wait?timeout=0", b""), (b"POST", b"/wait?timeout=0", b""), (b"POST", b"/close", CLOSE),
    (b"POST", b"/close", b""),
]  # fmt: skip
ACTION_IDS = [
    "summary",
    "rows",
    "rows-parquet",
    "annotate",
    "annotate-turn",
    "wait",
    "wait-post",
    "close",
    "close-empty",
]
UNKNOWN_IDS = [
    "no-such-session", "a/b", "~/.ssh/id_rsa", " ", ".", "x" * 200, "é" * 200, "*", "control-anchor*",
    "[c]ontrol-anchor", CONTROL_ANCHOR.upper(), CONTROL_ANCHOR + " ", " " + CONTROL_ANCHOR,
    CONTROL_ANCHOR + ".jsonl", CONTROL_ANCHOR + "+w1", CONTROL_ANCHOR + "/", "sid-" + "0" * 40, "%2e%2e", "%ff",
    SLASHED + "/",
]  # fmt: skip


@pytest.mark.parametrize("action", ACTIONS, ids=ACTION_IDS)
def test_control_unknown_sessions_are_404(control, action) -> None:
    method, suffix, body = action
    for session_id in UNKNOWN_IDS:
        check_control_refused(control, method, sid_path(session_id) + suffix, 404, body)


@pytest.mark.parametrize("action", ACTIONS, ids=ACTION_IDS)
def test_control_a_record_file_name_is_not_a_session_id(control, action) -> None:
    """`team/run-1` is recorded as `sid-<digest>.jsonl`: the id `sid-<digest>` is another (unknown) session, not an
    alias that reads that record or appends lines with another session id to it."""
    method, suffix, body = action
    alias = session_file_name(SLASHED).removesuffix(".jsonl")
    check_control_refused(control, method, sid_path(alias) + suffix, 404, body)


TRAVERSALS = [
    b"..%2F..%2Fetc%2Fpasswd", b"%2e%2e", b"%2E%2E", b"..", b"%2e%2e%2f%2e%2e%2fwork%2frec%2fcontrol-anchor",
    b"..%2Fcontrol-anchor", b"..%2F..%2Fwork%2Frec%2Fcontrol-anchor", b"a%2F..%2F..%2Fb", b"..%5C..%5Cwindows",
    b"%2Fetc%2Fpasswd", b"%2Ftmp%2Fx", b"%5Cetc", b"%5C%5C%3F%5CC%3A%5Cx", b"%2F%2Fhost%2Fshare", b"x%2F%2e%2e",
    b"control-anchor%00", b"%00", b"%00.jsonl", b"control-anchor%0a", b"%0d", b"x%0d%0aX-Evil:%201", b"%1b%5b2J",
    b"%7f", b"%c2%85", b"%e2%80%a8", b"%e2%80%a9", b"%09tab",
    b"%ff", b"%c0%af", b"%c0%ae%c0%ae", b"%ed%a0%80", b"control-anchor%fe%ff", b"%e2%82", b"%f4%90%80%80",
    b"a" * 201, b"%61" * 201, quote("é" * 201, safe="").encode(), b"x" * 5000,
]  # fmt: skip


@pytest.mark.parametrize("action", ACTIONS, ids=ACTION_IDS)
def test_control_refuses_traversal_control_characters_bad_utf8_and_overlong_ids(control, action) -> None:
    method, suffix, body = action
    for segment in TRAVERSALS:
        check_control_refused(control, method, b"/v1/sessions/" + segment + suffix, 400, body)


@pytest.mark.parametrize("action", ACTIONS, ids=ACTION_IDS)
def test_control_raw_non_ascii_targets_are_refused_before_the_addon(control, action) -> None:
    """Raw (unencoded) non-ASCII or control bytes in the request target: mitmproxy's parser answers 400 itself."""
    method, suffix, body = action
    for segment in ("é".encode() * 201, "é".encode(), b"\xff", b"a\x00b"):
        check_control_refused(control, method, b"/v1/sessions/" + segment + suffix, 400, body, json_error=False)


ODD_PATHS = [  # (method, target, body): a route that does not exist, however close to one
    (b"GET", ANCHOR_PATH + b"/", b""), (b"GET", ANCHOR_PATH + b"//", b""), (b"GET", ANCHOR_PATH + b"/rows/", b""),
    (b"POST", ANCHOR_PATH + b"/annotations/", ANNOTATE), (b"POST", ANCHOR_PATH + b"/close/", CLOSE),
    (b"GET", ANCHOR_PATH + b"/wait/", b""), (b"GET", ANCHOR_PATH + b"/rows/x", b""),
    (b"POST", ANCHOR_PATH + b"/close/x", CLOSE), (b"POST", ANCHOR_PATH + b"/annotations/../close", CLOSE),
    (b"POST", ANCHOR_PATH + b"/annotations/0", ANNOTATE), (b"POST", ANCHOR_PATH + b"/%63lose", CLOSE),
    (b"POST", ANCHOR_PATH + b"/CLOSE", CLOSE), (b"POST", ANCHOR_PATH + b"/close;x", CLOSE),
    (b"POST", ANCHOR_PATH + b"/close%00", CLOSE), (b"POST", ANCHOR_PATH + b"/close%2F", CLOSE),
    (b"POST", ANCHOR_PATH + b"/annotation", ANNOTATE), (b"POST", ANCHOR_PATH + b"/close/../../x/close", CLOSE),
    (b"GET", b"/v1/sessions/a/b/c/d", b""), (b"GET", b"/v1//sessions", b""), (b"GET", b"/V1/sessions", b""),
    (b"GET", b"/v1/Sessions", b""), (b"GET", b"/v1/sessions%2F" + CONTROL_ANCHOR.encode(), b""),
    (b"GET", b"/v2/sessions", b""), (b"GET", b"/", b""), (b"GET", b"/v1", b""), (b"GET", b"/v1/", b""),
    (b"GET", b"//v1/sessions", b""), (b"GET", b"/../v1/sessions/x/../../..", b""), (b"GET", b"/sessions", b""),
    (b"POST", b"/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'),
    (b"POST", b"/sessions/" + CONTROL_ANCHOR.encode() + b"/v1/chat/completions", b'{"messages": []}'),
]  # fmt: skip


@pytest.mark.parametrize("request_", ODD_PATHS, ids=[f"{m.decode()} {t.decode('latin-1')}" for m, t, _ in ODD_PATHS])
def test_control_refuses_extra_segments_trailing_slashes_and_other_hosts_routes(control, request_) -> None:
    """Trailing slashes, extra or encoded segments, other casings and the agent routes on the control host: 404,
    none of them an alias of a route (the chat route on the control host is not forwarded to the backend)."""
    method, target, body = request_
    check_control_refused(control, method, target, 404, body)


@pytest.mark.parametrize(
    ("method", "target"),
    [(b"GET", b"/v1/sessions/"), (b"GET", b"/v1/sessions//rows"), (b"POST", b"/v1/sessions//close"),
     (b"POST", b"/v1/sessions//annotations"), (b"GET", b"/v1/sessions//wait")],
)  # fmt: skip
def test_control_refuses_an_empty_session_id(control, method, target) -> None:
    check_control_refused(control, method, target, (400, 404), ANNOTATE if method == b"POST" else b"")


# -- query values and methods --------------------------------------------------------------------------------------

BAD_QUERIES = [
    *(ANCHOR_PATH + b"/rows?" + q for q in (
        b"format=unknown", b"format=VERL", b"format=generic%00", b"format=..%2F..%2Fx", b"format=verl&format=x",
        b"to=xml", b"to=JSONL", b"to=csv", b"to=parquet%2F..%2F..%2Fx", b"to=jsonl%0a", b"to=parquet&to=pickle",
        b"format=" + b"x" * 10000,
    )),
    *(ANCHOR_PATH + b"/wait?timeout=" + v for v in (
        b"-1", b"-0.001", b"nan", b"NaN", b"inf", b"-inf", b"Infinity", b"1e9", b"601", b"600.001", b"abc", b"1e400",
        b"0x10", b"1" + b"0" * 5000, b"%00", b"1;2",
    )),
    *(b"/v1/sessions?" + q for q in (
        b"limit=0", b"limit=-1", b"limit=100001", b"limit=99999999999999999999", b"limit=abc", b"limit=1.5",
        b"limit=1e3", b"limit=0x10", b"limit=1" + b"0" * 5000, b"live=maybe", b"live=2", b"live=%00",
        b"&".join(b"a%d=1" % i for i in range(9)), b"&".join(b"limit=%d" % i for i in range(9)),
    )),
]  # fmt: skip


@pytest.mark.parametrize("target", BAD_QUERIES, ids=[t.decode()[:80] for t in BAD_QUERIES])
def test_control_refuses_bad_query_values(control, target) -> None:
    check_control_refused(control, b"GET", target, 400)
    if b"/wait?" in target:
        check_control_refused(control, b"POST", target, 400)


METHODS = [  # (method, target, body, Allow)
    *((m, b"/v1/sessions", b"{}", "GET") for m in (b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS")),
    *((m, ANCHOR_PATH, b"{}", "GET") for m in (b"POST", b"PUT", b"DELETE", b"PATCH")),
    *((m, ANCHOR_PATH + b"/rows", b"", "GET") for m in (b"POST", b"DELETE")),
    *((m, ANCHOR_PATH + b"/annotations", ANNOTATE, "POST") for m in (b"GET", b"PUT", b"PATCH", b"DELETE")),
    *((m, ANCHOR_PATH + b"/close", CLOSE, "POST") for m in (b"GET", b"PUT", b"DELETE", b"OPTIONS")),
    *((m, ANCHOR_PATH + b"/wait", b"", "GET, POST") for m in (b"PUT", b"DELETE", b"PATCH")),
    (b"HEAD", ANCHOR_PATH + b"/close", b"", "POST"), (b"HEAD", ANCHOR_PATH + b"/annotations", b"", "POST"),
    (b"GET", sid_path("no-such-session") + b"/close", b"", "POST"), (b"DELETE", sid_path("x"), b"", "GET"),
    (b"GET", sid_path("../../etc/passwd") + b"/annotations", b"", "POST"),
    (b"TRACE", b"/v1/sessions", b"", "GET"), (b"FOO", ANCHOR_PATH + b"/close", CLOSE, "POST"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "target", "body", "allow"), METHODS, ids=[f"{m.decode()} {t.decode()}" for m, t, _, _ in METHODS]
)
def test_control_wrong_methods_are_405_with_allow(control, method, target, body, allow) -> None:
    headers, _ = check_control_refused(control, method, target, 405, body)
    assert headers.get("allow") == allow, headers


@pytest.mark.parametrize("host", [b"TITO.CONTROL", b"tito.control:80", b"Tito.Control:80", b"tito.control."])
def test_control_host_spellings_are_the_control_host(control, host) -> None:
    """Another spelling of the reserved host is still the control host: refused without the token, never forwarded
    upstream (with the driver's Authorization header) to the backend."""
    for method, target in AUTH_TARGETS[:6]:
        body = ANNOTATE if target.endswith(b"/annotations") else CLOSE if target.endswith(b"/close") else b""
        check_control_refused(control, method, target, 401, body, auth=False, host=host)


# -- generated storms ----------------------------------------------------------------------------------------------


@st.composite
def bad_annotations(draw) -> bytes:
    """A valid annotation with one thing broken: a wrong-typed field, a bad label, an unknown field."""
    good = {
        "reward": draw(st.floats(-1e6, 1e6)),
        "labels": draw(st.lists(st.text("abcxyz", min_size=1, max_size=5), max_size=3)),
        "metadata": draw(st.dictionaries(st.text(max_size=5), scalars, max_size=3)),
        "turn_id": 0,
    }
    body = {k: good[k] for k in draw(st.sets(st.sampled_from(sorted(good))))}
    breaker = draw(st.sampled_from(["unknown", "reward", "labels", "label", "metadata", "turn_id"]))
    if breaker == "unknown":
        body[draw(st.text(max_size=12).filter(lambda k: k not in ("reward", "labels", "metadata", "turn_id")))] = draw(
            values
        )
        body.setdefault("reward", 0.5)
    elif breaker == "reward":
        body["reward"] = draw(not_type(int, float, type(None)))
    elif breaker == "labels":
        body["labels"] = draw(not_type(list, type(None)))
    elif breaker == "label":
        bad = draw(st.one_of(not_type(str), st.just(""), st.text(min_size=257, max_size=300)))
        labels = list(body.get("labels", []))
        labels.insert(draw(st.integers(0, len(labels))), bad)
        body["labels"] = labels
    elif breaker == "metadata":
        body["metadata"] = draw(not_type(dict, type(None)))
    else:
        body["turn_id"] = draw(not_type(int, type(None)))
        body.setdefault("reward", 0.5)
    return json.dumps(body).encode()


@profile(120)
@given(body=bad_annotations())
def test_control_annotation_storm(control, body) -> None:
    check_control_refused(control, b"POST", ANCHOR_PATH + b"/annotations", 400, body)


@profile(120)
@given(session_id=hostile_id(), action=st.sampled_from(ACTIONS))
def test_control_hostile_session_id_storm(control, session_id, action) -> None:
    assume(refused(session_id))
    method, suffix, body = action
    check_control_refused(control, method, sid_path(session_id) + suffix, 400, body)


def test_the_control_storm_changed_nothing(control) -> None:
    """After every refusal: the records are the snapshot's bytes, both sessions read as before, and the same routes
    still accept a valid annotation and close (so the refusals above were refusals, not a dead route)."""
    assert control.changes() == []
    summary = control_ok(control, b"GET", ANCHOR_PATH)
    assert (summary["turns"], summary["annotations"], summary["closed"], summary["live"]) == (1, [], None, True)
    other = control_ok(control, b"GET", sid_path(SLASHED))
    assert (other["turns"], other["annotations"], other["closed"]) == (1, [], None)
    anchor_file = control.record_dir / session_file_name(CONTROL_ANCHOR)
    before = anchor_file.read_bytes()
    note = control_ok(control, b"POST", ANCHOR_PATH + b"/annotations", b'{"turn_id": 0, "reward": 0.5}')
    assert note["annotation"]["reward"] == 0.5
    closed = control_ok(control, b"POST", ANCHOR_PATH + b"/close", CLOSE)
    assert closed == {"session_id": CONTROL_ANCHOR, "closed": True, "turns": 1, "already_closed": False}
    after = anchor_file.read_bytes()
    assert after.startswith(before) and len(after[len(before) :].splitlines()) == 2
    recorded = read_session_file(anchor_file)
    assert [(t.turn_id, t.parent_turn_id) for t in recorded.turns] == [(0, None)]
    assert [n.reward for n in recorded.annotations] == [0.5] and [c.reason for c in recorded.closes] == ["closed"]
    assert sorted(p.name for p in control.record_dir.iterdir()) == sorted(
        [session_file_name(CONTROL_ANCHOR), session_file_name(SLASHED)]
    )
    assert CONTROL_TOKEN not in control.proxy.output().replace("token=" + CONTROL_TOKEN, "")
