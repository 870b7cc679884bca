"""The orjson fast path of `parse_json_object` answers exactly as the strict stdlib parse it stands in for.

Every body, valid or not, must give the same object (same types, same float signs) or the same BadRequest message
as `_parse_strict`, the reference; duplicate keys above all, since orjson keeps the last value silently.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.basics import examples

from tito_addon.protocols.json_body import _parse_strict, parse_json_object, read_json_object
from tito_addon.tito_errors import BadRequest


def _answer(parse: Any, body: bytes) -> tuple[str, Any]:
    try:
        return "ok", parse(body)
    except BadRequest as exc:
        return "bad", exc.message


def _same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down and -0.0 told from 0.0 (== says 1 == 1.0 and 0.0 == -0.0).
    Without recursion, for the deep documents."""
    pending = [(a, b)]
    while pending:
        x, y = pending.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, dict):
            if list(x) != list(y):
                return False
            pending.extend((x[k], y[k]) for k in x)
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            pending.extend(zip(x, y, strict=True))
        elif isinstance(x, float):
            if math.copysign(1.0, x) != math.copysign(1.0, y) or x != y:
                return False
        elif x != y:
            return False
    return True


def assert_as_strict(body: bytes) -> None:
    fast, strict = _answer(parse_json_object, body), _answer(_parse_strict, body)
    assert fast[0] == strict[0], (body[:200], fast, strict)
    if fast[0] == "bad":
        assert fast[1] == strict[1], body[:200]
    else:
        assert _same(fast[1], strict[1]), body[:200]


# -- generated documents: written with random whitespace, escapes and (sometimes) a key written twice ------------

WS = st.text(alphabet=" \t\r\n", max_size=3)
KEY_CHARS = st.sampled_from(['"', "\\", ":", " ", "a", "b", "é", "\u2028", "\x00", "\n", "\U0001f600", "\\\\", '\\"'])
TEXT = st.lists(KEY_CHARS, max_size=6).map("".join) | st.text(max_size=6)


def _write_string(s: str, rnd: random.Random, canonical: bool) -> str:
    """`s` as a JSON string: as compact clients write it, or each character raw, short- or \\u-escaped at random."""
    if canonical:
        return json.dumps(s, ensure_ascii=False)
    out = ['"']
    for ch in s:
        code = ord(ch)
        short = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f", "/": "\\/"}
        must = ch in '"\\' or code < 0x20
        choice = rnd.random()
        if code > 0xFFFF:
            hi, lo = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
            out.append(ch if choice < 0.5 else f"\\u{hi:04x}\\u{lo:04X}")
        elif ch in short and (must or choice < 0.3):
            out.append(short[ch] if choice < 0.6 or ch not in short else f"\\u{code:04x}")
        elif must or choice < 0.2:
            out.append(f"\\u{code:04x}" if choice < 0.5 else f"\\u{code:04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


NUMBERS = st.sampled_from(
    [
        "0", "-0", "1", "-1", "1.0", "-0.0", "1e2", "1E+2", "1e-2", "0.1", "1.5e300", "1e400", "-1e400", "1e-400",
        "-1e-400", "9223372036854775807", "9223372036854775808", "-9223372036854775808", "-9223372036854775809",
        "18446744073709551615", "18446744073709551616", "123456789012345678901234567890", "1" * 400,
        "1.7976931348623157e308", "1.7976931348623159e308", "2.4703282292062328e-324", "0.30000000000000004",
        "NaN", "Infinity", "-Infinity", "01", "1.", ".5", "+1",
    ]
)  # fmt: skip
FLOATS = st.floats(allow_nan=False, allow_infinity=False).map(repr)
DECIMALS = st.from_regex(r"-?(0|[1-9][0-9]{0,25})(\.[0-9]{1,25})?([eE][-+]?[0-9]{1,3})?", fullmatch=True)
SCALARS = st.one_of(
    NUMBERS,
    FLOATS,
    DECIMALS,
    st.integers().map(str),
    st.sampled_from(["true", "false", "null"]),
    TEXT.map(lambda s: ("s", s)),
)


# What a compact client writes for a number: orjson reads every one back, so the fast path answers for these.
CANONICAL_SCALARS = st.one_of(
    st.integers(-(2**63), 2**64 - 1).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda f: orjson.dumps(f).decode()),
    st.sampled_from(["true", "false", "null"]),
    TEXT.map(lambda s: ("s", s)),
)


@st.composite
def documents(draw: st.DrawFn, depth: int = 0, scalars: st.SearchStrategy = SCALARS) -> Any:
    """A JSON value as a tree of ("obj", [(key, value)]), ("arr", [values]), ("s", text) or a number's source."""
    kind = draw(st.sampled_from(["obj", "arr", "scalar"] if depth < 4 else ["scalar"]))
    if kind == "scalar":
        return draw(scalars)
    if kind == "arr":
        return ("arr", draw(st.lists(documents(depth + 1, scalars), max_size=4)))
    keys = draw(st.lists(TEXT, max_size=4, unique=True))
    if keys and draw(st.integers(0, 3)) == 0:  # a key written twice, maybe after escaping it differently
        keys.insert(draw(st.integers(0, len(keys))), draw(st.sampled_from(keys)))
    return ("obj", [(k, draw(documents(depth + 1, scalars))) for k in keys])


