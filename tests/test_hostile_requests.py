"""Hypothesis-generated malformed and hostile agent requests (chat, Anthropic Messages, OpenAI Responses) through
one real mitmdump.

Every request is sent over a raw socket (so header values, encodings and bodies are exactly what the strategy made)
to the chat route of a mitmdump in front of the sglang replica, behind a tap that sees every upstream call. Each
one must get a 4xx JSON error; nothing may reach the backend; no file under the proxy's directories may appear or
change; and a session opened before the storm must still be extended by a valid follow-up turn afterwards.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from pathlib import Path
from urllib.parse import quote

import pytest
from conftest import tokenizer_path
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from proxy_harness import Mitmdump, post
from upstream_tap import UpstreamTap

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


@profile(60)
@given(body=anthropic_bodies())
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
