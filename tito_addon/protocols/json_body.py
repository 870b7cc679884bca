"""A request body as one strict JSON object, for every protocol.

Python's `json` accepts what a backend's parser may read differently (a duplicate key keeps its last value,
`NaN` and `Infinity` parse), so both are refused here: what is validated is exactly what is forwarded.

Reading the agent's request is on every turn's path, and that strict parse (a Python hook per object) is a large
share of the proxy's own latency on a long conversation. Most agents send compact JSON (httpx, Node, serde_json),
which orjson reads several times faster; its result is used only when writing it back with orjson gives the body
byte for byte. That proves the strict parse would return the same object: the body then has one key per member (no
duplicate), only numbers orjson read exactly (an integer outside 64 bits comes back written as a float, so differs),
no `NaN`, at most 254 levels (orjson writes no deeper), and strings both parsers read alike. Anything else, and any
body orjson refuses, goes to the strict parse, which stays the reference and gives today's answer.

Not every client writes compact JSON: Python's `json.dumps`, which requests and aiohttp use, puts a space after each
`,` and `:` and escapes every non-ASCII character. The same proof holds for any writer whose output is compared byte
for byte, so a body is read fast when one of the known `JsonStyle`s writes its orjson reading back exactly, and the
style is returned with the object: the request memo finds the end of the messages, and reads what a later body
appends, in the style its client writes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from tito_addon.tito_errors import BadRequest


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise BadRequest(f"duplicate JSON key {key!r}")
        obj[key] = value
    return obj


def _reject_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not valid JSON")


def _parse_strict(body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest("request body is not valid UTF-8") from exc
    try:
        obj = json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise BadRequest("request body is nested too deeply") from exc
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object")
    return obj


@dataclass(frozen=True, slots=True)
class JsonStyle:
    """How one kind of client writes JSON: its separators, and a writer that gives its bytes for a parsed object."""

    name: str
    item_separator: bytes  # between array items and between object members
    key_separator: bytes  # between a key and its value
    write: Callable[[Any], bytes]

    def dumps(self, obj: Any) -> bytes | None:
        """`obj` as this style writes it, or None where it cannot (an integer beyond 64 bits, a lone surrogate)."""
        try:
            return self.write(obj)
        except (TypeError, ValueError, RecursionError):  # orjson.JSONEncodeError is a TypeError
            return None


def _python_writer(*, ensure_ascii: bool, separators: tuple[str, str]) -> Callable[[Any], bytes]:
    dumps = partial(json.dumps, ensure_ascii=ensure_ascii, separators=separators)
    return lambda obj: dumps(obj).encode()


COMPACT = JsonStyle("compact", b",", b":", orjson.dumps)  # openai-python, httpx, Node, serde_json: UTF-8 as is
COMPACT_ASCII = JsonStyle("compact-ascii", b",", b":", _python_writer(ensure_ascii=True, separators=(",", ":")))
SPACED_ASCII = JsonStyle("spaced-ascii", b", ", b": ", _python_writer(ensure_ascii=True, separators=(", ", ": ")))
SPACED = JsonStyle("spaced", b", ", b": ", _python_writer(ensure_ascii=False, separators=(", ", ": ")))


def _styles_to_try(body: bytes) -> tuple[JsonStyle, ...]:
    """The styles that may write `body` back, likeliest first, guessed from the separator after the first key and
    whether the body is ASCII. A wrong guess costs a write, never correctness."""
    if body[:2] != b'{"':
        return ()
    end = body.find(b'"', 2)
    if body[end + 1 : end + 2] != b":":
        return ()
    spaced = body[end + 2 : end + 3] == b" "
    if not body.isascii():
        return (SPACED,) if spaced else (COMPACT,)
    if spaced:
        return (SPACED_ASCII,)  # an ASCII body without escapes is also what SPACED writes: one test serves both
    return (COMPACT, COMPACT_ASCII) if b"\\u" in body else (COMPACT,)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body's JSON object; BadRequest for bytes that are not UTF-8, not JSON, too deep or not an object."""
    return read_json_object(body)[0]


def read_json_object(body: bytes) -> tuple[dict[str, Any], JsonStyle | None]:
    """The body's JSON object, and the style that writes it back exactly (None: none does), so that each member's
    bytes are its own encoding in that style, which `known_requests` relies on to find where the messages end."""
    styles = _styles_to_try(body)
    if styles:
        try:
            obj = orjson.loads(body)
        except Exception:  # whatever orjson refuses, the strict parse decides, with today's message
            obj = None
        if type(obj) is dict:
            for style in styles:
                if style.dumps(obj) == body:
                    return obj, style
    return _parse_strict(body), None


def _is_branch_label(part: Any) -> bool:
    """A union member's name in an error's location (`str`, `list[tagged-union[…]]`), not a field or an index."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none"))


def most_specific(errors: list[Any]) -> Any:
    """The error deepest in the request: of a union (`input` is a string or a list of items), the first error is
    the first member's (`input: a valid string`), while the one that names the wrong item is the deepest."""
    return max(errors, key=lambda error: sum(not _is_branch_label(p) for p in error.get("loc", ())))


def validated[M: BaseModel](model: type[M], obj: dict[str, Any], what: str, *, bounded: bool = False) -> M:
    """`obj` as `model`, or a BadRequest naming the first field that is wrong. `bounded`: `obj` was built from a
    request whose JSON bounds were checked already, so they are not walked again."""
    try:
        return model.model_validate(obj, context={"bounded": True} if bounded else None)
    except ValidationError as exc:
        error = most_specific(exc.errors())
        where = ".".join(str(p) for p in error.get("loc", ()) if not _is_branch_label(p)) or "body"
        raise BadRequest(f"invalid {what} at {where}: {error.get('msg')}") from exc
    except RecursionError as exc:
        raise BadRequest("request body is nested too deeply") from exc