def _write(doc: Any, rnd: random.Random, ws: list[str], canonical: bool = False) -> str:
    w = lambda: ws[rnd.randrange(len(ws))]  # noqa: E731
    if isinstance(doc, str):
        return doc
    kind, content = doc
    if kind == "s":
        return _write_string(content, rnd, canonical)
    if kind == "arr":
        return "[" + w() + ("," + w()).join(_write(v, rnd, ws, canonical) + w() for v in content) + "]"
    members = (
        _write_string(k, rnd, canonical) + w() + ":" + w() + _write(v, rnd, ws, canonical) + w() for k, v in content
    )
    return "{" + w() + ("," + w()).join(members) + "}"


@settings(max_examples=examples(1500), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    members=st.lists(st.tuples(TEXT, documents()), max_size=5, unique_by=lambda m: m[0]),
    duplicate=st.booleans(),
    ws=st.lists(WS, min_size=1, max_size=3),
    seed=st.integers(0, 2**32),
    outer=st.tuples(WS, WS),
    canonical=st.booleans(),
)
def test_generated_documents_parse_as_strict(members, duplicate, ws, seed, outer, canonical) -> None:
    """`canonical`: compact, strings escaped as compact clients do, so the orjson answer is used where valid."""
    if duplicate and members:
        members.append((members[0][0], ("arr", [])))
    if canonical:
        ws, outer = [""], ("", "")
    rnd = random.Random(seed)
    body = (outer[0] + _write(("obj", members), rnd, ws, canonical) + outer[1]).encode("utf-8", "surrogatepass")
    assert_as_strict(body)


