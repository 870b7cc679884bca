"""Errors a turn can end with, each carrying the HTTP answer the agent gets.

Every failure is answered explicitly: mitmproxy forwards a flow whose hook raised, so nothing may escape
the addon as a bare exception.
"""

from __future__ import annotations

import json

# The statuses the OpenAI and Anthropic SDKs, Claude Code and the AI SDK retry (with every 5xx) unless the reply
# says `x-should-retry: false`; a refusal that retrying cannot fix must say it, or Claude Code retries for minutes.
RETRIED_STATUSES = frozenset({408, 409, 429})
FINAL_HEADERS = {"x-should-retry": "false"}


class TitoError(Exception):
    """A failure with a defined HTTP status and a JSON error body."""

    status: int = 500
    error_type: str = "tito_error"
    # Whether the same request, sent again, can succeed. None: as its status says (408, 409, 429 and 5xx can, any
    # other 4xx cannot); a class whose cause outlives any retry says False whatever its status.
    retryable: bool | None = None

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

    @property
    def final(self) -> bool:
        """Retrying cannot change the answer: the reply carries `x-should-retry: false`."""
        if self.retryable is not None:
            return not self.retryable
        return not (self.status >= 500 or self.status in RETRIED_STATUSES)

    def headers(self) -> dict[str, str]:
        """The reply's headers: JSON, and `x-should-retry: false` when the refusal is final."""
        return {"content-type": "application/json", **(FINAL_HEADERS if self.final else {})}

    def body(self) -> bytes:
        payload = {"error": {"message": self.message, "type": self.error_type, "code": self.status}}
        return json.dumps(payload, ensure_ascii=False).encode()


class BadRequest(TitoError):
    """The agent's request is invalid; nothing was changed."""

    status = 400
    error_type = "invalid_request_error"
    retryable = False


class UpstreamMalformed(TitoError):
    """The backend answered 200 with a body we cannot trust."""

    status = 502
    error_type = "upstream_malformed"
    retryable = True


class UpstreamUnavailable(TitoError):
    """The backend could not be reached, reset the connection or timed out."""

    status = 502
    error_type = "upstream_unavailable"
    retryable = True


class TokenizationError(TitoError):
    """The chat template or tokenizer could not produce the prompt ids: the same request fails the same way again."""

    status = 500
    error_type = "tokenization_error"
    retryable = False


class TemplateRefusal(TokenizationError):
    """The model's chat template itself rejected the request (its `raise_exception`): the client's input is what
    the model cannot take, e.g. a Mistral tool-call id that is not nine alphanumerics."""

    status = 400
    error_type = "invalid_request_error"


class UpstreamPassthrough(Exception):
    """The backend answered non-200: the agent receives that status and body verbatim."""

    def __init__(self, status: int, body: bytes, content_type: str | None) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type or "application/json"


class SessionClosed(TitoError):
    """A request names a session its rollout driver closed, and `tito_after_close` is `refuse`: final, so a 410
    (Gone), which no supported SDK or CLI retries, where a 409 had Claude Code retrying for minutes."""

    status = 410
    error_type = "session_closed"
    retryable = False

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {session_id!r} was closed by its driver; its name is not reused (tito_after_close=refuse); "
            "nothing was forwarded"
        )
        self.session_id = session_id


class UnknownReply(TitoError):
    """A Responses request continues a `previous_response_id` this proxy never recorded: final, as OpenAI's own
    `previous_response_not_found`."""

    status = 404
    error_type = "previous_response_not_found"
    retryable = False

    def __init__(self, reply_id: str) -> None:
        super().__init__(f"previous response {reply_id!r} is not a turn this proxy has recorded")


class StoreUnavailable(TitoError):
    """The sessions' store cannot be reached or failed: the turn is refused (503), nothing forwarded or recorded."""

    status = 503
    error_type = "session_store_unavailable"
    retryable = True


class SessionGone(TitoError):
    """The session (or the turn a request extends) closed between locating it and using it: send it again."""

    status = 409
    error_type = "session_closed"
    retryable = True

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} closed while this turn was in flight; send the request again")
        self.session_id = session_id
