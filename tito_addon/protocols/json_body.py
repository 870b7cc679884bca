"""A request body as one strict JSON object, for every protocol.

Python's `json` accepts what a backend's parser may read differently (a duplicate key keeps its last value,
`NaN` and `Infinity` parse), so both are refused here: what is validated is exactly what is forwarded.
"""

from __future__ import annotations

import json
from typing import Any

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


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body's JSON object; BadRequest for bytes that are not UTF-8, not JSON, too deep or not an object."""
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


def validated[M: BaseModel](model: type[M], obj: dict[str, Any], what: str, *, bounded: bool = False) -> M:
    """`obj` as `model`, or a BadRequest naming the first field that is wrong. `bounded`: `obj` was built from a
    request whose JSON bounds were checked already, so they are not walked again."""
    try:
        return model.model_validate(obj, context={"bounded": True} if bounded else None)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise BadRequest(f"invalid {what} at {where}: {first.get('msg')}") from exc
    except RecursionError as exc:
        raise BadRequest("request body is nested too deeply") from exc