@settings(max_examples=examples(1000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    members=st.lists(st.tuples(TEXT, documents(scalars=CANONICAL_SCALARS)), max_size=5, unique_by=lambda m: m[0]),
    duplicate=st.booleans(),
)
def test_compact_documents_parse_as_strict(members, duplicate) -> None:
    """Bodies the fast path answers for, unless a key is written twice (in them or in a nested object)."""
    if duplicate and members:
        members.append((members[-1][0], members[0][1]))
    body = _write(("obj", members), random.Random(0), [""], canonical=True).encode("utf-8", "surrogatepass")
    assert_as_strict(body)


@settings(max_examples=examples(300), deadline=None)
@given(value=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=30,
), compact=st.booleans(), ascii_only=st.booleans())  # fmt: skip
def test_what_clients_write_parses_as_strict(value, compact, ascii_only) -> None:
    seps = (",", ":") if compact else (", ", ": ")
    body = json.dumps({"v": value}, separators=seps, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert_as_strict(body)


@settings(max_examples=examples(1000), deadline=None)
@given(body=st.binary(max_size=40) | st.text(alphabet='{}[]":,\\ a1-.eEnul\u00e9', max_size=40).map(str.encode))
def test_random_bytes_parse_as_strict(body) -> None:
    assert_as_strict(b"{" + body if body[:1] != b"{" else body)
    assert_as_strict(body)


# -- where orjson and the strict parse part ways, and duplicates hidden behind escapes and whitespace ------------

EDGE_CASES = [
    b'{"a": 1, "a": 2}',
    b'{"a":1,"a":1}',
    b'{"a": {"b": 1, "b": 1}}',
    b'[{"a": 1, "a": 2}]',
    b'{"a": 1, "\\u0061": 2}',  # the same key written two ways
    b'{"a\\\\": 1, "a\\\\": 2}',  # a key ending in an escaped backslash, twice
    b'{"a\\\\\\\\": 1, "a\\\\\\\\" :2}',
    b'{"x\\\\": 1, "y": 1, "y": 2}',  # a duplicate after a key ending in a backslash
    b'{"x\\\\\\\\": 1, "y": 1, "y": 2}',
    b'{"x\\\\\\\\" \n: 1, "y": 1, "y": 2}',
    b'{"a\\"": 1, "a\\"": 2}',
    b'{"k": "\\":", "k": 1}',  # an escaped quote and a colon inside a string
    b'{"k": "\\u0022:\\u0022:", "k": 1}',
    b'{"k": "\\\\\\":", "k": 2}',
    b'{"k": ":", "x": 1}',  # a string that starts with ":"
    b'{"k": " \\t:", "k": 1}',
    b'{"k": [":", ": ", "\\":"], "j": "\\u003a"}',
    b'{"a" \n\t\r : 1, "a"\r\n:2}',
    b'{"a":1}\n',
    b'{"":1,"":2}',
    b'{"":{"":{}}}',
    b'{"x": -0, "y": -0.0, "z": 1.0, "w": 1E2, "v": -0e0}',
    b'{"x": 1e400}',
    b'{"x": -1e999}',
    b'{"x": 1E+309}',
    b'{"x": 1e-400, "y": -1e-400}',
    b'{"x": 9223372036854775807, "y": -9223372036854775808, "z": 18446744073709551615}',
    b'{"x": 18446744073709551616}',
    b'{"x": -9223372036854775809}',
    b'{"x": 123456789012345678901234567890}',
    b'{"x": ' + b"1" * 5000 + b"}",
    b'{"x": 1.8446744073709552e19}',
    b'{"x": 1e19}',
    b'{"x": NaN}',
    b'{"x": Infinity}',
    b'{"x": -Infinity}',
    b'{"x": nan}',
    b'{"x": "\\ud800"}',
    b'{"x": "\\udc00\\ud800"}',
    b'{"x": "\\ud83d\\ude00"}',
    b'{"x": "\xed\xa0\x80"}',
    b'{"x": "\xff"}',
    b'{"x": "\xc0\x80"}',
    b'{"x": "\\u0000\x7f\xef\xbf\xbf"}',
    b'{"x": "\x01"}',
    b'\xef\xbb\xbf{"x": 1}',
    b'{"x": 1}\x00',
    b'\x0c{"x": 1}',
    b'{"x": 1}\xc2\xa0',
    b'{"x": 1,}',
    b'{"x": 01}',
    b"[]",
    b'"x"',
    b"1",
    b"null",
    b"",
    b" ",
    b"{",
    b'{"a": 1} {"b": 2}',
]


@pytest.mark.parametrize("body", EDGE_CASES, ids=range(len(EDGE_CASES)))
def test_edge_cases_parse_as_strict(body: bytes) -> None:
    assert_as_strict(body)


@pytest.mark.parametrize("depth", [1, 254, 255, 511, 512, 513, 1023, 1024, 1025, 1490, 1500, 5000])
@pytest.mark.parametrize("nest", ["obj", "arr"])
def test_deep_nesting_parses_as_strict(depth: int, nest: str) -> None:
    if nest == "obj":
        body = b'{"a":' * depth + b"1" + b"}" * depth
    else:
        body = b'{"a":' + b"[" * (depth - 1) + b"1" + b"]" * (depth - 1) + b"}"
    assert_as_strict(body)


def test_duplicate_keys_are_refused_with_the_strict_message() -> None:
    with pytest.raises(BadRequest, match="duplicate JSON key 'b'"):
        parse_json_object(b'{"a": {"b": 1, "b": 2}, "a": 3}')
    long_ok = {"model": "m", "messages": [{"role": "user", "content": f'{i}: "x": {{\\n}}'} for i in range(300)]}
    body = json.dumps(long_ok).encode()
    assert parse_json_object(body) == long_ok
    assert parse_json_object(json.dumps(long_ok, separators=(",", ":")).encode()) == long_ok
    with pytest.raises(BadRequest, match="duplicate JSON key 'role'"):
        parse_json_object(body[:-3] + b', "role": "x"}]}')


def test_the_fast_path_answers_for_compact_bodies(monkeypatch) -> None:
    """Not a silent fallback every time: a compact body (httpx, Node, serde_json), escapes and non-ASCII included,
    never reaches the strict parse."""
    messages = [
        {"role": "tool", "content": f'{i}: {{"ok": true, "path": "C:\\\\x"}}\n\té\u2028\x7f'} for i in range(50)
    ]
    obj = {"model": "m", "messages": messages, "temperature": 0.7, "n": 1, "seed": -(2**63), "top": 2**64 - 1}
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    monkeypatch.setattr("tito_addon.protocols.json_body._parse_strict", lambda body: pytest.fail("fell back"))
    assert _same(parse_json_object(body), obj)


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
@pytest.mark.parametrize("ensure_ascii", [False, True])
def test_the_fast_path_answers_for_every_client_style(separators, ensure_ascii, monkeypatch) -> None:
    """Spaced with ASCII escapes as Python's `json.dumps` writes for requests and aiohttp, and the other Python
    choices: each is read by orjson and proved by writing it back in its own style, with the style named."""
    messages = [{"role": "tool", "content": f'{i}: {{"ok": true}}\n\té\u2028😀 \x7f'} for i in range(50)]
    obj = {"model": "m", "messages": messages, "temperature": 0.7, "seed": -(2**63), "top": 2**64 - 1}
    body = json.dumps(obj, separators=separators, ensure_ascii=ensure_ascii).encode()
    monkeypatch.setattr("tito_addon.protocols.json_body._parse_strict", lambda body: pytest.fail("fell back"))
    parsed, style = read_json_object(body)
    assert _same(parsed, obj)
    assert style is not None and style.item_separator == separators[0].encode() and style.dumps(parsed) == body


def test_compact_bodies_with_a_duplicate_key_still_get_the_strict_message() -> None:
    for body, key in [
        (b'{"model":"a","model":"b"}', "model"),
        (b'{"messages":[{"role":"user","content":"x","role":"tool"}]}', "role"),
        (b'{"a":{"b":1},"a":{"b":1}}', "a"),
        (b'{"a":1,"\\u0061":2}', "a"),
    ]:
        with pytest.raises(BadRequest) as caught:
            parse_json_object(body)
        assert caught.value.message == f"duplicate JSON key {key!r}", body
