"""The control API's HTTP side: its routes, and the bodies and queries each takes as models; the use cases behind
them are the core's (`turns/session_control`). The proxy's `control_addon` checks the token and the host, then hands a
request here.

A refused request changes nothing: a body or query is validated whole before its use case runs.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from tito_addon.canonical_chat import json_value_problem
from tito_addon.protocols.http_reply import HttpReply, json_reply, refusal_reply
from tito_addon.protocols.json_body import parse_json_object, validated
from tito_addon.records.record_models import MAX_METADATA_BYTES, AnnotationRecord
from tito_addon.records.rollout_groups import GROUP_POLICIES
from tito_addon.records.trainer_rows import LAYOUTS, ROW_FILE_TYPES, ExportOptions, parse_calls
from tito_addon.sessions.session_ids import session_id_problem
from tito_addon.tito_errors import BadRequest, TitoError
from tito_addon.turns.session_control import MAX_WAIT_S, NotFound, SessionControl

MAX_BODY = 1024 * 1024
MAX_QUERY_FIELDS = 8
SESSION = "{session}"  # a route's path segment that names a session
CONTENT_TYPES = {
    "parquet": "application/vnd.apache.parquet",
    "jsonl": "application/jsonl",
    "summary": "application/json",
}


def integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer of hundreds of digits
        return False


def seconds(value: Any, name: str) -> float:
    """A number of seconds from 0 to `MAX_WAIT_S`, given as a JSON number or a query's text."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of seconds")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a number of seconds") from None
    if not math.isfinite(number) or not 0.0 <= number <= MAX_WAIT_S:
        raise ValueError(f"{name} must be between 0 and {MAX_WAIT_S:g} seconds")
    return number


def flag(value: Any, name: str) -> bool:
    text = str(value).lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no", ""):
        return False
    raise ValueError(f"{name} must be true or false")


class ControlRequest(BaseModel):
    """A control request's body or query: an unknown field is refused, and a wrong one with its own message."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    KNOWN_AS: ClassVar[str] = "field"

    @classmethod
    def of(cls, values: dict[str, Any]) -> Any:
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise BadRequest(cls._problem(exc)) from None

    @classmethod
    def _problem(cls, exc: ValidationError) -> str:
        errors = exc.errors()
        unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
        if unknown:
            return f"unknown {cls.KNOWN_AS}(s): {', '.join(unknown)}; allowed: {', '.join(cls.model_fields)}"
        error = errors[0]
        cause = (error.get("ctx") or {}).get("error")
        return str(cause) if cause is not None else f"{'.'.join(map(str, error['loc']))}: {error['msg']}"


def checked(field: str, test: Callable[[Any], Any], message: str, *, null: bool = True) -> Any:
    """A field's validator: a value given (`null`: other than null) must pass `test`, else the request is refused with
    `message` (`{value}` filled in)."""

    def check(cls: type, value: Any) -> Any:
        if (value is not None or not null) and not test(value):
            raise ValueError(message.format(value=value))
        return value

    return field_validator(field, mode="before")(check)


def one_of(field: str, choices: tuple[str, ...], what: str) -> Any:
    message = f"unknown {what} {{value!r}}; choose one of: {', '.join(choices)}"
    return checked(field, lambda value: value in choices, message, null=False)


def call_names(value: Any) -> Any:
    """`calls` as a comma-separated string (given so, or as a list of names), checked."""
    if isinstance(value, list) and all(isinstance(c, str) for c in value):
        value = ",".join(value)
    if value is not None and not isinstance(value, str):
        raise ValueError("calls must be a list of call names or a comma-separated string")
    parse_calls(value)  # its ValueError names what is wrong
    return value


class AnnotationBody(ControlRequest):
    KNOWN_AS: ClassVar[str] = "annotation field"
    turn_id: int | None = None
    reward: float | None = None
    labels: Any = None
    metadata: dict[str, Any] | None = None
    group: Any = None
    scope: Any = None

    _turn_id = checked("turn_id", integer, "turn_id must be an integer")
    _reward = checked("reward", finite_number, "reward must be a finite number")

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise ValueError("metadata must be a JSON object")
        if value is not None and len(dumps(value)) > MAX_METADATA_BYTES:  # not a 400: the request is too large
            raise TitoError(f"metadata is larger than {MAX_METADATA_BYTES} bytes as JSON", status=413)
        return value


def session_ids(value: Any) -> bool:
    if not (isinstance(value, list) and value and all(isinstance(s, str) for s in value)):
        raise ValueError("sessions must be a non-empty list of session ids")
    for session_id in value:
        problem = session_id_problem(session_id)
        if problem is not None:
            raise ValueError(f"invalid session id {session_id[:80]!r}: {problem}")
    return True


class RowsBody(ControlRequest):
    sessions: list[str] | None = None
    session_prefix: str | None = None
    format: str = "generic"
    to: str = "jsonl"
    calls: str | None = None
    group_size: int | None = None
    group_policy: str = "refuse"
    dedupe_shared_turns: bool | None = False
    mask_offpolicy: bool | None = False

    _sessions = checked("sessions", session_ids, "")
    _prefix = checked("session_prefix", lambda v: isinstance(v, str) and v, "session_prefix must be a non-empty string")
    _format = one_of("format", LAYOUTS, "format")
    _to = one_of("to", (*ROW_FILE_TYPES, "summary"), "file type")
    _calls = field_validator("calls", mode="before")(call_names)
    _size = checked(
        "group_size", lambda v: integer(v) and 1 <= v <= 1_000_000, "group_size must be an integer from 1 to 1000000"
    )
    _policy = checked(
        "group_policy",
        lambda v: v in GROUP_POLICIES,
        f"group_policy must be one of: {', '.join(GROUP_POLICIES)}",
        null=False,
    )
    _dedupe = checked("dedupe_shared_turns", lambda v: isinstance(v, bool), "dedupe_shared_turns must be true or false")
    _offpolicy = checked("mask_offpolicy", lambda v: isinstance(v, bool), "mask_offpolicy must be true or false")

    def options(self) -> ExportOptions:
        return ExportOptions(
            parse_calls(self.calls),
            self.group_size,
            self.group_policy,
            bool(self.dedupe_shared_turns),
            bool(self.mask_offpolicy),
        )


class ControlQuery(ControlRequest):
    """A query: parameters it does not know are ignored (a cache-buster, a client's own), as a web server does."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class RowsQuery(ControlQuery):
    format: str = "generic"
    to: str = "jsonl"
    calls: str | None = None

    _format = one_of("format", LAYOUTS, "format")
    _to = one_of("to", ROW_FILE_TYPES, "file type")
    _calls = field_validator("calls", mode="before")(call_names)


class ListQuery(ControlQuery):
    limit: int = 1000
    live: bool = False
    prefix: str = ""

    @field_validator("limit", mode="before")
    @classmethod
    def _limit(cls, value: Any) -> Any:
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ValueError("limit must be an integer") from None
        if not 1 <= number <= 100000:
            raise ValueError("limit must be between 1 and 100000")
        return number

    @field_validator("live", mode="before")
    @classmethod
    def _live(cls, value: Any) -> Any:
        return flag(value, "live")


timeout_seconds = field_validator("timeout", mode="before")(lambda cls, value: seconds(value, "timeout"))


class WaitQuery(ControlQuery):
    timeout: float = 30.0
    _timeout = timeout_seconds


class CloseBody(ControlRequest):
    timeout: float = 30.0
    _timeout = timeout_seconds


# -- the routes -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """A control request as its route reads it: its session (on a session's routes), query and body."""

    session_id: str
    query: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Route:
    methods: tuple[str, ...]
    path: str  # `{session}` stands for one segment naming a session
    serve: Callable[[ControlRoutes, Call], Awaitable[HttpReply]]

    def match(self, parts: list[str]) -> list[str] | None:
        """The segments that name sessions, when the path's segments `parts` are this route's; else None."""
        pattern = self.path.split("/")
        if len(pattern) != len(parts):
            return None
        named = []
        for want, part in zip(pattern, parts, strict=True):
            if want == SESSION:
                named.append(part)
            elif want != part:
                return None
        return named


class ControlRoutes:
    """Control requests to the use cases: a route by method and path, its query and body read as their models."""

    def __init__(self, control: SessionControl, extra: tuple[Route, ...] = ()) -> None:
        self.control = control
        self.routes = (*ROUTES, *extra)

    async def handle(self, method: str, path: str, body: bytes) -> HttpReply:
        try:
            return await self._route(method, path, body)
        except TitoError as error:
            return refusal_reply(error)

    async def _route(self, method: str, path: str, body: bytes) -> HttpReply:
        split = urlsplit(path)
        try:
            query = {k: v[-1] for k, v in parse_qs(split.query, max_num_fields=MAX_QUERY_FIELDS).items()}
        except ValueError:
            raise BadRequest("too many query parameters") from None
        if len(body) > MAX_BODY:
            raise TitoError(f"request body is larger than {MAX_BODY} bytes", status=413)
        parts = split.path.split("/")
        for route in self.routes:
            named = route.match(parts)
            if named is None:
                continue
            if method not in route.methods:
                error = TitoError(f"method {method} not allowed here; use {route.methods[0]}", status=405)
                reply = refusal_reply(error)
                reply.headers["allow"] = ", ".join(route.methods)
                return reply
            return await route.serve(self, Call(session_of(named[0]) if named else "", query, body))
        raise NotFound(f"no control API route {split.path!r}")

    async def list_sessions(self, call: Call) -> HttpReply:
        asked = ListQuery.of(call.query)
        found = await self.control.list_sessions(limit=asked.limit, live_only=asked.live, prefix=asked.prefix)
        return json_reply(200, dumps({"sessions": found}))

    async def summary(self, call: Call) -> HttpReply:
        return json_reply(200, dumps(await self.control.summary(call.session_id)))

    async def rows(self, call: Call) -> HttpReply:
        asked = RowsQuery.of(call.query)
        options = ExportOptions(calls=parse_calls(asked.calls))
        return rows_reply(await self.control.rows([call.session_id], None, asked.format, asked.to, options), asked.to)

    async def rows_of_sessions(self, call: Call) -> HttpReply:
        asked = RowsBody.of(checked_body(call.body))
        if asked.sessions is None and asked.session_prefix is None:
            raise BadRequest("name the sessions: sessions (a list of ids), session_prefix, or both")
        selection = (asked.sessions or [], asked.session_prefix)
        return rows_reply(await self.control.rows(*selection, asked.format, asked.to, asked.options()), asked.to)

    async def annotate(self, call: Call) -> HttpReply:
        asked = AnnotationBody.of(checked_body(call.body))
        fields = asked.model_dump(exclude_unset=True)
        note = validated(AnnotationRecord, {**fields, "session_id": call.session_id, "ts": time.time()}, "annotation")
        written = await self.control.annotate(note)
        body = {"session_id": call.session_id, "annotation": written.model_dump(by_alias=True, exclude_none=True)}
        return json_reply(200, dumps(body))

    async def wait(self, call: Call) -> HttpReply:
        asked = WaitQuery.of(call.query)
        return json_reply(200, dumps(await self.control.wait(call.session_id, asked.timeout)))

    async def close(self, call: Call) -> HttpReply:
        asked = CloseBody.of(checked_body(call.body) if call.body.strip() else {})
        return json_reply(200, dumps(await self.control.close(call.session_id, asked.timeout)))


ROUTES = (
    Route(("GET",), "/v1/sessions", ControlRoutes.list_sessions),
    Route(("POST",), "/v1/rows", ControlRoutes.rows_of_sessions),
    Route(("GET",), "/v1/sessions/{session}", ControlRoutes.summary),
    Route(("GET",), "/v1/sessions/{session}/rows", ControlRoutes.rows),
    Route(("POST",), "/v1/sessions/{session}/annotations", ControlRoutes.annotate),
    Route(("GET", "POST"), "/v1/sessions/{session}/wait", ControlRoutes.wait),
    Route(("POST",), "/v1/sessions/{session}/close", ControlRoutes.close),
)


def session_of(segment: str) -> str:
    try:
        session_id = unquote(segment, errors="strict")
    except UnicodeDecodeError:
        raise BadRequest("invalid session id: its percent-encoding is not UTF-8") from None
    problem = session_id_problem(session_id)
    if problem is not None:
        raise BadRequest(f"invalid session id: {problem}")
    return session_id


def rows_reply(export: Any, file_type: str) -> HttpReply:
    summary = export.summary
    headers = {
        "content-type": CONTENT_TYPES[file_type],
        "x-tito-rows": str(summary["rows"]),
        "x-tito-groups": str(len(summary["groups"]) - summary["dropped_groups"]),
    }
    return HttpReply(200, headers, dumps(summary) if export.data is None else export.data)


def checked_body(body: bytes) -> dict[str, Any]:
    """A control request's JSON object, held to the agent APIs' rules: strict JSON, at most 100 levels deep, finite
    numbers, valid Unicode."""
    obj = parse_json_object(body)
    problem = json_value_problem(obj)
    if problem is not None:
        raise BadRequest(f"request body refused: {problem}")
    return obj


def dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
